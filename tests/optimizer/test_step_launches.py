"""How many kernels the optimizer step launches: a fixed number, whatever the number of parameters.

On CPU a "launch" is counted as one aten op that is not a view or an allocation (on a GPU each such op
is at least one kernel; a view or an `empty` is none). The step of our DDP's optimizers (unsharded and
ZeRO-1) over a bf16 model with bf16 gradients, fp32 masters and torch's fused AdamW (what an accelerator
runs) must issue the same count for a 2-layer and an 8-layer model (4x the parameters), in one bucket:
every per-parameter piece of work (norms, gradient copies, master write-back) runs over flat tensors or
as one foreach op over the list.

Bound per step, with G = 2 AdamW parameter groups (decay / no decay), whatever the number of buckets:
  every bucket's gradient copy-in 1 (one foreach copy over the buckets)
  + norm 4 (foreach norm, stack, square, sum) + the one host read 1
  + the skip and the clip decided on the device 10 (to float64 1; found_inf 3; coefficient 5: sqrt, add,
    div, clamp, to float32; the clip itself, one foreach mul 1)
  + every bucket's AdamW at once (optimizer/fused_step.py): step counters +1 1, fused AdamW per group G,
    step counters -found_inf 1
  + the masters written back 1 (one foreach copy)
  + ZeRO: the squared norm's copy for its all-reduce 1 (world 1: no collective is issued).
So 19 + G = 21 unsharded, 22 ZeRO-1, for 1 bucket or 40. Before the flat per-bucket buffers (at commit
dbbbb2e) the same step issued 72 ops at 2 layers and 234 at 8 (unsharded; ZeRO-1 73 / 235): per parameter
one n*n, one gradient copy and one master copy; after them and before the batched AdamW (43eba8b),
15 + B * (2 + 3G): 23 at one bucket, 47 at four, and one torch `AdamW.step()` call per bucket.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import ModelConfig, Transformer
from optimizer import OptimizerConfig, build_optimizer
from parallel import DDPConfig, DistributedDataParallel

G = 2  # AdamW parameter groups


def bound(zero: bool) -> int:
    return 19 + G + int(zero)


_FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias",
         "lift_fresh", "set_", "resize_"}


class CountLaunches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if not func.is_view and name not in _FREE and func.namespace == "aten":  # not profiler marks
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _launches(n_layers: int, zero: bool, bucket_size=None) -> list[str]:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=n_layers, n_heads=4, n_kv_heads=2,
                                    multiple_of=16, max_seq_len=16)).to(torch.bfloat16)
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=bucket_size, use_distributed_optimizer=zero))
    opt = build_optimizer(ddp, OptimizerConfig(precision="bf16", fused=True, lr=1e-3, grad_clip=1e-3,
                                               use_distributed_optimizer=zero))
    x = torch.randint(0, 64, (2, 16))
    counts = []
    for _ in range(2):  # the second step: the AdamW state exists
        opt.zero_grad()
        logits = ddp(x)
        logits = logits[0] if isinstance(logits, tuple) else logits
        logits.float().square().mean().backward()
        with CountLaunches() as c:
            stepped, _ = opt.step()
        assert stepped
        counts.append(c.ops)
    _launches.buckets = len(ddp.buckets)
    return counts[-1]


@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero1"])
def test_the_step_launches_do_not_grow_with_the_parameters(zero):
    small, big = _launches(2, zero), _launches(8, zero)
    assert len(small) == len(big), (len(small), len(big), sorted(set(big) - set(small)))
    assert len(big) <= bound(zero), big


@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero1"])
def test_the_step_launches_do_not_grow_with_the_buckets(zero):
    one = _launches(2, zero)
    many_ddp = _launches(2, zero, bucket_size=1500)
    assert _launches.buckets >= 4
    assert len(one) == len(many_ddp) <= bound(zero), (one, many_ddp)
