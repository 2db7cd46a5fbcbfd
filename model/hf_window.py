"""Sliding-window attention in Hugging Face configs, both ways (model/hf_interop.py calls these).

Owns: reading a config.json's window into ModelConfig's `sliding_window` / `sliding_layers` (Mistral v0.1 and Mixtral:
every layer; Qwen2 / Qwen3 / Qwen3-MoE with use_sliding_window: the layers from max_window_layers on, or the
"sliding_attention" entries of transformers 5's layer_types), and writing ours into the family's fields (a Llama
whose every layer slides is written as a Mistral, the family transformers gives a window to); a pattern the family
cannot hold is a ValueError naming it. A window as long as the model's positions never cuts anything: none.
Must never: import transformers (plain dicts only).
"""
from __future__ import annotations

from typing import Any, Optional

QWEN_TYPES = ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "smollm3")  # (a use_sliding_window switch, per-layer types)


def window_from_hf(d: dict, kind: str, n_layers: int) -> dict[str, Any]:
    """ModelConfig's sliding_window / sliding_layers of a config.json dict of model_type `kind` ({} without one)."""
    if kind in QWEN_TYPES and not d.get("use_sliding_window"):
        return {}
    window = d.get("sliding_window")
    if kind == "glm4_moe" or window is None or window >= d.get("max_position_embeddings", 2048):
        return {}
    types = d.get("layer_types")
    if isinstance(types, list) and len(types) == n_layers and kind in QWEN_TYPES:
        layers: Optional[list] = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif kind in QWEN_TYPES:
        layers = list(range(int(d.get("max_window_layers", 0)), n_layers))
    else:  # Mistral, Mixtral: every layer
        layers = None
    if layers == list(range(n_layers)):
        layers = None
    if layers == []:
        return {}
    return {"sliding_window": int(window), "sliding_layers": layers}


def window_to_hf(cfg: Any, kind: str) -> dict[str, Any]:
    """The config.json fields that give a family of model_type `kind` (llama, qwen2, qwen3, mixtral, qwen3_moe,
    glm4_moe) our model's window; ValueError where the family cannot hold its pattern."""
    if not cfg.sliding_window or cfg.sliding_layers == []:
        return {}
    every = cfg.sliding_layers is None or sorted(cfg.sliding_layers) == list(range(cfg.n_layers))
    if kind in QWEN_TYPES:
        first = 0 if every else min(cfg.sliding_layers)
        if not every and sorted(cfg.sliding_layers) != list(range(first, cfg.n_layers)):
            raise ValueError(f"sliding_layers={cfg.sliding_layers}: a {kind} slides in its last layers only "
                             "(from max_window_layers on)")
        return {"use_sliding_window": True, "sliding_window": cfg.sliding_window, "max_window_layers": first,
                "layer_types": ["sliding_attention" if i >= first else "full_attention" for i in range(cfg.n_layers)]}
    if kind == "glm4_moe":
        raise ValueError("sliding-window attention: GLM-4-MoE has none")
    if not every:
        raise ValueError(f"sliding_layers={cfg.sliding_layers}: a Mistral / Mixtral slides in every layer (Qwen2 and "
                         "Qwen3 in their last ones)")
    out: dict[str, Any] = {"sliding_window": cfg.sliding_window}
    if kind == "llama":  # the Llama family with a window is transformers' Mistral
        out.update(architectures=["MistralForCausalLM"], model_type="mistral")
    return out
