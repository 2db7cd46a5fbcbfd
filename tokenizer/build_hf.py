"""Train the ``hf_bbpe`` tokenizer: byte-level BPE with the Hugging Face ``tokenizers`` trainer.

Owns: the pre-tokenizer (a GPT-4-style split regex, then byte-level mapping), the decoder, and the
trainer settings. Returns a ``tokenizers.Tokenizer`` holding only learned pieces (ids 0..n-1).
Must never: add special tokens (train_tokenizer.py appends them after the learned pieces), normalise
text (the byte-level round trip must stay exact), or read files itself.
"""
from __future__ import annotations

import sys

from typing import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# Contractions, letter runs with one leading non-letter, digits in groups of <=3, punctuation runs,
# newline runs, and whitespace (a trailing space stays with the next word). Same idea as cl100k/Qwen2.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def new_hf_bbpe() -> Tokenizer:
    """An untrained byte-level BPE pipeline: no normalizer, regex split, byte-level, no post-processor."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    return tk


def _batches(docs: Iterable[str], size: int = 1000) -> Iterator[list[str]]:
    batch: list[str] = []
    for d in docs:
        batch.append(d)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def train_hf_bbpe(docs: Iterable[str], learned_vocab_size: int, min_frequency: int = 2,
                  progress: bool = False) -> Tokenizer:
    """Train on a stream of documents; the trainer keeps only word counts, never the documents."""
    tk = new_hf_bbpe()
    trainer = trainers.BpeTrainer(
        vocab_size=learned_vocab_size,
        min_frequency=min_frequency,
        special_tokens=[],  # appended later, after the learned pieces
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is ever unknown
        # the Rust trainer's bars print only blank lines when stderr is not a terminal (logs, CI)
        show_progress=progress and sys.stderr.isatty(),
    )
    tk.train_from_iterator(_batches(docs), trainer=trainer)
    return tk
