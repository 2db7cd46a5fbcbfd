"""The trainer's torch-free look at --data_dir, for its pre-check (trainer/precheck.py): a path that does not
exist, and a pretraining --data_dir of raw text (.jsonl, .txt, ...) instead of token shards, answered in a second
with the commands that make shards, not after the model was built.

Owns: `training_data_problem`, the one line (exit 3, as the full path's DataError) or None.
Must never: import torch, read more than the directory listing (a bounded walk for raw files), or judge shards
(their sidecars, the index, the tokenizer they were made with): the full path checks those.
"""
from __future__ import annotations

import os
import shlex
from typing import Optional, Sequence

from data_preprocess.shard_format import SHARD_RE
from tokenizer.corpus import input_kind

MAX_LISTED = 10_000  # directory entries looked at for raw files (a huge tree is not walked to the end)


def _raw_files(path: str) -> list[str]:
    """Raw text inputs (the pretokenizer's kinds) at `path`: the file itself, or those under the directory."""
    if os.path.isfile(path):
        return [path] if input_kind(path) else []
    found, seen = [], 0
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            seen += 1
            if input_kind(name) and not name.startswith("."):
                found.append(os.path.join(root, name))
            if seen >= MAX_LISTED:
                return found
    return found


def _has_shards(path: str) -> bool:
    try:
        return any(SHARD_RE.match(n) for n in os.listdir(path))
    except OSError:
        return False


MAX_NAMED_FILES = 5  # a hint names the raw files themselves up to this many (else their folder)


def pretokenize_hint(raw: str, tokenizer_dir: str, max_seq_len: int, files: Sequence[str] = ()) -> str:
    """The commands that make token shards of `raw`, safe to paste: every path quoted for the shell, the raw files
    named one by one when they are few (a folder may also hold other tasks' files: the list shows what would be
    read), the output under out/ in the working directory (the pretokenizer's default), never beside the input."""
    from data_preprocess.pretokenize_pretrain_data import default_pretrain_out_dir
    q = shlex.quote
    inputs = list(files) if files and len(files) <= MAX_NAMED_FILES else [raw]
    out = default_pretrain_out_dir([raw])
    return (f"pretokenize them first: python -m data_preprocess.pretokenize_pretrain_data --data_dir "
            f"{' '.join(map(q, inputs))} --tokenizer_dir={q(tokenizer_dir)} --out_dir={q(out)}; python -m "
            f"data_preprocess.build_pretrain_sample_index_map --data_dir={q(out)} --max_seq_len={max_seq_len}; then "
            f"train with --data_dir={q(out)}")


def training_data_problem(task_type: str, data_dir: str, tokenizer_dir: str, max_seq_len: int,
                          data_mix: str = "") -> Optional[str]:
    """The full path's "data: ..." line for a --data_dir it would refuse, told before torch is imported, or None.

    Any task: a path that does not exist. Pretraining: a file, or a directory without token shards, with the
    pretokenizer's commands when it holds raw text. --data_mix runs are left to the full path."""
    if data_mix or not data_dir:
        return None
    if not os.path.exists(data_dir):
        if task_type == "pretrain":
            return f"data: {data_dir}: not a directory of token shards: it does not exist"
        return f"data: {data_dir}: no such file or directory"
    if task_type != "pretrain":
        return None
    if _has_shards(data_dir):
        return _index_problem(data_dir, max_seq_len)
    raw = _raw_files(data_dir)
    if os.path.isfile(data_dir):
        what = "a raw text file" if raw else "a file"
        return (f"data: {data_dir}: not a directory of token shards: it is {what}"
                + (f"; {pretokenize_hint(data_dir, tokenizer_dir, max_seq_len, raw)}" if raw else ""))
    if raw:
        names = ", ".join(os.path.relpath(p, data_dir) for p in raw[:3]) + (", ..." if len(raw) > 3 else "")
        return (f"data: {data_dir}: no token shards, but {len(raw)}{'+' if len(raw) >= MAX_LISTED else ''} raw "
                f"text file(s) ({names}); {pretokenize_hint(data_dir, tokenizer_dir, max_seq_len, raw)}")
    return None  # the full path names what is missing (no shards, orphans, ...)


def _index_problem(data_dir: str, max_seq_len: int) -> Optional[str]:
    """The full path's line for shards without a sample index for this --max_seq_len, or with one built for
    other shards (a stale index), read from the index's JSON and the shards' sidecars: no torch, no hashing."""
    from data_preprocess.build_pretrain_sample_index_map import load_index_meta
    from data_preprocess.shard_format import DataError, StaleIndexError
    try:
        load_index_meta(data_dir, max_seq_len)
    except StaleIndexError as e:
        return f"data: {e}"
    except DataError:
        return None  # damaged shards or index: the full path names them with its own checks
    return None
