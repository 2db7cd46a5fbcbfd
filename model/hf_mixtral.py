"""Hugging Face Mixtral checkpoints of our MoE models, both ways (model/hf_interop.py calls these for a config
with experts or a checkpoint with model_type "mixtral").

Why Mixtral: its attention is exactly our Llama attention (Qwen3-MoE adds q/k norms, Qwen2-MoE q/k/v biases and
a sigmoid-gated shared expert), so every weight maps one to one. What it cannot hold is refused in one line:
shared experts, dense first blocks, sigmoid scores, top_k = 1 (Mixtral renormalises the chosen weights, ours keep
the raw score at k = 1), and a non-zero selection bias (Mixtral has none: the export would route differently).

The interface both MoE families share (model/hf_glm4_moe.py has the same five functions, and a LAYOUT):
`export_problems`, `config_fields`, `moe_fields`, `to_hub`, `from_hub`.
Owns: the config.json fields, and its `LAYOUT` of the experts' names (moved by model/hf_moe_layout.py): the Hub's
`model.layers.N.block_sparse_moe.gate.weight` and `...experts.E.w1 / w3 / w2.weight` (what every Mixtral on the Hub
holds, read by transformers 4.x and 5.x alike); import also reads transformers 5's own layout (`mlp.gate.weight`,
`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj`).
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import torch

from model import hf_moe_layout as hub_layout

# no selection bias: a zero one is left out (export_problems refuses any other)
LAYOUT = hub_layout.HubLayout("Mixtral", block="block_sparse_moe", bias=None, projections=("w1", "w3", "w2"))


def export_problems(cfg, biases: dict[str, torch.Tensor]) -> list[str]:
    """Why an MoE model of config `cfg` and selection biases `biases` ({name: tensor}) cannot be written as a
    Mixtral checkpoint."""
    p = hub_layout.softmax_family_problems(cfg, biases, "Mixtral")
    if cfg.moe_first_dense_layers:
        p.append(f"moe_first_dense_layers={cfg.moe_first_dense_layers} (every Mixtral block is MoE)")
    return p


def config_fields(cfg) -> dict:
    """The config.json fields that make a Llama dict a Mixtral one."""
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            "intermediate_size": cfg.moe_hidden_dim or cfg.hidden_dim, "num_local_experts": cfg.moe_num_experts,
            "num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": 0.0, "router_jitter_noise": 0.0,
            "output_router_logits": False, "sliding_window": None}


def moe_fields(d: dict) -> dict:
    """The ModelConfig MoE fields of a Mixtral config.json dict."""
    return {"moe_num_experts": int(d["num_local_experts"]), "moe_top_k": int(d.get("num_experts_per_tok", 2)),
            "moe_hidden_dim": int(d["intermediate_size"]), "moe_score": "softmax"}


def to_hub(sd: dict[str, torch.Tensor], cfg=None) -> dict[str, torch.Tensor]:
    """Our state dict (names without `model.`) -> Hub Mixtral names (without `model.`); other tensors kept. `cfg`: the
    families' common signature (model/hf_deepseek_v3.py's layout depends on it, this one's does not)."""
    return hub_layout.to_hub(sd, LAYOUT)


def from_hub(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Hub or transformers-5 Mixtral names (without `model.`) -> ours, with zero selection biases."""
    return hub_layout.from_hub(sd, cfg, LAYOUT)
