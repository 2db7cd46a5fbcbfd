"""Phi-3 / Phi-4 (transformers' `Phi3ForCausalLM`, model_type `phi3`), both ways (model/hf_interop.py calls these).

A Phi-3 is a Llama whose q/k/v weights are stored as one `qkv_proj` (q rows, then k, then v) and whose gate/up weights
as one `gate_up_proj` (gate rows, then up); Phi-3.5-mini and Phi-4-mini add LongRoPE (`rope_scaling` longrope: short
and long factors per frequency) and Phi-4-mini a partial rotary (0.75 of each head turns). On import the fused weights
are split into our projections; a model that has what a Llama export cannot hold (longrope, a partial rotary) is
written back as a Phi-3, the projections fused again. Others export as the Llama (or Mistral) they are.
Owns: the split and the fusion, and the config.json fields of a Phi-3 export.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import re
from typing import Any

import torch

MODEL_TYPE = "phi3"
_PROJ = re.compile(r"^(layers\.\d+\.)(self_attn|mlp)\.(q|k|v|gate|up)_proj\.weight$")


def needs_phi3(cfg: Any) -> bool:
    """Whether a (dense, Llama-block) model is written as a Phi-3: LongRoPE or a partial rotary, which transformers'
    Llama does not hold (a GLM-4-MoE's partial rotary is GLM's: model/hf_glm4_moe.py)."""
    return not cfg.moe_num_experts and ((cfg.rope_scaling or {}).get("type") == "longrope"
                                        or cfg.partial_rotary_factor != 1.0)


def export_problems(cfg: Any) -> list[str]:
    """What a Phi-3 export cannot hold."""
    p = []
    kind = (cfg.rope_scaling or {}).get("type")
    if kind not in (None, "longrope"):
        p.append(f"rope_scaling {kind} (a Phi-3's RoPE is plain or longrope)")
    if cfg.head_dim * cfg.n_heads != cfg.dim:
        p.append(f"head_dim={cfg.head_dim} x {cfg.n_heads} heads != dim {cfg.dim}")
    for name, bad in (("q/k/v biases", cfg.qkv_bias), ("q / k norms", cfg.qk_norm),
                      ("layers without RoPE", cfg.nope_layers is not None)):
        if bad:
            p.append(name)
    if cfg.sliding_window and cfg.sliding_layers is not None:
        p.append("a window in some layers only (a Phi-3's slides in every layer)")
    return p


def config_fields(cfg: Any, rope_parameters: dict) -> dict[str, Any]:
    """The config.json fields that make a Llama dict a Phi-3 one (`rope_parameters`: the Llama dict's)."""
    problems = export_problems(cfg)
    if problems:
        raise ValueError("a model with longrope or a partial rotary is written as a Phi-3, which it does not fit: "
                         + "; ".join(problems))
    original = (cfg.rope_scaling or {}).get("original_max_position_embeddings", cfg.max_seq_len)
    rope = dict(rope_parameters, partial_rotary_factor=float(cfg.partial_rotary_factor))
    # (no 4.x `rope_scaling`: transformers 5 would take it over rope_parameters, and Phi-3's 4.x check wants three keys)
    return {"architectures": ["Phi3ForCausalLM"], "model_type": MODEL_TYPE, "rope_parameters": rope,
            "rope_scaling": None, "partial_rotary_factor": float(cfg.partial_rotary_factor),
            "original_max_position_embeddings": original,
            "sliding_window": cfg.sliding_window, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            # (Phi3Config's own defaults are Phi-3's ids, 32000 and up: none unless the tokenizer's are given)
            "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}


def split(sd: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """Phi-3's fused `qkv_proj` (q, k, v rows) and `gate_up_proj` (gate, up rows) split into the Llama projections
    they hold; other tensors kept (any checkpoint's names, with or without `model.`)."""
    out = {}
    nq, nkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    for name, t in sd.items():
        if name.endswith(".self_attn.qkv_proj.weight"):
            base = name[:-len("qkv_proj.weight")]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), t.split((nq, nkv, nkv), dim=0)):
                out[f"{base}{proj}.weight"] = part
        elif name.endswith(".mlp.gate_up_proj.weight") and t.dim() == 2:
            base = name[:-len("gate_up_proj.weight")]
            out[f"{base}gate_proj.weight"], out[f"{base}up_proj.weight"] = t.chunk(2, dim=0)
        else:
            out[name] = t
    return out


def fuse(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Ours (names without `model.`) -> Phi-3's fused projections; a layer's q, k, v (gate, up) must be in `sd`
    together (model/hf_interop.py keeps them in one shard)."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    out = {}
    for name, t in sd.items():
        m = _PROJ.match(name)
        if m is None:
            out[name] = t
            continue
        parts.setdefault(f"{m.group(1)}{m.group(2)}", {})[m.group(3)] = t
    for base, p in parts.items():
        order, fused = (("q", "k", "v"), "qkv_proj") if base.endswith("self_attn") else (("gate", "up"), "gate_up_proj")
        missing = [k for k in order if k not in p]
        if missing:
            raise ValueError(f"{base}: {', '.join(missing)} projection(s) missing for the fused {fused}")
        out[f"{base}.{fused}.weight"] = torch.cat([p[k] for k in order], dim=0)
    return out


def group_key(name: str) -> str:
    """Tensors that fuse into one Phi-3 weight share this key (a streamed export never splits them)."""
    m = _PROJ.match(name)
    return f"{m.group(1)}{m.group(2)}" if m is not None else name
