"""The KV cache of generation (model/generate.py, model/decode.py, model/speculative.py, GRPO's rollouts): each layer's
keys and values preallocated, written in place as positions arrive.

Owns: `KVCache` (model/llama.py imports it: `model.llama.KVCache` stays) and `kv_heads_of`.
Must never: allocate per step (every buffer is made once, at the cache's full length).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from model.config import ModelConfig


def kv_heads_of(model: nn.Module) -> int:
    """The key/value heads of `model`'s attention on this rank (fewer under tensor parallelism)."""
    return model.cfg.n_kv_heads // int(getattr(model, "tensor_parallel_size", 1))


class KVCache:
    """Preallocated keys/values per layer ([B, n_kv_heads, max_len, head_dim]) for generation; `kv_heads`: this
    rank's key/value heads when they are fewer (tensor parallelism: n_kv_heads / tp, `kv_heads_of`). Multi-head
    latent attention's (model/mla.py): each token's latent and shared RoPE key as its one "key" [B, 1, max_len,
    kv_lora_rank + qk_rope_head_dim], no values. Positions past `pos` are free: moving `pos` back forgets them
    (speculative decoding's rejected drafts)."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device, dtype: torch.dtype,
                 kv_heads: Optional[int] = None, n_layers: Optional[int] = None):
        shape = (batch_size, kv_heads or cfg.n_kv_heads, max_len, cfg.head_dim)
        if cfg.kv_lora_rank:
            shape = (batch_size, 1, max_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        n_layers = cfg.n_layers if n_layers is None else n_layers  # fewer: a multi-token prediction depth's own
        # uninitialised: a position is read only after it is written (attention over [:pos + T])
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        v_shape = shape[:-1] + (0,) if cfg.kv_lora_rank else shape
        self.v = [torch.empty(v_shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.pos = 0
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        if self.pos + t > self.max_len:
            raise ValueError(f"KV cache overflow: {self.pos + t} > {self.max_len}")
        self.k[layer][:, :, self.pos:self.pos + t] = k
        self.v[layer][:, :, self.pos:self.pos + t] = v
        return self.k[layer][:, :, :self.pos + t], self.v[layer][:, :, :self.pos + t]
