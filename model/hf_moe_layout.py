"""The Hugging Face Hub layout of an MoE model's expert weights, both ways, for the families model/hf_interop.py
writes (model/hf_mixtral.py, model/hf_glm4_moe.py): each family is one `HubLayout` (its names), and `to_hub` /
`from_hub` move tensors between ours and it.

Ours: `layers.N.mlp.router.weight` [E, D], `layers.N.mlp.expert_bias` [E], the stacked
`layers.N.mlp.experts.gate_up_proj` [E, 2I, D] (gate rows, then up) and `...experts.down_proj` [E, D, I].
The Hub's: the router and the bias under the family's block name, and one [I, D] / [D, I] weight per expert and
projection (`experts.E.<gate|up|down>.weight`: what checkpoints on the Hub hold, read by transformers 4.x and 5.x);
transformers 5's own stacked names (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`, gate rows first as ours)
import too. Every other tensor passes through unchanged (the model's strict load names what does not fit).
Must never: import transformers (plain dicts and tensors only), or drop a tensor the layout has a place for.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

_OURS = re.compile(r"layers\.(\d+)\.mlp\.(router\.weight|expert_bias|experts\.(gate_up|down)_proj)$")


@dataclass(frozen=True)
class HubLayout:
    family: str  # in messages: "Mixtral"
    block: str  # the MoE module's name on the Hub: layers.N.<block>
    bias: Optional[str]  # the selection bias's name under the block (None: the family has none; a zero one is left out)
    projections: tuple[str, str, str]  # the per-expert gate, up and down weights' names
    mtp_layers_follow: bool = False  # the checkpoint may hold MTP layers numbered after the model's (model/hf_mtp.py)

    def holds_biases(self) -> bool:
        return self.bias is not None


def softmax_family_problems(cfg, biases: dict[str, torch.Tensor], family: str, norm_switch: bool = False,
                            gated_shared: bool = False) -> list[str]:
    """Why an MoE model of config `cfg` and selection biases `biases` cannot be written as `family`, a family that
    routes on a softmax over every expert and has no shared experts, no routed scaling and no selection bias
    (Mixtral, Qwen3-MoE); `norm_switch`: the family says whether it renormalises its top k weights (Qwen3-MoE's
    norm_topk_prob), else it always does (Mixtral); `gated_shared`: it has one gated shared expert (Qwen2-MoE)."""
    p = []
    if not norm_switch and not cfg.moe_norm_topk and cfg.moe_top_k > 1:
        p.append(f"moe_norm_topk=false ({family} renormalises the chosen weights to sum 1)")
    if cfg.moe_shared_experts and not gated_shared:
        p.append(f"moe_shared_experts={cfg.moe_shared_experts} ({family} has no shared experts; a gated one is "
                 "Qwen2-MoE's: --moe_shared_gate)")
    if cfg.moe_score != "softmax":
        p.append(f"moe_score={cfg.moe_score} ({family} routes on softmax)")
    if cfg.moe_n_groups != 1:
        p.append(f"moe_n_groups={cfg.moe_n_groups} ({family} routes over every expert)")
    if cfg.moe_routed_scaling != 1.0:
        p.append(f"moe_routed_scaling={cfg.moe_routed_scaling} ({family} does not scale the experts' output)")
    if cfg.moe_top_k < 2 and not norm_switch:
        p.append(f"moe_top_k=1 ({family} renormalises the chosen weights to 1; ours keep the raw score)")
    biased = [name for name, t in biases.items() if bool(t.any())]
    if biased:
        p.append(f"non-zero selection biases ({biased[0]}, ...): {family} has none, its routing would differ")
    return p


def group_score_problem(cfg, family: str) -> list[str]:
    """A group ranking the family does not compute: DeepSeek-V3's and GLM-4-MoE's rank a group by its two best."""
    if cfg.moe_n_groups > 1 and getattr(cfg, "moe_group_score", "top2") != "top2":
        return [f"moe_group_score={cfg.moe_group_score} ({family} ranks a group by its two best scores)"]
    return []


def shared_expert_problems(cfg, family: str) -> list[str]:
    """Why the shared experts of `cfg` do not fit a family whose shared experts are n ungated copies of the expert
    width (DeepSeek-V3 / V2, GLM-4-MoE): a gate (Qwen2-MoE's), or a width of their own."""
    p = []
    if getattr(cfg, "moe_shared_gate", False):
        p.append(f"moe_shared_gate ({family}'s shared experts are not gated; Qwen2-MoE's are)")
    own = getattr(cfg, "moe_shared_hidden_dim", None)
    if own and own != cfg.moe_shared_experts * (cfg.moe_hidden_dim or cfg.hidden_dim):
        p.append(f"moe_shared_hidden_dim={own} ({family}'s shared experts are n_shared_experts x the expert width)")
    return p


def norm_topk_problem(d: dict, default: bool) -> list[str]:
    """What a config.json's norm_topk_prob (its family's `default` where absent) holds that ours does not compute: true
    at top 1 (the one weight renormalised to 1; ours keep the raw score there). norm_topk_prob false reads as
    moe_norm_topk false (`norm_topk_of`)."""
    k = int(d.get("num_experts_per_tok", 8))
    if d.get("norm_topk_prob", default) and k == 1:
        return ["norm_topk_prob=True with num_experts_per_tok=1 (the one weight renormalised to 1; ours keep the raw "
                "score at k = 1)"]
    return []


def norm_topk_of(d: dict, default: bool) -> bool:
    """Our moe_norm_topk of a config.json dict (its family's norm_topk_prob `default` where absent); at top 1 the
    default True (no renormalisation there either way)."""
    return bool(d.get("norm_topk_prob", default)) or int(d.get("num_experts_per_tok", 8)) == 1


def norm_topk(cfg) -> bool:
    """The norm_topk_prob a config.json gets for `cfg`: whether the chosen weights are renormalised (never at k = 1,
    where ours keep the raw score)."""
    return bool(cfg.moe_norm_topk) and cfg.moe_top_k > 1


def to_hub(sd: dict[str, torch.Tensor], layout: HubLayout) -> dict[str, torch.Tensor]:
    """Our state dict (names without `model.`) -> the layout's Hub names (without `model.`); other tensors kept.
    Each tensor maps on its own, so a streaming export converts any group of them."""
    out = {}
    gate_name, up_name, down_name = layout.projections
    for name, t in sd.items():
        m = _OURS.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, what, proj = f"layers.{m.group(1)}.{layout.block}", m.group(2), m.group(3)
        if what == "router.weight":
            out[f"{prefix}.gate.weight"] = t
        elif what == "expert_bias":
            if layout.bias is not None:
                out[f"{prefix}.{layout.bias}"] = t
        elif proj == "gate_up":
            for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                out[f"{prefix}.experts.{e}.{gate_name}.weight"] = gate
                out[f"{prefix}.experts.{e}.{up_name}.weight"] = up
        else:
            for e in range(t.shape[0]):
                out[f"{prefix}.experts.{e}.{down_name}.weight"] = t[e]
    return out


def from_hub(sd: dict[str, torch.Tensor], cfg, layout: HubLayout) -> dict[str, torch.Tensor]:
    """The layout's Hub names, or transformers 5's stacked ones (without `model.`) -> ours; a layer with experts but
    no bias in the checkpoint gets zero selection biases. ValueError naming a layer whose experts are incomplete."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    per_expert = re.compile(r"experts\.(\d+)\.(" + "|".join(map(re.escape, layout.projections)) + r")\.weight$")
    blocks = "|".join(sorted({re.escape(layout.block), "mlp"}))
    for name, t in sd.items():
        layer = re.match(r"layers\.(\d+)\.", name)
        if layout.mtp_layers_follow and layer is not None and \
                int(layer.group(1)) >= cfg.n_layers + getattr(cfg, "mtp_num_layers", 0):
            continue  # (transformers leaves them out too; the depths asked for are model/hf_mtp.py's)
        m = re.match(rf"layers\.(\d+)\.(?:{blocks})\.(.+)$", name)
        rest = m.group(2) if m is not None else ""
        e = per_expert.match(rest)
        ours = f"layers.{m.group(1)}.mlp" if m is not None else ""
        if rest == "gate.weight":
            out[f"{ours}.router.weight"] = t
        elif layout.bias is not None and rest == layout.bias:
            out[f"{ours}.expert_bias"] = t
        elif rest in ("experts.gate_up_proj", "experts.down_proj"):  # transformers 5: stacked, gate rows first
            out[f"{ours}.{rest}"] = t
        elif e is not None:
            experts.setdefault((int(m.group(1)), e.group(2)), {})[int(e.group(1))] = t
        else:
            out[name] = t
    gate_name, up_name, down_name = layout.projections
    for layer in sorted({layer for layer, _ in experts}):
        stacked = {}
        for proj in layout.projections:
            by_expert = experts.get((layer, proj), {})
            if sorted(by_expert) != list(range(cfg.moe_num_experts)):
                raise ValueError(f"layer {layer}: experts {sorted(by_expert)} of {proj} in the {layout.family} "
                                 f"checkpoint, expected 0..{cfg.moe_num_experts - 1}")
            stacked[proj] = torch.stack([by_expert[i] for i in range(cfg.moe_num_experts)])
        out[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat((stacked[gate_name], stacked[up_name]), 1)
        out[f"layers.{layer}.mlp.experts.down_proj"] = stacked[down_name]
    for name in [n for n in out if n.endswith(".mlp.router.weight")]:
        out.setdefault(name[:-len("router.weight")] + "expert_bias", torch.zeros(cfg.moe_num_experts))
    return {k: v.contiguous() for k, v in out.items()}
