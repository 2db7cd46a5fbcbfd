"""Hugging Face Qwen2-MoE (`Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) checkpoints of our softmax-routed
MoE models with a gated shared expert, both ways (model/hf_interop.py calls these for such a config, or a checkpoint
with model_type "qwen2_moe").

Why it maps one to one: Qwen2-MoE is Qwen2's attention (q/k/v biases: our `qkv_bias`) over a softmax router whose
chosen weights are renormalised or not (`norm_topk_prob`, our `moe_norm_topk`; false in Qwen's releases), plus one
shared expert of its own width (`shared_expert_intermediate_size`: our `moe_shared_hidden_dim`) whose output is
gated per token by sigmoid(x . g) (`shared_expert_gate`: our `moe_shared_gate`), dense first blocks
(`mlp_only_layers`). The names differ only in the shared expert's: the Hub's `mlp.shared_expert.*_proj` and
`mlp.shared_expert_gate.weight` are our `mlp.shared_experts.*_proj` and `mlp.shared_gate.weight`; the routed
experts move as every family's (model/hf_moe_layout.py). What it cannot hold is refused in one line: sigmoid
scores, groups, a routed scaling, selection biases, a shared expert without the gate (Qwen2-MoE always gates it);
on import norm_topk_prob true at top 1, `decoder_sparse_step` > 1, dense layers that are not the first ones.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import torch

from model import hf_moe_layout as hub_layout, hf_qwen3_moe

MODEL_TYPE = "qwen2_moe"
ARCHITECTURE = "Qwen2MoeForCausalLM"
LAYOUT = hub_layout.HubLayout("Qwen2-MoE", block="mlp", bias=None, projections=("gate_proj", "up_proj", "down_proj"))
# ours -> the Hub's, inside `layers.N.mlp.`
_SHARED = (("shared_experts.", "shared_expert."), ("shared_gate.weight", "shared_expert_gate.weight"))


def is_qwen2_moe(cfg) -> bool:
    """Whether an MoE config is written as Qwen2-MoE: its shared experts are gated."""
    return bool(cfg.moe_num_experts) and bool(getattr(cfg, "moe_shared_gate", False))


def export_problems(cfg, biases: dict[str, torch.Tensor]) -> list[str]:
    """Why an MoE model of config `cfg` cannot be written as a Qwen2-MoE checkpoint."""
    p = hub_layout.softmax_family_problems(cfg, biases, "Qwen2-MoE", norm_switch=True, gated_shared=True)
    return p + (["qk_norm (Qwen2-MoE's attention has no q / k norms)"] if cfg.qk_norm else [])


def config_fields(cfg) -> dict:
    """The config.json fields that make a Llama dict a Qwen2-MoE one."""
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "num_experts": cfg.moe_num_experts,
            "num_experts_per_tok": cfg.moe_top_k, "moe_intermediate_size": cfg.moe_hidden_dim or cfg.hidden_dim,
            "shared_expert_intermediate_size": cfg.moe_shared_width, "intermediate_size": cfg.hidden_dim,
            "norm_topk_prob": hub_layout.norm_topk(cfg), "qkv_bias": bool(cfg.qkv_bias), "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.moe_first_dense_layers)), "router_aux_loss_coef": 0.0,
            "output_router_logits": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.n_layers}


def moe_fields(d: dict) -> dict:
    """The ModelConfig fields of a Qwen2-MoE config.json dict (ValueError naming what ours cannot hold)."""
    p = hf_qwen3_moe.import_problems(d)  # (the same router switch and dense-block layout as Qwen3-MoE's)
    if p:
        raise ValueError("this Qwen2-MoE checkpoint cannot be read: " + "; ".join(p))
    return {"moe_num_experts": int(d.get("num_experts", 60)), "moe_top_k": int(d.get("num_experts_per_tok", 4)),
            "moe_hidden_dim": int(d["moe_intermediate_size"]), "moe_score": "softmax", "moe_shared_experts": 1,
            "moe_shared_hidden_dim": int(d["shared_expert_intermediate_size"]), "moe_shared_gate": True,
            "moe_first_dense_layers": len(d.get("mlp_only_layers") or []),
            "moe_norm_topk": hub_layout.norm_topk_of(d, False)}


def _renamed(sd: dict[str, torch.Tensor], to_hub: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        for ours, hub in _SHARED:
            a, b = (ours, hub) if to_hub else (hub, ours)
            if f".mlp.{a}" in name:
                name = name.replace(f".mlp.{a}", f".mlp.{b}")
                break
        out[name] = t
    return out


def to_hub(sd: dict[str, torch.Tensor], cfg=None) -> dict[str, torch.Tensor]:
    """Our state dict (names without `model.`) -> Hub Qwen2-MoE names; each tensor on its own."""
    return _renamed(hub_layout.to_hub(sd, LAYOUT), to_hub=True)


def from_hub(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Hub or transformers-5 Qwen2-MoE names (without `model.`) -> ours, with zero selection biases."""
    return hub_layout.from_hub(_renamed(sd, to_hub=False), cfg, LAYOUT)
