"""trainer: the training command's pieces, read in this order: config.py (every flag and its validation),
start.py (where a run starts, the model, the engine, the resumed state), loop.py (`train()` and `Loop`),
task.py (pretrain / SFT / DPO: data, loss, units), weights.py (where weights come from), samples.py
(--sample_every), faults.py (the tests' fault injection). train_my_ddp.py is the command."""
