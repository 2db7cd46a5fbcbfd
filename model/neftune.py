"""NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning"): while training, uniform
noise is added to the input embeddings, each element drawn from [-a, a] with a = alpha / sqrt(L x d) (L the row's
length, d the model's width), as transformers' Trainer and TRL's SFTTrainer add it for `neftune_noise_alpha`
(transformers' `neftune_post_forward_hook`: L is the padded or packed row's length, not a document's).

Owns: `add_neftune` (the forward hook on the embedding) and `noise_bound`.
Must never: touch an evaluation's or a generation's forward (the module in eval mode), or draw from anything but
the torch generator of the embedding's device (whose state the checkpoints hold, so a resumed run draws the same).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


def noise_bound(alpha: float, length: int, dim: int) -> float:
    """a = alpha / sqrt(length x dim): the noise of each element is uniform in [-a, a]."""
    return alpha / math.sqrt(length * dim)


def add_neftune(model: nn.Module, alpha: float) -> RemovableHandle:
    """Register NEFTune's noise on `model.embed_tokens`' output [B, L, d] in training mode; the handle removes it."""
    def noisy(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return out
        a = noise_bound(alpha, out.shape[1], out.shape[2])
        return out + torch.empty_like(out).uniform_(-a, a)
    return model.embed_tokens.register_forward_hook(noisy)
