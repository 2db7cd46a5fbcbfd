# A small DeepSeek-V3-shaped model on the CPU (docs/model.md "Mixture of experts", "Multi-head latent attention"), on
# the demo's data:
#   make demo STEPS=5      # (once) demo_out/tokenizer and demo_out/pretok
#   python train_my_ddp.py config/moe_deepseek_demo.py --data_dir=demo_out/pretok --tokenizer_dir=demo_out/tokenizer
# DeepSeek-V3's choices at toy scale: multi-head latent attention (keys and values from a 64-wide latent per token,
# queries from a 96-wide one; heads of 32 + 16 RoPE'd query / key dimensions and 32 value ones), the first block dense,
# then 16 fine-grained routed experts (4 per token) and one shared expert per block; sigmoid scores; group-limited
# routing (4 groups, a token's experts from its best 2); the routed output scaled (2.5); balanced by the selection bias,
# plus a tiny sequence-wise auxiliary loss; one multi-token prediction depth (an MoE block too) trained beside the loss
# at weight 0.3 (docs/model.md "Multi-token prediction"; left out of exports). Muon steps the hidden matrices, each
# expert's apart (docs/optimizer.md). A model of this shape exports to Hugging
# Face as DeepSeek-V3: python export_hf.py --ckpt=demo_out/moe_deepseek_run --out_dir=demo_out/moe_deepseek_hf, then
# transformers' DeepseekV3ForCausalLM or sample.py --ckpt=<that dir> read it (without the kv_lora_rank lines below:
# DeepSeek-V3's MoE on Llama attention, exported as GLM-4-MoE).
# Several ranks: torchrun --nproc_per_node=2 train_my_ddp.py config/moe_deepseek_demo.py ... --expert_parallel_size=2
# A .py config is executed as Python (nanoGPT style): only use config files you trust.
out_dir = "demo_out/moe_deepseek_run"
max_seq_len = 128
dim = 256
n_layers = 4
n_heads = 8
kv_lora_rank = 64
q_lora_rank = 96
qk_nope_head_dim = 32
qk_rope_head_dim = 16
v_head_dim = 32
hidden_dim = 512
moe_num_experts = 16
moe_top_k = 4
moe_hidden_dim = 64
moe_shared_experts = 1
moe_first_dense_layers = 1
moe_score = "sigmoid"
moe_n_groups = 4
moe_topk_groups = 2
moe_routed_scaling = 2.5
moe_bias_update_rate = 0.001
moe_aux_loss_coef = 0.0001
moe_aux_loss_type = "sequence"
mtp_num_layers = 1
mtp_loss_weight = 0.3
optimizer = "muon"
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
