"""model package: the Llama2 model, its kernels, loss, generation, FLOPs, HF interop and LoRA.

Public entry points: `ModelConfig`, `Transformer` (see docs/model.md and docs/INTERFACES.md).
"""
from model.config import ModelConfig
from model.llama import KVCache, Transformer

__all__ = ["ModelConfig", "Transformer", "KVCache"]
