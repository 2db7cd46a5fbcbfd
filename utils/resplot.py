"""`python -m utils.resplot RUN_DIR [RUN_DIR ...] [-o out.png]`: plot runs' curves to PNG.

Owns: reading metrics.jsonl of one or several runs and drawing loss / val_loss, lr and
throughput panels (the windowed average bold, each step's raw rate faint), plus DPO reward
accuracy and margin (chosen - rejected reward) when a run has them, so runs can be compared. Must never modify a run directory except to write
the PNG when no output path is given.
"""
from __future__ import annotations

import argparse
import os
import sys

from utils.metrics import dedupe_by_step, read_metrics

PANELS = (("loss", "train loss"), ("val_loss", "validation loss"), ("lr", "learning rate"),
          ("tokens_per_sec", "tokens / s (windowed average; raw per step faint)"))
DPO_PANELS = (("reward_acc", "DPO reward accuracy"), ("reward_margin", "DPO reward margin (chosen - rejected)"))


def moving_average(values: list[float], window: int = 20) -> list[float]:
    """Trailing mean over `window` points (for runs that logged no tokens_per_sec_avg)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    if key == "reward_margin":  # derived: chosen - rejected
        by_step = dedupe_by_step(records, "chosen_reward")
        steps = [s for s in sorted(by_step) if isinstance(by_step[s].get("rejected_reward"), (int, float))]
        return steps, [by_step[s]["chosen_reward"] - by_step[s]["rejected_reward"] for s in steps]
    by_step = dedupe_by_step(records, key)
    steps = [s for s in sorted(by_step) if isinstance(by_step[s][key], (int, float))]
    return steps, [by_step[s][key] for s in steps]


def plot_runs(run_dirs: list[str], out_path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for run in run_dirs:
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run} a run directory?)")
        runs.append((os.path.basename(os.path.normpath(run)), read_metrics(path)))
    has_dpo = any(_series(records, "reward_acc")[0] for _, records in runs)
    panels = PANELS + (DPO_PANELS if has_dpo else ())
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(12, 4 * (len(panels) // 2)))
    for label, records in runs:
        for ax, (key, title) in zip(axes.flat, panels):
            steps, values = _series(records, key)
            if steps and key == "tokens_per_sec":
                raw = ax.plot(steps, values, alpha=0.2, linewidth=0.8)[0]
                avg_steps, avg = _series(records, "tokens_per_sec_avg")
                if not avg_steps:
                    avg_steps, avg = steps, moving_average(values)
                ax.plot(avg_steps, avg, label=label, color=raw.get_color(), linewidth=1.8)
            elif steps:
                ax.plot(steps, values, label=label, marker="o" if key == "val_loss" else None, markersize=3)
            ax.set_title(title)
            ax.set_xlabel("step")
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
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
