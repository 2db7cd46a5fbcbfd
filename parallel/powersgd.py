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

Overflow: a step's new errors and Qs are committed once every bucket was reduced
(`on_sync_end`), except for a bucket whose all-reduced P, Q or uncompressed gradients hold an
inf/nan (all-reduced values: the same verdict on every rank, no extra collective). The optimizer
then reports its own, globally reduced verdict (`on_optimizer_step`); a skipped step (or, with
overlap_optim_step, a skipped bucket) gets back the errors, Qs and iteration of before it. So an
overflow step leaves the state exactly as it was, on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Collection, Optional, Union

import torch

from utils import comm
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
    iteration: int = 0  # steps whose gradients were applied (overflow-skipped steps don't count)
    bytes_sent: int = 0
    error: dict[str, torch.Tensor] = field(default_factory=dict)
    q: dict[str, torch.Tensor] = field(default_factory=dict)
    # ---- the step in flight (never saved) ----
    _pending_error: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _pending_q: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _pending_bad: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # bucket -> bool
    _undo: Optional[dict] = field(default=None, repr=False)  # what the last commit replaced
    _fallback_q: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def on_sync_end(self) -> None:
        """Called by DDP once all buckets of a step were reduced. Commits each bucket's new errors
        and Qs unless a non-finite all-reduced value was seen in that bucket (the same on every
        rank), and counts the iteration unless every bucket was non-finite. What the commit
        replaced is kept until the optimizer's verdict (`on_optimizer_step`) or the next step, so
        an overflow found by the optimizer (anywhere in the step) can still be undone."""
        buckets = sorted(self._pending_bad)
        flags = torch.stack([self._pending_bad[b] for b in buckets]).tolist() if buckets else []
        bad = {b for b, f in zip(buckets, flags) if f}
        undo: dict = {"error": {}, "q": {}, "iteration": self.iteration}
        for name, pending, store in (("error", self._pending_error, self.error), ("q", self._pending_q, self.q)):
            for key, new in pending.items():
                if _bucket_of(key) not in bad:
                    undo[name][key] = store.get(key)
                    store[key] = new
        if not buckets or len(bad) < len(buckets):
            self.iteration += 1
        self._undo = undo
        self._clear_pending()

    def on_optimizer_step(self, stepped: Union[bool, Collection[int]]) -> None:
        """The optimizer's verdict on the step whose gradients were just synced; it must be the
        same on every rank. True: keep the committed state; False (an overflow skipped the step):
        restore the errors, Qs and iteration of before the step; a collection of bucket indices
        (overlap_optim_step steps buckets independently): restore every other bucket's state."""
        undo, self._undo = self._undo, None
        if undo is None or stepped is True:
            return
        done = set() if stepped is False else {int(i) for i in stepped}
        for name, store in (("error", self.error), ("q", self.q)):
            for key, old in undo[name].items():
                if _bucket_of(key) in done:
                    continue
                if old is None:
                    store.pop(key, None)
                else:
                    store[key] = old
        if not done:
            self.iteration = undo["iteration"]

    def _clear_pending(self) -> None:
        self._pending_error, self._pending_q, self._pending_bad = {}, {}, {}

    def _flag_non_finite(self, bucket_index: int, t: torch.Tensor) -> None:
        bad = ~torch.isfinite(t).all()  # stays on the device until on_sync_end
        prev = self._pending_bad.get(bucket_index)
        self._pending_bad[bucket_index] = bad if prev is None else prev | bad

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
        self._clear_pending()
        self._undo = None
        self.iteration, self.bytes_sent = int(sd["iteration"]), int(sd["bytes_sent"])
        self.error = {k[len("error."):]: v.clone() for k, v in sd.items() if k.startswith("error.")}
        self.q = {k[len("q."):]: v.clone() for k, v in sd.items() if k.startswith("q.")}


def _bucket_of(key: str) -> int:
    return int(key.split(".", 1)[0])  # keys are "<bucket index>.<slot index>"


def _project_out(col: torch.Tensor, prev: torch.Tensor) -> None:
    """col -= prev prev^T col, twice: one classical Gram-Schmidt pass loses orthogonality when
    most of col lies in span(prev); the second pass restores it to rounding ("twice is enough")."""
    for _ in range(2):
        col.sub_(prev @ (prev.t() @ col))


