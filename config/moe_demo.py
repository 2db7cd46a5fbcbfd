# A small mixture-of-experts Llama on the CPU (docs/model.md "Mixture of experts"), on the demo's data:
#   make demo STEPS=5      # (once) demo_out/tokenizer and demo_out/pretok
#   python train_my_ddp.py config/moe_demo.py --data_dir=demo_out/pretok --tokenizer_dir=demo_out/tokenizer
#   python export_hf.py --ckpt=demo_out/moe_run --out_dir=demo_out/moe_hf   # a MixtralForCausalLM directory
# 8 experts of width 256, 2 per token, in every block: 8.4M parameters (vocab 2048), 3.2M of them in a token's matmuls.
# Balanced by the auxiliary loss and the router z-loss; for DeepSeek-V3's auxiliary-loss-free balancing use
# --moe_bias_update_rate=0.001 (and --moe_score=sigmoid, --moe_shared_experts=1, --moe_first_dense_layers=1 for
# its shape; a sigmoid router's model exports as GLM-4-MoE instead of Mixtral: config/moe_deepseek_demo.py).
# A .py config is executed as Python (nanoGPT style): only use config files you trust.
out_dir = "demo_out/moe_run"
max_seq_len = 128
dim = 256
n_layers = 4
n_heads = 8
moe_num_experts = 8
moe_top_k = 2
moe_hidden_dim = 256
moe_aux_loss_coef = 0.01
moe_z_loss_coef = 0.001
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
