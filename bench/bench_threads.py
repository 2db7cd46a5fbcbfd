"""Benchmark: the trainer's default CPU threads vs fixed thread settings, idle and beside two busy loops.

    .venv/bin/python bench/bench_threads.py                  # ~2 minutes on 2 cores
    .venv/bin/python bench/bench_threads.py --rounds 3 --steps 20

Each measurement is a real `python train_my_ddp.py` run (a fresh interpreter, as a user starts it) of the
demo's model (dim 256, 4 layers, seq 128, batch 8, vocab 2048) on token shards built here from a slice of
the bundled corpus; its tokens/s is the median of the per-step rates in metrics.jsonl after the first two
steps (the default's trial of one thread included). Settings:
  default            no --threads, no OMP_* variables: what the trainer chooses (utils/threads.py: every
                     usable core, or 1 thread while that is measured faster)
  threads=1          --threads=1
  threads=N          --threads=<usable cores>, fixed: PyTorch's default, the trainer's before it chose
  threads=N passive  the same with OMP_WAIT_POLICY=PASSIVE (waiting OpenMP threads sleep, not spin)
Conditions: idle (nothing started by the bench), and busy (two `while True: pass` processes started by the
bench for the measurement). The settings run interleaved, round by round; the table shows the median over
rounds, and the ratio default / best setting per condition. Other processes on a shared machine add noise:
the 1-minute load average before each condition is printed.
Nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from utils.threads import usable_cores  # noqa: E402  (torch-free)

PY = sys.executable
SEQ = 128


def build_data(work: str) -> tuple[str, str]:
    """A tokenizer and token shards from the first 80 documents of each bundled corpus file."""
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    src = os.path.join(ROOT, "data", "pretrain")
    for name in sorted(os.listdir(src)):
        if name.endswith(".jsonl"):
            with open(os.path.join(src, name), encoding="utf-8") as f, \
                    open(os.path.join(corpus, name), "w", encoding="utf-8") as g:
                for _, line in zip(range(80), f):
                    g.write(line)
    tok, shards = os.path.join(work, "tok"), os.path.join(work, "shards")
    for args in (["-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--output_dir={tok}",
                  "--vocab_size=2048", "--tokenizer_type=hf_bbpe"],
                 ["-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={corpus}", f"--tokenizer_dir={tok}",
                  f"--output_dir={shards}", "--num_workers=1", "--no_progress"],
                 ["-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}",
                  f"--max_seq_len={SEQ}", "--val_ratio=0.05"]):
        subprocess.run([PY, *args], cwd=ROOT, check=True, capture_output=True, text=True)
    return tok, shards


def settings(cores: int) -> dict[str, tuple[list[str], dict]]:
    """name -> (extra trainer flags, environment added)."""
    return {"default": ([], {}),
            "threads=1": (["--threads=1"], {}),
            f"threads={cores}": ([f"--threads={cores}"], {}),
            f"threads={cores} passive": ([f"--threads={cores}"], {"OMP_WAIT_POLICY": "PASSIVE"})}


FIRST_TRIAL_ENDS = 7  # utils/threads.ThreadTuner's defaults: 2 steps skipped, 2 measured, 3 steps on the other count


def run_trainer(work: str, tok: str, shards: str, steps: int, flags: list[str], env_changes: dict,
                after: int = 2) -> tuple[float, str, list[str]]:
    """(median tokens/s of the steps after `after`, the run's [layout] thread words, its [threads] lines)."""
    out = tempfile.mkdtemp(dir=work)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS")}
    env.update(env_changes)
    cmd = [PY, "train_my_ddp.py", f"--out_dir={out}", f"--data_dir={shards}", f"--tokenizer_dir={tok}",
           f"--max_seq_len={SEQ}", "--dim=256", "--n_layers=4", "--n_heads=8", "--batch_size=8",
           f"--max_iters={steps}", "--eval_interval=0", "--eval_iters=1", "--log_interval=1000",
           f"--checkpoint_interval={steps}", "--progress=false", "--peak_flops=1e11", "--device=cpu", *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"trainer failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    rates = []
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("step", 0) > after and "tokens_per_sec" in rec:
                rates.append(rec["tokens_per_sec"])
    layout = next((ln for ln in proc.stdout.splitlines() if ln.startswith("[layout]")), "")
    shutil.rmtree(out, ignore_errors=True)
    switches = [ln for ln in proc.stdout.splitlines() if ln.startswith("[threads]")]
    return statistics.median(rates), layout.rsplit("; threads ", 1)[-1], switches


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([PY, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per trainer run")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every setting per condition")
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes in the busy condition")
    a = ap.parse_args()
    cores = usable_cores()
    work = tempfile.mkdtemp(prefix="bench_threads_")
    try:
        t0 = time.time()
        tok, shards = build_data(work)
        print(f"data built in {time.time() - t0:.0f}s; {cores} usable cores; model dim 256 x 4 layers, "
              f"8 x {SEQ} tokens per step, {a.steps} steps per run, {a.rounds} round(s)", flush=True)
        table: dict[str, dict[str, list[float]]] = {}
        words: dict[str, str] = {}
        for condition in ("idle", f"beside {a.busy} busy loops"):
            procs = busy_loops(a.busy) if condition != "idle" else []
            try:
                time.sleep(1.0 if procs else 0.0)
                print(f"\n{condition}: load average {os.getloadavg()[0]:.1f} before", flush=True)
                for _ in range(a.rounds):
                    for name, (flags, env) in settings(cores).items():
                        # the default's steady state: after its first trial of one thread (later trials
                        # take at most 3% of a run's time: the tuner's budget)
                        after = FIRST_TRIAL_ENDS if name == "default" else 2
                        rate, w, switches = run_trainer(work, tok, shards, a.steps, flags, env, after)
                        table.setdefault(condition, {}).setdefault(name, []).append(rate)
                        words[name] = w
                        print(f"  {name:<18} {rate:8.0f} tokens/s   (threads {w})", flush=True)
                        for line in switches:
                            print(f"      {line}", flush=True)
            finally:
                for p in procs:
                    p.kill()
                    p.wait()
        print("\nmedian tokens/s over rounds; ratio = default / best setting of that condition")
        names = list(settings(cores))
        print(f"{'condition':<24}" + "".join(f"{n:>19}" for n in names) + f"{'default/best':>14}")
        for condition, rows in table.items():
            med = {n: statistics.median(rows[n]) for n in names}
            best = max(med.values())
            print(f"{condition:<24}" + "".join(f"{med[n]:>19.0f}" for n in names) + f"{med['default'] / best:>14.2f}")
        print(f"default = threads {words['default']}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
