"""Causal ring attention for context parallelism: each of the C ranks of a cp group holds 1/C of every
sequence, and keys/values travel around the ring so that every query still sees every earlier key.

Load balance (the "zigzag" split): the sequence is cut into 2C chunks and cp rank i holds chunk i (its head)
and chunk 2C-1-i (its tail), in that order. Under a causal mask rank i's head sees few keys and its tail many,
so every rank does the same work at every ring step: at step s it holds the keys/values of rank
src = (i - s) mod C and computes

    src == i (s = 0): head x head (causal), tail x head (full), tail x tail (causal)
    src <  i        : head x head(src) (full), tail x head(src) (full)
    src >  i        : tail x head(src) (full), tail x tail(src) (full)

(every other pair of chunks is in the future of the query chunk and skipped). `shard_sequence` /
`local_positions` give a rank its tokens and their RoPE positions; `unshard_sequence` undoes the split.

Each block returns its output and the log-sum-exp (lse) of its rows; blocks are merged by lse
(out = sum_b exp(lse_b - lse) out_b, lse = logaddexp over b), the flash-attention recurrence. The
backward is flash-attention's too (P = exp(S - lse), dS = P (dP - rowsum(dO O))), recomputing each block
from the saved q, k, v, output and lse: the keys/values go around the ring a second time and their
gradients dK/dV travel with them, one more hop at the end bringing each rank its own. Communication is
point-to-point (send to the next rank, receive from the previous: `batch_isend_irecv`), started before a
block is computed so that it overlaps with the block's math; with gloo on CPU too.

GQA: keys/values keep their n_kv_heads (the query heads of a group share them inside the einsum; no
repeat), so the ring moves n_kv_heads / n_heads of the bytes the queries would.

The block math is plain PyTorch in fp32 (fp64 for fp64 inputs), ROW_TILE query rows at a time, so the
scores held transiently (never saved) are [heads, ROW_TILE, c] for chunks of c tokens: correct on every
device, not a fused kernel.
The reference is model/attention.py's `attention_ref` on the whole sequence in one process.

Why our own: torch 2.13's `torch.distributed.tensor.experimental.context_parallel` does not run on CPU
(`aten._scaled_dot_product_flash_attention_for_cpu` has no sharding strategy: NotImplementedError with
gloo), and it shards buffers in place (inputs that require grad are refused).

Owns: the sequence split, the ring autograd Function and its block math.
Must never: read a tensor's value on the host, or know about the trainer, the mesh or the engines.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist


# ------------------------------------------------------------------------------ the sequence split
def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The global chunk numbers (of 2 x cp) that cp rank `rank` holds: its head and its tail."""
    return rank, 2 * cp - 1 - rank


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of a whole sequence: chunks `chunk_ids(rank, cp)` of 2 x cp along `dim`, concatenated.
    The length must be a multiple of 2 x cp."""
    if cp == 1:
        return x
    T = x.shape[dim]
    if T % (2 * cp):
        raise ValueError(f"context parallel {cp}: the sequence length {T} must be a multiple of 2 x {cp} = {2 * cp}")
    chunks = x.chunk(2 * cp, dim=dim)
    a, b = chunk_ids(rank, cp)
    return torch.cat((chunks[a], chunks[b]), dim=dim)


def local_positions(T: int, rank: int, cp: int, device: Any = None) -> torch.Tensor:
    """Global positions [T / cp] of this rank's tokens (the RoPE positions and the causal order)."""
    return shard_sequence(torch.arange(T, device=device), rank, cp, dim=0)


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every cp rank's part (in cp-rank order): the inverse of shard_sequence."""
    cp = len(parts)
    chunks: list[Optional[torch.Tensor]] = [None] * (2 * cp)
    for r, p in enumerate(parts):
        head, tail = p.chunk(2, dim=dim)
        a, b = chunk_ids(r, cp)
        chunks[a], chunks[b] = head, tail
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- block math
def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# query rows per tile of a block: the transient scores are [heads, ROW_TILE, c] (fp32) rather than [heads, c, c]
ROW_TILE = 1024


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, row0: int = 0,
            same_doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, G, R, n, D] (G kv heads x R query heads each; rows row0.. of their chunk), k [B, G, m, D] ->
    scores [B, G, R, n, m], -inf where the key is in the query's future when `causal` (a diagonal block), and where
    `same_doc` [B, n, m] (these rows' and keys' document ids equal) is False."""
    s = torch.einsum("bgrid,bgjd->bgrij", q, k) * scale
    if causal:
        rows = torch.arange(row0, row0 + q.shape[-2], device=q.device)
        future = torch.arange(k.shape[-2], device=q.device)[None, :] > rows[:, None]
        s = s.masked_fill(future, float("-inf"))
    if same_doc is not None:
        s = s.masked_fill(~same_doc[:, None, None], float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with the -inf of rows that see no key in a block (another document's keys only) replaced by 0, to
    subtract from their -inf scores: their probabilities are then 0, never NaN."""
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _same_doc(docs: Optional[tuple], r0: int, r1: int, n: int) -> Optional[torch.Tensor]:
    """[B, r1 - r0, n]: whether query rows r0..r1 and keys ..n of a block are in one document (None: no ids)."""
    if docs is None:
        return None
    q_docs, k_docs = docs
    return q_docs[:, r0:r1, None] == k_docs[:, None, :n]


