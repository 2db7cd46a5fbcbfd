"""What the commands that use one trained model (`sample.py`, `eval_lm.py`) share, below them both: the checkpoint
a `--ckpt` / `--checkpoint` pair names, the model loaded from it for inference, and the tokenizer the run recorded.
Must never modify a checkpoint, and imports torch and the trainer's loaders only inside the calls that load (a
command answers its flags before torch is imported)."""
