"""PowerSGD gradient compression (Vogels et al., 2019) as a DDP comm hook.

Owns: per-parameter low-rank compression of a bucket's gradients, the error-feedback buffers,
the warm-started Q factors, the iteration counter and a byte counter, and their (tensors + ints)
state dict for exact resume. It must never touch parameters or optimizer state, and must take
identical decisions on every rank (shapes, ranks and random Q come only from shared values).

Per parameter of a bucket (gradients arrive divided by world size, so SUM == mean):
  ndim >= 2 and n*m / (r*(n+m)) >= min_compression_rate  ->  compressed:
      M = grad + error;  P = M Q;  allreduce(P);  P = orth(P);  Q = M^T P;  allreduce(Q)
      approx = P Q^T;  error = M - approx / world_size;  grad = approx
  (M is this rank's share of the sum; the ranks' errors add up to the residual sum - approx)
  otherwise (biases, norms, tiny or skinny matrices)  ->  plain all-reduce.
Before `start_powerSGD_iter` every bucket is plainly all-reduced (compression early in training
hurts; Vogels et al. and torch both warm up this way). All maths is in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from parallel import comm
from parallel.comm_hooks import allreduce_hook

if TYPE_CHECKING:
    from parallel.distributed_data_parallel.param_and_grad_buffer import GradBucket


@dataclass
class PowerSGDState:
    matrix_approximation_rank: int = 1
    start_powerSGD_iter: int = 10
    min_compression_rate: float = 2.0
    warm_start: bool = True
    use_error_feedback: bool = True
    orthogonalization_epsilon: float = 0.0
    seed: int = 0
    # ---- mutable state (saved by state_dict) ----
    iteration: int = 0
    bytes_sent: int = 0
    error: dict[str, torch.Tensor] = field(default_factory=dict)
    q: dict[str, torch.Tensor] = field(default_factory=dict)

    def on_sync_end(self) -> None:
        """Called by DDP once all buckets of a step were reduced."""
        self.iteration += 1

    def state_dict(self) -> dict:
        sd: dict = {"iteration": int(self.iteration), "bytes_sent": int(self.bytes_sent),
                    "seed": int(self.seed), "matrix_approximation_rank": int(self.matrix_approximation_rank)}
        for k, v in self.error.items():
            sd[f"error.{k}"] = v.detach().clone()
        for k, v in self.q.items():
            sd[f"q.{k}"] = v.detach().clone()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if int(sd["matrix_approximation_rank"]) != self.matrix_approximation_rank or int(sd["seed"]) != self.seed:
            raise ValueError("PowerSGD state was saved with another rank/seed; refusing an inexact resume")
        self.iteration, self.bytes_sent = int(sd["iteration"]), int(sd["bytes_sent"])
        self.error = {k[len("error."):]: v.clone() for k, v in sd.items() if k.startswith("error.")}
        self.q = {k[len("q."):]: v.clone() for k, v in sd.items() if k.startswith("q.")}


def _orthogonalize(p: torch.Tensor, eps: float) -> None:
    """In-place Gram-Schmidt on the columns of an fp32 matrix (rank r is small)."""
    for i in range(p.shape[1]):
        col = p[:, i:i + 1]
        norm = col.norm()
        col.div_(norm + eps if eps > 0 else norm.clamp_min(1e-30))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1:]
            rest.sub_(col @ (col.t() @ rest))


def _init_q(state: PowerSGDState, key: str, m: int, r: int, device: torch.device) -> torch.Tensor:
    # Same seed on every rank -> same Q everywhere without communication.
    salt = sum(ord(c) * 131 ** i for i, c in enumerate(key)) % (2 ** 31)
    it = 0 if state.warm_start else state.iteration
    g = torch.Generator().manual_seed((state.seed * 1_000_003 + salt * 7919 + it) % (2 ** 62))
    return torch.randn(m, r, generator=g, dtype=torch.float32).to(device)


def compression_plan(state: PowerSGDState, shape: torch.Size) -> tuple[bool, int, int, int]:
    """(compress?, n, m, r) for a gradient of `shape`. Public so tests/bench can predict bytes."""
    if len(shape) < 2:
        return False, 0, 0, 0
    n = shape[0]
    m = int(torch.Size(shape[1:]).numel())
    r = min(state.matrix_approximation_rank, n, m)
    rate = (n * m) / (r * (n + m))
    return rate >= state.min_compression_rate, n, m, r


def powersgd_hook(state: PowerSGDState, bucket: "GradBucket") -> comm.CommHandle:
    if state.iteration < state.start_powerSGD_iter:
        return allreduce_hook(state, bucket)
    buf, ws, group = bucket.buffer(), bucket.world_size, bucket.group
    dev = buf.device
    mats, plain = [], []
    for i, slot in enumerate(bucket.slots):
        view = buf[slot.start:slot.end]
        ok, n, m, r = compression_plan(state, slot.shape)
        if ok:
            mats.append((f"{bucket.index}.{i}", view, n, m, r))
        else:
            plain.append(view)

    # Uncompressed part: one flat all-reduce, copied back on wait.
    flat_plain = torch.cat(plain) if plain else None
    works = []
    if flat_plain is not None:
        works.append(comm.all_reduce(flat_plain, group, ws))
        if ws > 1:
            state.bytes_sent += flat_plain.numel() * flat_plain.element_size()

    ms, qs = [], []
    for key, view, n, m, r in mats:
        # fp32 buffers are used in place as M (no 'M = grad + error' copy of big matrices).
        mat = view.view(n, m).float()
        if state.use_error_feedback and key in state.error:
            mat.add_(state.error[key])
        q = state.q.get(key) if state.warm_start else None
        q = _init_q(state, key, m, r, dev) if q is None else q.clone()
        # Orthogonalise Q too (as torch does): a reused Q = M^T P drifts towards the top singular
        # vector in every column, and P = M Q would then lose rank numerically for r > 1.
        _orthogonalize(q, state.orthogonalization_epsilon)
        ms.append(mat)
        qs.append(q)
    p_flat = torch.cat([(mat @ q).reshape(-1) for mat, q in zip(ms, qs)]) if mats else None
    if p_flat is not None:
        works.append(comm.all_reduce(p_flat, group, ws))
        if ws > 1:
            state.bytes_sent += p_flat.numel() * 4
    p_work = works[-1] if p_flat is not None else None

    def finish() -> None:
        if p_work is not None:
            p_work.wait()
        if mats:
            ps, off = [], 0
            for (_, _, n, _, r) in mats:
                p = p_flat[off:off + n * r].view(n, r)
                off += n * r
                _orthogonalize(p, state.orthogonalization_epsilon)
                ps.append(p)
            q_flat = torch.cat([(mat.t() @ p).reshape(-1) for mat, p in zip(ms, ps)])
            w = comm.all_reduce(q_flat, group, ws)
            if ws > 1:
                state.bytes_sent += q_flat.numel() * 4
            if w is not None:
                w.wait()
            off = 0
            for (key, view, n, m, r), mat, p in zip(mats, ms, ps):
                q = q_flat[off:off + m * r].view(m, r)
                off += m * r
                approx = p @ q.t()
                if state.use_error_feedback:
                    # mat is this rank's share of the SUM (grads were divided by world size),
                    # approx approximates the whole sum: this rank's share of it is approx/ws,
                    # so the errors of all ranks add up to (sum - approx), the true residual.
                    err = state.error.get(key)
                    if err is None:
                        state.error[key] = mat - approx / ws
                    else:
                        torch.sub(mat, approx, alpha=1.0 / ws, out=err)
                if state.warm_start:
                    state.q[key] = q.clone()  # the all-reduced Q, re-orthogonalised at next use
                view.copy_(approx.view(-1))
        for w in works[:1] if flat_plain is not None else []:
            if w is not None:
                w.wait()
        if flat_plain is not None:
            off = 0
            for v in plain:
                v.copy_(flat_plain[off:off + v.numel()])
                off += v.numel()

    return comm.CommHandle([], then=finish)
