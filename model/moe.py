"""Mixture-of-experts feed-forward: a router, routed experts (stacked SwiGLU weights [E, ...]), optional shared
experts, dropless token routing, and the statistics that balance the experts' load.

One MoE forward is four steps, each its own function so that expert parallelism can put an all-to-all between
them (tokens to the ranks holding their experts after `dispatch`, back before `combine`):
  route    scores [N, E] (softmax or sigmoid of the router's logits, fp32), the top-k experts of each token
           (chosen on scores + `expert_bias`: DeepSeek-V3's auxiliary-loss-free balancing, the bias steers the
           choice only) and their weights (the scores of the chosen experts; renormalised to sum 1 when k > 1)
  dispatch the N*k (token, expert) pairs sorted by expert (stable): the token rows in that order and the count
           per expert; dropless (no capacity, every pair computed) by default. With a capacity factor
           (`dispatch_capacity`, training forwards only) each expert takes at most C = ceil(factor N k / E) rows,
           padded to exactly C (static shapes: E x C rows whatever the routing), the pairs past C dropped by
           routing weight or by position (GShard, Switch; Megatron's moe_expert_capacity_factor with
           moe_pad_expert_input_to_capacity): a dropped pair adds nothing to its token (the residual carries it)
  experts  the SwiGLU of each expert on its rows (model/moe_experts.py): the grouped matmul (torch._grouped_mm /
           F.grouped_mm; gate and up in one), the fused loop (the loop's matmuls with the backward written out: no
           cat or stack, less saved for backward), or the reference loop
  combine  every row back to its (token, slot), weighted, summed over the k slots

Balancing: the auxiliary loss (Switch/Megatron form, E/(k N) sum_i count_i P_i, 1 when perfectly balanced;
HF Mixtral's load_balancing_loss_func is k times it), the router z-loss (ST-MoE: mean of logsumexp(logits)^2),
and the bias update (`update_expert_bias`: b_i += rate * sign(mean load - load_i) after each optimizer step).
Under context or tensor parallelism (`sequence_group`) the losses are the whole sequences', each rank computing its
own tokens' part of them from the loads summed over the group (`balancing_losses`): the parts sum to what one
process computes on the whole sequence. Under tensor parallelism each tensor rank runs the layer on its share of
the tokens (`token_split_group`: the replicated rows split over the ranks on the way in and all-gathered on the way
out; under sequence parallelism they arrive split) with the layer's weights whole on every tensor rank: the same
FLOPs per rank as splitting every expert's width, and no partial sums to all-reduce. The layer keeps what the
trainer reads between steps (`take_aux_losses`, `take_counts`): the losses and number of forwards since the last
take (training forwards with grad only; never an activation-checkpointing recompute) and the tokens per expert.

Must never: read a tensor's value to the host on the grouped path (the loop reference does, by design), drop a
token without a capacity factor, or let the selection bias weigh an expert's output.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

from model.moe_experts import ExpertAct, GroupedExperts, SharedExperts
from utils.moe_flags import MOE_DROP_POLICIES

# ------------------------------------------------------------------------------------------ routing
def route(x: torch.Tensor, router_weight: torch.Tensor, bias: Optional[torch.Tensor], top_k: int,
          score: str, n_groups: int = 1, topk_groups: int = 1, scaling: float = 1.0,
          normalize: bool = True, group_score: str = "top2",
          router_bias: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, D] -> (expert ids [N, k], their weights [N, k], scores [N, E], logits [N, E]; fp32, or fp64 for fp64 x).
    The bias (or None) is added to the scores for the choice only; the weights are the unbiased scores.
    n_groups > 1 (DeepSeek-V3's group-limited routing): the E experts are n_groups consecutive groups, each ranked
    for a token by the sum of its 2 best choice scores (`group_score` "top2"; "max": by its best one, DeepSeek-V2's
    group_limited_greedy); the token's experts come from its best topk_groups groups
    only (the others' scores masked to -inf for the choice). `scaling`: the weights times it
    (routed_scaling_factor), after the renormalisation; `normalize` False: no renormalisation (the chosen raw scores:
    norm_topk_prob false, Qwen1.5 / Qwen2-MoE's and DeepSeek-V2's). `router_bias`: the router's own bias in the
    logits (gpt-oss's; softmax over every expert then renormalised over the top k is its softmax over the top k's
    logits)."""
    dtype = torch.promote_types(x.dtype, torch.float32)  # fp32 at least: a bf16 router picks by ties
    logits = F.linear(x.to(dtype), router_weight.to(dtype), None if router_bias is None else router_bias.to(dtype))
    scores = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    choice = scores if bias is None else scores + bias.detach().to(dtype)
    if n_groups > 1:
        grouped = choice.detach().unflatten(-1, (n_groups, -1))  # [N, G, E/G]
        rank = grouped.amax(dim=-1) if group_score == "max" else grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
        best = rank.topk(topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(rank, dtype=torch.bool).scatter_(-1, best, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    idx = torch.topk(choice, top_k, dim=-1, sorted=True).indices
    weights = scores.gather(-1, idx)
    if top_k > 1 and normalize:  # Mixtral / Qwen-MoE norm_topk_prob / DeepSeek-V3; at k=1 (Switch) the raw score
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return idx, weights, scores, logits


def dispatch(x: torch.Tensor, idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert: (rows [N*k, D], counts per expert [E] int64, order [N*k]: the
    flat (token * k + slot) index of each row). Expert parallelism sends rows and counts to the experts' ranks."""
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return x.index_select(0, order // idx.shape[1]), counts, order  # (its backward: one index_add)


def expert_capacity(n_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """The rows each expert takes per forward at capacity `factor`: ceil(factor x N k / E), at least 1 (from shapes:
    no device read)."""
    return max(1, math.ceil(factor * n_tokens * top_k / num_experts))


def dispatch_capacity(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int,
                      policy: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs laid out in E x `capacity` rows: (rows [E*C, D], expert e's in rows e*C .. e*C + C - 1, the unused
    ones zero; counts [E], C each; slot [N*k]: each (token * k + slot) pair's row, E*C where it was dropped; the
    counts as routed [E], before the drop). An
    expert chosen by more than C pairs keeps the C of largest routing weight (policy "probs", ties by position) or
    the first C in token order ("position"). No host read: every shape comes from N, k, E and C."""
    n, k = idx.shape
    flat = idx.reshape(-1)
    if policy == "probs":
        by_weight = torch.argsort(weights.detach().reshape(-1), descending=True, stable=True)
        order = by_weight[torch.argsort(flat[by_weight], stable=True)]
    elif policy == "position":
        order = torch.argsort(flat, stable=True)
    else:
        raise ValueError(f"token drop policy must be one of {MOE_DROP_POLICIES}, got {policy!r}")
    counts = torch.bincount(flat, minlength=num_experts)
    expert = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]
    full = num_experts * capacity
    slot = torch.empty_like(flat)
    slot[order] = torch.where(rank < capacity, expert * capacity + rank, full)
    # which pair fills each row (n * k: none, the zero row); the dropped pairs all land on the discarded entry `full`
    src = torch.full((full + 1,), n * k, dtype=torch.long, device=flat.device)
    src.scatter_(0, slot, torch.arange(n * k, device=flat.device))
    token = torch.where(src[:full] < n * k, src[:full] // k, n)
    rows = torch.cat([x, x.new_zeros(1, x.shape[-1])]).index_select(0, token)
    return rows, torch.full_like(counts, capacity), slot, counts


def combine_capacity(rows: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`dispatch_capacity`'s expert output rows [E*C, D] back to [N, D]: each token's kept rows times their weights,
    summed; a dropped pair reads a zero row (no value, no gradient to its weight)."""
    n, k = weights.shape
    padded = torch.cat([rows, rows.new_zeros(1, rows.shape[-1])])
    per_slot = padded.index_select(0, slot).view(n, k, rows.shape[-1])
    return (per_slot * weights.to(rows.dtype).unsqueeze(-1)).sum(dim=1)


def combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The experts' output rows [N*k, D] (in dispatch order) back to [N, D]: each token's k rows times their
    weights, summed."""
    n, k = weights.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    per_slot = rows.index_select(0, inverse).view(n, k, rows.shape[-1])
    return (per_slot * weights.to(rows.dtype).unsqueeze(-1)).sum(dim=1)


# ---------------------------------------------------------------------------------------- the layer
def load_balancing_loss(scores: torch.Tensor, counts: torch.Tensor, top_k: int, score: str) -> torch.Tensor:
    """Switch / Megatron: E / (k N) * sum_i count_i * P_i, P_i the mean routing probability of expert i (sigmoid
    scores normalised per token first, as DeepSeek-V3); 1 when the load is uniform. Counts carry no gradient."""
    n, e = scores.shape
    probs = scores if score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    return (counts.to(probs.dtype) * probs.mean(dim=0)).sum() * (e / (top_k * n))


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE: mean over tokens of logsumexp(logits)^2."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def sequence_balancing_loss(scores: torch.Tensor, idx: torch.Tensor, seq: torch.Tensor, n_seqs: int, top_k: int,
                            score: str, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's complementary sequence-wise balance loss (Megatron's seq_aux_loss): the Switch loss of each
    sequence's own tokens, E / (k T_b) sum_i count_bi P_bi, averaged over the n_seqs sequences; seq [N]: each
    token's sequence, idx [N, k] its experts. Returns (the loss, or with `group` this rank's part of it: the loads
    and token counts per sequence summed over the group, the probabilities this rank's; the tokens of all the
    sequences)."""
    n, e = scores.shape
    probs = scores if score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    ones = probs.new_ones(idx.numel())
    loads = probs.new_zeros(n_seqs * e).index_add_(0, seq.repeat_interleave(idx.shape[1]) * e + idx.reshape(-1),
                                                   ones)
    tokens = probs.new_zeros(n_seqs).index_add_(0, seq, ones[:n])
    if group is not None:
        both = funcol.all_reduce(torch.cat([loads, tokens]), "sum", group)
        loads, tokens = both[:n_seqs * e], both[n_seqs * e:]
    per_seq = probs.new_zeros(n_seqs, e).index_add_(0, seq, probs)  # (with its gradient)
    each = (loads.view(n_seqs, e) * per_seq).sum(dim=-1) * e / (top_k * tokens.clamp(min=1) ** 2)
    return each.sum() / n_seqs, tokens.sum()


def balancing_losses(scores: torch.Tensor, counts: torch.Tensor, logits: torch.Tensor, top_k: int, score: str,
                     group: Any = None, sequences: Optional[tuple] = None) -> torch.Tensor:
    """[3]: the balancing loss, the z-loss and 1 (a forward) of these N tokens. With `group` (context parallel:
    the ranks whose tokens together are the sequences) this rank's parts of the whole sequences' values, which
    sum over the group to them: the loads and token count are summed over the group first (no gradient), the
    balancing loss is E / (k N^2) sum_i load_i * (sum over this rank's tokens of p_i), the z-loss and the forward
    this rank's tokens' share. `sequences` (idx [N, k], each token's sequence [N], their number): the balancing
    loss is the sequence-wise one (`sequence_balancing_loss`)."""
    if sequences is not None:
        balance, n_all = sequence_balancing_loss(scores, *sequences, top_k, score, group)
        z = torch.logsumexp(logits, dim=-1).square().sum() / n_all
        return torch.stack([balance, z, scores.new_full((), float(scores.shape[0])) / n_all])
    if group is None:
        return torch.stack([load_balancing_loss(scores, counts, top_k, score), router_z_loss(logits),
                            scores.new_ones(())])
    n, e = scores.shape
    total = torch.cat([counts.detach().to(scores.dtype), scores.new_full((1,), float(n))])
    total = funcol.all_reduce(total, "sum", group)
    loads, n_all = total[:e], total[e]
    probs = scores if score == "softmax" else scores / scores.sum(dim=-1, keepdim=True)
    balance = (loads * probs.sum(dim=0)).sum() * e / (top_k * n_all * n_all)
    z = torch.logsumexp(logits, dim=-1).square().sum() / n_all
    return torch.stack([balance, z, n / n_all])


def in_backward() -> bool:
    """Whether this forward is activation checkpointing's recompute inside a backward (its statistics were
    taken when the forward first ran)."""
    return torch._C._current_graph_task_id() != -1


class MoEFeedForward(nn.Module):
    """The MoE replacement of a block's MLP. Parameters: `router.weight` [E, D], `experts.gate_up_proj` [E, 2I, D],
    `experts.down_proj` [E, D, I], `shared_experts.*` (when any); buffer `expert_bias` [E] fp32 (saved: a resume
    keeps the balance)."""

    def __init__(self, cfg):
        super().__init__()
        self.num_experts, self.top_k, self.score = cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_score
        self.n_groups, self.topk_groups = cfg.moe_n_groups, cfg.moe_topk_groups
        self.routed_scaling, self.norm_topk, self.group_score = cfg.moe_routed_scaling, cfg.moe_norm_topk, \
            cfg.moe_group_score
        # training forwards only: evaluation and generation route dropless (as an exported Mixtral does)
        self.capacity_factor, self.drop_policy = cfg.moe_capacity_factor, cfg.moe_token_drop_policy
        hidden = cfg.moe_hidden_dim or cfg.hidden_dim
        self.router = nn.Linear(cfg.dim, self.num_experts, bias=cfg.moe_router_bias)
        self.experts = GroupedExperts(self.num_experts, cfg.dim, hidden, cfg.moe_expert_biases,
                                      ExpertAct(cfg.moe_act, cfg.moe_swiglu_limit, cfg.moe_swiglu_alpha))
        self.shared_experts = SharedExperts(cfg.dim, cfg.moe_shared_width, cfg.fused_swiglu,
                                            cfg.kernel_backend) if cfg.moe_shared_experts else None
        # Qwen2-MoE: the shared experts' output gated per token by sigmoid(x . g)
        self.shared_gate = nn.Linear(cfg.dim, 1, bias=False) if cfg.moe_shared_gate else None
        self.resid_dropout = nn.Dropout(cfg.resid_dropout)
        self.register_buffer("expert_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        # the group whose ranks' tokens together are the sequences (context parallelism's, or the tensor-parallel
        # one: parallel/transforms/): the balancing losses are the whole sequences', each rank holding its tokens'
        # part of them
        self.sequence_group: Any = None
        # tensor parallelism without sequence parallelism (parallel/transforms/tensor_parallel.py): the rows arrive
        # alike on these ranks; each runs the layer on its share of them, all-gathered on the way out
        self.token_split_group: Any = None
        # the balancing loss per sequence (DeepSeek-V3's sequence-wise loss), set by the trainer (trainer/moe.py
        # from --moe_aux_loss_type); a plain attribute: training behaviour, not the model's shape
        self.aux_per_sequence = False
        # [3]: balancing loss, z-loss and the number of forwards, summed over the forwards since the last take
        self._aux: Optional[torch.Tensor] = None
        self._step_counts: Optional[torch.Tensor] = None  # [E] fp32 tokens per expert since the last take
        self._step_dropped: Optional[torch.Tensor] = None  # pairs dropped at capacity since the last take

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n_seqs = shape[0] if x.ndim == 3 else 1
        seq = torch.arange(flat.shape[0], device=x.device) // max(1, flat.shape[0] // n_seqs) \
            if self.aux_per_sequence and self.training else None
        if self.token_split_group is not None:
            # imported here: its torch.compiler.disable imports torch._dynamo (~2 s), which sample.py and
            # export_hf.py should not pay for; a tensor-parallel run loaded it when its transform ran
            from model.token_shares import gather_shares, share_of, take_share
            flat = take_share(flat, self.token_split_group)
            seq = None if seq is None else share_of(seq, self.token_split_group)
        idx, weights, scores, logits = route(flat, self.router.weight, self.expert_bias, self.top_k, self.score,
                                             self.n_groups, self.topk_groups, self.routed_scaling, self.norm_topk,
                                             self.group_score, self.router.bias)
        dropped = None
        if self.capacity_factor > 0 and self.training:
            cap = expert_capacity(flat.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            rows, padded, slot, counts = dispatch_capacity(flat, idx, weights, self.num_experts, cap,
                                                           self.drop_policy)  # counts as routed: loads, balancing
            out = combine_capacity(self.experts(rows, padded), slot, weights)
            dropped = (slot == self.num_experts * cap).sum()
        else:
            rows, counts, order = dispatch(flat, idx, self.num_experts)
            out = combine(self.experts(rows, counts), order, weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(flat)
            out = out + (shared if self.shared_gate is None else torch.sigmoid(self.shared_gate(flat)) * shared)
        if self.token_split_group is not None:
            out = gather_shares(out, self.token_split_group, shape[:-1].numel())
        if self.training and torch.is_grad_enabled():
            # computed in the recompute too (activation checkpointing wants the same saved tensors), kept once;
            # (balancing loss, z-loss, forwards): under context parallelism this rank's parts of them
            aux = balancing_losses(scores, counts, logits, self.top_k, self.score, self.sequence_group,
                                   None if seq is None else (idx, seq, n_seqs))
        if self.training and torch.is_grad_enabled() and not in_backward():
            self._aux = aux if self._aux is None else self._aux + aux
            c = counts.detach().float()
            self._step_counts = c if self._step_counts is None else self._step_counts + c
            if dropped is not None:
                d = dropped.float()
                self._step_dropped = d if self._step_dropped is None else self._step_dropped + d
        return self.resid_dropout(out.view(shape))

    def take_aux(self) -> Optional[torch.Tensor]:
        aux, self._aux = self._aux, None
        return aux

    def take_counts(self) -> torch.Tensor:
        c, self._step_counts = self._step_counts, None
        return c if c is not None else torch.zeros(self.num_experts, device=self.expert_bias.device)

    def take_dropped(self) -> torch.Tensor:
        """The (token, expert) pairs dropped at capacity since the last take (0 without a capacity factor)."""
        d, self._step_dropped = self._step_dropped, None
        return d if d is not None else torch.zeros((), device=self.expert_bias.device)


# ------------------------------------------------------------------------------- the trainer's side
def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE layers of a model (through any wrapper: DDP, FSDP2, a compiled module), in module order."""
    return [m for m in model.modules() if isinstance(m, MoEFeedForward)]


def take_aux_losses(layers: Iterable[MoEFeedForward]) -> Optional[torch.Tensor]:
    """[L, 3]: each layer's (balancing loss, z-loss, forwards) summed over its training forwards since the last take
    (None when there were none). Taking clears them."""
    taken = [layer.take_aux() for layer in layers]
    taken = [t for t in taken if t is not None]
    return torch.stack(taken) if taken else None


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's bias moves by `rate` towards balance,
    b_i += rate * sign(mean_j c_j - c_i) (an overloaded expert is chosen less, an idle one more)."""
    bias.add_(torch.sign(counts.mean() - counts) * rate)

