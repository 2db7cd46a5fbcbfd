"""`python -m utils.resplot RUN_DIR [RUN_DIR ...] [-o out.png]`: plot runs' curves to PNG.

Owns: reading metrics.jsonl of one or several runs and drawing loss / val_loss, lr and
throughput panels so runs can be compared. Must never modify a run directory except to write
the PNG when no output path is given.
"""
from __future__ import annotations

import argparse
import os
import sys

from utils.metrics import dedupe_by_step, read_metrics

PANELS = (("loss", "train loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("tokens_per_sec", "tokens / s"))


def plot_runs(run_dirs: list[str], out_path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for run in run_dirs:
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run} a run directory?)")
        records = read_metrics(path)
        label = os.path.basename(os.path.normpath(run))
        for ax, (key, title) in zip(axes.flat, PANELS):
            series = dedupe_by_step(records, key)
            if series:
                steps = sorted(series)
                ax.plot(steps, [series[s][key] for s in steps], label=label,
                        marker="o" if key == "val_loss" else None, markersize=3)
            ax.set_title(title)
            ax.set_xlabel("step")
    for ax in axes.flat:
        if ax.lines:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    axes.flat[0].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run directories holding metrics.jsonl")
    p.add_argument("-o", "--output", default=None, help="PNG path (default: <first run>/curves.png)")
    args = p.parse_args(argv)
    out = args.output or os.path.join(args.runs[0], "curves.png")
    try:
        plot_runs(args.runs, out)
    except FileNotFoundError as e:
        print(f"resplot: {e}", file=sys.stderr)
        return 2
    print(f"resplot: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
