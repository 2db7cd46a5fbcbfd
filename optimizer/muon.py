"""Muon (momentum + Newton-Schulz orthogonalisation) for the hidden 2-D matrices, over our flat fp32 masters.

Owns: which parameters are Muon's (`is_muon_param`: every 2-D weight inside the transformer blocks -
q/k/v/o, gate/up/down and LoRA adapters - and an MoE block's stacked experts, each expert's matrices apart
(`matrices_of`); never the token embedding, the LM head or a norm), the Muon
math (`MuonState.step`), its momentum state, and the collectives that bring each sharded matrix together
for its orthogonalisation under ZeRO-1/2. AdamW (optimizer/adamw.py) keeps every other parameter.

The math is torch.optim.Muon's, operation for operation (so tests compare bit for bit where both see the
same matrix): B <- lerp(B, g, 1 - mu); U <- lerp(g, B, mu) (nesterov) or B; O <- NS5(U) in bf16 with
Keller Jordan's coefficients; p <- p (1 - lr wd) - lr' O, with lr' = adjust(lr, shape).
The learning-rate convention (`muon_adjust_lr`): "match_rms_adamw" (Moonlight: lr' = 0.2 sqrt(max(A, B)) lr,
the default) or "original" (Keller: lr' = sqrt(max(1, A / B)) lr). We default to Moonlight's because it
makes the update's RMS about 0.2, AdamW's typical update RMS, so an AdamW-tuned --learning_rate and
--weight_decay carry over to Muon's matrices (Liu et al. 2025, "Muon is Scalable for LLM Training").
The model's q/k/v (and gate/up) parameters are separate (the fused projection only concatenates them in
the forward), so each is orthogonalised as its own matrix.

Distributed (ZeRO-1/2: each rank owns a contiguous 1/W of every bucket, cutting matrices anywhere): the
elementwise momentum runs on the owned shard; then, for all buckets at once (two collectives per step),
  1. an all-to-all sends each matrix's owner (the rank whose shards hold most of it; ties round-robin) the
     pieces the other ranks hold, in bf16: lossless, as Newton-Schulz rounds its input to bf16 first,
  2. each matrix is assembled and orthogonalised ONCE, on its owner,
  3. an all-to-all returns each piece of the (bf16) result to the rank that holds that piece,
then the decay and the update on the shard: bit-identical to one process. Bytes a rank sends per step:
2 x (its shards' Muon elements owned by other ranks + its own matrices' elements held by other ranks):
at most ~2 x 2 x P_muon / W (P_muon: the Muon parameters; only matrices cut by a shard boundary move, so
with buckets much larger than a matrix it is far less), against ~2 x (W-1)/W x P for ZeRO's own bf16
parameter all-gather. `comm_bytes` counts them. `MuonState.comm_bytes` counts them. Without ZeRO every rank holds the
whole reduced gradient and orthogonalises every matrix itself: no communication.
Must never: orthogonalise a part of a matrix, or issue collectives in an order that is not the same on
every rank (it is fixed at construction from the buckets).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim.Muon's (Keller Jordan's) quintic
NS_STEPS = 5
NS_EPS = 1e-7
ADJUST_LR_CHOICES = ("match_rms_adamw", "original")


def is_muon_param(name: str, shape: Sequence[int], experts: bool = True) -> bool:
    """A hidden matrix: 2-D and inside a transformer block (`layers.<i>.`), or (`experts`: OptimizerConfig.
    muon_experts) an MoE block's stacked expert weights (3-D, `.experts.`: a stack of matrices, `matrices_of`); the
    embedding, the LM head and every norm / bias are AdamW's."""
    return (len(shape) == 2 and ".layers." in f".{name}") or \
        (experts and len(shape) == 3 and ".experts." in f".{name}")