def _tiles(rows: int, causal: bool, keys: int):
    """(first row, end row, keys seen) per tile of ROW_TILE query rows; a causal tile sees keys < its end row."""
    for r0 in range(0, rows, ROW_TILE):
        r1 = min(rows, r0 + ROW_TILE)
        yield r0, r1, (r1 if causal else keys)


def block_forward(q, k, v, causal: bool, scale: float, docs: Optional[tuple] = None):
    """One block: (out [B, G, R, c, D], lse [B, G, R, c]) in the accumulation dtype, ROW_TILE query rows at a time.
    docs: (the query rows' document ids [B, c], the keys' [B, m]) or None; a row that sees no key here gets out 0
    and lse -inf."""
    outs, lses = [], []
    for r0, r1, n in _tiles(q.shape[-2], causal, k.shape[-2]):
        s = _scores(q[..., r0:r1, :], k[..., :n, :], causal, scale, r0, _same_doc(docs, r0, r1, n))
        lse = torch.logsumexp(s, dim=-1)
        outs.append(torch.einsum("bgrij,bgjd->bgrid", torch.exp(s - _finite(lse)[..., None]), v[..., :n, :]))
        lses.append(lse)
    return torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)


def block_backward(q, k, v, dout, lse, delta, causal: bool, scale: float, docs: Optional[tuple] = None):
    """One block's (dq, dk, dv) given the merged row lse and delta = rowsum(dout * out), ROW_TILE rows at a time.
    (The merged lse is finite: every row sees itself.)"""
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r0, r1, n in _tiles(q.shape[-2], causal, k.shape[-2]):
        qt, dot = q[..., r0:r1, :], dout[..., r0:r1, :]
        s = _scores(qt, k[..., :n, :], causal, scale, r0, _same_doc(docs, r0, r1, n))
        p = torch.exp(s - lse[..., r0:r1, None])
        dv[..., :n, :] += torch.einsum("bgrij,bgrid->bgjd", p, dot)
        ds = p * (torch.einsum("bgrid,bgjd->bgrij", dot, v[..., :n, :]) - delta[..., r0:r1, None])
        dq[..., r0:r1, :] = torch.einsum("bgrij,bgjd->bgrid", ds, k[..., :n, :]) * scale
        dk[..., :n, :] += torch.einsum("bgrij,bgrid->bgjd", ds, qt) * scale
    return dq, dk, dv


def _merge(out, lse, b_out, b_lse):
    """Merge a block into the running (out, lse) of the same query rows (None: the first block)."""
    if out is None:
        return b_out, b_lse
    new = torch.logaddexp(lse, b_lse)
    base = _finite(new)  # both -inf (no key seen yet): both factors 0
    return out * torch.exp(lse - base)[..., None] + b_out * torch.exp(b_lse - base)[..., None], new


def step_pairs(rank: int, src: int) -> tuple[tuple[int, int, bool], ...]:
    """(query chunk, key chunk, causal) pairs to compute at the ring step holding rank `src`'s keys/values
    (0 = head, 1 = tail); see the module docstring."""
    if src == rank:
        return ((0, 0, True), (1, 0, False), (1, 1, True))
    if src < rank:
        return ((0, 0, False), (1, 0, False))
    return ((1, 0, False), (1, 1, False))


# ---------------------------------------------------------------------------------- the ring
class _Ring:
    """Send to the next cp rank and receive from the previous one, asynchronously."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, t: torch.Tensor, tag: int = 0):
        """Post the exchange of `t`; returns (the receive buffer, the pending requests). `tag` keeps the
        keys/values (0) and their gradients (1) apart when both are in flight between the same two ranks."""
        t = t.contiguous()
        recv = torch.empty_like(t)
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.group, tag)]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending) -> None:
        for req in pending[1]:
            req.wait()


def _split_heads(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    B, H, T, D = q.shape
    return q.view(B, n_kv, H // n_kv, T, D)


def _pair_docs(docs: Optional[torch.Tensor], rank: int, src: int, size: int, qi: int, ki: int) -> Optional[tuple]:
    """(document ids of this rank's query chunk qi, of rank src's key chunk ki) from the whole sequences' [B, T]."""
    if docs is None:
        return None
    chunks = docs.chunk(2 * size, dim=1)
    return chunks[chunk_ids(rank, size)[qi]], chunks[chunk_ids(src, size)[ki]]


