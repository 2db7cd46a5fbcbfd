"""Tokenizer stage: train a byte-level BPE tokenizer on the user's corpus, load it, encode text and chats.

Owns the public API used by data_preprocess/ and dataset/ (see docs/INTERFACES.md, tokenizer section).
Must never import a later package of the pipeline.
"""
from typing import Any

from tokenizer.chat import encode_chat
from tokenizer.contract import SPECIAL_TOKENS, padded_vocab_size
from tokenizer.loading import encode_prompts, encode_texts, load_tokenizer, load_tokenizer_meta

__all__ = ["SPECIAL_TOKENS", "encode_chat", "encode_prompts", "encode_texts", "load_tokenizer", "load_tokenizer_meta",
           "padded_vocab_size", "train_tokenizer"]


def __getattr__(name: str) -> Any:
    # Imported lazily so `python -m tokenizer.train_tokenizer` does not find its module pre-imported.
    if name == "train_tokenizer":
        from tokenizer.train_tokenizer import train_tokenizer

        # Importing the submodule bound its name on this package; the public name is the function.
        globals()["train_tokenizer"] = train_tokenizer
        return train_tokenizer
    raise AttributeError(name)
