"""Data-stage benchmark: prints figures and ratios, asserts nothing.

1. Pretokenize (`pretokenize_pretrain`) on generated jsonl corpora of each `--text_mb` size:
   a. start-up costs, each in fresh subprocesses (best of `--repeats`): interpreter start, importing
      the pretokenizer, importing transformers (which imports torch), `load_tokenizer`, and what one
      worker process does before its first batch (rebuild the backend from JSON + first encode);
   b. the whole CLI (`python -m data_preprocess.pretokenize_pretrain_data`) in a fresh process per
      worker count: what a user waits for, start-up included;
   c. steady state: `pretokenize_pretrain` called in this process once the imports are done, with
      tokenizing forced in-process and forced onto a pool of N workers (the size threshold
      `SMALL_INPUT_BYTES` picks between them), against the bare tokenizer's `encode_batch` (Rust,
      all cores) on the same texts.
2. Random-sample reading from ~1 GB of uint16 shards (random ids written straight into shards):
   samples/s and peak RSS of `PretokDatasetWithIndex` + `ResumableLoader` in a fresh subprocess,
   against bare np.memmap slicing of the same offsets in another fresh subprocess.

Tokens/s count content tokens (without the <s> </s> each document gets), as `encode_batch` does.
Times are best of `--repeats` runs: on a shared machine the best run is the least disturbed one.

Usage: .venv/bin/python bench/bench_data.py [--work_dir=/tmp/bench_data] [--text_mb=1,20] [--workers=1,2]
       [--repeats=3] [--shard_gb=1.0] [--skip_pretokenize] [--skip_reading]
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


STARTUP = r"""
import json, os, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
what, tok_dir = sys.argv[1], sys.argv[2]
r = {{}}
if what == "python":
    pass
elif what == "import_pretokenizer":
    import data_preprocess.pretokenize_pretrain_data
elif what == "load_tokenizer":
    from transformers import AutoTokenizer  # imports torch
    t1 = time.perf_counter(); r["import_transformers"] = t1 - t0
    from tokenizer import load_tokenizer
    load_tokenizer(tok_dir)
    r["load_tokenizer"] = time.perf_counter() - t1
elif what == "worker_init":
    from data_preprocess import pretrain_workers as W
    backend_json = open(sys.argv[3]).read()
    t1 = time.perf_counter()
    W.init_worker(backend_json, None)
    W.tokenize_batch(["warm up the encoder"])
    r["worker_init"] = time.perf_counter() - t1
    r["torch_imported"] = "torch" in sys.modules or "transformers" in sys.modules
