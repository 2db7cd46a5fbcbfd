"""The one place that knows about accelerator back ends.

Owns: picking the device and the matching process-group backend, seeding, autocast
contexts, and CUDA stream/event stand-ins that are no-ops on CPU. Every other module asks
this one instead of writing a device literal, so the same code runs on CPU + gloo and on
CUDA + NCCL. It must never set NCCL environment variables or touch a device at import time.
"""
from __future__ import annotations

import contextlib
import os
import random
import time
from typing import Optional

import numpy as np
import torch

_ACCEL = "cuda"  # the single accelerator literal of the project


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def resolve_device(preference: str = "auto", local_rank: int = 0) -> torch.device:
    """'auto' -> the local accelerator when present, else CPU. Explicit strings pass through."""
    if preference in ("", "auto"):
        if accelerator_available():
            return torch.device(_ACCEL, local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    dev = torch.device(preference)
    if dev.type == _ACCEL and dev.index is None:
        dev = torch.device(_ACCEL, local_rank % max(1, torch.cuda.device_count()))
    return dev


def is_accelerator(device: torch.device | str) -> bool:
    return torch.device(device).type == _ACCEL


FP8_MIN_CAPABILITY = (8, 9)  # Ada (8.9) and Hopper (9.0) and later have FP8 tensor cores


def fp8_matmul_problem(device: torch.device | str, capability: Optional[tuple[int, int]] = None) -> Optional[str]:
    """Why `device` cannot run FP8 matmuls (one line), or None. The CPU has none either, but runs torchao's
    emulation (the same casts and scales, matmuls in higher precision): None there too, and the caller says
    so. `capability` overrides the accelerator's (tests)."""
    if not is_accelerator(device):
        return None
    major, minor = capability if capability is not None else torch.cuda.get_device_capability(torch.device(device))
    if (major, minor) < FP8_MIN_CAPABILITY:
        return (f"this GPU (compute capability {major}.{minor}) has no FP8 tensor cores: --float8 needs "
                f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or later (Ada, Hopper)")
    return None


def dist_backend(device: torch.device | str) -> str:
    """NCCL for the accelerator, gloo for CPU."""
    return "nccl" if is_accelerator(device) else "gloo"


def set_device(device: torch.device) -> None:
    if is_accelerator(device):
        torch.cuda.set_device(device)


def synchronize(device: torch.device | str) -> None:
    if is_accelerator(device):
        torch.cuda.synchronize(torch.device(device))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def autocast_context(device: torch.device | str, dtype: torch.dtype):
    """bf16/fp16 autocast on the device's type; a null context for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def parse_dtype(name: str) -> torch.dtype:
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
             "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; expected one of fp32, bf16, fp16")
    return table[name]


def cpu_has_native_low_precision(dtype: torch.dtype) -> bool:
    """Does this CPU run `dtype` matmuls natively (oneDNN: AVX512-BF16/AMX for bf16, AVX512-FP16/AMX for
    fp16)? On an AVX2-only CPU they are emulated: a 1024^3 bf16 matmul measured ~1 GFLOP/s against
    ~58 GFLOP/s in fp32 on a 2-core AMD EPYC (AVX2)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: assume native, say nothing
        return True
    return True


def low_precision_cpu_warning(device: torch.device | str, dtype: torch.dtype) -> Optional[str]:
    """A one-line warning when `dtype` would run emulated on this CPU, else None."""
    if is_accelerator(device) or dtype == torch.float32 or cpu_has_native_low_precision(dtype):
        return None
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    return (f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no native {name} matmul: {name} runs "
            f"emulated (a training step measured ~30x slower than fp32 on an AVX2 CPU); use --dtype=fp32 here")


def memory_stats(device: torch.device | str) -> dict:
    """Allocated/peak memory in MiB: accelerator counters, or this process's RSS on CPU."""
    if is_accelerator(device):
        dev = torch.device(device)
        return {"mem_alloc_mib": torch.cuda.memory_allocated(dev) / 2**20,
                "mem_peak_mib": torch.cuda.max_memory_allocated(dev) / 2**20}
    try:
        import psutil
        return {"rss_mib": psutil.Process(os.getpid()).memory_info().rss / 2**20}
    except ImportError:  # psutil is in requirements, but keep logging alive without it
        return {}


def free_memory_bytes(device: torch.device | str) -> Optional[int]:
    """Free memory of an accelerator (torch.cuda.mem_get_info), None when there is none to ask (utils/model_bounds.py
    asks this for every device but the CPU, whose free memory it reads with psutil)."""
    if not accelerator_available():
        return None
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return int(torch.cuda.mem_get_info(index)[0])


def new_event(device: torch.device | str):
    """An accelerator event (HostCopy's); None on CPU, where work is done when it returns."""
    return torch.cuda.Event() if is_accelerator(device) else None


class HostCopy:
    """A small device tensor's value, copied to the host without waiting for it now.

    `HostCopy(t)` queues a non-blocking device-to-host copy behind the work that produces `t` and
    records an event; `.get()` waits for that event only (free when a later sync, e.g. the optimizer
    reading the gradient norm, already passed it). On CPU the copy is the tensor itself."""

    def __init__(self, t: torch.Tensor) -> None:
        self._event = None
        if is_accelerator(t.device):
            self._host = t.detach().to("cpu", non_blocking=True)
            self._event = new_event(t.device)
            self._event.record()
        else:
            self._host = t.detach()

    def get(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device` without stopping the host: a CPU tensor bound for an accelerator is copied into
    pinned memory first (a host memcpy, from PyTorch's caching host allocator), then copied over
    asynchronously. A copy from pageable memory makes the host wait until the stream has finished all
    work queued before it (the previous step's optimizer), so the next step could not be queued ahead."""
    if is_accelerator(device) and t.device.type == "cpu":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


class StepTimer:
    """Seconds per training step, measured from one step's end to the next, with no host sync: on an
    accelerator, timing events recorded on the stream at each step end, each interval read once its end
    event has completed (`query()`, usually a step later); on the CPU, the host clock (a step's work is
    done when it returns). `restart()` after evaluation, checkpoint or sample time, so that none of it
    is charged to the next step. `lap(tokens)` ends a step and returns the intervals now known, as
    (tokens, seconds) pairs in step order."""

    def __init__(self, device: torch.device | str) -> None:
        self._accel = is_accelerator(device)
        self._pending: list = []
        self._start = self._mark()

    def _mark(self):
        if self._accel:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def restart(self) -> None:
        self._start = self._mark()

    def lap(self, tokens: float) -> list[tuple[float, float]]:
        end = self._mark()
        self._pending.append((float(tokens), self._start, end))
        self._start = end
        done = []
        while self._pending and (not self._accel or self._pending[0][2].query()):
            n, start, stop = self._pending.pop(0)
            done.append((n, start.elapsed_time(stop) / 1e3 if self._accel else stop - start))
        return done


def local_rank_from_env() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def optional_import(name: str):
    """Import an optional accelerator package, or None. Callers log the result once."""
    try:
        return __import__(name, fromlist=["_"])
    except Exception:  # ImportError, or a broken CUDA extension raising at import
        return None


def get_peak_flops_override() -> Optional[float]:
    v = os.environ.get("PEAK_FLOPS")
    return float(v) if v else None