def _orthogonalize(p: torch.Tensor, eps: float, fallback: Optional[torch.Tensor] = None) -> None:
    """In-place Gram-Schmidt on the columns of an fp32 matrix (rank r is small).

    Columns come out orthonormal or, where a column is numerically dependent on the previous
    ones (what is left of it is at most max(rows, r) * fp32-eps of the largest column: a gradient
    of rank < r, an all-zero one), zero; with `fallback` (same shape, random) such a column is
    replaced by the fallback's column orthogonalised against the others, so a warm-started Q
    never loses columns for good. Normalising that rounding noise instead would give columns that
    are far from orthogonal (or, for tiny gradients, enormous), and P P^T M would no longer be a
    projection. Works on p / max|p|, so tiny (or huge) gradients behave like unit-sized ones.
    Decisions use tensor ops only (no host sync), and non-finite input stays non-finite.
    """
    rows, r = p.shape
    amax = p.abs().amax()
    p.div_(torch.where(amax > 0, amax, torch.ones_like(amax)))  # inf/nan propagate
    tol = max(rows, r) * torch.finfo(torch.float32).eps
    limit = p.norm(dim=0).amax() * tol
    for i in range(r):
        col = p[:, i:i + 1]
        if i > 0:
            _project_out(col, p[:, :i])
        norm = col.norm()
        unit = col / (norm + eps if eps > 0 else norm)
        dependent = norm <= limit  # False for nan: a non-finite column stays non-finite
        if fallback is not None:
            alt = fallback[:, i:i + 1].clone()
            if i > 0:
                _project_out(alt, p[:, :i])
            alt = alt / alt.norm()
        else:
            alt = torch.zeros_like(col)
        col.copy_(torch.where(dependent, alt, unit))


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


def _fallback(state: PowerSGDState, key: str, m: int, r: int, device: torch.device) -> torch.Tensor:
    """Fixed random columns (seeded like Q, identical on every rank) that replace Q columns which
    became dependent (a gradient of rank < r); cached, not saved (re-created from the seed)."""
    fb = state._fallback_q.get(key)
    if fb is None or fb.shape != (m, r) or fb.device != device:
        fb = state._fallback_q[key] = _init_q(state, key + "/fallback", m, r, device)
    return fb


def powersgd_hook(state: PowerSGDState, bucket: "GradBucket") -> comm.CommHandle:
    state._undo = None  # a new step: the previous one can no longer be undone
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
        # fp32 buffers are used in place as M (no 'M = grad + error' copy of big matrices); the
        # committed error is only read here, so a skipped step can still keep it.
        mat = view.view(n, m).float()
        if state.use_error_feedback and key in state.error:
            mat.add_(state.error[key])
        q = state.q.get(key) if state.warm_start else None
        q = _init_q(state, key, m, r, dev) if q is None else q.clone()
        # Orthogonalise Q too (as torch does): a reused Q = M^T P drifts towards the top singular
        # vector in every column, and P = M Q would then lose rank numerically for r > 1.
        _orthogonalize(q, state.orthogonalization_epsilon, _fallback(state, key, m, r, dev))
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
            state._flag_non_finite(bucket.index, p_flat)  # all-reduced: the same verdict on every rank
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
            state._flag_non_finite(bucket.index, q_flat)
            off = 0
            for (key, view, n, m, r), mat, p in zip(mats, ms, ps):
                q = q_flat[off:off + m * r].view(m, r)
                off += m * r
                approx = p @ q.t()
                if state.use_error_feedback:
                    # mat is this rank's share of the SUM (grads were divided by world size),
                    # approx approximates the whole sum: this rank's share of it is approx/ws,
                    # so the errors of all ranks add up to (sum - approx), the true residual.
                    # Committed in on_sync_end, once every bucket of the step was checked.
                    state._pending_error[key] = mat - approx / ws
                if state.warm_start:
                    state._pending_q[key] = q.clone()  # the all-reduced Q, re-orthogonalised at next use
                view.copy_(approx.view(-1))
        for w in works[:1] if flat_plain is not None else []:
            if w is not None:
                w.wait()
        if flat_plain is not None:
            state._flag_non_finite(bucket.index, flat_plain)
            off = 0
            for v in plain:
                v.copy_(flat_plain[off:off + v.numel()])
                off += v.numel()

    return comm.CommHandle([], then=finish)
