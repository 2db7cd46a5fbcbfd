# Continued pretraining of an existing Llama (a Hugging Face directory) with LoRA on every
# projection plus trainable embeddings and LM head, as in the Chinese-LLaMA recipe.
#   python train_my_ddp.py config/lora_continued_pretrain.py --init_from=path/to/hf_llama \
#       --data_dir=out/pretok_zh --tokenizer_dir=path/to/hf_llama
out_dir = "out/lora_cpt"
max_seq_len = 2048
lora_rank = 64
lora_alpha = 128.0
lora_dropout = 0.05
lora_targets = "all"
lora_train_embeddings = True
batch_size = 4
gradient_accumulation_steps = 8
max_iters = 10000
learning_rate = 2e-4
min_lr = 2e-5
warmup_iters = 200
weight_decay = 0.0
dtype = "bf16"
gradient_checkpointing = True
eval_interval = 500
checkpoint_interval = 500
