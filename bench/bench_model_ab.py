"""A/B benchmark: this tree's model against the model package of another git revision, in one process.

The "no regression" check for model changes. The base revision's `model/` is extracted with
`git archive` into a temporary directory and imported as the package `model_base` (its
`model.` imports rewritten), so both versions live in one process. Both get the same config, the
same weights (the base loads this tree's state_dict: checkpoint keys never depend on the kernels),
the same batch, precision, optimizer (torch fused AdamW) and thread count, and their timed steps are
interleaved so that load from other processes hits both alike. A step is forward + backward + AdamW.
Prints tokens/s (median of --steps), new/base per cell and the first losses (they must agree).
Nothing is asserted.

    .venv/bin/python bench/bench_model_ab.py --base d8495b6                    # tiny + large, fp32 + bf16, eager
    .venv/bin/python bench/bench_model_ab.py --base d8495b6 --configs tiny --modes eager,compile
"""
from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from bench.bench_model import CONFIGS, make_step  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from parallel.transforms.compile import compile_in_place  # noqa: E402

_IMPORT = re.compile(r"^(\s*)(from|import) model(?=[.\s])", re.M)


def import_base(rev: str, workdir: str):
    """The `model` package of git revision `rev`, importable as `model_base` (returns the package)."""
    tar = subprocess.run(["git", "-C", ROOT, "archive", rev, "model"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        tf.extractall(workdir, filter="data")
    src = os.path.join(workdir, "model")
    for name in os.listdir(src):
        if name.endswith(".py"):
            path = os.path.join(src, name)
            with open(path) as f:
                text = f.read()
            with open(path, "w") as f:
                f.write(_IMPORT.sub(r"\1\2 model_base", text))
    os.rename(src, os.path.join(workdir, "model_base"))
    sys.path.insert(0, workdir)
    return importlib.import_module("model_base")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision whose model/ is the baseline")
    p.add_argument("--configs", default="tiny,large", help="comma list of: " + ",".join(CONFIGS))
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--modes", default="eager", help="comma list of eager,compile")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", args.base], capture_output=True, text=True,
                         check=True).stdout.strip()
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load avg {os.getloadavg()}, "
          f"base {rev}, new {head} (+ working tree)", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base_pkg = import_base(args.base, tmp)
        for cname in args.configs.split(","):
            spec = CONFIGS[cname]
            B, T = spec["batch"], spec["seq"]
            g = torch.Generator().manual_seed(1)
            x = torch.randint(0, spec["model"]["vocab_size"], (B, T), generator=g)
            y = torch.cat((x[:, 1:], torch.full((B, 1), -100)), dim=1)
            for prec in args.precisions.split(","):
                dtype = torch.bfloat16 if prec == "bf16" else torch.float32
                for mode in args.modes.split(","):
                    torch.manual_seed(0)
                    new = Transformer(ModelConfig(**spec["model"]))
                    base = base_pkg.Transformer(base_pkg.ModelConfig(**spec["model"]))
                    base.load_state_dict(new.state_dict(), strict=True)
                    if mode == "compile":
                        compile_in_place(new)
                        compile_in_place(base)
                    steps = {"base": make_step(base, "ours", x, y, dtype), "new": make_step(new, "ours", x, y, dtype)}
                    first = {k: s() for k, s in steps.items()}
                    for _ in range(args.warmup):
                        for s in steps.values():
                            s()
                    times = {k: [] for k in steps}
                    for i in range(args.steps):
                        order = list(steps.items())
                        for k, s in (order if i % 2 == 0 else order[::-1]):  # alternate who goes first
                            t0 = time.perf_counter()
                            s()
                            times[k].append(time.perf_counter() - t0)
                    tps = {k: B * T / statistics.median(v) for k, v in times.items()}
                    row = dict(config=cname, precision=prec, mode=mode, base_tokens_per_s=round(tps["base"]),
                               new_tokens_per_s=round(tps["new"]), new_over_base=round(tps["new"] / tps["base"], 3),
                               first_loss_base=round(first["base"], 5), first_loss_new=round(first["new"], 5))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    del new, base, steps
    print(f"\n| config | precision | mode | base {rev} tokens/s | new tokens/s | new/base | first loss base / new |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['config']} | {r['precision']} | {r['mode']} | {r['base_tokens_per_s']} | {r['new_tokens_per_s']} "
              f"| {r['new_over_base']:.2f}x | {r['first_loss_base']} / {r['first_loss_new']} |")


if __name__ == "__main__":
    main()
