"""Ministral 3 (transformers' `Ministral3ForCausalLM`, model_type `ministral3`; also the text model of Mistral's
December 2025 vision-language checkpoints), both ways (model/hf_interop.py calls these).

Ministral 3 is a Mistral (GQA, heads of their own width, YaRN on RoPE) whose queries are scaled by position after RoPE:
q x (1 + beta ln(1 + floor(position / L))), beta its rope_parameters' `llama_4_scaling_beta`, L their
`original_max_position_embeddings` (1 below L: only long contexts change). Ours: `query_pos_scale_beta`,
`query_pos_scale_length`. The rope dict also carries `max_position_embeddings`, which is not a scaling setting.
Owns: those config.json fields. Must never: import transformers (plain dicts only).
"""
from __future__ import annotations

from typing import Any

MODEL_TYPE = "ministral3"
_NOT_SCALING = ("llama_4_scaling_beta", "max_position_embeddings")  # (in its rope dict, read here)


def rope_dict(d: dict) -> dict:
    """The config dict with its rope dict stripped of the keys that are not RoPE's (for utils/rope_config.py)."""
    rp = {k: v for k, v in (d.get("rope_parameters") or {}).items() if k not in _NOT_SCALING}
    return dict(d, rope_parameters=rp)


def fields_from_hf(d: dict) -> dict[str, Any]:
    """ModelConfig's query-scale fields of a ministral3 config.json dict."""
    rp = d.get("rope_parameters") or {}
    beta = rp.get("llama_4_scaling_beta")
    if beta is None:
        return {}
    length = rp.get("original_max_position_embeddings", d.get("max_position_embeddings"))
    return {"query_pos_scale_beta": float(beta), "query_pos_scale_length": int(length)}


def config_fields(cfg: Any, rope_parameters: dict) -> dict[str, Any]:
    """The config.json fields that make a Llama dict a Ministral 3 one (`rope_parameters`: the Llama dict's)."""
    original = (cfg.rope_scaling or {}).get("original_max_position_embeddings")
    if original is not None and original != cfg.query_pos_scale_length:
        raise ValueError(f"query_pos_scale_length={cfg.query_pos_scale_length} and the RoPE scaling's "
                         f"original_max_position_embeddings={original}: a Ministral 3 holds one length for both")
    rope = dict(rope_parameters, llama_4_scaling_beta=cfg.query_pos_scale_beta,
                original_max_position_embeddings=cfg.query_pos_scale_length)
    return {"architectures": ["Ministral3ForCausalLM"], "model_type": MODEL_TYPE, "rope_parameters": rope,
            "rope_scaling": None, "sliding_window": cfg.sliding_window}
