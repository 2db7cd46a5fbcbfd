"""Data-stage benchmark: prints figures and ratios, asserts nothing.

1. Pretokenize throughput (tokens/s) of `pretokenize_pretrain` with N worker processes against
   the bare tokenizer's `encode_batch` (Rust, all cores) on the same text, in this process.
2. Random-sample reading from ~1 GB of uint16 shards (random ids written straight into shards):
   samples/s and peak RSS of `PretokDatasetWithIndex` + `ResumableLoader` in a fresh subprocess,
   against bare np.memmap slicing of the same offsets in another fresh subprocess.

Usage: .venv/bin/python bench/bench_data.py [--work_dir=/tmp/bench_data] [--text_mb=20] [--shard_gb=1.0]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from his her an which 的 是 在 了 和 有 "
         "model data token train learn shard index loader sample batch epoch rank world seed").split()


def make_corpus(path: str, mb: float, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    texts, size = [], 0
    while size < mb * 1e6:
        n = int(rng.integers(50, 400))
        t = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n)) + f" {int(rng.integers(1e6))}."
        texts.append(t)
        size += len(t.encode())
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
    return texts


def bench_pretokenize(work: str, text_mb: float, workers: int) -> None:
    from data_preprocess.pretokenize_pretrain_data import pretokenize_pretrain
    from tokenizer import load_tokenizer
    from tokenizer.loading import safe_backend
    from tokenizer.train_tokenizer import train_tokenizer
    raw = os.path.join(work, "raw")
    os.makedirs(raw, exist_ok=True)
    texts = make_corpus(os.path.join(raw, "corpus.jsonl"), text_mb)
    tok_dir = os.path.join(work, "tok")
    train_tokenizer(os.path.join(raw, "corpus.jsonl"), tok_dir, vocab_size=2048, max_train_bytes=2_000_000)
    backend = safe_backend(load_tokenizer(tok_dir))
    t0 = time.perf_counter()
    n_ref = sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))
    t_ref = time.perf_counter() - t0
    out = os.path.join(work, "shards_text")
    t0 = time.perf_counter()
    s = pretokenize_pretrain(raw, tok_dir, out, num_workers=workers, progress=False)
    t_ours = time.perf_counter() - t0
    ours_tps = (s["tokens"] - 2 * s["documents"]) / t_ours  # content tokens, same count as the reference
    print(f"[pretokenize] {text_mb:.0f} MB jsonl, {len(texts)} docs, {n_ref} tokens")
    print(f"  bare encode_batch (rayon, all cores): {n_ref / t_ref:,.0f} tok/s ({t_ref:.2f}s)")
    print(f"  pretokenize_pretrain, {workers} workers (read+tokenize+write shards): {ours_tps:,.0f} tok/s "
          f"({t_ours:.2f}s)")
    print(f"  ratio ours/bare = {ours_tps / (n_ref / t_ref):.2f}")


def write_random_shards(d: str, total_tokens: int, shard_tokens: int, vocab: int = 32000) -> None:
    """Random ids straight into the shard format, in chunks (flat memory while generating)."""
    from data_preprocess.shard_format import atomic_write_json, atomic_save_npy, dtype_for_vocab, shard_base
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(0)
    dtype = dtype_for_vocab(vocab)
    k, left = 0, total_tokens
    while left > 0:
        n = min(shard_tokens, left)
        base = os.path.join(d, shard_base("rand", k))
        with open(base + ".bin", "wb") as f:
            for off in range(0, n, 1 << 24):
                rng.integers(0, vocab, size=min(1 << 24, n - off), dtype=dtype).tofile(f)
        atomic_save_npy(base + ".idx.npy", np.array([0, n], dtype=np.int64))
        left -= n
        atomic_write_json(base + ".json", {"format_version": 1, "dtype": dtype.str, "vocab_size": vocab,
                                           "bos_id": 1, "eos_id": 2, "num_tokens": n, "num_bytes": n * dtype.itemsize,
                                           "num_documents": 1, "shard_index": k, "final": left == 0,
                                           "tokenizer_fingerprint": "random"})
        k += 1


READER = r"""
import os, sys, time, json
sys.path.insert(0, {root!r})
import numpy as np, psutil, torch
proc = psutil.Process()
def hwm():  # VmHWM: peak RSS of this process image (ru_maxrss survives exec and shows the parent's)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
mode, d, L, steps, B = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
base = proc.memory_info().rss
peak = base
if mode == "ours":
    from dataset import PretokDatasetWithIndex, ResumableLoader
    ds = PretokDatasetWithIndex(d, L)
    it = ResumableLoader(ds, B, seed=0)
    t0 = time.perf_counter()
    for s in range(steps):
        batch = next(it)
        if s % 50 == 0: peak = max(peak, proc.memory_info().rss)