class RingAttentionFunction(torch.autograd.Function):
    """Causal attention of this rank's two chunks over the whole sequence, around the cp group's ring; with
    `docs` (the whole sequences' document ids [B, T], the same on every rank) only within a document."""

    @staticmethod
    def forward(ctx, q, k, v, group, docs=None):
        acc = _acc_dtype(q.dtype)
        ring = _Ring(group)
        n_kv, scale = k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qs = _split_heads(q.to(acc), n_kv).chunk(2, dim=-2)
        outs, lses = [None, None], [None, None]
        kv = torch.stack((k, v))
        for s in range(ring.size):
            pending = ring.start(kv) if s < ring.size - 1 else None
            ks, vs = (t.to(acc).chunk(2, dim=-2) for t in kv)
            src = (ring.rank - s) % ring.size
            for qi, ki, causal in step_pairs(ring.rank, src):
                o, l = block_forward(qs[qi], ks[ki], vs[ki], causal, scale,
                                     _pair_docs(docs, ring.rank, src, ring.size, qi, ki))
                outs[qi], lses[qi] = _merge(outs[qi], lses[qi], o, l)
            if pending is not None:
                _Ring.wait(pending)
                kv = pending[0]
        out = torch.cat(outs, dim=-2)                 # [B, G, R, T, D]
        lse = torch.cat(lses, dim=-1)                 # [B, G, R, T]
        # laid out [B, T, H, D] in memory (returned as its [B, H, T, D] view), as SDPA's CPU and flash kernels
        # return it: the model's transpose + reshape to [B, T, H x D] is then a view, and o_proj saves this
        # same storage rather than a copy
        y = out.reshape(q.shape).to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.group, ctx.docs = group, docs
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k, v, y, lse = ctx.saved_tensors
        acc = _acc_dtype(q.dtype)
        ring = _Ring(ctx.group)
        n_kv, scale = k.shape[1], 1.0 / math.sqrt(q.shape[-1])
        qf, dyf = _split_heads(q.to(acc), n_kv), _split_heads(dy.to(acc), n_kv)
        delta = (dyf * _split_heads(y.to(acc), n_kv)).sum(-1)
        qs, dys = qf.chunk(2, dim=-2), dyf.chunk(2, dim=-2)
        lses, deltas = lse.chunk(2, dim=-1), delta.chunk(2, dim=-1)
        dq = [torch.zeros_like(qs[0]), torch.zeros_like(qs[1])]
        kv = torch.stack((k, v))
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)  # the gradients of the keys/values held now
        for s in range(ring.size):
            # the next keys/values are fetched while this block computes; its gradients go on after it
            pending = ring.start(kv) if s < ring.size - 1 else None
            ks, vs = (t.to(acc).chunk(2, dim=-2) for t in kv)
            dks, dvs = dkv[0].chunk(2, dim=-2), dkv[1].chunk(2, dim=-2)   # views: written in place
            src = (ring.rank - s) % ring.size
            for qi, ki, causal in step_pairs(ring.rank, src):
                g_q, g_k, g_v = block_backward(qs[qi], ks[ki], vs[ki], dys[qi], lses[qi], deltas[qi], causal, scale,
                                               _pair_docs(ctx.docs, ring.rank, src, ring.size, qi, ki))
                dq[qi] += g_q
                dks[ki].add_(g_k)
                dvs[ki].add_(g_v)
            if ring.size > 1:
                grads = ring.start(dkv, tag=1)
                _Ring.wait(grads)
                dkv = grads[0]
            if pending is not None:
                _Ring.wait(pending)
                kv = pending[0]
        dq_full = torch.cat(dq, dim=-2).reshape(q.shape).to(q.dtype)
        return dq_full, dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any,
                   docs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [B, H, T/C, D], k/v [B, Hkv, T/C, D]: this cp rank's tokens (shard_sequence's order) -> [B, H, T/C, D],
    causal attention over the whole sequence of the cp `group` (C = its size; None or size 1: local causal).
    docs: the whole sequences' document ids [B, T] (every rank passes the same; `sequence_documents`): a query
    sees the earlier keys of its own document only. None: one document per row."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k.shape[1]} key/value heads evenly")
    if group is None or dist.get_world_size(group) == 1:
        return _local(q, k, v, docs)
    return _ring_eager(q, k, v, group, docs)


@torch.compiler.disable
def _ring_eager(q, k, v, group, docs=None):
    """The ring outside any compiled graph: under --compile each block is compiled in the pieces before and
    after attention (a graph break here), and the exchanges run eagerly with this rank's process group."""
    return RingAttentionFunction.apply(q, k, v, group, docs)


