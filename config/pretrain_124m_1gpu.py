# GPT-2-small-sized Llama2 (124M with a 32k vocabulary) on one GPU, bf16, compiled.
#   python train_my_ddp.py config/pretrain_124m_1gpu.py --data_dir=out/pretok --tokenizer_dir=out/tok
# 16 x 1024 tokens per micro-batch, 8 micro-batches: ~131k tokens per optimizer step.
out_dir = "out/pretrain_124m"
max_seq_len = 1024
dim = 768
n_layers = 12
n_heads = 12
batch_size = 16
gradient_accumulation_steps = 8
max_iters = 20000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 700
lr_schedule = "cosine"
weight_decay = 0.1
grad_clip = 1.0
dtype = "bf16"
compile = True
eval_interval = 500
eval_iters = 50
checkpoint_interval = 1000
keep_last = 3
tensorboard = False  # True after `pip install tensorboard` (optional for training; requirements-dev.txt has it)
