"""A torch-free stand-in for train_my_ddp.py that honours the same supervision contract.

It exists so that tests of monitor_process.py run in milliseconds per step. It owns nothing else
and must never import torch (start-up time matters: tests restart it many times).

Contract kept (see docs/monitor.md):
- `--key=value` flags only; an unknown flag or a bad value exits 2 (bad configuration).
- `--exit_at_start=N` exits N before the first step, as the trainer does for a named error.
- Steps are numbered 1..max_iters. Each step appends {"step", "loss", "attempt_pid"} to
  <out_dir>/metrics.jsonl and touches <out_dir>/heartbeat (rank 0 only, RANK from the environment).
- Every checkpoint_interval steps the state is saved atomically as
  <out_dir>/checkpoints/step_XXXXXXXX/{state.json,COMPLETE} (temporary directory, then os.replace).
- It continues from the newest checkpoint holding COMPLETE (`--resume=auto`, the default, and
  `--resume=always` / `--init_from=resume`; scratch when there is none); `--resume=never` starts from
  scratch and exits 2 when a checkpoint exists.
- The "loss" depends on a state carried from step to step, so a resume from a wrong or partial
  state gives a different loss sequence than an uninterrupted run.
- SIGTERM/SIGINT: finish the current step, save a checkpoint, exit 75.
- MYLLM_FAULT=hang@S | crash@S | kill_in_save@S, once per MYLLM_FAULT_ONCE_FILE when it is set.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from trainer.faults import fire_step_faults, fires as fault_fires  # noqa: E402  (the trainer's own; torch-free)

EXIT_BAD_CONFIG = 2
EXIT_INTERRUPTED = 75

DEFAULTS = {
    "out_dir": "",
    "init_from": "scratch",
    "resume": "auto",
    "max_iters": 20,
    "checkpoint_interval": 5,
    "step_time": 0.01,
    "label": "",          # free text; recorded in args.json so tests can check quoting survived
    "exit_at_start": 0,   # exit with this code before the first step (a trainer's named error)
}

_stop_signal: int | None = None


def _on_stop(signum: int, _frame) -> None:
    global _stop_signal
    _stop_signal = signum


def parse(argv: list[str]) -> dict:
    cfg = dict(DEFAULTS)
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            print(f"fake_train: bad argument {arg!r} (expected --key=value)", file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
        key, value = arg[2:].split("=", 1)
        if key not in cfg:
            print(f"fake_train: unknown flag --{key}", file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
        try:
            cfg[key] = type(DEFAULTS[key])(value)
        except ValueError:
            print(f"fake_train: bad value for --{key}: {value!r}", file=sys.stderr)
            sys.exit(EXIT_BAD_CONFIG)
    if not cfg["out_dir"] or cfg["init_from"] not in ("scratch", "resume") or \
            cfg["resume"] not in ("auto", "always", "never"):
        print("fake_train: --out_dir is required, --init_from must be scratch|resume, --resume auto|always|never",
              file=sys.stderr)
        sys.exit(EXIT_BAD_CONFIG)
    return cfg


def newest_checkpoint(ckpt_root: str) -> str | None:
    if not os.path.isdir(ckpt_root):
        return None
    done = [d for d in os.listdir(ckpt_root)
            if d.startswith("step_") and os.path.exists(os.path.join(ckpt_root, d, "COMPLETE"))]
    return os.path.join(ckpt_root, max(done)) if done else None


def save(ckpt_root: str, step: int, state: dict) -> None:
    final = os.path.join(ckpt_root, f"step_{step:08d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    payload = json.dumps({"step": step, "state": state})
    with open(os.path.join(tmp, "state.json"), "w") as f:
        if fault_fires("kill_in_save", step):
            f.write(payload[: len(payload) // 2])
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    with open(os.path.join(tmp, "COMPLETE"), "w") as f:
        f.write("ok\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)


def main(argv: list[str]) -> int:
    cfg = parse(argv)
    if cfg["exit_at_start"]:
        print(f"[rank 0] error: fake_train: exiting {cfg['exit_at_start']} at start", file=sys.stderr, flush=True)
        return cfg["exit_at_start"]
    rank = int(os.environ.get("RANK", "0"))
    out_dir = cfg["out_dir"]
    ckpt_root = os.path.join(out_dir, "checkpoints")
    os.makedirs(ckpt_root, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_stop)
    signal.signal(signal.SIGINT, _on_stop)
    if rank == 0:
        with open(os.path.join(out_dir, "args.json"), "w") as f:
            json.dump(argv, f)
    with open(os.path.join(out_dir, f"pid_rank{rank}_{os.getpid()}"), "w") as f:
        f.write(str(os.getpid()))

    step, state = 0, {"w": 1.0}
    path = newest_checkpoint(ckpt_root)
    if path and cfg["resume"] == "never" and cfg["init_from"] != "resume":
        print("[rank 0] error: fake_train: --out_dir holds checkpoints and --resume=never", file=sys.stderr)
        return EXIT_BAD_CONFIG
    if cfg["init_from"] == "resume" or cfg["resume"] != "never":
        if path:
            with open(os.path.join(path, "state.json")) as f:
                saved = json.load(f)
            step, state = saved["step"], saved["state"]
            print(f"fake_train: resumed from step {step}", flush=True)

    while step < cfg["max_iters"]:
        step += 1
        fire_step_faults(step)  # crash@step / hang@step, as the trainer fires them
        time.sleep(cfg["step_time"])
        # A toy "optimizer": the state evolves, and the loss depends on it.
        state["w"] = 0.9 * state["w"] + 0.05 * math.sin(step)
        loss = 2.0 + state["w"] + 0.01 * math.cos(3 * step)
        if rank == 0:
            with open(os.path.join(out_dir, "metrics.jsonl"), "a") as f:
                f.write(json.dumps({"step": step, "loss": loss, "pid": os.getpid()}) + "\n")
            with open(os.path.join(out_dir, "heartbeat"), "a"):
                os.utime(os.path.join(out_dir, "heartbeat"))
        print(f"step {step} loss {loss:.6f}", flush=True)
        if _stop_signal is not None:
            if rank == 0:
                save(ckpt_root, step, state)
            print(f"fake_train: signal {_stop_signal}, saved step {step}, exiting 75", flush=True)
            return EXIT_INTERRUPTED
        if step % cfg["checkpoint_interval"] == 0 and rank == 0:
            save(ckpt_root, step, state)
    print("fake_train: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
