"""The quickstart: the whole pipeline on the bundled corpus, on CPU, in a few minutes.

train a byte-level BPE tokenizer -> pretokenize to token shards -> build the sample index ->
pretrain a tiny Llama2 -> validation loss falling -> checkpoint -> generate with a KV cache.
Every stage is the same command a user would type (printed before it runs).
Outputs go to demo_out/ (removed and rebuilt on each run).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "demo_out")
PY = sys.executable
SEQ = 128
STEPS = int(os.environ.get("STEPS") or 800)  # `make demo STEPS=50` for a short version


def run(title: str, args: list[str]) -> None:
    print(f"\n=== {title}\n$ {' '.join(shlex.quote(a) for a in ['python'] + args[1:])}", flush=True)
    t0 = time.time()
    rc = subprocess.call(args, cwd=ROOT)
    if rc != 0:
        print(f"demo: stage '{title}' failed with exit code {rc}", file=sys.stderr)
        sys.exit(rc)
    print(f"=== {title}: done in {time.time() - t0:.1f}s", flush=True)


def main() -> int:
    t0 = time.time()
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    tok, pretok, run_dir = (os.path.join(OUT, d) for d in ("tokenizer", "pretok", "run"))
    run("1/5 train a byte-level BPE tokenizer",
        [PY, "-m", "tokenizer.train_tokenizer", "--data_dir=data/pretrain", f"--output_dir={tok}",
         "--vocab_size=2048", "--tokenizer_type=hf_bbpe"])
    run("2/5 pretokenize the corpus into token shards",
        [PY, "-m", "data_preprocess.pretokenize_pretrain_data", "--data_dir=data/pretrain",
         f"--tokenizer_dir={tok}", f"--output_dir={pretok}", "--num_workers=2"])
    run("3/5 build the sample index (train/val split)",
        [PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={pretok}",
         f"--max_seq_len={SEQ}", "--val_ratio=0.05"])
    run("4/5 pretrain a tiny Llama2 on CPU",
        [PY, "train_my_ddp.py", f"--out_dir={run_dir}", f"--data_dir={pretok}", f"--tokenizer_dir={tok}",
         f"--max_seq_len={SEQ}", "--dim=256", "--n_layers=4", "--n_heads=8", "--batch_size=16",
         f"--max_iters={STEPS}", f"--eval_interval={max(1, STEPS // 8)}", "--eval_iters=10",
         f"--log_interval={max(1, STEPS // 16)}", f"--checkpoint_interval={max(1, STEPS // 4)}",
         "--learning_rate=3e-3", "--min_lr=3e-4", f"--warmup_iters={min(30, max(1, STEPS // 10))}",
         "--weight_decay=0.1"])
    # the falling validation loss, read back from the run's metrics
    import json
    vals = []
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("val_loss") is not None:
                vals.append((rec["step"], rec["val_loss"]))
    print("\nvalidation loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in vals))
    if len(vals) >= 2 and vals[-1][1] >= vals[0][1]:
        print("demo: validation loss did not fall", file=sys.stderr)
        return 1
    run("5/5 generate from the checkpoint (KV cache, temperature 0.8, top-k 50)",
        [PY, "sample.py", f"--ckpt={run_dir}", f"--tokenizer_dir={tok}", "--prompt=The module",
         "--max_new_tokens=60", "--temperature=0.8", "--top_k=50"])
    run("   ... and a Chinese prompt",
        [PY, "sample.py", f"--ckpt={run_dir}", f"--tokenizer_dir={tok}", "--prompt=机器学习",
         "--max_new_tokens=60", "--temperature=0.8", "--top_k=50"])
    print(f"\ndemo finished in {time.time() - t0:.0f}s; outputs in {OUT} "
          f"(plot them: python -m utils.resplot {run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
