"""Hugging Face Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B) checkpoints of our softmax-routed
MoE models with q / k norms, both ways (model/hf_interop.py calls these for such a config, or a checkpoint with
model_type "qwen3_moe").

Why it maps one to one: Qwen3-MoE is Qwen3's attention (q / k norms, heads sized on their own: model/llama.py with
`qk_norm`, `attn_head_dim`) over Mixtral's routing (softmax over every expert, the top k, their weights renormalised
to sum 1 or not: `norm_topk_prob`, ours `moe_norm_topk`), with dense first blocks (`mlp_only_layers` 0 .. k-1, of width
`intermediate_size`) and no shared experts. What it cannot hold is refused in one line: shared experts, sigmoid scores,
group-limited routing, a routed scaling, a non-zero selection bias; on import, `norm_topk_prob` true at top 1 (the one
weight renormalised to 1, ours keep the raw score), MoE blocks not every layer after the dense ones
(`decoder_sparse_step` > 1, `mlp_only_layers` other than a prefix).

The interface of model/hf_mixtral.py (`export_problems`, `config_fields`, `moe_fields`, `to_hub`, `from_hub`, a
LAYOUT), plus `import_problems`.
Owns: the config.json fields, and its `LAYOUT` of the experts' names (moved by model/hf_moe_layout.py): the Hub's
`model.layers.N.mlp.gate.weight` and `...mlp.experts.E.gate_proj / up_proj / down_proj.weight`; import also reads
transformers 5's own stacked layout. A dense block's `mlp.*_proj` has the same names on both sides.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import torch

from model import hf_moe_layout as hub_layout

LAYOUT = hub_layout.HubLayout("Qwen3-MoE", block="mlp", bias=None, projections=("gate_proj", "up_proj", "down_proj"))


def export_problems(cfg, biases: dict[str, torch.Tensor]) -> list[str]:
    """Why an MoE model of config `cfg` and selection biases `biases` cannot be written as a Qwen3-MoE checkpoint."""
    p = hub_layout.softmax_family_problems(cfg, biases, "Qwen3-MoE", norm_switch=True)
    if cfg.qkv_bias:
        p.append("qkv_bias (Qwen3-MoE's attention has no biases)")
    return p


def import_problems(d: dict) -> list[str]:
    """What a Qwen3-MoE config.json holds that our model does not compute."""
    p = hub_layout.norm_topk_problem(d, False)
    if int(d.get("decoder_sparse_step", 1)) != 1:
        p.append(f"decoder_sparse_step={d['decoder_sparse_step']} (ours: every block after the dense ones is MoE)")
    dense = sorted(int(i) for i in d.get("mlp_only_layers") or [])
    if dense != list(range(len(dense))):
        p.append(f"mlp_only_layers={dense} (ours: the dense blocks are the first ones)")
    return p


def config_fields(cfg) -> dict:
    """The config.json fields that make a Llama dict a Qwen3-MoE one."""
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": cfg.moe_num_experts,
            "num_experts_per_tok": cfg.moe_top_k, "moe_intermediate_size": cfg.moe_hidden_dim or cfg.hidden_dim,
            "intermediate_size": cfg.hidden_dim, "norm_topk_prob": hub_layout.norm_topk(cfg), "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.moe_first_dense_layers)), "router_aux_loss_coef": 0.0,
            "output_router_logits": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": cfg.n_layers}


def moe_fields(d: dict) -> dict:
    """The ModelConfig MoE fields of a Qwen3-MoE config.json dict (ValueError for what `import_problems` names)."""
    problems = import_problems(d)
    if problems:
        raise ValueError("this Qwen3-MoE checkpoint cannot be read: " + "; ".join(problems))
    experts = d.get("num_experts", d.get("num_local_experts"))  # (the Hub's name; transformers 5 saves the other)
    return {"moe_num_experts": int(experts), "moe_top_k": int(d.get("num_experts_per_tok", 8)),
            "moe_hidden_dim": int(d["moe_intermediate_size"]), "moe_score": "softmax",
            "moe_first_dense_layers": len(d.get("mlp_only_layers") or []),
            "moe_norm_topk": hub_layout.norm_topk_of(d, False)}


def to_hub(sd: dict[str, torch.Tensor], cfg=None) -> dict[str, torch.Tensor]:
    """Our state dict (names without `model.`) -> Hub Qwen3-MoE names (without `model.`); other tensors kept."""
    return hub_layout.to_hub(sd, LAYOUT)


def from_hub(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Hub or transformers-5 Qwen3-MoE names (without `model.`) -> ours, with zero selection biases."""
    return hub_layout.from_hub(sd, cfg, LAYOUT)