def _local(q, k, v, docs=None):
    """C = 1: the whole sequence on this rank, one causal block of the same block math."""
    acc = _acc_dtype(q.dtype)
    y, _ = block_forward(_split_heads(q.to(acc), k.shape[1]), k.to(acc), v.to(acc), True, 1.0 / math.sqrt(q.shape[-1]),
                         None if docs is None else (docs, docs))
    return y.reshape(q.shape).to(q.dtype)


def sequence_documents(B: int, T: int, device: Any, attention_mask: Optional[torch.Tensor] = None,
                       position_ids: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None,
                       cu_seqlens: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """The whole sequences' document ids [B, T] for the ring (None: every row one causal document): the packed
    documents a batch carries (model/attention.py batch_documents, as the one-rank masks take them), and padding
    (attention_mask 0) one document per pad token, so that no query sees a pad but itself (the `allowed` rule)."""
    from model.attention import batch_documents
    docs = batch_documents(B, T, device, position_ids, doc_ids, cu_seqlens)
    if attention_mask is not None:
        if docs is None:
            docs = torch.zeros(B, T, dtype=torch.long, device=device)
        pad_ids = -1 - torch.arange(T, device=device)[None].expand(B, T)
        docs = torch.where(attention_mask[:, -T:].bool(), docs.to(torch.long), pad_ids)
    return docs


# ------------------------------------------------------------------------ the model's cp switch
class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: each rank's loss is seeded with its own gradient and the
    parameters' gradients are summed over the ranks afterwards (the data-parallel reduction does it)."""

    @staticmethod
    def forward(ctx, t, group):
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherSequence(torch.autograd.Function):
    """This rank's [B, T/C] values of its tokens -> the whole rows' [B, T] (all-gathered over the cp group, in
    sequence order); backward: this rank's positions of the gradient (every rank computes the same function of
    the whole rows, as with _SumOverGroup: each seeds its own tokens' part)."""

    @staticmethod
    def forward(ctx, t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        ctx.rank, ctx.size = dist.get_rank(group), len(parts)
        return unshard_sequence(parts, dim=1)

    @staticmethod
    def backward(ctx, g):
        return shard_sequence(g, ctx.rank, ctx.size, dim=1), None


@contextmanager
def whole_sequences(model: Any) -> Iterator[Any]:
    """Context parallelism switched off on `model` (the project's Transformer) inside the block: every rank runs whole
    sequences (generation with a KV cache: GRPO's rollouts and held-out answers, which the cp ranks of a replica
    decode alike). Yields the model's ContextParallel (None without it)."""
    cp = getattr(model, "context_parallel", None)
    model.context_parallel = None
    try:
        yield cp
    finally:
        model.context_parallel = cp


class ContextParallel:
    """What the model needs to run context parallel: its cp group, this rank's place in it, and the split.
    Set on the model by parallel/transforms/context_parallel.py (`model.context_parallel`)."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def shard(self, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's chunks of a [B, T, ...] batch tensor (None stays None)."""
        return None if x is None else shard_sequence(x, self.rank, self.size, dim=1)

    def positions(self, B: int, T: int, device: Any) -> torch.Tensor:
        """The global positions [B, T / C] of this rank's tokens of a length-T sequence."""
        return local_positions(T, self.rank, self.size, device)[None].expand(B, T // self.size)

    def next_token_values(self, values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """From this rank's [B, T/C, V] of the whole rows (logits, log-probabilities), the value of each next token
        (input_ids[:, t + 1] at position t) as the whole rows' [B, T - 1] on every rank, differentiable through
        this rank's positions (GRPO's per-token log-probabilities)."""
        nxt = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)  # (the last position's is dropped below)
        mine = values.gather(-1, self.shard(nxt)[..., None])[..., 0]
        return self.gather_tokens(mine)[:, :-1]

    @torch.compiler.disable  # eager, like reduce_loss
    def gather_tokens(self, per_token: torch.Tensor) -> torch.Tensor:
        """This rank's per-token values [B, T/C] as the whole rows' [B, T] on every rank (DPO's sequence sums)."""
        return _GatherSequence.apply(per_token, self.group)

    @torch.compiler.disable  # its all-reduces run eagerly (a graph break under --compile, like the ring's)
    def reduce_loss(self, loss_sum: torch.Tensor, labels: torch.Tensor, reduction: str,
                    ignore_index: int = -100) -> torch.Tensor:
        """The whole sequences' loss from this rank's sum over its tokens: summed over the cp group
        (every rank returns the same value; gradients flow to this rank's part only), divided by the
        group's target count for "mean"."""
        total = _SumOverGroup.apply(loss_sum, self.group)
        if reduction == "sum":
            return total
        n = (labels != ignore_index).sum().to(torch.float32)
        dist.all_reduce(n, group=self.group)
        return total / n.clamp(min=1)
