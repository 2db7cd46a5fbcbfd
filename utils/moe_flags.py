"""The mixture-of-experts flags of the trainer (`MoEFlags`, mixed into trainer/config.py's TrainConfig) and their
checks: `moe_shape_problems` (the model's MoE shape, as ModelConfig refuses it) and `moe_problems` (every MoE
flag, one phrase each for the trainer's exit-2 line).

Must never: import torch or any package above utils/ (the torch-free pre-check reads it; model/config.py too).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from utils.configurator import flag

MOE_SCORES = ("softmax", "sigmoid")
MOE_AUX_LOSS_TYPES = ("batch", "sequence")
MOE_DROP_POLICIES = ("probs", "position")  # model/moe.py dispatch_capacity's
MOE_ACTS = ("silu", "gpt_oss")  # model/moe_experts.py ExpertAct's
MAX_EXPERTS = 4096


@dataclass
class MoEFlags:
    """Mixture of experts (model/moe.py; docs/model.md "Mixture of experts")."""
    moe_num_experts: int = flag(0, "routed experts per MoE block (0 = a dense model)")
    moe_top_k: int = flag(2, "experts each token is routed to (their weights renormalised to sum 1 when > 1)")
    moe_shared_experts: int = flag(0, "always-on shared experts per MoE block (DeepSeek), merged into one SwiGLU")
    moe_shared_hidden_dim: int = flag(0, "the shared experts' SwiGLU width (Qwen2-MoE's "
                                      "shared_expert_intermediate_size; 0 = --moe_shared_experts x the expert width)")
    moe_shared_gate: bool = flag(False, "the shared experts' output times a per-token sigmoid gate (Qwen2-MoE's "
                                 "shared_expert_gate)")
    moe_hidden_dim: int = flag(0, "expert width (SwiGLU hidden size of one expert; 0 = --hidden_dim's)")
    moe_first_dense_layers: int = flag(0, "the first k blocks keep a dense MLP (DeepSeek's first_k_dense_replace)")
    moe_score: str = flag("softmax", "router scores: softmax (Mixtral, Qwen-MoE) | sigmoid (DeepSeek-V3)")
    moe_n_groups: int = flag(1, "group-limited routing (DeepSeek-V3's n_group; 1 = off): the experts in this many "
                             "equal groups, each token's top-k chosen only from its best --moe_topk_groups of them "
                             "(a group ranked by its 2 best scores; under expert parallelism: fewer ranks per token)")
    moe_topk_groups: int = flag(1, "with --moe_n_groups > 1: the groups a token's experts come from (topk_group)")
    moe_group_score: str = flag("top2", "with --moe_n_groups > 1: a group ranked by the sum of its 2 best scores "
                                "(top2: DeepSeek-V3's) or by its best (max: DeepSeek-V2's group_limited_greedy)")
    moe_routed_scaling: float = flag(1.0, "the routed experts' combined output times this (DeepSeek-V3's "
                                     "routed_scaling_factor, 2.5 there); the shared experts' is not scaled")
    moe_norm_topk_prob: bool = flag(True, "with --moe_top_k > 1: the chosen experts' weights renormalised to sum 1 "
                                    "(Mixtral, Qwen3-MoE, DeepSeek-V3); false: their raw scores (transformers' "
                                    "norm_topk_prob: Qwen1.5 / Qwen2-MoE's, DeepSeek-V2's)")
    moe_capacity_factor: float = flag(0.0, "training: each expert takes at most ceil(factor x tokens x top_k / "
                                      "experts) rows per forward, padded to exactly that (static shapes; GShard, "
                                      "Switch, Megatron's moe_expert_capacity_factor with "
                                      "moe_pad_expert_input_to_capacity); the pairs past it are dropped (the "
                                      "residual carries the token); 0 = dropless. Evaluation and generation route "
                                      "dropless")
    moe_token_drop_policy: str = flag("probs", "past capacity: probs (drop the pairs of smallest routing weight) | "
                                      "position (drop the latest tokens)")
    moe_aux_loss_coef: float = flag(0.0, "weight of the load-balancing loss (Switch: E/(kN) sum count_i P_i, 1 when "
                                    "balanced) added to the loss; e.g. 0.01")
    moe_aux_loss_type: str = flag("batch", "batch (the load-balancing loss over each forward's tokens: Switch, "
                                  "Megatron's aux_loss) | sequence (per sequence, averaged: DeepSeek-V3's "
                                  "complementary sequence-wise loss, Megatron's seq_aux_loss; e.g. with "
                                  "--moe_aux_loss_coef=0.0001 beside --moe_bias_update_rate)")
    moe_bias_update_rate: float = flag(0.0, "auxiliary-loss-free balancing (DeepSeek-V3): after each optimizer "
                                       "step every expert's selection bias moves by this towards balance; e.g. "
                                       "0.001 (0 = off)")
    moe_z_loss_coef: float = flag(0.0, "weight of the router z-loss (ST-MoE: mean logsumexp(logits)^2); e.g. 0.001")
    moe_router_bias: bool = flag(False, "a learned bias in the router's logits (gpt-oss's)")
    moe_expert_biases: bool = flag(False, "biases on each expert's gate / up and down projections (gpt-oss's)")
    moe_act: str = flag("silu", "the experts' activation: silu (SwiGLU) | gpt_oss (gpt-oss's clamped SwiGLU: "
                        "min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1))")
    moe_swiglu_limit: float = flag(7.0, "with --moe_act=gpt_oss: the clamp (gpt-oss's swiglu_limit)")
    moe_swiglu_alpha: float = flag(1.702, "with --moe_act=gpt_oss: the sigmoid's slope (gpt-oss's swiglu_alpha)")


def moe_shape_problems(num_experts: int, top_k: int, shared: int, hidden: int, first_dense: int,
                       score: str, prefix: str = "moe_", *, n_groups: int = 1, topk_groups: int = 1,
                       routed_scaling: float = 1.0, capacity_factor: float = 0.0,
                       drop_policy: str = "probs") -> list[str]:
    """Why an MoE shape cannot be built (num_experts > 0), one phrase per problem."""
    p = []
    if n_groups < 1 or num_experts % max(1, n_groups):
        p.append(f"{prefix}n_groups={n_groups}: must be >= 1 and divide {prefix}num_experts={num_experts}")
    elif n_groups > 1:
        per = num_experts // n_groups
        if per < 2:
            p.append(f"{prefix}n_groups={n_groups}: leaves {per} expert per group (a group is ranked by its 2 best "
                     "scores)")
        if not 1 <= topk_groups <= n_groups:
            p.append(f"{prefix}topk_groups={topk_groups}: must be in [1, {prefix}n_groups={n_groups}]")
        elif top_k > topk_groups * per:
            p.append(f"{prefix}top_k={top_k}: more than the {topk_groups} x {per} experts of "
                     f"{prefix}topk_groups={topk_groups} groups")
    if not (math.isfinite(capacity_factor) and capacity_factor >= 0):
        p.append(f"{prefix}capacity_factor={capacity_factor}: must be a finite number >= 0 (0 = dropless)")
    if drop_policy not in MOE_DROP_POLICIES:
        p.append(f"{prefix}token_drop_policy={drop_policy!r} ({' | '.join(MOE_DROP_POLICIES)})")
    if not (math.isfinite(routed_scaling) and routed_scaling > 0):
        p.append(f"{prefix}routed_scaling={routed_scaling}: must be a finite number > 0")
    if not 1 <= num_experts <= MAX_EXPERTS:
        p.append(f"{prefix}num_experts={num_experts}: must be in [0, {MAX_EXPERTS}]")
    if not 1 <= top_k <= max(1, num_experts):
        p.append(f"{prefix}top_k={top_k}: must be in [1, {prefix}num_experts={num_experts}]")
    for name, v in (("shared_experts", shared), ("hidden_dim", hidden), ("first_dense_layers", first_dense)):
        if v < 0:
            p.append(f"{prefix}{name}={v}: must be >= 0")
    if score not in MOE_SCORES:
        p.append(f"{prefix}score={score!r} ({' | '.join(MOE_SCORES)})")
    return p


def moe_problems(cfg: Any) -> list[str]:
    """Every MoE flag of a TrainConfig that a run cannot use, as '--flag=value: why' phrases."""
    p = []
    if cfg.moe_num_experts < 0:
        p.append(f"--moe_num_experts={cfg.moe_num_experts}: must be >= 0 (0 = dense)")
    elif cfg.moe_num_experts > 0:
        p.extend(moe_shape_problems(cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_shared_experts, cfg.moe_hidden_dim,
                                    cfg.moe_first_dense_layers, cfg.moe_score, prefix="--moe_",
                                    n_groups=cfg.moe_n_groups, topk_groups=cfg.moe_topk_groups,
                                    routed_scaling=cfg.moe_routed_scaling,
                                    capacity_factor=cfg.moe_capacity_factor, drop_policy=cfg.moe_token_drop_policy))
        if (cfg.moe_shared_hidden_dim or cfg.moe_shared_gate) and cfg.moe_shared_experts < 1:
            p.append(f"--moe_shared_hidden_dim={cfg.moe_shared_hidden_dim} / --moe_shared_gate={cfg.moe_shared_gate} "
                     "describe the shared experts: they need --moe_shared_experts >= 1")
        if cfg.moe_group_score not in ("top2", "max"):
            p.append(f"--moe_group_score={cfg.moe_group_score!r} (top2 | max)")
        if cfg.moe_act not in MOE_ACTS:
            p.append(f"--moe_act={cfg.moe_act!r} ({' | '.join(MOE_ACTS)})")
        gpt_oss = cfg.moe_router_bias or cfg.moe_expert_biases or cfg.moe_act != "silu"
        if gpt_oss and cfg.moe_shared_experts:
            p.append("--moe_router_bias / --moe_expert_biases / --moe_act=gpt_oss are gpt-oss's experts: not with "
                     f"--moe_shared_experts={cfg.moe_shared_experts}")
        for name in ("moe_swiglu_limit", "moe_swiglu_alpha"):
            if not (math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0):
                p.append(f"--{name}={getattr(cfg, name)}: must be a finite number > 0")
        if cfg.moe_shared_hidden_dim < 0:
            p.append(f"--moe_shared_hidden_dim={cfg.moe_shared_hidden_dim}: must be >= 0")
        if cfg.moe_first_dense_layers >= cfg.n_layers:
            p.append(f"--moe_first_dense_layers={cfg.moe_first_dense_layers}: leaves no MoE block of "
                     f"--n_layers={cfg.n_layers}")
    if cfg.moe_bias_update_rate and getattr(cfg, "lora_rank", 0) > 0:
        p.append(f"--moe_bias_update_rate={cfg.moe_bias_update_rate} cannot be combined with --lora_rank="
                 f"{cfg.lora_rank}: the selection biases belong to the frozen base, which LoRA checkpoints leave out")
    if cfg.moe_aux_loss_type not in MOE_AUX_LOSS_TYPES:
        p.append(f"--moe_aux_loss_type={cfg.moe_aux_loss_type!r} ({' | '.join(MOE_AUX_LOSS_TYPES)})")
    for name in ("moe_aux_loss_coef", "moe_bias_update_rate", "moe_z_loss_coef"):
        v = getattr(cfg, name)
        if not (math.isfinite(v) and v >= 0):
            p.append(f"--{name}={v}: must be a finite number >= 0")
    return p


def moe_model_fields(cfg: Any) -> dict:
    """The ModelConfig fields of a new model from the trainer's MoE flags."""
    return {"moe_num_experts": cfg.moe_num_experts, "moe_top_k": cfg.moe_top_k,
            "moe_shared_experts": cfg.moe_shared_experts, "moe_hidden_dim": cfg.moe_hidden_dim or None,
            "moe_first_dense_layers": cfg.moe_first_dense_layers, "moe_score": cfg.moe_score,
            "moe_n_groups": cfg.moe_n_groups, "moe_topk_groups": cfg.moe_topk_groups,
            "moe_routed_scaling": cfg.moe_routed_scaling, "moe_capacity_factor": cfg.moe_capacity_factor,
            "moe_token_drop_policy": cfg.moe_token_drop_policy, "moe_norm_topk": cfg.moe_norm_topk_prob,
            "moe_shared_hidden_dim": cfg.moe_shared_hidden_dim or None, "moe_shared_gate": cfg.moe_shared_gate,
            "moe_group_score": cfg.moe_group_score, "moe_router_bias": cfg.moe_router_bias,
            "moe_expert_biases": cfg.moe_expert_biases, "moe_act": cfg.moe_act,
            "moe_swiglu_limit": cfg.moe_swiglu_limit, "moe_swiglu_alpha": cfg.moe_swiglu_alpha}


def moe_param_delta(mcfg: Any) -> int:
    """Parameters an MoE ModelConfig (hidden_dim resolved) has beyond its dense twin: per MoE block the router, E
    experts of 3 x dim x width and the shared experts' SwiGLU (`moe_shared_width`, and its gate) in place of the dense
    SwiGLU (the memory check counts every expert)."""
    e = getattr(mcfg, "moe_num_experts", 0)
    if not e:
        return 0
    width = mcfg.moe_hidden_dim or mcfg.hidden_dim
    blocks = max(0, mcfg.n_layers + getattr(mcfg, "mtp_num_layers", 0) - mcfg.moe_first_dense_layers)  # + MTP's
    per_block = (e * mcfg.dim + e * 3 * mcfg.dim * width + 3 * mcfg.dim * mcfg.moe_shared_width
                 + (e if getattr(mcfg, "moe_router_bias", False) else 0)  # (gpt-oss's biases)
                 + (e * (2 * width + mcfg.dim) if getattr(mcfg, "moe_expert_biases", False) else 0)
                 + (mcfg.dim if getattr(mcfg, "moe_shared_gate", False) else 0) - 3 * mcfg.dim * mcfg.hidden_dim)
    return blocks * per_block
