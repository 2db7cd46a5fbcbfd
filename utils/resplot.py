"""`python -m utils.resplot RUN_DIR [RUN_DIR ...] [-o out.png]`: plot runs' curves to PNG.

Owns: reading metrics.jsonl of one or several runs and drawing, on linear axes, train and validation
loss, lr and throughput (the windowed average bold, each step's raw rate faint); GRPO runs get their loss,
reward (--eval_data_dir's held-out val_reward as dots) and completion length; DPO runs get their
own panels (DPO loss, reward accuracy, train and validation, and the chosen - rejected margin) so a
DPO loss never shares an axis with an LM loss; restarts (from monitor_summary.json and the rows a
resume set aside) are dotted vertical lines. Must never modify a run directory except to write the
PNG when no output path is given.
"""
from __future__ import annotations

import json
import os
import re
import sys

from utils.metrics import dedupe_by_step, read_metrics

# (panel title, [(metric key, drawn for LM runs / DPO runs, as a line or as dots)])
LM_PANELS = (("train loss", "loss"), ("validation loss", "val_loss"))
COMMON_PANELS = (("learning rate", "lr"), ("tokens / s (windowed average; raw per step faint)", "tokens_per_sec"))
DPO_PANELS = (("DPO loss (train line, validation dots)", ("loss", "val_loss")),
              ("DPO reward accuracy (train line, validation dots)", ("reward_acc", "val_reward_acc")),
              ("DPO reward margin (chosen - rejected)", ("reward_margin",)))
GRPO_PANELS = (("GRPO loss", ("loss",)),
               ("GRPO reward (step's completions line, held-out greedy dots)", ("reward", "val_reward")),
               ("GRPO completion length (tokens)", ("completion_length",)))


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


def restart_steps(run_dir: str) -> list[int]:
    """Steps a run was resumed from after an interruption: the supervisor's attempts (its
    monitor_summary.json) and the rows a resume set aside (metrics.jsonl.after_step<N>.*)."""
    steps: set[int] = set()
    try:
        with open(os.path.join(run_dir, "monitor_summary.json"), encoding="utf-8") as f:
            attempts = json.load(f).get("attempts") or []
        steps.update(int(a.get("resumed_from_step") or 0) for a in attempts[1:] if isinstance(a, dict))
    except (OSError, ValueError, TypeError, AttributeError):
        pass
    for name in os.listdir(run_dir):
        m = re.match(r"metrics\.jsonl\.after_step(\d+)\.", name)
        if m:
            steps.add(int(m.group(1)))
    return sorted(steps)


def _kind(records: list[dict]) -> str:
    """"dpo", "grpo" (its rows log completion_length) or "lm": which panels a run's curves go to."""
    if any("reward_acc" in r or "val_reward_acc" in r for r in records):
        return "dpo"
    return "grpo" if any("completion_length" in r for r in records) else "lm"


def plot_runs(run_dirs: list[str], out_path: str) -> str:
    """One PNG: LM losses on linear axes; DPO runs' losses and reward accuracies (train and
    validation) on their own panels; lr and throughput for all; restarts as dotted vertical lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for run in run_dirs:
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no metrics.jsonl (is {run} a run directory?)")
        records = read_metrics(path)
        runs.append((os.path.basename(os.path.normpath(run)), records, _kind(records), restart_steps(run)))
    kinds = {r[2] for r in runs}
    panels: list[tuple[str, str, tuple]] = []  # (title, for "lm" / "dpo" / "grpo" / "all", keys)
    if "lm" in kinds:
        panels += [(t, "lm", (k,)) for t, k in LM_PANELS]
    if "dpo" in kinds:
        panels += [(t, "dpo", ks) for t, ks in DPO_PANELS]
    if "grpo" in kinds:
        panels += [(t, "grpo", ks) for t, ks in GRPO_PANELS]
    panels += [(t, "all", (k,)) for t, k in COMMON_PANELS]
    rows = -(-len(panels) // 2)
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4 * rows), squeeze=False)
    for run_index, (label, records, run_kind, restarts) in enumerate(runs):
        color = f"C{run_index % 10}"  # one colour per run on every panel
        for ax, (title, kind, keys) in zip(axes.flat, panels):
            if kind not in ("all", run_kind):
                continue
            for i, key in enumerate(keys):
                steps, values = _series(records, key)
                if not steps:
                    continue
                if key == "tokens_per_sec":
                    line = ax.plot(steps, values, alpha=0.2, linewidth=0.8, color=color)[0]
                    avg_steps, avg = _series(records, "tokens_per_sec_avg")
                    if not avg_steps:
                        avg_steps, avg = steps, moving_average(values)
                    ax.plot(avg_steps, avg, label=label, color=line.get_color(), linewidth=1.8)
                else:
                    dots = key.startswith("val_")
                    line = ax.plot(steps, values, label=label if i == 0 else f"{label} (validation)", color=color,
                                   marker="o" if dots else None, markersize=3, linestyle=":" if dots and i else "-")
            for s in restarts:
                ax.axvline(s, color=color, linestyle=":", alpha=0.6, linewidth=1)
            ax.set_title(title)
            ax.set_xlabel("step")
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax in axes.flat:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
            ax.grid(alpha=0.3)
    if any(r[3] for r in runs):
        fig.suptitle("dotted vertical lines: resumed after an interruption (at that step)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> int:
    from utils.cli import Parser
    p = Parser(description=__doc__.splitlines()[0])  # the commands' convention: no prefix guessing, hints
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
