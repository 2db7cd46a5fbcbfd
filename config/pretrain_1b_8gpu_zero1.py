# A 1B Llama2 (dim 2048, 16 layers, GQA 16/8 heads) on one node of 8 GPUs with ZeRO-1.
#   torchrun --standalone --nproc_per_node=8 train_my_ddp.py config/pretrain_1b_8gpu_zero1.py \
#       --data_dir=out/pretok --tokenizer_dir=out/tok
# 4 x 2048 tokens x 8 ranks x 4 micro-batches: ~262k tokens per optimizer step.
out_dir = "out/pretrain_1b"
max_seq_len = 2048
dim = 2048
n_layers = 16
n_heads = 16
n_kv_heads = 8
batch_size = 4
gradient_accumulation_steps = 4
max_iters = 50000
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 2000
weight_decay = 0.1
dtype = "bf16"
compile = True
use_distributed_optimizer = True
zero_stage = 1
comm_hook = "reduce_scatter"
overlap_grad_reduce = True
overlap_param_gather = True
bucket_size = 40_000_000
eval_interval = 1000
eval_iters = 50
checkpoint_interval = 1000
keep_last = 2
tensorboard = False  # True after `pip install tensorboard` (optional for training; requirements-dev.txt has it)
