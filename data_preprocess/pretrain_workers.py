"""Where the pretokenizer (pretokenize_pretrain_data.py) tokenizes: worker processes, or this process for one worker
or less than `SMALL_INPUT_BYTES` of input to do (`open_executor`). The tokenizer is loaded once, in this process,
and workers get its backend as JSON (no transformers / torch import in a worker); the shards are the same bytes
either way. Tokenizes only: what becomes of the ids is the driver's.
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable, Optional

import numpy as np

from data_preprocess.shard_format import DataError
from data_preprocess.worker_tokenizer import WorkerTokenizer, backend_json

# Inputs to (re)do smaller than this are tokenized in this process: starting workers costs more
# than they save there (measured with bench/bench_data.py; see docs/data.md).
SMALL_INPUT_BYTES = 4_000_000

_ENCODE: Optional[Callable[[list[str]], list[list[int]]]] = None


def init_worker(backend: Optional[str], encode_fn: Optional[Callable]) -> None:
    """Worker start-up: no transformers/torch import and no tokenizer directory read. The parent
    loaded the tokenizer once (`load_tokenizer`) and sends its backend as JSON (`backend`);
    `encode_texts` on it encodes exactly as on the parent's tokenizer (worker_tokenizer.py)."""
    global _ENCODE
    # One tokenizer thread per worker process: the pool is the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if encode_fn is not None:
        _ENCODE = encode_fn
        return
    from tokenizer import encode_texts
    tok = WorkerTokenizer(backend)
    _ENCODE = lambda texts: encode_texts(tok, texts)  # noqa: E731


def _to_arrays(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Flat ids + lengths: two arrays pickle far faster than a list of lists."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def tokenize_batch(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _ENCODE is not None, "worker not initialized"
    return _to_arrays(_ENCODE(texts))


class InProcess:
    """The executor interface, tokenizing in this process: `submit(tokenize_batch, texts)` does
    that work at once with this process's encoder and returns a finished Future (an exception is
    kept in it and reported like a worker's)."""

    def __init__(self, encode: Optional[Callable[[list[str]], list[list[int]]]]):
        self.encode = encode

    def submit(self, fn: Callable, texts: list[str]) -> Future:
        assert fn is tokenize_batch, fn
        fut: Future = Future()
        try:
            assert self.encode is not None, "no tokenizer loaded"
            fut.set_result(_to_arrays(self.encode(texts)))
        except Exception as e:  # noqa: BLE001 - reported with its file like a worker's exception
            fut.set_exception(e)
        return fut

    def __enter__(self) -> "InProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def open_executor(todo_bytes: int, num_workers: int, tokenizer_dir: Optional[str],
                   encode_fn: Optional[Callable]) -> "InProcess | ProcessPoolExecutor":
    """Worker processes when there is enough input for them to pay off, else this process.

    The tokenizer is loaded once, here, and only when some input is (re)done: a worker only
    rebuilds its backend from JSON (tens of ms) instead of importing transformers + torch
    (seconds per process, all at once on a busy machine)."""
    if todo_bytes == 0:
        return InProcess(None)  # everything complete: nothing to tokenize, nothing to load
    in_process = num_workers <= 1 or todo_bytes < SMALL_INPUT_BYTES
    tok = None
    if encode_fn is None:
        from tokenizer import encode_texts, load_tokenizer
        try:
            tok = load_tokenizer(tokenizer_dir)
        except Exception as e:  # noqa: BLE001 - a broken tokenizer directory fails the run, named
            raise DataError(f"{tokenizer_dir}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
    if in_process:
        return InProcess(encode_fn or (lambda texts: encode_texts(tok, texts)))
    return ProcessPoolExecutor(max_workers=num_workers, initializer=init_worker,
                               initargs=(None if tok is None else backend_json(tok), encode_fn))
