"""IBM Granite (transformers' `GraniteForCausalLM`, model_type `granite`: Granite 3.x dense, 2B / 8B), both ways
(model/hf_interop.py calls these).

Granite is a Llama with four multipliers (model/config.py): the embedding's output times `embedding_multiplier`,
each sublayer's output times `residual_multiplier` before its residual add, attention scores q.k times
`attention_multiplier` (ours: `query_scale` = 1 / multiplier^2, the scores' q.k / sqrt(query_scale)) and the logits
divided by `logits_scaling` (ours: the final normed hidden state divided before the LM head, (h / s) W^T = h W^T / s,
so every loss head, the KV-cache decoder and tensor parallelism's vocabulary shards take it alike). Its weights are a
Llama's, under a Llama's names.
What our model lacks is a ValueError naming it: biases (attention_bias, mlp_bias).
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

from typing import Any

MODEL_TYPE = "granite"
ARCHITECTURE = "GraniteForCausalLM"
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")  # the same names in both configs


def applies(cfg: Any) -> bool:
    """Whether a model is written as Granite (one of its multipliers set)."""
    return any(getattr(cfg, name) is not None for name in MULTIPLIERS)


def fields_from_hf(d: dict, head_dim: int) -> dict[str, Any]:
    """ModelConfig's fields of a granite config.json dict beyond a Llama's (transformers' defaults: 1.0 each)."""
    out: dict[str, Any] = {name: float(d.get(name, 1.0)) for name in MULTIPLIERS}
    m = float(d.get("attention_multiplier", 1.0))
    if not m > 0:
        raise ValueError(f"attention_multiplier={m!r} must be > 0")
    scale = 1.0 / (m * m)  # q.k x m = q.k / sqrt(1 / m^2)
    out["query_scale"] = None if abs(scale - head_dim) <= 1e-9 * head_dim else scale
    return out


def config_fields(cfg: Any) -> dict[str, Any]:
    """The config.json fields of a GraniteForCausalLM for `cfg` (the Llama dict's sizes, eps and RoPE stay)."""
    odd = [f for f in cfg.block_fields if f not in MULTIPLIERS + ("query_scale",)]
    odd += [what for what, on in (("q / k norms", cfg.qk_norm), ("q/k/v biases", cfg.qkv_bias),
                                  ("MoE blocks", cfg.moe_num_experts), ("a sliding window", cfg.sliding_window),
                                  ("layers without RoPE", cfg.nope_layers is not None)) if on]
    if odd:
        raise ValueError("a model with Granite's multipliers is written as Granite, which it does not fit: "
                         + "; ".join(odd))
    scale = cfg.query_scale if cfg.query_scale is not None else cfg.head_dim
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "attention_multiplier": scale ** -0.5,
            **{name: 1.0 if getattr(cfg, name) is None else float(getattr(cfg, name)) for name in MULTIPLIERS}}
