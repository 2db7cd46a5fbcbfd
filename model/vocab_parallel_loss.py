"""Linear + cross-entropy over a vocabulary shard (tensor parallelism): the LM head's loss without the
full logits on any rank, and without gathering them.

Owns: `vocab_parallel_lm_head_loss(hidden, weight, labels, reduction, chunk_size, softcap)`, called by
model/loss.py's `lm_head_loss` when the LM head's weight is a DTensor sharded on the vocabulary
(parallel/transforms/tensor_parallel.py shards it `Shard(0)` over the tensor-parallel mesh).

Each rank holds rows [v0, v0 + V/tp) of the weight. Tokens are processed `chunk_size` at a time, as in
the chunked linear+CE of model/loss.py: per chunk this rank's logits [c, V/tp] are computed in fp32,
the softmax's max is all-reduced (MAX) over the tensor group, then the sum of exp(logit - max) and the
target's logit (0 on the ranks whose shard does not hold it) in one all-reduce (SUM): the loss is
logsumexp - target logit, identical on every rank of the group. Only per-token lse is kept. Backward
recomputes each chunk's local logits, forms (softmax - one-hot) for this shard, and returns this
shard's weight gradient and d hidden, all-reduced over the group: every rank's hidden state is the
same replicated tensor, so its gradient is the sum over the vocabulary shards. A soft-cap (`softcap`, Gemma 2's
final_softcap: cap * tanh(logit / cap), model/softcap.py) is elementwise: each rank caps its own shard's logits,
and scales its part of the gradient by the cap's derivative.

Same reductions as the unsharded head ("mean" over target tokens, 0 for none; "sum"; "none" per
token), IGNORE_INDEX labels ignored. The collectives are torch.distributed's (gloo on CPU, NCCL on
CUDA); no Triton kernel runs on a shard (the PyTorch chunked path does, on every device).

Must never: materialise [tokens x full vocab] logits, or give ranks of one tensor group different losses.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from model.softcap import cap_value, softcap_
from utils.constants import IGNORE_INDEX


def shard_bounds(weight) -> tuple[torch.Tensor, int, dist.ProcessGroup]:
    """(this rank's rows, the first row's global index, the tensor group) of a vocabulary-sharded DTensor."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    mesh, placements = weight.device_mesh, weight.placements
    if mesh.ndim != 1 or placements[0] != Shard(0):
        raise ValueError(f"the LM head weight is a DTensor with placements {placements} on a {mesh.ndim}-D mesh; "
                         "the vocabulary-parallel loss needs it sharded on the vocabulary (Shard(0)) over one "
                         "tensor-parallel mesh dimension")
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, placements)
    return weight.to_local(), int(offset[0]), mesh.get_group()


def _acc_dtype(h: torch.Tensor) -> torch.dtype:
    """fp32 statistics for half / fp32 inputs (fp64 inputs keep fp64)."""
    return torch.promote_types(h.dtype, torch.float32)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(h, w.t()).to(_acc_dtype(h))


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, reduction: str,
                chunk_size: int, vocab_start: int, group: dist.ProcessGroup, cap: Optional[float]) -> torch.Tensor:
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        n, v_local = h.shape[0], weight.shape[0]
        lse = torch.empty(n, dtype=_acc_dtype(h), device=h.device)
        target = torch.empty(n, dtype=_acc_dtype(h), device=h.device)
        w = weight.to(h.dtype)
        for s in range(0, n, chunk_size):
            logits = _chunk_logits(h[s:s + chunk_size], w)
            softcap_(logits, cap, want_deriv=False)  # (in place; nothing without a cap)
            m = logits.amax(dim=1)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            local_y = y[s:s + chunk_size] - vocab_start
            inside = (local_y >= 0) & (local_y < v_local)
            tgt = logits.gather(1, local_y.clamp(0, v_local - 1)[:, None]).squeeze(1) * inside
            both = torch.stack([torch.exp(logits - m[:, None]).sum(dim=1), tgt])
            dist.all_reduce(both, group=group)  # sum of exp over the full vocabulary, the target's logit
            lse[s:s + chunk_size] = m + both[0].log()
            target[s:s + chunk_size] = both[1]
        valid = y != IGNORE_INDEX
        per_token = torch.where(valid, lse - target, torch.zeros_like(lse))
        n_valid = valid.sum()
        ctx.save_for_backward(hidden, weight, labels, lse, n_valid)
        ctx.reduction, ctx.chunk_size, ctx.vocab_start, ctx.group = reduction, chunk_size, vocab_start, group
        ctx.cap = cap
        if reduction == "none":
            return per_token.reshape(labels.shape)
        if reduction == "sum":
            return per_token.sum()
        return per_token.sum() / n_valid.clamp(min=1)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        hidden, weight, labels, lse, n_valid = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        y = labels.reshape(-1)
        v_local = weight.shape[0]
        acc = _acc_dtype(h)
        valid = (y != IGNORE_INDEX).to(acc)
        if ctx.reduction == "none":
            row_scale = g.reshape(-1).to(acc) * valid
        elif ctx.reduction == "sum":
            row_scale = g.to(acc) * valid
        else:
            row_scale = g.to(acc) * valid / n_valid.clamp(min=1).to(acc)
        w = weight.to(h.dtype)
        d_h = torch.empty_like(h)
        d_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        c = ctx.chunk_size
        for s in range(0, h.shape[0], c):
            h_c = h[s:s + c]
            logits = _chunk_logits(h_c, w)
            deriv = softcap_(logits, ctx.cap)  # capped in place as in the forward, and its derivative (None: no cap)
            probs = torch.exp(logits - lse[s:s + c, None])  # this shard's softmax columns
            local_y = y[s:s + c] - ctx.vocab_start
            inside = (local_y >= 0) & (local_y < v_local)
            rows = torch.arange(h_c.shape[0], device=h.device)
            probs[rows, local_y.clamp(0, v_local - 1)] -= inside.to(acc)  # - one-hot where this shard holds it
            grad_logits = probs * row_scale[s:s + c, None]
            if deriv is not None:  # the gradient with respect to the uncapped logits
                grad_logits *= deriv
            d_h[s:s + c] = (grad_logits.to(h.dtype) @ w).to(d_h.dtype)
            d_w += grad_logits.t() @ h_c.to(acc)
        dist.all_reduce(d_h, group=ctx.group)  # the replicated hidden state's gradient: the sum over shards
        return d_h.view_as(hidden), d_w.to(weight.dtype), None, None, None, None, None, None


def vocab_parallel_lm_head_loss(hidden: torch.Tensor, weight, labels: torch.Tensor, reduction: str,
                                chunk_size: int, softcap: Optional[float] = None) -> torch.Tensor:
    """Loss of the LM head whose `weight` (a DTensor) is sharded on the vocabulary over a tensor group;
    `hidden` [..., D] is the same (replicated) tensor on every rank of the group. `softcap`: the logits are
    cap * tanh(logits / cap) (None: not capped)."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be mean, sum or none, got {reduction!r}")
    cap = cap_value(softcap)
    local, start, group = shard_bounds(weight)
    return _VocabParallelCE.apply(hidden, local, labels, reduction, max(1, int(chunk_size)), start, group, cap)
