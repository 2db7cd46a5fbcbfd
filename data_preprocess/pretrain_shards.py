"""The shards of one pretokenized input (pretokenize_pretrain_data.py): `ShardWriter` packs `<s> ids </s>` documents
into fixed-size shards with their sidecars (format in shard_format.py, a sidecar never before its shard), and the
resume rule: which output files are an input's (`stem_for`, `stem_files`) and whether its shards are complete and
from the same source, tokenizer and options (`complete_shard_tokens`), so that a rerun keeps them.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from data_preprocess.shard_format import (SHARD_RE, DataError, read_sidecar, write_shard, check_shard)
from tokenizer.corpus import is_dataset_source


class ShardWriter:
    """Packs `<s> ids </s>` documents into fixed-size shards (the last one shorter).

    Documents may continue into the next shard: readers see one concatenated stream, so a
    shard boundary inside a document costs nothing and keeps shard sizes predictable."""

    def __init__(self, out_dir: str, stem: str, shard_tokens: int, meta: dict):
        self.out_dir, self.stem, self.shard_tokens, self.meta = out_dir, stem, shard_tokens, meta
        self.dtype = np.dtype(meta["dtype"])
        self.buf = np.empty(shard_tokens, dtype=self.dtype)
        self.fill = 0
        self.doc_starts: list[int] = []
        self.k = 0
        self.tokens = 0
        self.docs = 0

    def add(self, ids: np.ndarray) -> None:
        """One whole document."""
        self.begin_doc()
        self.extend(ids)
        self.end_doc()

    def begin_doc(self) -> None:
        if self.fill == self.shard_tokens:
            self._flush(final=False)  # flushed lazily so the final shard is never an empty one
        self.doc_starts.append(self.fill)
        self.docs += 1
        if self.meta["bos_id"] is not None:  # (a tokenizer without a bos: `ids </s>`)
            self.extend(np.asarray([self.meta["bos_id"]]))

    def end_doc(self) -> None:
        self.extend(np.asarray([self.meta["eos_id"]]))

    def extend(self, ids: np.ndarray) -> None:
        """Append ids to the open document (one document may be added in several pieces)."""
        pos = 0
        while pos < ids.size:
            if self.fill == self.shard_tokens:
                self._flush(final=False)  # a full shard with more of this document to come
            n = min(ids.size - pos, self.shard_tokens - self.fill)
            self.buf[self.fill:self.fill + n] = ids[pos:pos + n]
            self.fill += n
            pos += n

    def _flush(self, final: bool) -> None:
        offsets = np.asarray(self.doc_starts + [self.fill], dtype=np.int64)
        write_shard(self.out_dir, self.stem, self.k, self.buf[:self.fill], offsets,
                    dict(self.meta, final=final))
        self.tokens += self.fill
        self.k += 1
        self.fill = 0
        self.doc_starts = []

    def close(self) -> None:
        self._flush(final=True)  # the final shard may be empty (a file of empty docs): still marks completion


def stem_for(path: Any, data_dir: Optional[str], taken: set[str]) -> str:
    if is_dataset_source(path):
        stem = path.stem
        while stem in taken:
            stem += "_"
        taken.add(stem)
        return stem
    rel = os.path.relpath(path, data_dir) if data_dir and os.path.isdir(data_dir) else os.path.basename(path)
    stem = os.path.splitext(rel)[0].replace(os.sep, "__")
    if stem in taken:  # a.json and a.jsonl in one folder
        stem = rel.replace(os.sep, "__").replace(".", "_")
    taken.add(stem)
    return stem


def stem_files(out_dir: str, stem: str) -> list[str]:
    return [n for n in os.listdir(out_dir)
            if n.startswith(stem + "_") and n[len(stem) + 1:len(stem) + 6].isdigit()
            and len(n) > len(stem) + 6 and n[len(stem) + 6] == "."]


def complete_shard_tokens(out_dir: str, stem: str, expect: dict) -> Optional[tuple[int, int]]:
    """(token count, duplicate documents recorded) of an input's complete shards, or None when they are not
    complete.

    Complete = sidecars 0..n-1 present, sizes agree, the last marked final, and built from the
    same source file (size, mtime), tokenizer, text fields and max_doc_chars as this run."""
    sidecars = sorted(n for n in stem_files(out_dir, stem) if SHARD_RE.match(n))
    if not sidecars:
        return None
    try:
        metas = [read_sidecar(os.path.join(out_dir, n)) for n in sidecars]
        for n, m in zip(sidecars, metas):
            check_shard(os.path.join(out_dir, n), m)
    except DataError:
        return None
    if [m.get("shard_index") for m in metas] != list(range(len(metas))) or not metas[-1].get("final"):
        return None
    if not all(all(m.get(k) == v for k, v in expect.items()) for m in metas):
        return None
    return sum(int(m.get("num_tokens", 0)) for m in metas), int(metas[-1].get("duplicate_documents", 0) or 0)
