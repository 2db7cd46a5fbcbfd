"""ByteDance Seed-OSS (transformers' `SeedOssForCausalLM`, model_type `seed_oss`: Seed-OSS-36B), both ways
(model/hf_interop.py calls these).

Seed-OSS is a Llama with biases on q/k/v (`attention_bias`: our `qkv_bias`) and optionally on o_proj
(`attention_out_bias`: `o_bias`), heads sized on their own (80 heads of 128 at hidden 4096), and dropout on the
attention probabilities and on each sublayer's output (`attention_dropout`, `residual_dropout`: our `attn_dropout`,
`resid_dropout`, at the same places). Its weights are a Llama's, under a Llama's names, biases included.
A dense model with q/k/v biases and heads of their own width (which Qwen2 cannot hold), or with an o_proj bias
without gpt-oss's sinks, is written as Seed-OSS.
What our model lacks is a ValueError naming it: mlp_bias.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

from typing import Any

MODEL_TYPE = "seed_oss"
ARCHITECTURE = "SeedOssForCausalLM"


def applies(cfg: Any) -> bool:
    """Whether a model is written as Seed-OSS (see the module's docstring)."""
    if cfg.moe_num_experts or cfg.attn_sinks or cfg.kv_lora_rank or cfg.qk_norm:
        return False
    return bool(cfg.o_bias or (cfg.qkv_bias and cfg.attn_head_dim is not None))


def fields_from_hf(d: dict) -> dict[str, Any]:
    """ModelConfig's fields of a seed_oss config.json dict beyond a Llama's (transformers' defaults where unset)."""
    if d.get("mlp_bias"):
        raise ValueError("this Seed-OSS checkpoint has what our model does not: mlp_bias")
    return {"qkv_bias": bool(d.get("attention_bias", True)), "o_bias": bool(d.get("attention_out_bias", False)),
            "attn_dropout": float(d.get("attention_dropout", 0.1) or 0.0),
            "resid_dropout": float(d.get("residual_dropout", 0.1) or 0.0)}


def config_fields(cfg: Any) -> dict[str, Any]:
    """The config.json fields of a SeedOssForCausalLM for `cfg` (the Llama dict's sizes, head_dim, eps and RoPE
    stay)."""
    odd = list(cfg.block_fields) + [what for what, on in (("a sliding window", cfg.sliding_window),
                                                          ("layers without RoPE", cfg.nope_layers is not None)) if on]
    if odd:
        raise ValueError("a model with an o_proj bias or q/k/v biases on heads of their own width is written as "
                         "Seed-OSS, which it does not fit: " + "; ".join(odd))
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "attention_bias": bool(cfg.qkv_bias),
            "attention_out_bias": bool(cfg.o_bias), "attention_dropout": float(cfg.attn_dropout),
            "residual_dropout": float(cfg.resid_dropout)}
