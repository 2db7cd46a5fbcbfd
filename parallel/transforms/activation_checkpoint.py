"""Activation checkpointing as a transform: each Transformer block's activations are recomputed in the
backward instead of kept (the model's own `cfg.gradient_checkpointing` switch, read by
Transformer.forward per block with torch.utils.checkpoint, so every engine and kernel sees the same
blocks and the parameter names never change).

Owns: turning the switch on for --gradient_checkpointing=true, whatever the model came from (flags, our
checkpoint, Hugging Face).
Must never: turn off checkpointing a model was built with.
"""
from __future__ import annotations

from typing import Any

from torch import nn


def apply(model: nn.Module, mesh: Any, config: Any) -> None:
    if bool(getattr(config, "gradient_checkpointing", False)) and hasattr(model, "cfg"):
        model.cfg.gradient_checkpointing = True
