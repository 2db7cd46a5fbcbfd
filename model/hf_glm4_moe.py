"""Hugging Face GLM-4-MoE (`Glm4MoeForCausalLM`) checkpoints of our sigmoid-routed MoE models, both ways
(model/hf_interop.py calls these for an MoE config with sigmoid scores or a checkpoint with model_type "glm4_moe").

Why GLM-4-MoE: it is DeepSeek-V3's mixture of experts (sigmoid scores, the selection bias
`e_score_correction_bias`, group-limited routing ranked by each group's two best scores, `routed_scaling_factor`,
shared experts merged into one SwiGLU, dense first blocks) on plain Llama attention (GQA, half-split RoPE; its
q/k norms, q/k/v biases and partial rotary are switches, ours too: `qk_norm`, `qkv_bias`, `partial_rotary_factor`,
GLM-4.5's half-rotated heads). DeepSeek-V3's own transformers class needs multi-head latent attention, which our
model does not have. So every weight of ours maps one to one. What it
cannot hold is refused in one line: softmax scores (GLM routes on the sigmoid; a softmax model is a Mixtral,
model/hf_mixtral.py); on import, norm_topk_prob true at top 1 (the one weight renormalised to 1; ours keep the raw
score there); norm_topk_prob is our `moe_norm_topk` at k > 1.

The interface of model/hf_mixtral.py (`export_problems`, `config_fields`, `moe_fields`, `to_hub`, `from_hub`, a
LAYOUT), plus `import_problems`.
Owns: the config.json fields, and its `LAYOUT` of the experts' names (moved by model/hf_moe_layout.py): the Hub's
`model.layers.N.mlp.gate.weight`, `...mlp.gate.e_score_correction_bias` and
`...mlp.experts.E.gate_proj / up_proj / down_proj.weight` (what GLM-4.5 on the Hub holds, and what transformers 5
regroups on load); import also reads transformers 5's own stacked layout. The shared experts
(`mlp.shared_experts.*_proj`) and dense blocks (`mlp.*_proj`) have the same names on both sides.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import torch

from model import hf_moe_layout as hub_layout

LAYOUT = hub_layout.HubLayout("GLM-4-MoE", block="mlp", bias="gate.e_score_correction_bias",
                              projections=("gate_proj", "up_proj", "down_proj"), mtp_layers_follow=True)


def export_problems(cfg, biases: dict[str, torch.Tensor]) -> list[str]:
    """Why an MoE model of config `cfg` cannot be written as a GLM-4-MoE checkpoint (any selection biases can)."""
    p = hub_layout.shared_expert_problems(cfg, "GLM-4-MoE") + hub_layout.group_score_problem(cfg, "GLM-4-MoE")
    return p if cfg.moe_score == "sigmoid" else p + [
        f"moe_score={cfg.moe_score} (GLM-4-MoE routes on the sigmoid; a softmax model exports as a Mixtral)"]


def config_fields(cfg) -> dict:
    """The config.json fields that make a Llama dict a GLM-4-MoE one (rope_parameters gains partial_rotary_factor,
    written even at 1.0: transformers' default for GLM is 0.5; attention_bias: GLM-4.5's q/k/v biases)."""
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
            "n_routed_experts": cfg.moe_num_experts, "num_experts_per_tok": cfg.moe_top_k,
            "moe_intermediate_size": cfg.moe_hidden_dim or cfg.hidden_dim, "n_shared_experts": cfg.moe_shared_experts,
            "first_k_dense_replace": cfg.moe_first_dense_layers, "n_group": cfg.moe_n_groups,
            "topk_group": cfg.moe_topk_groups, "routed_scaling_factor": float(cfg.moe_routed_scaling),
            "norm_topk_prob": hub_layout.norm_topk(cfg), "use_qk_norm": bool(cfg.qk_norm),
            "partial_rotary_factor": float(cfg.partial_rotary_factor), "attention_bias": bool(cfg.qkv_bias),
            "num_nextn_predict_layers": cfg.mtp_num_layers, "output_router_logits": False}  # (model/hf_mtp.py)


def import_problems(d: dict) -> list[str]:
    """Why a GLM-4-MoE config.json dict cannot be our model (GLM-4.5's own checkpoints among them)."""
    return hub_layout.norm_topk_problem(d, True)


def moe_fields(d: dict) -> dict:
    """The ModelConfig MoE fields of a GLM-4-MoE config.json dict (ValueError naming what ours cannot hold)."""
    problems = import_problems(d)
    if problems:
        raise ValueError("this GLM-4-MoE checkpoint cannot be loaded into our model: " + "; ".join(problems))
    return {"moe_num_experts": int(d["n_routed_experts"]), "moe_top_k": int(d.get("num_experts_per_tok", 8)),
            "moe_hidden_dim": int(d["moe_intermediate_size"]), "moe_shared_experts": int(d.get("n_shared_experts", 1)),
            "moe_first_dense_layers": int(d.get("first_k_dense_replace", 1)), "moe_score": "sigmoid",
            "moe_n_groups": int(d.get("n_group", 1)), "moe_topk_groups": int(d.get("topk_group", 1)),
            "moe_routed_scaling": float(d.get("routed_scaling_factor", 1.0)),
            "moe_norm_topk": hub_layout.norm_topk_of(d, True)}


def to_hub(sd: dict[str, torch.Tensor], cfg=None) -> dict[str, torch.Tensor]:
    """Our state dict (names without `model.`) -> Hub GLM-4-MoE names (without `model.`); other tensors kept."""
    return hub_layout.to_hub(sd, LAYOUT)


def from_hub(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Hub or transformers-5 GLM-4-MoE names (without `model.`) -> ours. A checkpoint's layers past the model's
    (GLM-4.5 keeps its MTP layer as layer `num_hidden_layers`) are left out, as transformers leaves them, but for
    the MTP depths a run asked for (model/hf_mtp.py)."""
    return hub_layout.from_hub(sd, cfg, LAYOUT)
