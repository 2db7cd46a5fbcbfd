"""data_preprocess package: commands that turn raw text into pretokenized files.

Owns the on-disk formats (`shard_format.py`; SFT / DPO folders and their in-memory form in
`chat_tokens.py`), raw SFT / DPO records tokenized in memory for the trainer
(`pretokenize_sft_data.tokenize_sft_records`, `pretokenize_dpo_data.tokenize_dpo_records`), and the
sample index. Must never import `dataset/`, the model or training code."""
