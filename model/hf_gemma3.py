"""Gemma 3's text model (transformers' `Gemma3ForCausalLM`, model_type `gemma3_text`: Gemma 3 270M / 1B), both ways
(model/hf_interop.py calls these).

Gemma 3 is our block with Gemma's switches on (model/config.py): the embedding times sqrt(hidden_size)
(`scale_embeddings`), a norm on each sublayer's output (`sandwich_norms`), GeGLU (`mlp_act=gelu_tanh`), Qwen3's per-head
q / k norms, scores over sqrt(query_pre_attn_scalar) (`query_scale`), 5 sliding layers of 6 whose RoPE turns at their
own base (`rope_local_theta`), the others at rope_theta with the checkpoint's scaling.

Owns: the config.json fields, and the names and values of the weights: Gemma's RMSNorm multiplies by (1 + w) where ours
multiplies by w, so every norm weight is read as 1 + w and written as w - 1 (in fp32); its layer norms are named
input_layernorm, post_attention_layernorm (ours: attn_output_norm), pre_feedforward_layernorm (ours:
post_attention_layernorm, the MLP's input norm in a Llama) and post_feedforward_layernorm (ours: mlp_output_norm).
Gemma 3's vision-language checkpoints (model_type `gemma3`: 4B, 12B, 27B) hold the same text model
(model/hf_vision_language.py reads it), whose `text_config` sets only what differs from transformers'
Gemma3TextConfig defaults (`with_defaults`).
Soft-capped logits, where a checkpoint sets them (Gemma 2's, model/hf_gemma2.py, which shares this module's names and
weights), are read and written. What our model lacks is a ValueError naming it: bidirectional attention
(EmbeddingGemma), biases.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import re
from typing import Any, Optional

import torch

MODEL_TYPE = "gemma3_text"
# transformers' Gemma3TextConfig defaults: a multimodal checkpoint's text_config sets only what differs from them
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                 "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
                 "query_pre_attn_scalar": 256, "sliding_window": 4096, "rope_theta": 1_000_000.0,
                 "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True, "initializer_range": 0.02}
ARCHITECTURE = "Gemma3ForCausalLM"
_RENAMES = (("post_attention_layernorm", "attn_output_norm"), ("pre_feedforward_layernorm", "post_attention_layernorm"),
            ("post_feedforward_layernorm", "mlp_output_norm"))  # hub -> ours (in this order: no chain)
_LAYER_NORM = re.compile(r"^(layers\.\d+\.)([a-z_]+_norm|[a-z_]+_layernorm)\.weight$")
_NORM = re.compile(r"(^norm|_norm|_layernorm)\.weight$")
SOFTCAPS = (("attn_softcap", "attn_logit_softcapping"), ("final_softcap", "final_logit_softcapping"))  # ours, hub


def is_gemma(cfg: Any) -> bool:
    """Whether a model config is written as Gemma 3 (its block: norms of the sublayers' inputs and outputs)."""
    return bool(cfg.sandwich_norms and cfg.pre_norms)


def with_defaults(d: dict) -> dict:
    """A gemma3_text config.json dict with transformers' Gemma3TextConfig defaults filled in."""
    return {**TEXT_DEFAULTS, **d}


def block_problems(d: dict, acts: tuple = ("gelu_pytorch_tanh", "gelu_tanh")) -> list[str]:
    """What a Gemma config.json (1, 2 or 3) sets that our model lacks: bidirectional attention (EmbeddingGemma's), an
    activation other than `acts` (the tanh GELU's spellings)."""
    problems = []
    if d.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention (EmbeddingGemma's)")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in acts:
        problems.append(f"hidden_activation={act!r} (ours: gelu_pytorch_tanh)")
    return problems


def fields_from_hf(d: dict, n_heads: int, head_dim: int) -> dict[str, Any]:
    """ModelConfig's fields of a gemma3_text config.json dict (transformers 4.x or 5.x spelling) beyond a Llama's;
    ValueError for what our model lacks."""
    problems = block_problems(d)
    full, local = _rope_dicts(d)
    if local.get("rope_type", "default") != "default":
        problems.append(f"a scaled RoPE on the sliding layers ({local.get('rope_type')!r})")
    if problems:
        raise ValueError("this Gemma 3 checkpoint has what our model does not: " + "; ".join(problems))
    n = d["num_hidden_layers"]
    types = d.get("layer_types")
    if not (isinstance(types, list) and len(types) == n):  # transformers' default from the pattern (4.x configs)
        pattern = int(d.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    scalar = d.get("query_pre_attn_scalar", 256)
    out: dict[str, Any] = {
        "scale_embeddings": True, "sandwich_norms": True, "mlp_act": "gelu_tanh", "qk_norm": True,
        "query_scale": None if scalar == head_dim else float(scalar),
        "rope_theta": float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        "tie_embeddings": bool(d.get("tie_word_embeddings", True)), "attn_head_dim": head_dim,
        **{ours: None if d.get(hub) is None else float(d[hub]) for ours, hub in SOFTCAPS},
    }
    if sliding:  # kept even where the window is longer than the positions: the layers' RoPE base follows it
        out.update(sliding_window=int(d.get("sliding_window") or 4096),
                   sliding_layers=None if len(sliding) == n else sliding,
                   rope_local_theta=float(local.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))))
    return out


def _rope_dicts(d: dict) -> tuple[dict, dict]:
    """The full and the sliding layers' rope dicts of a gemma3_text config (5.x: rope_parameters keyed by layer type;
    4.x: rope_theta / rope_scaling / rope_local_base_freq at the top)."""
    rp = d.get("rope_parameters") or {}
    if isinstance(rp.get("full_attention"), dict) or isinstance(rp.get("sliding_attention"), dict):
        return dict(rp.get("full_attention") or {}), dict(rp.get("sliding_attention") or {})
    full = dict(d.get("rope_scaling") or {})
    full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
    return full, {"rope_type": "default", "rope_theta": d.get("rope_local_base_freq", 10_000.0)}


def full_rope_dict(d: dict) -> dict:
    """A config dict whose rope fields are the full layers' (what utils/rope_config.rope_scaling_from_hf reads)."""
    full, _ = _rope_dicts(d)
    return {"rope_parameters": full, "max_position_embeddings": d.get("max_position_embeddings", 131_072)}


def export_problems(cfg: Any, qk_norm: bool = True) -> list[str]:
    """What a model with the sublayers' output norms has that Gemma 3 (`qk_norm`; else Gemma 2) cannot hold, or lacks
    that it must have."""
    p = []
    if not cfg.scale_embeddings:
        p.append("scale_embeddings off")
    if cfg.mlp_act != "gelu_tanh":
        p.append(f"mlp_act={cfg.mlp_act} (Gemma's is gelu_tanh)")
    if cfg.qk_norm != qk_norm:
        p.append("q / k norms" if cfg.qk_norm else "no q / k norms")
    if cfg.qkv_bias:
        p.append("q/k/v biases")
    if cfg.moe_num_experts:
        p.append("MoE blocks")
    if cfg.nope_layers is not None:
        p.append("layers without RoPE")
    if cfg.partial_rotary_factor != 1.0 or cfg.qk_norm_full:
        p.append("a partial rotary" if cfg.partial_rotary_factor != 1.0 else "q / k norms over all the heads")
    return p


def config_fields(cfg: Any, rope_full: dict) -> dict[str, Any]:
    """The config.json fields of a Gemma3ForCausalLM for `cfg` (the Llama dict's shared ones stay: sizes, eps,
    max_position_embeddings, tie_word_embeddings); `rope_full`: the full layers' rope dict as a Llama's."""
    problems = export_problems(cfg)
    if problems:
        raise ValueError("a model with Gemma's sublayer output norms is written as Gemma 3, which it does not fit: "
                         + "; ".join(problems))
    n = cfg.n_layers
    types = ["sliding_attention" if cfg.slides(i) else "full_attention" for i in range(n)]
    local_theta = float(cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta)
    if cfg.sliding_window and cfg.rope_local_theta is None:
        raise ValueError("a Gemma 3's sliding layers rotate at their own base: rope_local_theta is unset")
    scaling = {k: v for k, v in rope_full.items() if k not in ("rope_type", "rope_theta")}
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int_if_whole(cfg.query_scale if cfg.query_scale is not None else cfg.head_dim),
        "sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": types,
        "rope_parameters": {"full_attention": dict(rope_full), "sliding_attention": {"rope_type": "default",
                                                                                     "rope_theta": local_theta}},
        "rope_theta": float(cfg.rope_theta), "rope_local_base_freq": local_theta,
        "rope_scaling": {"rope_type": rope_full["rope_type"], **scaling} if scaling else None,
        "final_logit_softcapping": cfg.final_softcap, "attn_logit_softcapping": cfg.attn_softcap,
        "use_bidirectional_attention": False,
        "attention_bias": False,
    }