r[what] = r.get(what, time.perf_counter() - t0)
print(json.dumps(r))
"""


def _startup_costs(work: str, tok_dir: str, repeats: int) -> dict:
    """Seconds, best of `repeats` fresh processes each; 'python' is the interpreter alone."""
    from tokenizer import load_tokenizer
    backend = os.path.join(work, "backend.json")
    with open(backend, "w", encoding="utf-8") as f:
        f.write(load_tokenizer(tok_dir).backend_tokenizer.to_str())
    code = STARTUP.format(root=ROOT)
    best: dict = {}
    for what in ("python", "import_pretokenizer", "load_tokenizer", "worker_init"):
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "-c", code, what, tok_dir, backend], capture_output=True,
                                 text=True, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            r["wall_" + what] = time.perf_counter() - t0
            for k, v in r.items():
                best[k] = v if isinstance(v, bool) else min(best.get(k, v), v)
    return best


def _content_tokens(out: str) -> int:
    tokens = docs = 0
    for n in os.listdir(out):
        if n.endswith(".json"):
            with open(os.path.join(out, n), encoding="utf-8") as f:
                m = json.load(f)
            tokens += m["num_tokens"]
            docs += m["num_documents"]
    return tokens - 2 * docs


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_pretokenize(work: str, sizes_mb: list[float], workers: list[int], repeats: int) -> None:
    import shutil
    from data_preprocess import pretokenize_pretrain_data as M
    from data_preprocess import pretrain_workers as W
    from tokenizer import load_tokenizer
    from tokenizer.loading import safe_backend
    from tokenizer.train_tokenizer import train_tokenizer
    corpora = {}
    for mb in sizes_mb:
        raw = os.path.join(work, f"raw_{mb:g}MB")
        os.makedirs(raw, exist_ok=True)
        corpora[mb] = (raw, make_corpus(os.path.join(raw, "corpus.jsonl"), mb))
    tok_dir = os.path.join(work, "tok")
    train_tokenizer(os.path.join(corpora[max(sizes_mb)][0], "corpus.jsonl"), tok_dir, vocab_size=2048,
                    max_train_bytes=2_000_000)
    st = _startup_costs(work, tok_dir, repeats)
    print(f"[pretokenize start-up] best of {repeats} fresh processes, seconds")
    print(f"  python interpreter start (python -c pass, wall): {st['wall_python']:.2f}")
    print(f"  import data_preprocess.pretokenize_pretrain_data: {st['import_pretokenizer']:.2f}")
    print(f"  import transformers.AutoTokenizer (pulls in torch): {st['import_transformers']:.2f}")
    print(f"  load_tokenizer after that import: {st['load_tokenizer']:.2f}")
    print(f"  one worker before its first batch now (backend from JSON + first encode; "
          f"transformers/torch imported: {st['torch_imported']}): {st['worker_init']:.3f}")
    load = st['import_transformers'] + st['load_tokenizer']
    print(f"  -> loading the tokenizer costs {load:.2f} once per run, in the parent (before the backend-as-JSON "
          f"workers, every worker paid it too, all at once)")
    out = os.path.join(work, "shards_text")
    for mb in sizes_mb:
        raw, texts = corpora[mb]
        backend = safe_backend(load_tokenizer(tok_dir))
        t_ref = _best(lambda: backend.encode_batch(texts, add_special_tokens=False), repeats)
        n_ref = sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))
        print(f"[pretokenize] {mb:g} MB jsonl, {len(texts)} docs, {n_ref} tokens "
              f"(in-process below {W.SMALL_INPUT_BYTES / 1e6:g} MB of input or with 1 worker)")
        print(f"  bare encode_batch (rayon, all cores), in this process: {n_ref / t_ref:,.0f} tok/s ({t_ref:.2f}s)")
        for w in workers:
            def cli() -> None:
                shutil.rmtree(out, ignore_errors=True)
                subprocess.run([sys.executable, "-m", "data_preprocess.pretokenize_pretrain_data",
                                f"--data_dir={raw}", f"--tokenizer_dir={tok_dir}", f"--output_dir={out}",
                                f"--num_workers={w}", "--quiet"], cwd=ROOT, check=True, capture_output=True)
            t = _best(cli, repeats)
            n = _content_tokens(out)
            assert n == n_ref, (n, n_ref)
            print(f"  CLI, --num_workers={w}, fresh process (start-up included): {n / t:,.0f} tok/s ({t:.2f}s)")
        modes = [("in-process", 1, 1 << 62)] + [(f"{w} workers", w, 0) for w in workers]
        thr = W.SMALL_INPUT_BYTES
        try:
            for name, w, threshold in modes:
                W.SMALL_INPUT_BYTES = threshold

                def call() -> None:
                    shutil.rmtree(out, ignore_errors=True)
                    M.pretokenize_pretrain(raw, tok_dir, out, num_workers=w, progress=False)
                t = _best(call, repeats)
                print(f"  pretokenize_pretrain, {name}, imports done (read+tokenize+write shards): "
                      f"{n_ref / t:,.0f} tok/s ({t:.2f}s), ratio to bare = {t_ref / t:.2f}")
        finally:
            W.SMALL_INPUT_BYTES = thr


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
    ap.add_argument("--text_mb", default="1,20", help="comma-separated corpus sizes in MB")
    ap.add_argument("--shard_gb", type=float, default=1.0)
    ap.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    ap.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is reported")
    ap.add_argument("--skip_pretokenize", action="store_true")
    ap.add_argument("--skip_reading", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.work_dir, exist_ok=True)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start")
    if not a.skip_pretokenize:
        bench_pretokenize(a.work_dir, [float(x) for x in a.text_mb.split(",")],
                          [int(x) for x in a.workers.split(",")], a.repeats)
    if not a.skip_reading:
        bench_reading(a.work_dir, a.shard_gb)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
