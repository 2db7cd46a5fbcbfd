"""Fault injection for the supervisor's and the trainer's own tests, read from the environment.

    MYLLM_FAULT=kind@N            one fault; kinds below
    MYLLM_FAULT_ONCE_FILE=path    fire once: the first firing writes `path`, later ones see it and do not fire
    MYLLM_FAULT_SPIKE_FACTOR=100  what an injected loss spike multiplies the loss by
    MYLLM_FAULT_SAVE_DELAY=0.5    --async_checkpoint: every background write sleeps this long (seconds) after its
                                  files are written, before the publish (kill trials land inside writes more often)

Kinds keyed on the optimizer step N: crash (exit 1 at the start of the step), hang (park forever
there), kill_in_save (SIGKILL in the middle of that step's checkpoint save; with --async_checkpoint=true
inside the background write, after rank 0's weights are written and before the publish, while the training
goes on), nan_loss (that step's loss is NaN). Two loss spikes keyed on the DATA, not the step, so skipping
the data makes them go away: spike_data@D (the step that trains on data step D) and spike_token@T (the
micro-batches holding token id T: a corrupt sample in real shards); both fire every time that data is read
again (a replay from a checkpoint reproduces them), or once with MYLLM_FAULT_ONCE_FILE (a one-off fault of the machine).

Owns: parsing the spec (`fault_spec`, the one parser) and deciding whether a fault fires.
Must never: fire without MYLLM_FAULT set, or import torch (tests/fake_train.py, the supervisor tests'
torch-free stand-in trainer, fires its faults through this module).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional


def fault_spec() -> Optional[tuple[str, int]]:
    """(kind, N) of MYLLM_FAULT, or None when unset or not `kind@N`."""
    spec = os.environ.get("MYLLM_FAULT", "")
    kind, sep, at = spec.partition("@")
    if not sep:
        return None
    try:
        return kind, int(at)
    except ValueError:
        return None


def fires(kind: str, at: int) -> bool:
    """Whether the fault `kind@at` is the one asked for, and (with MYLLM_FAULT_ONCE_FILE) has not fired yet."""
    if fault_spec() != (kind, at):
        return False
    once = os.environ.get("MYLLM_FAULT_ONCE_FILE")
    if once:
        if os.path.exists(once):
            return False
        with open(once, "w") as f:
            f.write(f"{kind}@{at}")
    return True


def step_fault_due(step: int) -> bool:
    """Whether crash@step or hang@step is asked for (fired or not): the trainer finishes the step before it
    first, so that its metrics row is written before the fault, as without a fault."""
    return fault_spec() in (("crash", step), ("hang", step))


def fire_step_faults(step: int) -> None:
    """crash@step and hang@step, at the start of that step."""
    if fires("crash", step):
        print(f"[fault] crash@{step}", flush=True)
        os._exit(1)
    if fires("hang", step):
        print(f"[fault] hang@{step}", flush=True)
        while True:
            time.sleep(3600)


def save_delay() -> float:
    """MYLLM_FAULT_SAVE_DELAY: seconds each background checkpoint write waits before publishing (0: none)."""
    try:
        return max(0.0, float(os.environ.get("MYLLM_FAULT_SAVE_DELAY", "0") or 0))
    except ValueError:
        return 0.0


def save_fault_hook(step: int, in_background: bool, kill: Callable[[], None]) -> Optional[Callable[[], None]]:
    """The hook a save of `step` calls in its middle (rank 0, weights written, not yet published), or None:
    kill_in_save@step calls `kill`; a background write (in_background) first sleeps MYLLM_FAULT_SAVE_DELAY."""
    delay = save_delay() if in_background else 0.0
    if not delay and fault_spec() != ("kill_in_save", step):
        return None

    def hook() -> None:
        if delay:
            time.sleep(delay)
        if fires("kill_in_save", step):
            print(f"[fault] kill_in_save@{step}" + (" (background write)" if in_background else ""), flush=True)
            kill()
    return hook


def _has_token(batch: dict, token: int) -> bool:
    return any(bool((v == token).any()) for k, v in batch.items() if k.endswith("input_ids"))


def spike_fault(data_step: int, batches: list) -> Optional[tuple[float, Optional[int]]]:
    """(factor, token or None) when an injected loss spike hits this step's data, else None. The loss
    and the gradients of the hit micro-batches are multiplied by the factor (see `spiked`)."""
    spec = fault_spec()
    if spec is None:
        return None
    factor = float(os.environ.get("MYLLM_FAULT_SPIKE_FACTOR", "100"))
    kind, at = spec
    if kind == "spike_data" and fires("spike_data", data_step):
        return factor, None
    if kind == "spike_token" and any(_has_token(b, at) for b in batches) and fires("spike_token", at):
        return factor, at
    return None


def spiked(loss_fn: Callable, factor: float, token: Optional[int]) -> Callable:
    """loss_fn with its loss sum (hence its gradients) multiplied by `factor` on the hit micro-batches."""
    def fn(model: Any, batch: dict):
        loss_sum, stats = loss_fn(model, batch)
        return (loss_sum * factor if token is None or _has_token(batch, token) else loss_sum), stats
    return fn
