"""Gemma 2 (transformers' `Gemma2ForCausalLM`, model_type `gemma2`: Gemma 2 2B / 9B / 27B), both ways
(model/hf_interop.py calls these).

Gemma 2 is Gemma 3's block (model/hf_gemma3.py: the embedding times sqrt(hidden_size), norms on the sublayers' inputs
and outputs, GeGLU, scores over sqrt(query_pre_attn_scalar), the (1 + w) norm weights and their names) without its
q / k norms or its sliding layers' own RoPE base, and with logit soft-capping (model/softcap.py): the attention scores
capped at attn_logit_softcapping (50) before the softmax (`attn_softcap`: model/attention.py softcap_attention) and
the LM head's logits at final_logit_softcapping (30) in every loss and in generation (`final_softcap`). Every other
layer slides (transformers' default layer_types: the even ones, window 4096).
What our model lacks is a ValueError naming it: bidirectional attention, biases, another activation.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

from typing import Any

from model import hf_gemma3

MODEL_TYPE = "gemma2"
ARCHITECTURE = "Gemma2ForCausalLM"
# transformers' Gemma2Config defaults (a config.json that leaves a field out means these)
DEFAULTS = {"vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
            "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256, "sliding_window": 4096,
            "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "tie_word_embeddings": True,
            "rope_theta": 10_000.0, "initializer_range": 0.02}


def applies(cfg: Any) -> bool:
    """Whether a model with Gemma's block is written as Gemma 2 (no q / k norms; Gemma 3 has them)."""
    return hf_gemma3.is_gemma(cfg) and not cfg.qk_norm


def with_defaults(d: dict) -> dict:
    """A gemma2 config.json dict with transformers' Gemma2Config defaults filled in."""
    return {**DEFAULTS, **d}


def fields_from_hf(d: dict, head_dim: int) -> dict[str, Any]:
    """ModelConfig's fields of a gemma2 config.json dict (`with_defaults` applied) beyond a Llama's; ValueError for
    what our model lacks."""
    problems = hf_gemma3.block_problems(d)
    if problems:
        raise ValueError("this Gemma 2 checkpoint has what our model does not: " + "; ".join(problems))
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if not (isinstance(types, list) and len(types) == n):  # transformers' default: the even layers slide
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"] if d.get("sliding_window") else []
    scalar = d.get("query_pre_attn_scalar", 256)
    out: dict[str, Any] = {
        "scale_embeddings": True, "sandwich_norms": True, "mlp_act": "gelu_tanh",
        "query_scale": None if scalar == head_dim else float(scalar), "attn_head_dim": head_dim,
        "tie_embeddings": bool(d.get("tie_word_embeddings", True)),
        **{ours: None if d.get(hub) is None else float(d[hub]) for ours, hub in hf_gemma3.SOFTCAPS},
    }
    if sliding:
        out.update(sliding_window=int(d["sliding_window"]), sliding_layers=None if len(sliding) == n else sliding)
    return out


def config_fields(cfg: Any) -> dict[str, Any]:
    """The config.json fields of a Gemma2ForCausalLM for `cfg` (the Llama dict's shared ones stay: sizes, eps, RoPE,
    max_position_embeddings, tie_word_embeddings)."""
    problems = hf_gemma3.export_problems(cfg, qk_norm=False)
    if cfg.rope_local_theta is not None:
        problems.append("a RoPE base of the sliding layers' own (Gemma 3's rope_local_base_freq)")
    if problems:
        raise ValueError("a model with Gemma's sublayer output norms and no q / k norms is written as Gemma 2, which "
                         "it does not fit: " + "; ".join(problems))
    types = ["sliding_attention" if cfg.slides(i) else "full_attention" for i in range(cfg.n_layers)]
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hf_gemma3.int_if_whole(cfg.query_scale if cfg.query_scale is not None
                                                        else cfg.head_dim),
        "sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": types,
        "final_logit_softcapping": cfg.final_softcap, "attn_logit_softcapping": cfg.attn_softcap,
        "use_bidirectional_attention": None, "attention_bias": False,
    }
