"""Per-token log-probabilities and entropies of the LM head's distribution, chunk by chunk: never the [tokens x
vocabulary] logits at once, and under tensor parallelism never gathered (RL losses: GRPO's policy, reference and
old-policy log-probabilities).

Owns: `token_logprobs(hidden, weight, targets, temperature, chunk_size, softcap)`, called by model/llama.py's forward
(`logprobs_of=`), which returns (log p(target), entropy) per token of logits / temperature. With `softcap` (Gemma 2's
final_softcap, model/softcap.py) the logits are cap * tanh(logits / cap) first (the model's logits), then divided by
the temperature; the backward multiplies d z by the cap's derivative 1 - tanh^2 (per shard under tensor parallelism).

Each chunk of `chunk_size` tokens: this rank's logits [c, V] (or [c, V/tp] when the weight is a DTensor sharded on
the vocabulary, parallel/transforms/tensor_parallel.py) in fp32, divided by the temperature; the softmax's max
(all-reduced MAX over the tensor group), then in one all-reduce (SUM) the sum of exp(z - max), the target's z (0 on
the shards that do not hold it) and the sum of exp(z - max) * (z - max): log p = z_target - lse, entropy = log S -
that sum / S (S the sum of exp(z - max); both terms >= 0, so nothing large cancels). Only
the per-token lse is kept for the backward, which recomputes each chunk's logits: d z = g (one-hot - softmax) /
temperature; this shard's weight gradient and d hidden (all-reduced over the group: the hidden state is replicated).
The entropy is a statistic: no gradient flows through it.

Under torch.compile (a whole-model graph) the reference from whole logits is traced instead: Inductor fuses it, and
the Function's Python loop and collectives would not trace. Tensor parallelism compiles the blocks only (the head
runs eagerly, chunked).

Must never: materialise the full logits (eagerly), or give ranks of one tensor group different values.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from model.loss_precision import compute_dtype
from model.softcap import cap_value, softcap_
from model.softcap import softcap as softcap_logits


def _logits(h: torch.Tensor, w: torch.Tensor, temperature: float, cap: Optional[float] = None,
            want_deriv: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(z, d): one chunk's logits [c, V] soft-capped by `cap` (if any) then divided by the temperature, in the
    accumulation dtype, and the cap's derivative d (if a cap and `want_deriv`, else None)."""
    z = torch.mm(h, w.t()).to(torch.promote_types(h.dtype, torch.float32))  # a new tensor: changed in place below
    d = softcap_(z, cap, want_deriv)  # (in place; None without a cap)
    return (z if temperature == 1.0 else z.div_(temperature)), d  # x / 1.0 is x: skipping it changes no bit


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk_size: int, vocab_start: int, group: Optional[dist.ProcessGroup], cdtype: torch.dtype,
                cap: Optional[float]):
        h = hidden.reshape(-1, hidden.shape[-1])
        y = targets.reshape(-1)
        n, v_local = h.shape[0], weight.shape[0]
        acc = torch.promote_types(cdtype, torch.float32)
        lse, logp, entropy = (torch.empty(n, dtype=acc, device=h.device) for _ in range(3))
        w = weight.to(cdtype)
        for s in range(0, n, chunk_size):
            z, _ = _logits(h[s:s + chunk_size].to(cdtype), w, temperature, cap)
            m = z.amax(dim=1)
            if group is not None:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            local_y = y[s:s + chunk_size] - vocab_start
            inside = (local_y >= 0) & (local_y < v_local)
            target = z.gather(1, local_y.clamp(0, v_local - 1)[:, None])[:, 0] * inside
            d = z.sub_(m[:, None])  # (in place: one [chunk x vocabulary] buffer less)
            e = torch.exp(d)
            sums = torch.stack([e.sum(dim=1), target, e.mul_(d).sum(dim=1)])
            if group is not None:
                dist.all_reduce(sums, group=group)  # over the whole vocabulary
            log_s = sums[0].log()
            lse[s:s + chunk_size] = m + log_s
            logp[s:s + chunk_size] = sums[1] - lse[s:s + chunk_size]
            # -sum p log p = log S - sum e (z - max) / S: two terms >= 0, no cancellation between large numbers
            entropy[s:s + chunk_size] = log_s - sums[2] / sums[0]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_size, ctx.vocab_start, ctx.group = temperature, chunk_size, vocab_start, group
        ctx.cdtype, ctx.cap = cdtype, cap
        logp, entropy = logp.reshape(targets.shape), entropy.reshape(targets.shape)
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, g: torch.Tensor, _g_entropy: Optional[torch.Tensor]):
        hidden, weight, targets, lse = ctx.saved_tensors
        h = hidden.reshape(-1, hidden.shape[-1])
        y = targets.reshape(-1)
        v_local = weight.shape[0]
        acc = lse.dtype
        g = g.reshape(-1).to(acc) / ctx.temperature  # d z / d logits = 1 / temperature
        w = weight.to(ctx.cdtype)  # the forward's matmul dtype (autocast's), also where autocast is off
        d_h = torch.empty_like(h)
        d_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        c = ctx.chunk_size
        for s in range(0, h.shape[0], c):
            h_c = h[s:s + c].to(ctx.cdtype)
            grad_z, deriv = _logits(h_c, w, ctx.temperature, ctx.cap, want_deriv=True)
            grad_z = grad_z.sub_(lse[s:s + c, None]).exp_().neg_()  # - softmax (shard)
            local_y = y[s:s + c] - ctx.vocab_start
            inside = (local_y >= 0) & (local_y < v_local)
            rows = torch.arange(h_c.shape[0], device=h.device)
            grad_z[rows, local_y.clamp(0, v_local - 1)] += inside.to(acc)  # + one-hot where this shard holds it
            grad_z *= g[s:s + c, None]
            if deriv is not None:  # the gradient with respect to the uncapped logits
                grad_z *= deriv
            d_h[s:s + c] = (grad_z.to(ctx.cdtype) @ w).to(d_h.dtype)
            d_w += grad_z.t() @ h_c.to(acc)
        if ctx.group is not None:
            dist.all_reduce(d_h, group=ctx.group)  # the replicated hidden state's gradient: the sum over shards
        return d_h.view_as(hidden), d_w.to(weight.dtype), None, None, None, None, None, None, None


