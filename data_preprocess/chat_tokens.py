"""The pretokenized SFT / DPO / KTO format: the folders the pretokenizers write and the same data in memory.

Owns: what tells the kinds apart (`ChatKind`: meta file, index file, its columns, count keys; `SFT`, `DPO`,
`KTO`: unpaired examples, each with its desirable flag), the in-memory form `ChatTokens` (what `pretokenize_sft_data.tokenize_sft_records` /
`pretokenize_dpo_data.tokenize_dpo_records` make of raw records: the arrays and meta fields a folder
holds), recognizing a pretokenized folder of either kind (`is_pretokenized`, `check_not_other_kind`),
writing a folder atomically with its meta last (`write_tokenized`), the totals of the per-file counts
(`drop_totals`) and the one-line account of what was read (`read_summary`). The files, column by column,
are described in `pretokenize_sft_data` and `pretokenize_dpo_data`.

The `dataset/` readers import this module, so it must never import a tokenizer, a chat template or the
record readers; nor store labels unsigned (trap 2).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from data_preprocess.shard_format import DataError, atomic_save_npy, atomic_write_json, remove_temp_files
from utils.publish import atomic_write_bytes


@dataclass(frozen=True)
class ChatKind:
    """One kind of pretokenized chat data: SFT samples (one token span a row), DPO pairs (two) or KTO examples (one,
    and its label: a tag column)."""
    kind: str                 # the --task_type, and meta["kind"]
    meta_name: str            # written last: its presence marks a complete folder
    index_name: str           # int64 [n, cols]: (offset, length) per branch, tags, file id, position in the file
    count_key: str            # meta / per-file count: num_samples, num_pairs
    first_key: str            # per-file: the file's first row
    unit: str                 # one row, in messages: "SFT sample", "DPO pair"
    raw_units: str            # what the raw records are called in the other-kind message
    branches: int             # token spans a row: 1 (SFT), 2 (DPO: chosen, rejected)
    meta_kind_required: bool  # the readers refuse a meta whose "kind" is not this kind
    format_version: int = 1
    tags: int = 0             # integer columns a row holds after its spans (KTO: 1 = desirable, 0 = undesirable)
    values: tuple[str, ...] = ()  # optional float columns a record may carry (DPO: its margin), kept in VALUES_NAME

    @property
    def cols(self) -> int:
        return 2 * self.branches + self.tags + 2

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """(offset column, length column) of every branch."""
        return tuple((2 * b, 2 * b + 1) for b in range(self.branches))

    @property
    def units(self) -> str:
        return self.unit + "s"


SFT = ChatKind("sft", "sft_meta.json", "samples.npy", "num_samples", "first_sample", "SFT sample", "records", 1,
               meta_kind_required=False)
DPO = ChatKind("dpo", "dpo_meta.json", "pairs.npy", "num_pairs", "first_pair", "DPO pair", "pairs", 2,
               meta_kind_required=True, values=("margin",))
KTO = ChatKind("kto", "kto_meta.json", "examples.npy", "num_examples", "first_example", "KTO example",
               "labelled examples", 1, meta_kind_required=True, tags=1)
KINDS = (SFT, DPO, KTO)
# float64 [n, len(kind.values)] beside the index, written only when a kept row's record carried one of the values
# (0.0 where a record did not); the meta then lists them ("values_columns") and counts the rows that carried one
VALUES_NAME = "values.npy"


@dataclass
class ChatTokens:
    """Pretokenized samples / pairs in memory, as a folder of `kind` would hold them."""
    kind: ChatKind
    path: str             # the raw records they were made from (named in messages)
    meta: dict            # pad_id, max_seq_len, the count (kind.count_key), files: per-file counts
    ids: np.ndarray       # int64, every row's tokens back to back
    labels: np.ndarray    # int32, aligned with ids (unshifted), -100 where nothing is learned
    index: np.ndarray     # int64 [n, kind.cols]
    values: "np.ndarray | None" = None  # float64 [n, len(kind.values)] where a record carried one, else None


def is_pretokenized(path: str, kind: ChatKind) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, kind.meta_name))


def check_not_other_kind(path: str, kind: ChatKind) -> None:
    """DataError when `path` is a pretokenized folder of another kind (SFT given for DPO, or back)."""
    for other in (k for k in KINDS if k is not kind and is_pretokenized(path, k)):
        raise DataError(f"{path} holds pretokenized {other.units}, not {kind.units} (--task_type={other.kind}, or "
                        f"pretokenize the {kind.raw_units} with data_preprocess.pretokenize_{kind.kind}_data)")


def write_tokenized(out: str, kind: ChatKind, ids: np.ndarray, labels: np.ndarray, dtype: np.dtype,
                    index: np.ndarray, meta: dict, values: "np.ndarray | None" = None) -> None:
    """ids (dtype), labels (int32), the int64 index, the rows' float values (VALUES_NAME, where there are any)
    and the meta JSON, each atomically, meta last: its presence marks a complete folder, so it is removed first
    when the arrays are replaced (and an earlier write's values file with it)."""
    os.makedirs(out, exist_ok=True)
    remove_temp_files(out)
    meta_path = os.path.join(out, kind.meta_name)
    for stale in (meta_path, os.path.join(out, VALUES_NAME)):
        if os.path.exists(stale):
            os.remove(stale)
    if values is not None:
        atomic_save_npy(os.path.join(out, VALUES_NAME), np.ascontiguousarray(values, dtype=np.float64))
    atomic_write_bytes(os.path.join(out, "input_ids.bin"), memoryview(ids.astype(dtype)).cast("B"))
    atomic_write_bytes(os.path.join(out, "labels.bin"), memoryview(labels.astype("<i4")).cast("B"))
    atomic_save_npy(os.path.join(out, kind.index_name), index)
    atomic_write_json(meta_path, meta)


def drop_totals(files: list[dict]) -> dict:
    """Totals over the per-file counts: {dropped_overlong, truncated, skipped: {reason: n}}."""
    out: dict[str, Any] = {"dropped_overlong": 0, "truncated": 0, "skipped": {}}
    for f in files:
        out["dropped_overlong"] += int(f["dropped_overlong"])
        out["truncated"] += int(f["truncated"])
        for k, v in f["skipped"].items():
            out["skipped"][k] = out["skipped"].get(k, 0) + int(v)
    return out



def read_summary(kind: ChatKind, meta: dict, num_tokens: int) -> str:
    """What was read, in one line, from the per-file counts the pretokenizer keeps (a folder's meta or the
    in-memory `ChatTokens.meta`): records read, rows kept (truncated ones among them), dropped with the reason
    counts, skipped with the reason counts, tokens kept."""
    tot = drop_totals(meta["files"])
    kept = int(meta[kind.count_key])
    no_target = sum(int(f.get("dropped_no_target", 0)) for f in meta["files"])
    dropped = tot["dropped_overlong"] + no_target
    skipped = sum(tot["skipped"].values())
    reasons = ([f"over-long {tot['dropped_overlong']}", f"no target left {no_target}"] if kind is SFT
               else [f"over-long or no target left {tot['dropped_overlong']}"])  # DPO counts both as one
    line = (f"{kept + dropped + skipped} records -> {kept} {kind.units} ({tot['truncated']} truncated to "
            f"{int(meta['max_seq_len']) + 1} tokens), dropped {dropped} ({', '.join(reasons)}), skipped {skipped}")
    if tot["skipped"]:
        line += " (" + ", ".join(f"{k} {v}" for k, v in sorted(tot["skipped"].items())) + ")"
    return line + f", {int(num_tokens)} tokens"
