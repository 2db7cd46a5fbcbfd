# Supervised fine-tuning of a pretrained run on chat data (loss on assistant replies only).
#   python train_my_ddp.py config/sft.py --init_from=out/pretrain_124m --data_dir=data/sft \
#       --tokenizer_dir=out/tok
task_type = "sft"
out_dir = "out/sft"
max_seq_len = 1024
sft_packing = True
batch_size = 8
gradient_accumulation_steps = 4
max_iters = 2000
learning_rate = 2e-5
min_lr = 2e-6
warmup_iters = 50
weight_decay = 0.0
dtype = "bf16"
val_ratio = 0.02
eval_interval = 200
checkpoint_interval = 200
