"""data_preprocess package: commands that turn raw text into pretokenized files.

Owns the on-disk formats (`shard_format.py`, SFT files in `pretokenize_sft_data.py`) and the
sample index. Must never import `dataset/`, the model or training code."""