else:
    from data_preprocess.shard_format import list_shards
    sh = list_shards(d)
    maps = [np.memmap(s.path, dtype=s.dtype, mode="r") for s in sh]
    ends = np.cumsum([s.num_tokens for s in sh])
    starts = np.load(os.path.join(d, f"index_L{{L}}", "train.npy"), mmap_mode="r")
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    for s in range(steps):
        rows = []
        for j in rng.integers(0, len(starts), B):
            st = int(starts[j]); i = int(np.searchsorted(ends, st, side="right")); o = st - (int(ends[i - 1]) if i else 0)
            a = maps[i][o:o + L + 1]
            if a.size < L + 1: a = np.concatenate([a, maps[i + 1][:L + 1 - a.size]])
            rows.append(torch.from_numpy(a.astype(np.int64)))
        batch = torch.stack(rows)
        if s % 50 == 0: peak = max(peak, proc.memory_info().rss)
dt = time.perf_counter() - t0
peak = max(peak, proc.memory_info().rss)
print(json.dumps({{"samples_per_s": steps * B / dt, "base_rss_mb": base / 2**20, "peak_rss_mb": peak / 2**20,
                  "vmhwm_mb": hwm()}}))
"""


def bench_reading(work: str, shard_gb: float, L: int = 1024, steps: int = 2000, B: int = 8) -> None:
    from data_preprocess.build_pretrain_sample_index_map import build_index
    d = os.path.join(work, "shards_random")
    total = int(shard_gb * 1e9 / 2)
    if not os.path.exists(os.path.join(d, f"index_L{L}", "index_meta.json")):
        write_random_shards(d, total, shard_tokens=100_000_000)
        build_index(d, L, val_ratio=0.001)
    code = READER.format(root=ROOT)
    res = {}
    for mode in ("ours", "bare"):
        r = subprocess.run([sys.executable, "-c", code, mode, d, str(L), str(steps), str(B)],
                           capture_output=True, text=True, check=True)
        res[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"[reading] {total * 2 / 1e9:.2f} GB of uint16 shards, L={L}, {steps} random batches of {B}")
    for mode, name in (("ours", "PretokDatasetWithIndex + ResumableLoader"), ("bare", "bare np.memmap slicing")):
        r = res[mode]
        print(f"  {name}: {r['samples_per_s']:,.0f} samples/s, RSS {r['base_rss_mb']:.0f} MB after imports "
              f"-> peak {r['peak_rss_mb']:.0f} MB (VmHWM {r['vmhwm_mb']:.0f} MB)")
    print(f"  ratio samples/s ours/bare = {res['ours']['samples_per_s'] / res['bare']['samples_per_s']:.2f}; "
          f"peak RSS growth ours = {res['ours']['peak_rss_mb'] - res['ours']['base_rss_mb']:.0f} MB "
          f"for {total * 2 / 2**20:.0f} MB of shards")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work_dir", default="/tmp/bench_data")
    ap.add_argument("--text_mb", type=float, default=20)
    ap.add_argument("--shard_gb", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--skip_pretokenize", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.work_dir, exist_ok=True)
    if not a.skip_pretokenize:
        bench_pretokenize(a.work_dir, a.text_mb, a.workers)
    bench_reading(a.work_dir, a.shard_gb)


if __name__ == "__main__":
    main()
