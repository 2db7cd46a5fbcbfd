"""The quickstart: the whole pipeline on the bundled corpus, on CPU, in a few minutes.

train a byte-level BPE tokenizer -> pretokenize to token shards -> build the sample index ->
pretrain a tiny Llama2 -> validation loss falling -> checkpoint -> generate with a KV cache.
Every stage is the same command a user would type (printed before it runs).

Outputs go to demo_out/, which is kept: running the demo again skips the stages that finished and the
trainer continues its run from the last checkpoint (--resume=auto), so a Ctrl-C loses at most the steps
since it. `make clean` (or deleting demo_out/) starts over.

    make demo              # 300 steps (docs/benchmarks.md gives the minutes it takes)
    make demo LONG=1       # 800 steps, the run the walk-through's figures come from
    make demo STEPS=50     # any length; a longer run continues the shorter one's checkpoint
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "demo_out")
PY = sys.executable
SEQ = 128
SHORT_STEPS, LONG_STEPS = 300, 800
EXIT_INTERRUPTED = 130  # the shell's code for a Ctrl-C


def demo_steps(env: dict) -> int:
    """STEPS when given, else 800 with LONG=1, else 300."""
    if (env.get("STEPS") or "").strip():
        return int(env["STEPS"])
    return LONG_STEPS if (env.get("LONG") or "").strip() not in ("", "0") else SHORT_STEPS


class Interrupted(Exception):
    pass


_interrupted = {"flag": False}


def _on_sigint(signum, frame) -> None:
    # Ctrl-C reaches the whole foreground process group: the stage's process (the trainer saves a
    # checkpoint and exits 75) and this one, which only remembers it and waits for the stage to finish
    _interrupted["flag"] = True


def run(title: str, args: list[str], done_marker: str | None = None) -> None:
    """One stage: skipped when `done_marker` (a file in demo_out/) says it finished on an earlier run."""
    marker = os.path.join(OUT, f".done_{done_marker}") if done_marker else None
    if marker and os.path.exists(marker):
        print(f"\n=== {title}: done on an earlier run (kept in {os.path.relpath(OUT, ROOT)}/)", flush=True)
        return
    print(f"\n=== {title}\n$ {' '.join(shlex.quote(a) for a in ['python'] + args[1:])}", flush=True)
    t0 = time.time()
    rc = subprocess.Popen(args, cwd=ROOT).wait()
    if _interrupted["flag"]:
        raise Interrupted()
    if rc != 0:
        print(f"demo: stage '{title}' failed with exit code {rc}", file=sys.stderr)
        sys.exit(rc)
    if marker:
        open(marker, "w").close()
    print(f"=== {title}: done in {time.time() - t0:.1f}s", flush=True)


def stages(steps: int) -> None:
    tok, pretok, run_dir = (os.path.join(OUT, d) for d in ("tokenizer", "pretok", "run"))
    run("1/5 train a byte-level BPE tokenizer",
        [PY, "-m", "tokenizer.train_tokenizer", "--data_dir=data/pretrain", f"--output_dir={tok}",
         "--vocab_size=2048", "--tokenizer_type=hf_bbpe"], done_marker="tokenizer")
    run("2/5 pretokenize the corpus into token shards",
        [PY, "-m", "data_preprocess.pretokenize_pretrain_data", "--data_dir=data/pretrain",
         f"--tokenizer_dir={tok}", f"--output_dir={pretok}", "--num_workers=2"], done_marker="pretok")
    run("3/5 build the sample index (train/val split)",
        [PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={pretok}",
         f"--max_seq_len={SEQ}", "--val_ratio=0.05"], done_marker="index")
    # the schedule is the 800-step run's (warmup, peak, floor) scaled to the length; a longer run continues a
    # shorter one's checkpoint (the trainer's --resume=auto) with its own --max_iters
    run(f"4/5 pretrain a tiny Llama2 on CPU ({steps} steps; continues {os.path.relpath(run_dir, ROOT)} if it "
        "holds a checkpoint)",
        [PY, "train_my_ddp.py", f"--out_dir={run_dir}", f"--data_dir={pretok}", f"--tokenizer_dir={tok}",
         f"--max_seq_len={SEQ}", "--dim=256", "--n_layers=4", "--n_heads=8", "--batch_size=16",
         f"--max_iters={steps}", f"--eval_interval={max(1, steps // 6)}", "--eval_iters=10",
         f"--log_interval={max(1, steps // 15)}", f"--checkpoint_interval={max(1, steps // 10)}",
         "--learning_rate=3e-3", "--min_lr=3e-4", f"--warmup_iters={min(30, max(1, steps // 10))}",
         "--weight_decay=0.1"])
    vals = []  # the falling validation loss, read back from the run's metrics (the last record of each step)
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("val_loss") is not None:
                vals.append((rec["step"], rec["val_loss"]))
    vals = sorted(dict(vals).items())
    print("\nvalidation loss by step: " + ", ".join(f"{s}: {v:.3f}" for s, v in vals))
    if len(vals) >= 2 and vals[-1][1] >= vals[0][1]:
        print("demo: validation loss did not fall", file=sys.stderr)
        sys.exit(1)
    run("5/5 generate from the checkpoint (KV cache, temperature 0.8, top-k 50)",
        [PY, "sample.py", f"--ckpt={run_dir}", f"--tokenizer_dir={tok}", "--prompt=The module",
         "--max_new_tokens=60", "--temperature=0.8", "--top_k=50"])
    run("   ... and a Chinese prompt",
        [PY, "sample.py", f"--ckpt={run_dir}", f"--tokenizer_dir={tok}", "--prompt=机器学习",
         "--max_new_tokens=60", "--temperature=0.8", "--top_k=50"])


def main() -> int:
    t0 = time.time()
    steps = demo_steps(dict(os.environ))
    os.makedirs(OUT, exist_ok=True)
    signal.signal(signal.SIGINT, _on_sigint)
    try:
        stages(steps)
    except (Interrupted, KeyboardInterrupt):
        again = "make demo" + (f" STEPS={os.environ['STEPS']}" if (os.environ.get("STEPS") or "").strip()
                               else " LONG=1" if steps == LONG_STEPS else "")
        print(f"\ndemo: interrupted; run `{again}` again to continue where it stopped (demo_out/ is kept; "
              "`make clean` starts over)", file=sys.stderr, flush=True)
        return 0 if os.environ.get("DEMO_UNDER_MAKE") else EXIT_INTERRUPTED
    run_dir = os.path.join(OUT, "run")
    print(f"\ndemo finished in {time.time() - t0:.0f}s; outputs in {OUT} "
          f"(plot them: python -m utils.resplot {run_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
