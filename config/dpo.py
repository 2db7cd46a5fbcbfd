# DPO on preference pairs, starting from the SFT run; the frozen reference is the SFT weights.
#   python train_my_ddp.py config/dpo.py --init_from=out/sft --data_dir=data/dpo --tokenizer_dir=out/tok
task_type = "dpo"
out_dir = "out/dpo"
max_seq_len = 1024
batch_size = 4
gradient_accumulation_steps = 8
max_iters = 1000
learning_rate = 5e-7
min_lr = 5e-8
warmup_iters = 50
weight_decay = 0.0
dpo_loss = "sigmoid"
dpo_beta = 0.1
dtype = "bf16"
eval_interval = 100
checkpoint_interval = 100