def int_if_whole(x: float):
    """x as an int where it is one (transformers' Gemma3TextConfig types query_pre_attn_scalar as int)."""
    return int(x) if float(x).is_integer() else float(x)


def from_hub(sd: dict[str, torch.Tensor], rename: bool = True) -> dict[str, torch.Tensor]:
    """Gemma's names (without `model.`) and norm weights (1 + w) -> ours, the norms in fp32 (`rename` False: Gemma 1's
    block, a Llama's norms under a Llama's names, only the weights shifted)."""
    out = {}
    for name, t in sd.items():
        m = _LAYER_NORM.match(name) if rename else None
        if m is not None:
            for hub, ours in _RENAMES:
                if m.group(2) == hub:
                    name = f"{m.group(1)}{ours}.weight"
                    break
        out[name] = t.float() + 1.0 if _NORM.search(name) else t
    return out


def to_hub(sd: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None,
           rename: bool = True) -> dict[str, torch.Tensor]:
    """Ours -> Gemma's names (without `model.`) and norm weights (w - 1, computed in fp32, then in `dtype` or the
    weight's own); `rename` False: Gemma 1's (the names as they are)."""
    back = {ours: hub for hub, ours in _RENAMES}
    out = {}
    for name, t in sd.items():
        m = _LAYER_NORM.match(name) if rename else None
        if m is not None and m.group(2) in back:
            name = f"{m.group(1)}{back[m.group(2)]}.weight"
        out[name] = (t.float() - 1.0).to(dtype or t.dtype) if _NORM.search(name) else t
    return out
