"""OLMo 2 and OLMo 3 (transformers' `Olmo2ForCausalLM` / `Olmo3ForCausalLM`, model_type `olmo2` / `olmo3`: Ai2's fully
open models), both ways (model/hf_interop.py calls these).

OLMo 2 is a Llama whose block norms the sublayers' outputs instead of their inputs (`pre_norms` off, `sandwich_norms`:
x + norm(attn(x)), then h + norm(mlp(h))) and whose q / k norms run over all the heads' width at once, before the
heads split (`qk_norm_full`). OLMo 3 adds sliding-window layers (3 of 4 by default, `layer_types`) whose RoPE may differ
from the full layers' (the full ones carry YaRN in the long-context models): `rope_local_theta` where it does.

Owns: the config.json fields and the names of the weights: OLMo's post_attention_layernorm / post_feedforward_layernorm
are our attn_output_norm / mlp_output_norm (a Llama's post_attention_layernorm is the MLP's input norm, which OLMo
lacks); the other names are a Llama's. What our model lacks is a ValueError naming it (a scaled RoPE on the sliding
layers; biases are refused as a Llama's).
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import re
from typing import Any

import torch

MODEL_TYPES = ("olmo2", "olmo3")
_RENAMES = (("post_attention_layernorm", "attn_output_norm"), ("post_feedforward_layernorm", "mlp_output_norm"))
_LAYER_NORM = re.compile(r"^(layers\.\d+\.)([a-z_]+)\.weight$")


def is_olmo(cfg: Any) -> bool:
    """Whether a model config is written as OLMo 2 / 3 (a block with the sublayers' output norms only)."""
    return not cfg.pre_norms


def fields_from_hf(d: dict, kind: str) -> dict[str, Any]:
    """ModelConfig's fields of an olmo2 / olmo3 config.json dict beyond a Llama's (rope_theta / rope_scaling of the full
    layers among them); ValueError for what our model lacks."""
    from utils.rope_config import rope_scaling_from_hf
    out: dict[str, Any] = {"pre_norms": False, "sandwich_norms": True, "qk_norm": True, "qk_norm_full": True}
    rp = d.get("rope_parameters") or {}
    per_type = isinstance(rp.get("full_attention"), dict)
    full = dict(rp["full_attention"]) if per_type else dict(rp or d.get("rope_scaling") or {})
    theta = float(full.get("rope_theta", d.get("rope_theta", 500_000.0 if kind == "olmo3" else 10_000.0)))
    out["rope_theta"] = theta
    out["rope_scaling"] = rope_scaling_from_hf({"rope_parameters": full,
                                                "max_position_embeddings": d.get("max_position_embeddings", 2048)})
    if kind != "olmo3":
        return out
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if not (isinstance(types, list) and len(types) == n):  # transformers' default: every 4th layer full
        types = ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and d.get("sliding_window") is not None:
        out.update(sliding_window=int(d["sliding_window"]), sliding_layers=None if len(sliding) == n else sliding)
        local = dict(rp.get("sliding_attention") or {}) if per_type else {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"this OLMo 3 checkpoint scales the sliding layers' RoPE ({local.get('rope_type')!r}): "
                             "ours rotates them unscaled")
        local_theta = float(local.get("rope_theta", theta))
        if local_theta != theta or out["rope_scaling"] is not None:  # (else every layer turns alike)
            out["rope_local_theta"] = local_theta
    return out


def export_problems(cfg: Any) -> list[str]:
    """What a model without pre-norms has that OLMo 2 / 3 cannot hold, or lacks that it must have."""
    p = []
    if not (cfg.qk_norm and cfg.qk_norm_full):
        p.append("no q / k norms over all the heads (qk_norm_full)")
    for name, bad in (("q/k/v biases", cfg.qkv_bias), ("MoE blocks", cfg.moe_num_experts),
                      ("a partial rotary", cfg.partial_rotary_factor != 1.0),
                      ("layers without RoPE", cfg.nope_layers is not None), ("scale_embeddings", cfg.scale_embeddings),
                      (f"mlp_act={cfg.mlp_act}", cfg.mlp_act != "silu"), ("query_scale", cfg.query_scale is not None),
                      (f"head_dim={cfg.head_dim} x {cfg.n_heads} heads != dim {cfg.dim}",
                       cfg.head_dim * cfg.n_heads != cfg.dim)):
        if bad:
            p.append(name)
    return p


def config_fields(cfg: Any, rope_full: dict) -> dict[str, Any]:
    """The config.json fields of an Olmo2ForCausalLM (no sliding window) or Olmo3ForCausalLM for `cfg`; `rope_full`:
    the full layers' rope dict as a Llama's."""
    problems = export_problems(cfg)
    if problems:
        raise ValueError("a model with only the sublayers' output norms is written as OLMo 2 / 3, which it does not "
                         "fit: " + "; ".join(problems))
    if not cfg.sliding_window:
        if cfg.rope_local_theta is not None:
            raise ValueError("rope_local_theta without sliding layers")
        return {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"}
    types = ["sliding_attention" if cfg.slides(i) else "full_attention" for i in range(cfg.n_layers)]
    local = {"rope_type": "default",
             "rope_theta": float(cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta)}
    if cfg.rope_local_theta is None and cfg.rope_scaling:
        raise ValueError("an OLMo 3 with scaled RoPE needs the sliding layers' own base (rope_local_theta)")
    return {"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", "sliding_window": cfg.sliding_window,
            "layer_types": types, "rope_parameters": {"full_attention": dict(rope_full), "sliding_attention": local}}


def from_hub(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OLMo's names (without `model.`) -> ours."""
    names = dict(_RENAMES)
    out = {}
    for name, t in sd.items():
        m = _LAYER_NORM.match(name)
        out[f"{m.group(1)}{names[m.group(2)]}.weight" if m is not None and m.group(2) in names else name] = t
    return out


def to_hub(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ours -> OLMo's names (without `model.`)."""
    names = {ours: hub for hub, ours in _RENAMES}
    out = {}
    for name, t in sd.items():
        m = _LAYER_NORM.match(name)
        out[f"{m.group(1)}{names[m.group(2)]}.weight" if m is not None and m.group(2) in names else name] = t
    return out
