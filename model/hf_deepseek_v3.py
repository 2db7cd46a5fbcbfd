"""Hugging Face DeepSeek-V3 (`DeepseekV3ForCausalLM`) and DeepSeek-V2 (`DeepseekV2ForCausalLM`) checkpoints of our
models with multi-head latent attention, both ways (model/hf_interop.py calls these for a config with
kv_lora_rank > 0 or a checkpoint with model_type "deepseek_v3" / "deepseek_v2"): a sigmoid router's model (or a
dense one) is a DeepSeek-V3, a softmax router's a DeepSeek-V2 (V2-Lite's routing: softmax over every expert, the
chosen raw scores, transformers' `greedy`).

The attention's names are transformers' (model/mla.py): they map one to one, except that DeepSeek lays the RoPE'd
dimensions of q (each head's last qk_rope_head_dim rows of q_proj / q_b_proj) and of the shared key
(kv_a_proj_with_mqa's last rows) out in interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`, true in
DeepSeek-V3's checkpoints and transformers' default), ours in halves (x_i, x_{i + rope/2}): those rows are permuted on
the way (exact: a permutation of the rows q_rot.k_rot sums over). A DeepSeek-V3 checkpoint with rope_interleave false is
read as it is (DeepSeek-V2's rotary is always interleaved). The mixture of experts is DeepSeek-V3's, the layout
GLM-4-MoE's (model/hf_glm4_moe.py: sigmoid scores, selection bias `e_score_correction_bias`, group-limited routing,
routed scaling, shared experts, dense first blocks); a model without experts is written with every block dense
(first_k_dense_replace = its layers). What the families cannot hold is refused in one line: for DeepSeek-V2 renormalised
weights at k > 1 (transformers' never
renormalises, whatever norm_topk_prob says), group-limited routing (its `group_limited_greedy` ranks a group by its
best score, ours by its two best: not built), non-zero selection biases.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

from typing import Any

import torch

from model import hf_glm4_moe, hf_moe_layout as hub_layout

MODEL_TYPE = "deepseek_v3"
MODEL_TYPES = (MODEL_TYPE, "deepseek_v2")
# checkpoints of DeepSeek-V3's architecture under a name of their own (Kimi K2 / K2-Thinking: config.json model_type
# "kimi_k2", architectures DeepseekV3ForCausalLM, the same tensors), read as DeepSeek-V3
ALIASES = {"kimi_k2": MODEL_TYPE}
ARCHITECTURE = "DeepseekV3ForCausalLM"
LAYOUT = hub_layout.HubLayout("DeepSeek-V3", block="mlp", bias="gate.e_score_correction_bias",
                              projections=("gate_proj", "up_proj", "down_proj"), mtp_layers_follow=True)
LAYOUT_V2 = hub_layout.HubLayout("DeepSeek-V2", block="mlp", bias=None,
                                 projections=("gate_proj", "up_proj", "down_proj"), mtp_layers_follow=True)


def _v2(cfg: Any) -> bool:
    """Whether `cfg` is written as DeepSeek-V2: a softmax router's experts."""
    return bool(cfg.moe_num_experts) and cfg.moe_score == "softmax"


def architecture(cfg: Any) -> str:
    """The transformers class a model with multi-head latent attention is written as."""
    return "DeepseekV2ForCausalLM" if _v2(cfg) else ARCHITECTURE


def is_deepseek(cfg: Any) -> bool:
    """Whether `cfg` (a ModelConfig) is written as DeepSeek-V3: its attention is multi-head latent attention."""
    return bool(getattr(cfg, "kv_lora_rank", 0))