def matrices_of(name: str, shape: Sequence[int]) -> tuple[int, int, int]:
    """A Muon parameter as (count, rows, cols): a stack of `count` matrices [rows, cols], each orthogonalised on its
    own. A 2-D weight is one matrix; stacked expert weights [E, R, C] are E (model/moe.py GroupedExperts), and
    `experts.gate_up_proj` [E, 2I, D] is 2E of [I, D]: each expert's gate and up apart, as a dense block's
    gate_proj and up_proj are (and as Mixtral's w1 / w3)."""
    if len(shape) == 2:
        return 1, int(shape[0]), int(shape[1])
    e, r, c = (int(s) for s in shape)
    if name.endswith("gate_up_proj"):
        return 2 * e, r // 2, c
    return e, r, c


def orthogonalise(u: torch.Tensor, name: str, shape: Sequence[int]) -> torch.Tensor:
    """Newton-Schulz of every matrix of a Muon parameter (`matrices_of`), from its update with that many elements
    in the parameter's layout; bf16, in the parameter's shape."""
    count, rows, cols = matrices_of(name, shape)
    m = u.reshape(rows, cols) if count == 1 else u.reshape(count, rows, cols)
    return zeropower_via_newtonschulz(m).view(tuple(shape))


def zeropower_via_newtonschulz(g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = NS_STEPS,
                               eps: float = NS_EPS) -> torch.Tensor:
    """torch.optim.Muon's orthogonalisation of a 2-D matrix (bf16, transposed to wide), the same ops in the
    same order: the result's bits are torch's for the same input. A 3-D input is a stack of matrices, each
    orthogonalised on its own by the batched forms of the same ops (one launch per op for the stack)."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x.div_(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, gram_update, x, beta=a)
    else:
        x.div_(torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def adjusted_lr(lr: float, shape: Sequence[int], convention: str) -> float:
    """The learning rate a matrix of `shape` ([rows, cols]: one of a stack's, `matrices_of`) is updated with
    (torch.optim.Muon's _adjust_lr)."""
    rows, cols = shape[0], shape[1]
    if convention == "original":
        return lr * math.sqrt(max(1, rows / cols))
    if convention == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"muon_adjust_lr must be one of {ADJUST_LR_CHOICES}, got {convention!r}")


@dataclass
class MuonMatrix:
    """One Muon parameter: its name and full shape, its round-robin owner, and, when this rank updates a
    part of it, that part: the flat element range [lo, hi) of the parameter, the bucket-local start of
    that range (`at`), the master it updates and its fp32 momentum buffer."""
    name: str
    shape: tuple
    bucket_index: int
    slot_start: int  # bucket-local offset of the parameter's element 0
    owner: int  # (ZeRO: a rank of the matrix's domain, MuonDomain)
    piece: object = None  # the optimizer's Piece (main, lo, hi) when this rank holds a part
    momentum: Optional[torch.Tensor] = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class MuonDomain:
    """The ranks a ZeRO-sharded Muon matrix is cut over, and the exchanges among them: the data-parallel group for
    the dense buffers, the ranks holding the same experts for an expert-parallel buffer (whose matrices are other
    experts on the other expert-parallel ranks). `layout[r]`: the (matrix, lo, hi) parts rank r of the domain
    holds, in matrix order; `send[o]` / `recv[r]`: this rank's parts of owner o's matrices / rank r's parts of
    this rank's matrices, the two all-to-alls' order."""
    group: object
    rank: int
    world_size: int
    matrices: list  # indices into MuonState.matrices
    layout: list
    send: list
    recv: list


class MuonState:
    """Muon over the optimizer's pieces of the Muon matrices: an update of our DDP's optimizers beside AdamW's
    (optimizer/adamw.py BucketAdamW), with the same small interface (step, state_bytes, a piece's state).
    `sharded`: the pieces are flat ZeRO shards (orthogonalised through the all-to-alls above); otherwise each piece
    is a whole matrix, which every rank orthogonalises itself (plain DDP: each holds the whole reduced gradient; no
    communication)."""
    state_keys = ("momentum",)
    skips_on_device = False  # no found_inf input: with Muon the host decides (one host read, before the update)

    def __init__(self, ddp, pieces: list, config, *, sharded: bool, group, rank: int, world_size: int):
        self.config, self.sharded = config, sharded
        self.group, self.rank, self.world_size = group, rank, world_size
        self.lr = float(config.muon_lr or config.lr)
        self.lr_scale = 1.0  # the schedule's factor: set_lr(lr) scales Muon's lr like AdamW's
        self.ddp = ddp
        by_param = {id(pc.param): pc for pc in pieces}
        self.matrices: list[MuonMatrix] = []
        for bucket in ddp.buckets:  # model order, the same on every rank: owners and collectives agree
            for slot in bucket.slots:
                if not is_muon_param(slot.name, tuple(slot.param.shape), config.muon_experts):
                    continue
                m = MuonMatrix(slot.name, tuple(slot.param.shape), bucket.index, slot.start,
                               owner=len(self.matrices) % world_size, piece=by_param.get(id(slot.param)))
                if m.piece is not None:
                    m.momentum = torch.zeros(m.piece.hi - m.piece.lo, dtype=torch.float32,
                                             device=m.piece.main.device)
                self.matrices.append(m)
        # ZeRO: per domain (the dense buffers' data-parallel group; an expert-parallel buffer's own group), which
        # part [lo, hi) of each matrix every rank's shards hold (in matrix order), and from it the order of both
        # all-to-alls: what this rank sends to each owner (`send`), what it receives from each rank for the
        # matrices it owns (`recv`), as (matrix, lo, hi) lists per peer rank
        self.domains: list[MuonDomain] = []
        if sharded:
            by_group: dict[int, list[int]] = {}
            for i, m in enumerate(self.matrices):
                buf = ddp.buckets[m.bucket_index].buffer
                by_group.setdefault(id(buf.group) if getattr(buf, "expert", False) else 0, []).append(i)
            for key, idx in by_group.items():  # dense first (matrix order), the same on every rank
                buf = ddp.buckets[self.matrices[idx[0]].bucket_index].buffer
                g, me, w = (buf.group, buf.rank, buf.world_size) if key else (group, rank, world_size)
                self.domains.append(self._domain(ddp, idx, g, me, w))
        self.comm_bytes = 0  # cumulative payload bytes of Muon's collectives
        self.steps = 0

    def _domain(self, ddp, idx: list[int], group, rank: int, world_size: int) -> MuonDomain:
        """The layout, owners and exchange order of the matrices `idx`, cut over `world_size` ranks."""
        layout: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
        for r in range(world_size):
            for i in idx:
                m = self.matrices[i]
                olo, ohi = ddp.buckets[m.bucket_index].shard_range(r, world_size)
                lo, hi = max(olo, m.slot_start) - m.slot_start, min(ohi, m.slot_start + m.numel) - m.slot_start
                if lo < hi:
                    layout[r].append((i, lo, hi))
        # the owner: the rank whose shards already hold the most of the matrix (a matrix inside one shard
        # moves nowhere); ties go round-robin from the matrix's index
        held = {i: [0] * world_size for i in idx}
        for r, lay in enumerate(layout):
            for i, lo, hi in lay:
                held[i][r] += hi - lo
        for i in idx:
            self.matrices[i].owner = max(range(world_size), key=lambda r: (held[i][r], -((r - i) % world_size)))
        have = [(i, self.matrices[i].piece.lo, self.matrices[i].piece.hi) for i in idx
                if self.matrices[i].piece is not None]
        if layout[rank] != have:
            raise RuntimeError(f"Muon's shard layout {layout[rank][:3]} disagrees with the optimizer's "
                               f"pieces {have[:3]}")
        send = [[e for e in layout[rank] if self.matrices[e[0]].owner == o] for o in range(world_size)]
        recv = [[e for e in layout[r] if self.matrices[e[0]].owner == rank] for r in range(world_size)]
        return MuonDomain(group, rank, world_size, idx, layout, send, recv)

    def current_lr(self) -> float:
        return self.lr * self.lr_scale

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, found_inf: Optional[torch.Tensor] = None) -> None:
        """One Muon step on the (already unscaled and clipped) gradients in each piece's `main.grad`; never with a
        device flag (`skips_on_device`)."""
        if found_inf is not None:
            raise RuntimeError("Muon cannot skip a step on a device flag: its optimizer decides on the host")
        cfg, mu = self.config, self.config.muon_momentum
        updates: dict[int, torch.Tensor] = {}
        for i, m in enumerate(self.matrices):
            if m.piece is None:
                continue
            g = m.piece.main.grad.reshape(-1)
            m.momentum.lerp_(g, 1 - mu)
            updates[i] = g.lerp(m.momentum, mu) if cfg.muon_nesterov else m.momentum
        if self.sharded:
            ortho = {}
            for d in self.domains:
                ortho.update(self._orthogonalise_sharded(d, {i: updates[i] for i in d.matrices if i in updates}))
        else:
            ortho = {i: orthogonalise(u, self.matrices[i].name, self.matrices[i].shape) for i, u in updates.items()}
        lr = self.current_lr()
        for i, o in ortho.items():
            m = self.matrices[i]
            main = m.piece.main
            main.mul_(1 - lr * cfg.muon_weight_decay)
            main.add_(o.view(main.shape), alpha=-adjusted_lr(lr, matrices_of(m.name, m.shape)[1:],
                                                            cfg.muon_adjust_lr))
        self.steps += 1

    def _orthogonalise_sharded(self, d: MuonDomain, updates: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """ZeRO, over one domain's ranks: an all-to-all brings each owner the bf16 pieces of its matrices, it
        orthogonalises them, a second all-to-all returns each piece's result to the rank holding it (module
        docstring). Returns each local piece's orthogonalised part (bf16, the orthogonalisation's own result: added
        to the fp32 master as one process adds it)."""
        dev = next(iter(self.ddp.param_to_bucket)).device
        sizes_out = [sum(hi - lo for _, lo, hi in peer) for peer in d.send]
        sizes_in = [sum(hi - lo for _, lo, hi in peer) for peer in d.recv]
        send = torch.empty(sum(sizes_out), dtype=torch.bfloat16, device=dev)
        at = 0
        for peer in d.send:
            for i, lo, hi in peer:
                send[at:at + hi - lo].copy_(updates[i])  # the same rounding as NS's own .bfloat16()
                at += hi - lo
        recv = self._all_to_all(d, send, sizes_in, sizes_out)
        full: dict[int, torch.Tensor] = {}
        at = 0
        for peer in d.recv:
            for i, lo, hi in peer:
                m = self.matrices[i]
                dst = full.setdefault(i, torch.empty(m.numel, dtype=torch.bfloat16, device=dev))
                dst[lo:hi].copy_(recv[at:at + hi - lo])
                at += hi - lo
        ortho = {i: orthogonalise(f, self.matrices[i].name, self.matrices[i].shape).reshape(-1)
                 for i, f in full.items()}
        back = torch.cat([ortho[i][lo:hi] for peer in d.recv for i, lo, hi in peer]) if sum(sizes_in) else \
            torch.empty(0, dtype=torch.bfloat16, device=dev)
        mine = self._all_to_all(d, back, sizes_out, sizes_in)
        out, at = {}, 0
        for peer in d.send:
            for i, lo, hi in peer:
                out[i] = mine[at:at + hi - lo]
                at += hi - lo
        return out

    def _all_to_all(self, d: MuonDomain, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int]
                    ) -> torch.Tensor:
        """dist.all_to_all_single over the domain's ranks with uneven splits (in_sizes[r] elements of `inp` go to
        rank r, out_sizes[r] come from it); a copy on one rank. Counts the bytes sent to other ranks."""
        if d.world_size == 1:
            return inp.clone()
        out = torch.empty(sum(out_sizes), dtype=inp.dtype, device=inp.device)
        dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=d.group)
        self.comm_bytes += sum(n for r, n in enumerate(in_sizes) if r != d.rank) * inp.element_size()
        return out

    # ------------------------------------------------------------------ state
    def state_bytes(self) -> int:
        return sum(m.momentum.numel() * 4 for m in self.matrices if m.momentum is not None)

    def momentum_of(self, piece) -> Optional[torch.Tensor]:
        for m in self.matrices:
            if m.piece is piece:
                return m.momentum
        return None

    def piece_state(self, piece, own) -> dict:
        return {"momentum": own(self.momentum_of(piece)), "step": float(self.steps)}

    def begin_load(self) -> None:
        pass

    def load_piece(self, piece, parts: dict, step: float) -> None:
        self.momentum_of(piece).copy_(parts["momentum"])
        self.steps = int(step)

    def end_load(self) -> None:
        pass


