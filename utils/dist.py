"""Process-group set-up from the torchrun environment, and small collective helpers.

Owns: reading RANK / WORLD_SIZE / LOCAL_RANK (set by torchrun; a plain `python` run is world
size 1 with no process group), choosing the backend from the device, and scalar reductions.
Must never: require `--local_rank` on the command line or set NCCL environment variables.
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from utils.device import (accelerator_available, dist_backend, is_accelerator, local_rank_from_env,
                          resolve_device, set_device)


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


class DeviceError(ValueError):
    """--device names a device this machine does not have (a configuration error)."""
    exit_code = 2  # EXIT_BAD_CONFIG (utils/constants.py), read by utils.errors.exit_code_for


def device_problem(device_pref: str) -> Optional[str]:
    """Why `device_pref` cannot be used here, or None. Checked before any process group exists."""
    if device_pref in ("", "auto"):
        return None
    try:
        dev = torch.device(device_pref)
    except (RuntimeError, ValueError) as e:
        return f"--device={device_pref}: not a device ({' '.join(str(e).split())}); use auto, cpu, cuda or cuda:N"
    if dev.type == "cpu":
        return None
    if not is_accelerator(dev):
        return f"--device={device_pref}: device type {dev.type!r} is not supported; use auto, cpu, cuda or cuda:N"
    if not accelerator_available():
        return f"--device={device_pref}: no {dev.type} device is available on this machine; use --device=cpu or auto"
    return None


def init_distributed(device_pref: str = "auto", timeout_s: int = 1800, need_group: bool = False) -> DistInfo:
    """Raises DeviceError when the device cannot be used (no such index, no accelerator).
    need_group: start a one-process group when not launched by torchrun (FSDP needs one)."""
    problem = device_problem(device_pref)
    if problem:
        raise DeviceError(problem)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = local_rank_from_env()
    device = resolve_device(device_pref, local_rank)
    try:
        set_device(device)
    except (RuntimeError, AssertionError, ValueError) as e:  # e.g. an index past the last device
        raise DeviceError(f"--device={device_pref}: cannot use {device} ({' '.join(str(e).split())})") from e
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend=dist_backend(device), timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if device.type != "cpu" else None)
        host_group()  # made now, at the same point on every rank (NCCL runs: a gloo group for host numbers)
    elif need_group and not dist.is_initialized():
        # FSDP shards over a process group even in one process: a group of one, on an in-memory store.
        dist.init_process_group(backend=dist_backend(device), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank, device)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


_host_groups: dict = {}  # the default group -> its gloo twin (False: one could not be made)


def host_group():
    """(usable, group): the process group that reduces HOST numbers (a step's token counts, the stop flag)
    without the device. The default group itself when it is gloo; under NCCL a gloo group over the same
    ranks, made once (every rank calls this at the same point: it is collective the first time). A reduction
    of host numbers over NCCL copies them to the device and back, two synchronising copies that each wait
    for all the work queued before them (the previous step's update): every step then began on an idle GPU.
    usable is False when the gloo group could not be made (logged once): the device path is taken then."""
    if dist.get_backend() == "gloo":
        return True, None
    world = dist.group.WORLD
    if world not in _host_groups:
        try:
            _host_groups[world] = dist.new_group(backend="gloo")
        except (RuntimeError, ValueError) as e:  # e.g. gloo cannot reach another host: NCCL carries it all
            logging.getLogger(__name__).warning("no gloo group for host values (%s): they are reduced on the "
                                                "device (two syncs per step)", " ".join(str(e).split())[:300])
            _host_groups[world] = False
    group = _host_groups[world]
    return group is not False, (group or None)


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device, to_host: bool = True) -> torch.Tensor:
    """Sum a small vector of floats over ranks (float64 so token counts stay exact).

    to_host=True with host values: reduced on the host (`host_group`), never through the device. to_host=False
    leaves the result where the reduction ran (the device under a process group, else where `values` were),
    for the caller to read later without a sync of its own (utils.device.HostCopy)."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
    t = t.to(dtype=torch.float64)
    if dist.is_initialized():
        if to_host and t.device.type == "cpu":
            usable, group = host_group()
            if usable:
                dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
                return t
        t = t.to(device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu() if to_host else t


def all_reduce_max(value: float, device: torch.device) -> float:
    """MAX of a host float over ranks, reduced on the host (`host_group`); one process returns it untouched."""
    if not dist.is_initialized():
        return float(value)
    usable, group = host_group()  # group: None (the default group) unless a gloo twin carries it
    t = torch.tensor([value], dtype=torch.float64, device="cpu" if usable else device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


_VERDICT_BYTES = 1024  # an error line longer than this is cut (utils.errors.one_line keeps 500 characters)


def first_error_of_ranks(error: Optional[tuple[int, str]], device: Optional[torch.device] = None,
                         group=None) -> Optional[tuple[int, str]]:
    """Every rank's verdict in ONE collective: each passes None (all is well) or (exit code, one-line message);
    every rank gets back the same answer, the error of the lowest rank that has one, or None when no rank
    has one. One process (no process group)
    returns its own verdict untouched. Tensors only (no pickle): a code and the message's UTF-8 bytes."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return error
    buf = torch.zeros(_VERDICT_BYTES + 2, dtype=torch.int64)
    if error is not None:
        data = error[1].encode("utf-8", "replace")[:_VERDICT_BYTES]
        buf[0], buf[1] = int(error[0]), len(data)
        buf[2:2 + len(data)] = torch.tensor(list(data), dtype=torch.int64)
    if device is None:
        device = torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device(torch.accelerator.current_accelerator())
    buf = buf.to(device)
    every = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, buf, group=group)
    for t in every:
        t = t.cpu()
        n = int(t[1])
        if n > 0:
            return int(t[0]), bytes(t[2:2 + n].tolist()).decode("utf-8", "replace")
    return None


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