def export_problems(cfg: Any, biases: dict[str, torch.Tensor]) -> list[str]:
    """Why a model of config `cfg` cannot be written as a DeepSeek-V3 (sigmoid) or DeepSeek-V2 (softmax) checkpoint."""
    p = hub_layout.shared_expert_problems(cfg, "DeepSeek-V3 / V2") if cfg.moe_num_experts else []
    if not _v2(cfg):
        return p + hub_layout.group_score_problem(cfg, "DeepSeek-V3")
    if cfg.moe_norm_topk and cfg.moe_top_k > 1:
        p.append("moe_norm_topk=true (a softmax router with latent attention is written as DeepSeek-V2, which "
                 "transformers never renormalises: train with --moe_norm_topk_prob=false)")
    if cfg.moe_n_groups != 1 and cfg.moe_group_score != "max":
        p.append(f"moe_n_groups={cfg.moe_n_groups} with moe_group_score={cfg.moe_group_score} (DeepSeek-V2 ranks a "
                 "group by its best score: --moe_group_score=max)")
    biased = [name for name, t in biases.items() if bool(t.any())]
    if biased:
        p.append(f"non-zero selection biases ({biased[0]}, ...): DeepSeek-V2 has none")
    return p


def config_fields(cfg: Any) -> dict:
    """The config.json fields that make a Llama dict a DeepSeek-V3 one (head_dim: its RoPE width, as transformers
    sets it)."""
    d = {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "kv_lora_rank": cfg.kv_lora_rank,
         "q_lora_rank": cfg.q_lora_rank, "qk_nope_head_dim": cfg.qk_nope_head_dim,
         "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim, "head_dim": cfg.qk_rope_head_dim,
         "attention_bias": False}
    if not _v2(cfg):  # (DeepSeek-V3's own switches; V2's rotary is always interleaved)
        d.update({"rope_interleave": True, "num_nextn_predict_layers": cfg.mtp_num_layers})  # (model/hf_mtp.py)
    if _v2(cfg):
        d.update({"architectures": [architecture(cfg)], "model_type": "deepseek_v2",
                  "n_routed_experts": cfg.moe_num_experts, "num_experts_per_tok": cfg.moe_top_k,
                  "moe_intermediate_size": cfg.moe_hidden_dim or cfg.hidden_dim,
                  "n_shared_experts": cfg.moe_shared_experts, "first_k_dense_replace": cfg.moe_first_dense_layers,
                  "routed_scaling_factor": float(cfg.moe_routed_scaling), "norm_topk_prob": False,
                  "topk_method": "group_limited_greedy" if cfg.moe_n_groups > 1 else "greedy",
                  "n_group": cfg.moe_n_groups if cfg.moe_n_groups > 1 else None,
                  "topk_group": cfg.moe_topk_groups if cfg.moe_n_groups > 1 else None})
    elif cfg.moe_num_experts:
        moe = hf_glm4_moe.config_fields(cfg)
        d.update({k: moe[k] for k in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                                      "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                                      "routed_scaling_factor", "norm_topk_prob")})
    else:  # every block dense (the MoE sizes unused: the smallest transformers accepts)
        d.update({"n_routed_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": cfg.hidden_dim,
                  "n_shared_experts": 0, "first_k_dense_replace": cfg.n_layers + cfg.mtp_num_layers,  # (+ MTP's)
                  "n_group": 1, "topk_group": 1,
                  "routed_scaling_factor": 1.0, "norm_topk_prob": False})
    return d


def fields_from_hf(d: dict) -> dict:
    """The ModelConfig fields of a DeepSeek-V3 config.json dict beyond a Llama's (its attention_bias is refused with
    every family's, in model/hf_interop.py config_from_hf)."""
    fields = {"kv_lora_rank": int(d.get("kv_lora_rank", 512)), "q_lora_rank": d.get("q_lora_rank", 1536),
              "qk_nope_head_dim": int(d.get("qk_nope_head_dim", 128)),
              "qk_rope_head_dim": int(d.get("qk_rope_head_dim", 64)), "v_head_dim": int(d.get("v_head_dim", 128)),
              "n_kv_heads": None, "attn_head_dim": None}
    layers = int(d["num_hidden_layers"])
    v2 = d.get("model_type") == "deepseek_v2"
    first_dense = int(d.get("first_k_dense_replace", 0 if v2 else 3))
    if first_dense < layers and v2:
        fields.update(_v2_moe_fields(d, first_dense))
    elif first_dense < layers:  # (else a dense model: its MoE sizes are unused)
        fields.update(hf_glm4_moe.moe_fields(dict(d, first_k_dense_replace=first_dense)))
    return fields


def _v2_moe_fields(d: dict, first_dense: int) -> dict:
    """A DeepSeek-V2 config's MoE as ours: softmax scores, the chosen raw scores times routed_scaling_factor (what
    transformers computes, whatever norm_topk_prob says); `group_limited_greedy` as groups ranked by their best
    score (`moe_group_score` max)."""
    method = d.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"this DeepSeek-V2 checkpoint routes with topk_method={method!r} (greedy or "
                         "group_limited_greedy are read)")
    groups = int(d.get("n_group") or 1) if method == "group_limited_greedy" else 1
    fields = {"moe_n_groups": groups, "moe_topk_groups": int(d.get("topk_group") or 1) if groups > 1 else 1,
              "moe_group_score": "max" if groups > 1 else "top2"}
    return {**fields, "moe_num_experts": int(d["n_routed_experts"]),
            "moe_top_k": int(d.get("num_experts_per_tok") or 6), "moe_hidden_dim": int(d["moe_intermediate_size"]),
            "moe_shared_experts": int(d.get("n_shared_experts", 2)),
            "moe_first_dense_layers": first_dense, "moe_score": "softmax", "moe_norm_topk": False,
            "moe_routed_scaling": float(d.get("routed_scaling_factor", 1.0))}


def interleaved(d: dict) -> bool:
    """Whether a DeepSeek-V3 config.json dict's RoPE rows are interleaved pairs (transformers' default: yes;
    DeepSeek-V2's always)."""
    return d.get("model_type") == "deepseek_v2" or bool(d.get("rope_interleave", True))


def _rope_rows(rope: int, to_hub: bool) -> torch.Tensor:
    """The row order that turns half-split RoPE rows into interleaved pairs (to_hub), or back."""
    half = torch.arange(rope // 2)
    order = torch.stack((half, half + rope // 2), dim=1).reshape(-1)  # hub row 2i = ours i, 2i + 1 = ours i + rope/2
    return order if to_hub else torch.argsort(order)


def _permute(sd: dict[str, torch.Tensor], cfg: Any, to_hub: bool) -> dict[str, torch.Tensor]:
    rope, head = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    order = _rope_rows(rope, to_hub)
    out = dict(sd)
    for name, t in sd.items():
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            w = t.reshape(-1, head, t.shape[-1])
            out[name] = torch.cat((w[:, :-rope], w[:, -rope:][:, order]), dim=1).reshape(t.shape)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            out[name] = torch.cat((t[:-rope], t[-rope:][order]))
    return out


def to_hub(sd: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """Our state dict (names without `model.`) -> DeepSeek-V3's (RoPE rows interleaved, experts per the layout);
    each tensor on its own, so a streaming export converts any group of them."""
    sd = _permute(sd, cfg, to_hub=True)
    return hub_layout.to_hub(sd, LAYOUT_V2 if _v2(cfg) else LAYOUT) if cfg.moe_num_experts else sd


def from_hub(sd: dict[str, torch.Tensor], cfg: Any, rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's names (without `model.`) -> ours; its layers past the model's and its MTP depths' (the MTP
    layers a run did not ask for: model/hf_mtp.py) left out, as transformers leaves them."""
    if cfg.moe_num_experts:
        sd = hub_layout.from_hub(sd, cfg, LAYOUT_V2 if _v2(cfg) else LAYOUT)
    else:
        sd = {n: t for n, t in sd.items() if not _past_layers(n, cfg.n_layers + cfg.mtp_num_layers)}
    return _permute(sd, cfg, to_hub=False) if rope_interleave else sd


def _past_layers(name: str, n_layers: int) -> bool:
    parts = name.split(".")
    return len(parts) > 1 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) >= n_layers