class DTensorMuon:
    """Muon over sharded DTensor parameters (FSDP2's row shards; tensor parallelism's column / row splits): the
    momentum is a DTensor laid out like its parameter (DCP re-shards it like AdamW's moments). Each matrix is
    orthogonalised once, on its owner (round-robin over the mesh's ranks in parameter order), from its bf16
    update (lossless, as in the ZeRO path):
    - row shards on a 1-D mesh (FSDP2; tp's column-parallel weights): for all such matrices at once, one
      uneven all-to-all brings each owner the other ranks' rows of its matrices, one returns their rows of
      the result. Bytes a rank sends per step: 2 x (its rows of matrices others own + the rows others hold of
      the matrices it owns), about 2 x 2 x (W-1)/W x P_muon / W;
    - any other layout (tp's row-parallel weights, 2-D meshes), per matrix: `full_tensor()` (an all-gather)
      and a SUM redistribution from Partial to the parameter's placements (the other ranks add exact zeros):
      2 x 2 x numel bytes per matrix (the full side of both collectives).
    `comm_bytes` counts both."""

    def __init__(self, named_params: list, config):
        from torch.distributed.tensor import Shard
        self.config = config
        self.lr = float(config.muon_lr or config.lr)
        self.lr_scale = 1.0
        self.params = [(n, p) for n, p in named_params if is_muon_param(n, tuple(p.shape), config.muon_experts)]
        self.momentum = {n: torch.zeros_like(p.detach(), dtype=torch.float32) for n, p in self.params}
        # decided from the placements alone: the same on every rank (the collectives must match)
        self.row_sharded = [p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) for _, p in self.params]
        self.steps = 0
        self.comm_bytes = 0

    def current_lr(self) -> float:
        return self.lr * self.lr_scale

    @staticmethod
    def rows(p) -> list[int]:
        """The rows each rank of a Shard(0) parameter's 1-D mesh holds (torch.chunk's split, as DTensor's)."""
        n = p.device_mesh.size()
        sizes = [c.shape[0] for c in torch.empty(p.shape[0], 0).chunk(n)]
        return sizes + [0] * (n - len(sizes))

    @staticmethod
    def _mesh_index(mesh) -> int:
        return int((mesh.mesh.flatten() == dist.get_rank()).nonzero()[0])

    def owner(self, i: int, p) -> int:
        return i % p.device_mesh.size()

    @torch.no_grad()
    def step(self) -> None:
        cfg, mu, lr = self.config, self.config.muon_momentum, self.current_lr()
        ortho: dict[int, torch.Tensor] = {}
        by_mesh: dict[int, list] = {}
        for i, (name, p) in enumerate(self.params):
            if p.grad is None:
                continue
            g, buf = p.grad.to_local(), self.momentum[name].to_local()
            buf.lerp_(g, 1 - mu)
            u = (g.lerp(buf, mu) if cfg.muon_nesterov else buf).bfloat16()  # NS's own first rounding
            if self.row_sharded[i]:
                by_mesh.setdefault(id(p.device_mesh), []).append((i, p, u))
            else:
                ortho[i] = self._orthogonalise_any(i, p, u)
        for group in by_mesh.values():
            ortho.update(self._orthogonalise_rows(group))
        for i, o in ortho.items():
            name, p = self.params[i]
            local = p.to_local()
            local.mul_(1 - lr * cfg.muon_weight_decay)
            local.add_(o.view(local.shape), alpha=-adjusted_lr(lr, matrices_of(name, tuple(p.shape))[1:],
                                                             cfg.muon_adjust_lr))
        self.steps += 1

    def _orthogonalise_any(self, i: int, p, u: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial
        mesh = p.device_mesh
        full = DTensor.from_local(u, mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
        o = orthogonalise(full, self.params[i][0], tuple(p.shape)) if self._mesh_index(mesh) == i % mesh.size() \
            else torch.zeros_like(full)
        if mesh.size() > 1:
            self.comm_bytes += 2 * full.numel() * full.element_size()
        return DTensor.from_local(o, mesh, [Partial()] * mesh.ndim).redistribute(mesh, p.placements).to_local()

    def _orthogonalise_rows(self, group: list) -> dict[int, torch.Tensor]:
        """Row-sharded matrices of one 1-D mesh: two uneven all-to-alls (class docstring)."""
        mesh = group[0][1].device_mesh
        W, me, pg = mesh.size(), mesh.get_local_rank(), mesh.get_group()
        rows = {i: self.rows(p) for i, p, _ in group}
        for i, p, u in group:
            if u.shape[0] != rows[i][me]:
                raise RuntimeError(f"{self.params[i][0]}: {u.shape[0]} local rows, torch.chunk's split gives "
                                   f"{rows[i][me]}")
        cols = {i: math.prod(p.shape[1:]) for i, p, _ in group}  # (elements per row: a stack's per expert)
        owned = [(i, p) for i, p, _ in group if self.owner(i, p) == me]
        # what goes to owner o: this rank's rows of o's matrices, in parameter order
        send = [u.reshape(-1) for o in range(W) for i, p, u in group if self.owner(i, p) == o]
        in_sizes = [sum(rows[i][me] * cols[i] for i, p, _ in group if self.owner(i, p) == o) for o in range(W)]
        out_sizes = [sum(rows[i][r] * cols[i] for i, _ in owned) for r in range(W)]
        recv = self._all_to_all(torch.cat(send) if send else group[0][2].new_empty(0), out_sizes, in_sizes, pg, me)
        pieces: dict[int, list] = {i: [] for i, _ in owned}
        at = 0
        for r in range(W):
            for i, _ in owned:
                n = rows[i][r] * cols[i]
                pieces[i].append(recv[at:at + n])
                at += n
        back = []
        results = {i: orthogonalise(torch.cat(pieces[i]), self.params[i][0], tuple(p.shape)) for i, p in owned}
        for r in range(W):
            start = {i: sum(rows[i][:r]) for i, _ in owned}
            back += [results[i][start[i]:start[i] + rows[i][r]].reshape(-1) for i, _ in owned]
        mine = self._all_to_all(torch.cat(back) if back else group[0][2].new_empty(0), in_sizes, out_sizes, pg, me)
        out, at = {}, 0
        for o in range(W):
            for i, p, u in group:
                if self.owner(i, p) == o:
                    out[i] = mine[at:at + u.numel()]
                    at += u.numel()
        return out

    def _all_to_all(self, inp: torch.Tensor, out_sizes: list[int], in_sizes: list[int], pg, me: int) -> torch.Tensor:
        if len(in_sizes) == 1:
            return inp.clone()
        out = torch.empty(sum(out_sizes), dtype=inp.dtype, device=inp.device)
        dist.all_to_all_single(out, inp, out_sizes, in_sizes, group=pg)
        self.comm_bytes += sum(n for r, n in enumerate(in_sizes) if r != me) * inp.element_size()
        return out

    def state_bytes(self) -> int:
        return sum(m.to_local().numel() * 4 for m in self.momentum.values())