def token_logprobs(hidden: torch.Tensor, weight, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = 1024, softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets), entropy), each shaped like `targets`, of softmax(z / temperature), z = hidden @ weight.T
    soft-capped by `softcap` (cap * tanh(z / cap); None: z itself): hidden [..., D], targets [...] token ids (every
    one a valid id). `weight` may be a DTensor sharded on the vocabulary (tensor parallelism; hidden replicated over
    its group): then no rank holds more than its shard's logits."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    cap = cap_value(softcap)
    if torch.compiler.is_compiling():  # traced (--compile of the whole model): the whole logits, which Inductor
        logits = torch.nn.functional.linear(hidden, weight)  # fuses (capped in fp32, as the chunks are)
        if cap is not None:
            logits = softcap_logits(logits.to(torch.promote_types(logits.dtype, torch.float32)), cap)
        return token_logprobs_ref(logits, targets, temperature)
    from torch.distributed.tensor import DTensor
    if isinstance(weight, DTensor):
        from model.vocab_parallel_loss import shard_bounds
        local, start, group = shard_bounds(weight)
    else:
        local, start, group = weight, 0, None
    # the matmuls' dtype: autocast's where it is on (bf16 logits, as the whole-logits path's), in the forward and in
    # the backward's recompute alike (autocast is off there)
    return _TokenLogprobs.apply(hidden, local, targets, float(temperature), max(1, int(chunk_size)), start, group,
                                compute_dtype(hidden), cap)


def token_logprobs_ref(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from whole logits [..., V], already soft-capped where the model caps them (the reference the chunked
    function is tested against)."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        z = z / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp_all.gather(-1, targets[..., None])[..., 0], entropy.detach()
