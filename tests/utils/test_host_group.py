"""utils/dist.py: host numbers (a step's token counts, the stop flag) are reduced over a gloo group, never
through the device. Under NCCL that is a gloo twin of the default group (made once); here, on gloo, the
NCCL case is played by reporting the default group's backend as "nccl": the twin is made and carries the
reductions, with the same sums and maxima; a device tensor still goes through the default group."""
from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist_helpers import spawn


def _ranks(rank: int, world: int) -> None:
    import utils.dist as ud
    real_backend, real_all_reduce = dist.get_backend, dist.all_reduce
    used = []

    def spy(t, op=dist.ReduceOp.SUM, group=None, **kw):
        used.append((group, t.device.type))
        return real_all_reduce(t, op=op, group=group, **kw)
    try:
        dist.get_backend = lambda group=None: "nccl" if group is None else real_backend(group)
        dist.all_reduce = spy
        usable, group = ud.host_group()
        assert usable and group is not None and real_backend(group) == "gloo"
        assert ud.host_group() == (True, group)  # made once
        got = ud.all_reduce_sum([1.0 + rank, 10.0 * (rank + 1)], torch.device("cpu"))
        assert got.tolist() == [3.0, 30.0] and got.dtype == torch.float64
        assert ud.all_reduce_max(float(rank == 1), torch.device("cpu")) == 1.0
        assert ud.all_reduce_max(0.0, torch.device("cpu")) == 0.0
        assert used == [(group, "cpu")] * 3
        dev = ud.all_reduce_sum(torch.tensor([2.0]), torch.device("cpu"), to_host=False)  # a "device" result
        assert dev.tolist() == [4.0] and used[-1] == (None, "cpu")
    finally:
        dist.get_backend, dist.all_reduce = real_backend, real_all_reduce
        ud._host_groups.clear()


def test_host_numbers_are_reduced_over_a_gloo_group_under_nccl():
    spawn(_ranks, 2)


def test_a_gloo_default_group_is_its_own_host_group():
    spawn(_gloo_ranks, 2)


def _gloo_ranks(rank: int, world: int) -> None:
    import utils.dist as ud
    assert ud.host_group() == (True, None) and not ud._host_groups
    assert ud.all_reduce_sum([float(rank)], torch.device("cpu")).tolist() == [1.0]
