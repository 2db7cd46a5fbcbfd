"""Build the fixed-length sample index over token shards
(`python -m data_preprocess.build_pretrain_sample_index_map`).

Owns: cutting the concatenation of all shards (in name order) into samples of L+1 tokens with
stride L (x = s[:-1], y = s[1:], so consecutive samples share one token and no token is ever a
target twice), the held-out validation split, and `index_meta.json`, which records exactly
what was indexed (shard names, byte sizes, token counts, tokenizer fingerprint, L) so that an
index never loads against changed shards or another L.

The split (`split_by`): "document" (the default) holds out whole documents, so every sample that holds a
token of a validation document is a validation sample or in neither split, never a training one. The
documents come from the shards' document offsets (`<shard>.idx.npy`, named by the sidecar's
doc_index_file); they are held out in runs of consecutive documents ("blocks") of at least
max(2L + 1, min(BLOCK_SAMPLES x L, total / MIN_BLOCKS)) tokens, so that short documents do not leave most
validation samples straddling a training document (2L + 1 tokens always hold one whole sample). Blocks are drawn in a seeded random order until the validation
samples (those whose L+1 tokens all lie in held-out blocks) reach the count asked for; a sample with tokens on
both sides is in neither split (num_dropped), and held-out samples beyond the count asked for (the tail of the
last block drawn) are dropped too, so num_val is exactly what was asked. "sample" draws validation samples
uniformly (format 1's only split): a document's samples can then land on both sides.

Layout: `<data_dir>/index_L<L>/{train.npy, val.npy, index_meta.json}`; train/val hold int64
start offsets into the concatenated stream, sorted (the loader does the shuffling). Format 2 (this one)
adds split_by, num_dropped (num_train + num_val + num_dropped = num_samples) and, by document, the
documents and blocks counted; format 1 (a split by sample, no such fields) is still read, a newer format
is refused with the command that rebuilds it.

Must never: treat shards separately (a shard whose length is a multiple of L must not make the
next shard disappear -- known trap 4), put one sample in both splits, or (by document) a token of a
validation document in a training sample.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from typing import Optional

import numpy as np

from data_preprocess.shard_format import (DataError, StaleIndexError, ShardInfo, atomic_save_npy,
                                          atomic_write_json, int_field, list_shards, read_json_object,
                                          remove_temp_files, shards_fingerprint)
from utils.disk_space import DiskFullError
from utils.writable import UnwritableDirError, check_writable_dir

log = logging.getLogger("build_index")
INDEX_FORMAT_VERSION = 2
READ_FORMAT_VERSIONS = (1, 2)  # 1: split by sample, written before split_by existed; same files
SPLITS = ("document", "sample")
BLOCK_SAMPLES = 8  # a held-out run of documents holds at least this many samples' tokens ...
MIN_BLOCKS = 64    # ... or 1/MIN_BLOCKS of the corpus when that is less (a small corpus still has runs to draw)


def index_dir_for(data_dir: str, max_seq_len: int) -> str:
    return os.path.join(data_dir, f"index_L{int(max_seq_len)}")


def num_samples_for(total_tokens: int, max_seq_len: int) -> int:
    """Samples of L+1 tokens at stride L that fit in a stream of total_tokens."""
    return max(0, (total_tokens - 1) // max_seq_len)


def shard_records(shards: list[ShardInfo]) -> list[dict]:
    return [{"name": s.name, "bytes": s.num_bytes, "tokens": s.num_tokens} for s in shards]


def document_starts(shards: list[ShardInfo]) -> np.ndarray:
    """Start offsets (int64, sorted) in the concatenated stream of every document of `shards` (in name order),
    from each shard's document offsets; a document continued from the shard before has no start there."""
    parts, base = [np.zeros(1, dtype=np.int64)], 0
    for s in shards:
        name = s.sidecar.get("doc_index_file")
        hint = "re-run the pretokenizer, or build the index with --split_by=sample"
        if not isinstance(name, str):
            raise DataError(f"{s.path}: its sidecar names no document offsets (doc_index_file); {hint}")
        path = os.path.join(os.path.dirname(s.path), os.path.basename(name))
        try:
            offs = np.asarray(np.load(path), dtype=np.int64).ravel()
        except (OSError, ValueError, EOFError) as e:
            raise DataError(f"{path}: unreadable document offsets ({type(e).__name__}); {hint}") from e
        if offs.size == 0 or offs[0] < 0 or offs[-1] != s.num_tokens or bool(np.any(np.diff(offs) < 0)):
            raise DataError(f"{path}: document offsets are not increasing up to the shard's {s.num_tokens} tokens; "
                            f"{hint}")
        parts.append(base + offs[:-1])  # the last entry is the shard's end
        base += s.num_tokens
    starts = np.unique(np.concatenate(parts))
    return starts[starts < max(base, 1)]


