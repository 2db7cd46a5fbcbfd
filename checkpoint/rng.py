"""Every RNG a training step can touch (torch CPU and device, Python, NumPy), as plain tensors: what each rank's
extra_rank{r}.pt holds, so that a resumed run draws what the uninterrupted run would have.

Owns: capturing, restoring and checking RNG states. Must never: hold anything but tensors (the file is loaded
with torch.load(weights_only=True)).
"""
from __future__ import annotations

import random
from typing import Any, Optional

import numpy as np
import torch

from utils.errors import one_line


def capture_rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    """Every RNG a training step can touch, as tensors (weights_only-loadable)."""
    py_state = random.getstate()  # (version, tuple of 625 ints, gauss_next)
    np_state = np.random.get_state()
    state = {
        "torch_cpu": torch.get_rng_state(),
        "python_version": torch.tensor([py_state[0]], dtype=torch.int64),
        "python_state": torch.tensor(py_state[1], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if py_state[2] is None else py_state[2]], dtype=torch.float64),
        "numpy_keys": torch.from_numpy(np_state[1].astype(np.int64)),
        "numpy_pos": torch.tensor([np_state[2], np_state[3]], dtype=torch.int64),
        "numpy_gauss": torch.tensor([np_state[4]], dtype=torch.float64),
    }
    if device.type != "cpu" and hasattr(torch, device.type):
        state["device"] = getattr(torch, device.type).get_rng_state(device)
    return state


def restore_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["torch_cpu"])
    gauss = float(state["python_gauss"].item())
    random.setstate((int(state["python_version"].item()),
                     tuple(int(x) for x in state["python_state"].tolist()),
                     None if gauss != gauss else gauss))
    pos, has_gauss = (int(x) for x in state["numpy_pos"].tolist())
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss,
                         float(state["numpy_gauss"].item())))
    if "device" in state and device.type != "cpu":
        getattr(torch, device.type).set_rng_state(state["device"], device)

def rng_state_problem(state: Any) -> Optional[str]:
    """None when `state` (from capture_rng_state) can be restored, else why. Tried on this process's
    generators and put back, so that a damaged file is named at load, not when the loop starts."""
    if not isinstance(state, dict):
        return f"the RNG state is a {type(state).__name__}, not a dict of tensors"
    if "device" in state and not torch.is_tensor(state["device"]):
        return "the device RNG state is not a tensor"
    cpu = torch.device("cpu")
    before = capture_rng_state(cpu)
    try:
        restore_rng_state(state, cpu)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, IndexError, OverflowError) as e:
        return f"the RNG state does not restore ({type(e).__name__}: {one_line(e)[:160]})"
    finally:
        restore_rng_state(before, cpu)
    return None

