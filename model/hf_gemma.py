"""Gemma 1 (transformers' `GemmaForCausalLM`, model_type `gemma`: Gemma 2B / 7B, Gemma 1.1, CodeGemma), both ways
(model/hf_interop.py calls these).

Gemma 1 is a Llama with three of Gemma's switches (model/config.py): the embedding times sqrt(hidden_size)
(`scale_embeddings`), GeGLU (`mlp_act=gelu_tanh`; the releases' config.json says `hidden_act: "gelu"`, which
transformers reads as the tanh approximation, as we do) and heads sized on their own (head_dim 256 at hidden 2048 /
3072), tied embeddings. Its RMSNorm multiplies by (1 + w): the norm weights are read as 1 + w and written back as
w - 1 (model/hf_gemma3.py `from_hub` / `to_hub` without its renames: Gemma 1's norms have a Llama's names).
What our model lacks is a ValueError naming it: bidirectional attention, biases, another activation.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

from typing import Any

from model import hf_gemma3

MODEL_TYPE = "gemma"
ARCHITECTURE = "GemmaForCausalLM"
# transformers' GemmaConfig defaults (Gemma 7B's shape: a config.json that leaves a field out means these)
DEFAULTS = {"vocab_size": 256_000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
            "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "rope_theta": 10_000.0, "initializer_range": 0.02}
GELU_TANH = ("gelu", "gelu_pytorch_tanh", "gelu_tanh")  # ("gelu": the releases' legacy spelling of the tanh form)


def applies(cfg: Any) -> bool:
    """Whether a model is written as Gemma 1: the scaled embedding without the sublayers' output norms."""
    return bool(cfg.scale_embeddings and not cfg.sandwich_norms and cfg.pre_norms)


def with_defaults(d: dict) -> dict:
    """A gemma config.json dict with transformers' GemmaConfig defaults filled in."""
    return {**DEFAULTS, **d}


def fields_from_hf(d: dict, head_dim: int) -> dict[str, Any]:
    """ModelConfig's fields of a gemma config.json dict (`with_defaults` applied) beyond a Llama's; ValueError for
    what our model lacks."""
    problems = hf_gemma3.block_problems(d, GELU_TANH)
    if problems:
        raise ValueError("this Gemma checkpoint has what our model does not: " + "; ".join(problems))
    return {"scale_embeddings": True, "mlp_act": "gelu_tanh", "attn_head_dim": head_dim,
            "tie_embeddings": bool(d.get("tie_word_embeddings", True))}


def config_fields(cfg: Any) -> dict[str, Any]:
    """The config.json fields of a GemmaForCausalLM for `cfg` (the Llama dict's shared ones stay: sizes, eps, RoPE,
    max_position_embeddings, tie_word_embeddings)."""
    odd = [f for f in cfg.block_fields if f not in ("scale_embeddings", "mlp_act")]
    odd += [what for what, on in (("q / k norms", cfg.qk_norm), ("q/k/v biases", cfg.qkv_bias),
                                  ("MoE blocks", cfg.moe_num_experts), ("a sliding window", cfg.sliding_window),
                                  ("layers without RoPE", cfg.nope_layers is not None)) if on]
    if cfg.mlp_act != "gelu_tanh":
        odd.append(f"mlp_act={cfg.mlp_act} (Gemma's is gelu_tanh)")
    if odd:
        raise ValueError("a model with Gemma's scaled embedding and no sublayer output norms is written as Gemma 1, "
                         "which it does not fit: " + "; ".join(odd))
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "hidden_act": "gelu_pytorch_tanh",
            "attention_bias": False, "use_bidirectional_attention": None}