def _blocks(doc_starts: np.ndarray, min_tokens: int) -> np.ndarray:
    """Start offsets of runs of consecutive documents, each run at least `min_tokens` long (the last one may be
    shorter): the units validation is drawn in."""
    out, j, n = [], 0, len(doc_starts)
    while j < n:
        out.append(int(doc_starts[j]))
        j = max(j + 1, int(np.searchsorted(doc_starts, doc_starts[j] + min_tokens, side="left")))
    return np.asarray(out, dtype=np.int64)


def _split_by_document(shards: list[ShardInfo], total: int, n: int, n_val: int, max_seq_len: int,
                       seed: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(is_train, is_val) over the n samples, and the meta fields of the split: whole blocks of documents drawn
    in a seeded order until n_val samples lie wholly in them; the excess of the last blocks and the samples
    that straddle both sides are in neither split."""
    L = max_seq_len
    docs = document_starts(shards)
    min_tokens = max(2 * L + 1, min(BLOCK_SAMPLES * L, total // MIN_BLOCKS))
    starts = _blocks(docs, min_tokens)
    nb = len(starts)
    sizes = np.diff(np.append(starts, total))
    order = np.random.Generator(np.random.PCG64(seed)).permutation(nb)
    first = np.arange(n, dtype=np.int64) * L
    b0 = np.searchsorted(starts, first, side="right") - 1      # block of a sample's first token
    b1 = np.searchsorted(starts, first + L, side="right") - 1  # ... and of its last
    held = np.zeros(nb, dtype=bool)
    is_val = is_train = np.zeros(n, dtype=bool)
    drawn = 0
    while int(is_val.sum()) < n_val and drawn < nb:
        need, est = n_val - int(is_val.sum()), 0
        while est < need and drawn < nb:  # enough blocks for the shortfall, then count exactly
            held[order[drawn]] = True
            est += int(sizes[order[drawn]]) // L
            drawn += 1
        cum = np.concatenate([[0], np.cumsum(held, dtype=np.int64)])
        k = cum[b1 + 1] - cum[b0]  # held-out blocks a sample touches
        is_val, is_train = k == b1 - b0 + 1, k == 0
    if int(is_val.sum()) < n_val or not is_train.any():
        raise ValueError(f"cannot hold out {n_val} samples by document and keep training samples ({len(docs)} "
                         f"document(s) in {nb} run(s) of >= {min_tokens} tokens); ask for fewer (--val_ratio / "
                         "--val_samples), or split by sample (--split_by=sample)")
    rank = np.empty(nb, dtype=np.int64)
    rank[order] = np.arange(nb)
    val_ids = np.flatnonzero(is_val)
    keep = val_ids[np.lexsort((val_ids, rank[b0[val_ids]]))][:n_val]  # in draw order: the last block's tail goes
    is_val = np.zeros(n, dtype=bool)
    is_val[keep] = True
    return is_train, is_val, {"documents": int(len(docs)), "blocks": int(nb), "val_blocks": int(drawn),
                              "block_min_tokens": int(min_tokens)}


def build_index(data_dir: str, max_seq_len: int, val_ratio: float = 0.01,
                val_samples: Optional[int] = None, seed: int = 1234, split_by: str = "document") -> dict:
    """Write the index for `data_dir`'s shards; returns index_meta. `split_by`: "document" (whole documents
    held out; see the module docstring) or "sample"."""
    if max_seq_len < 1:
        raise ValueError("max_seq_len must be >= 1")
    if split_by not in SPLITS:
        raise ValueError(f"split_by must be one of {SPLITS}, got {split_by!r}")
    shards = list_shards(data_dir)
    check_writable_dir(index_dir_for(data_dir, max_seq_len), "")  # exit 2 before the index is computed
    total = sum(s.num_tokens for s in shards)
    n = num_samples_for(total, max_seq_len)
    if n == 0:
        raise DataError(f"{data_dir}: {total} tokens cannot make one sample of {max_seq_len + 1} tokens")
    if val_samples is not None:
        n_val = int(val_samples)
    else:
        if not 0.0 <= val_ratio < 1.0:
            raise ValueError("val_ratio must be in [0, 1)")
        n_val = int(round(val_ratio * n))
        if val_ratio > 0 and n_val == 0 and n > 1:
            n_val = 1  # a requested split is never silently empty
    if not 0 <= n_val < n:
        raise ValueError(f"val_samples={n_val} must leave training samples (have {n})")
    extra: dict = {}
    if split_by == "document" and n_val:
        is_train, is_val, extra = _split_by_document(shards, total, n, n_val, max_seq_len, seed)
    else:
        rng = np.random.Generator(np.random.PCG64(seed))
        # Held-out samples are drawn uniformly (Floyd-style, O(n_val) memory); a boolean mask of n
        # bytes then splits the ids. Sorting keeps the file readable and the memmap access local.
        val_ids = np.sort(rng.choice(n, size=n_val, replace=False)) if n_val else np.empty(0, np.int64)
        is_val = np.zeros(n, dtype=bool)
        is_val[val_ids] = True
        is_train = ~is_val
    starts = np.arange(n, dtype=np.int64) * max_seq_len
    out = index_dir_for(data_dir, max_seq_len)
    os.makedirs(out, exist_ok=True)
    remove_temp_files(out)
    meta_path = os.path.join(out, "index_meta.json")
    if os.path.exists(meta_path):
        os.remove(meta_path)  # the meta is the completeness marker: drop it before rewriting arrays
    atomic_save_npy(os.path.join(out, "train.npy"), starts[is_train])
    atomic_save_npy(os.path.join(out, "val.npy"), starts[is_val])
    meta = {
        "format_version": INDEX_FORMAT_VERSION,
        "max_seq_len": int(max_seq_len), "sample_tokens": int(max_seq_len) + 1, "stride": int(max_seq_len),
        "num_train": int(is_train.sum()), "num_val": int(n_val), "num_samples": int(n),
        "split_by": split_by, "num_dropped": int(n - is_train.sum() - n_val), **extra,
        "total_tokens": int(total), "seed": int(seed),
        "val_ratio": None if val_samples is not None else float(val_ratio),
        "val_samples": None if val_samples is None else int(val_samples),
        "dtype": shards[0].dtype.str, "vocab_size": shards[0].vocab_size,
        "tokenizer_fingerprint": shards[0].fingerprint,
        "shards": shard_records(shards), "shards_fingerprint": shards_fingerprint(shards),
    }
    atomic_write_json(meta_path, meta)  # last: present means train/val are complete
    return meta


def read_index_meta(meta_path: str) -> dict:
    """index_meta.json with the fields a reader relies on checked for type (DataError naming the file
    and the field: a truncated file, a list, "num_train": "5", a shard record without its size...)."""
    meta = read_json_object(meta_path, "index meta")
    version = meta.get("format_version", 1)
    if version not in READ_FORMAT_VERSIONS:
        raise StaleIndexError(f"{meta_path}: index format {json.dumps(version)[:20]}, this code reads formats "
                              f"{', '.join(map(str, READ_FORMAT_VERSIONS))}; rebuild the index with "
                              "python -m data_preprocess.build_pretrain_sample_index_map")
    int_field(meta_path, meta, "max_seq_len", minimum=1)
    for key in ("num_train", "num_val", "total_tokens"):
        int_field(meta_path, meta, key)
    if not isinstance(meta.get("shards_fingerprint"), str):
        raise DataError(f"{meta_path}: field 'shards_fingerprint' is missing or not a string")
    recs = meta.get("shards")
    if not isinstance(recs, list) or not recs:
        raise DataError(f"{meta_path}: field 'shards' is {json.dumps(recs)[:40]}, not a list of shard records")
    for i, r in enumerate(recs):
        if not (isinstance(r, dict) and isinstance(r.get("name"), str)):
            raise DataError(f"{meta_path}: field 'shards[{i}]' is not a {{name, bytes, tokens}} record")
        for key in ("bytes", "tokens"):
            int_field(meta_path, r, key, label=f"shards[{i}].{key}")
    return meta


def load_index_meta(data_dir: str, max_seq_len: int, shards: Optional[list[ShardInfo]] = None) -> dict:
    """Read index_meta.json and check it against the shards on disk; StaleIndexError otherwise."""
    out = index_dir_for(data_dir, max_seq_len)
    meta_path = os.path.join(out, "index_meta.json")
    if not os.path.exists(meta_path):
        others = sorted(d for d in os.listdir(data_dir) if d.startswith("index_L")) if os.path.isdir(data_dir) else []
        raise StaleIndexError(f"{meta_path}: no index for max_seq_len={max_seq_len}"
                              + (f" (found {others}; build one with build_pretrain_sample_index_map "
                                 f"--max_seq_len={max_seq_len})" if others else ""))
    meta = read_index_meta(meta_path)
    if meta["max_seq_len"] != int(max_seq_len):
        raise StaleIndexError(f"{meta_path}: built for max_seq_len={meta.get('max_seq_len')}, asked for {max_seq_len}")
    shards = shards if shards is not None else list_shards(data_dir)
    now = shard_records(shards)
    if now != meta["shards"] or shards_fingerprint(shards) != meta.get("shards_fingerprint"):
        was = {r["name"]: r for r in meta["shards"]}
        cur = {r["name"]: r for r in now}
        diff = sorted(set(was) ^ set(cur)) + sorted(k for k in set(was) & set(cur) if was[k] != cur[k])
        raise StaleIndexError(f"{meta_path}: the shards changed since the index was built "
                              f"(differing: {diff[:5] or 'tokenizer fingerprint'}); rebuild the index")
    return meta


def main(argv: Optional[list[str]] = None) -> int:
    from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_OK
    from utils.cli import Parser
    ap = Parser(
        prog="python -m data_preprocess.build_pretrain_sample_index_map",
        description="Index fixed-length samples (L+1 tokens, stride L) over all shards of --data_dir "
                    "as one stream; writes <data_dir>/index_L<L>/{train.npy,val.npy,index_meta.json}.",
        epilog="validation split: --split_by=document (default) holds out whole documents (runs of consecutive "
               "documents, drawn with --seed), so no document has samples on both sides; samples that straddle "
               "a held-out and a training document are in neither split (num_dropped in index_meta.json). "
               "--split_by=sample draws samples uniformly (a document can then be on both sides). Exact duplicate "
               "documents are separate documents here: drop them when pretokenizing (--dedup=true). "
               "bad input: a shard whose sidecar disagrees with its size, shards without sidecars, or "
               "shards from different tokenizers are errors (exit 3); nothing is skipped.")
    ap.add_argument("--data_dir", required=True, help="folder of <stem>_<k:05d>.bin/.json shards")
    ap.add_argument("--max_seq_len", type=int, required=True)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--val_ratio", type=float, default=0.01)
    g.add_argument("--val_samples", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--split_by", choices=SPLITS, default="document",
                    help="hold out whole documents (default) or samples drawn uniformly")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return EXIT_OK if e.code == 0 else EXIT_BAD_CONFIG
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        meta = build_index(args.data_dir, args.max_seq_len, args.val_ratio, args.val_samples, args.seed,
                           args.split_by)
    except ValueError as e:
        log.error("%s", e)
        return EXIT_BAD_CONFIG
    except (UnwritableDirError, DiskFullError) as e:  # exit 2 / 7, one line naming the path
        log.error("%s", e)
        return e.exit_code
    except DataError as e:
        log.error("%s", e)
        return EXIT_BAD_DATA
    log.info("indexed %d tokens from %d shard(s): %d train / %d val samples of %d tokens (split by %s; %d in "
             "neither split) -> %s", meta["total_tokens"], len(meta["shards"]), meta["num_train"], meta["num_val"],
             meta["sample_tokens"], meta["split_by"], meta["num_dropped"],
             index_dir_for(args.data_dir, args.max_seq_len))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
