# The `make demo` run: a 4.3M-parameter Llama2 on the bundled corpus, CPU, a few minutes.
#   python train_my_ddp.py config/demo.py --data_dir=demo_out/pretok --tokenizer_dir=demo_out/tokenizer
# A .py config is executed as Python (nanoGPT style): only use config files you trust.
out_dir = "demo_out/run"
max_seq_len = 128
dim = 256
n_layers = 4
n_heads = 8
batch_size = 16
max_iters = 800
eval_interval = 100
eval_iters = 10
log_interval = 50
checkpoint_interval = 200
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 30
weight_decay = 0.1
device = "cpu"
