"""Activation checkpointing as a transform: the Transformer blocks' activations are recomputed in the backward
instead of kept (the model's own `cfg.gradient_checkpointing` switch and `cfg.checkpoint_policy`, read by
Transformer.forward per block through model/checkpointing.py, so every engine and kernel sees the same blocks and
the parameter names never change).

Owns: `checkpoint_policy` (the flags' policy: --gradient_checkpointing=true or --activation_checkpoint=full is
`full`; --activation_checkpoint=selective is --selective_ac_option's `op` or N) and setting it on the model,
whatever the model came from (flags, our checkpoint, Hugging Face).
Must never: turn off checkpointing a model was built with.
"""
from __future__ import annotations

from typing import Any, Optional

from torch import nn


def checkpoint_policy(config: Any) -> Optional[str]:
    """The policy the flags ask for (model/checkpointing.py: full | op | "N"), None for none."""
    mode = str(getattr(config, "activation_checkpoint", "none"))
    if mode == "selective":
        return str(getattr(config, "selective_ac_option", "op")).strip()
    if mode == "memory_budget":  # (the compile transform's: no checkpoint in the model)
        return None
    if mode == "full" or bool(getattr(config, "gradient_checkpointing", False)):
        return "full"
    return None


def describe(config: Any) -> str:
    """The flags' checkpointing in words, for the [layout] line."""
    if str(getattr(config, "activation_checkpoint", "none")) == "memory_budget":
        return f"by the compiled graphs' memory budget ({float(config.activation_memory_budget):g})"
    return describe_policy(checkpoint_policy(config))


def describe_policy(policy: Optional[str]) -> str:
    """A model/checkpointing.py policy in words."""
    if policy is None:
        return "off"
    if policy in ("full", "op"):
        return {"full": "full (each block)", "op": "selective per op (attention and every other matmul kept)"}[policy]
    n = int(policy)
    return "full (each block)" if n == 1 else f"every {({2: '2nd', 3: '3rd'}).get(n, f'{n}th')} block"


def apply(model: nn.Module, mesh: Any, config: Any) -> None:
    policy = checkpoint_policy(config)
    if policy is not None and hasattr(model, "cfg"):
        model.cfg.gradient_checkpointing = True
        model.cfg.checkpoint_policy = policy
