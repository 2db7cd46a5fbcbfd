# A small gpt-oss-shaped model on the CPU (docs/model.md "gpt-oss"), on the demo's data:
#   make demo STEPS=5      # (once) demo_out/tokenizer and demo_out/pretok
#   python train_my_ddp.py config/moe_gpt_oss_demo.py --data_dir=demo_out/pretok --tokenizer_dir=demo_out/tokenizer
# gpt-oss's choices at toy scale: grouped-query attention (8 query heads over 2 key/value heads) with q/k/v/o biases
# and a learned sink logit per head in every softmax, sliding-window (64) and full layers in turn, and every block an
# MoE of 16 routed experts (4 per token; no shared expert) with a router bias, expert biases and gpt-oss's clamped
# SwiGLU; balanced by a small auxiliary loss. A model of this shape exports to Hugging Face as gpt-oss:
# python export_hf.py --ckpt=demo_out/moe_gpt_oss_run --out_dir=demo_out/moe_gpt_oss_hf, then transformers'
# GptOssForCausalLM or sample.py --ckpt=<that dir> read it.
# Several ranks: torchrun --nproc_per_node=2 train_my_ddp.py config/moe_gpt_oss_demo.py ... --expert_parallel_size=2
# A .py config is executed as Python (nanoGPT style): only use config files you trust.
out_dir = "demo_out/moe_gpt_oss_run"
max_seq_len = 128
dim = 256
n_layers = 4
n_heads = 8
n_kv_heads = 2
qkv_bias = True
o_bias = True
attn_sinks = True
sliding_window = 64
sliding_layers = "every:2:0"
moe_num_experts = 16
moe_top_k = 4
moe_hidden_dim = 128
moe_router_bias = True
moe_expert_biases = True
moe_act = "gpt_oss"
moe_aux_loss_coef = 0.01
batch_size = 16
max_iters = 300
eval_interval = 100
eval_iters = 10
log_interval = 50
checkpoint_interval = 100
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 30
weight_decay = 0.1
device = "cpu"
