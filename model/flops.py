"""Training FLOPs per token and model FLOPs utilisation (MFU).

Owns: the FLOPs formula, the peak-FLOPs measurement (a short matmul benchmark, cached per
(device, dtype)) and the MFU helper. The peak comes from, in order: the `peak_flops` argument, the
PEAK_FLOPS environment variable, the measured matmul peak.

Formula (training = forward + backward, backward = 2x forward):
    flops_per_token = 6 * N  +  12 * n_layers * dim * seq_len
- N: parameters that take part in a matmul per token = all layer weights + the LM head
  (the embedding lookup is a gather, not a matmul; with tied embeddings the shared matrix counts once,
  as the LM head). Norm weights are included (negligible).
- 12 * L * d * T: attention scores QK^T and the weighted sum AV, 2 * T * d multiply-adds each per token
  per layer forward (4 * T * d FLOPs), times 3 for forward + backward. As in PaLM/nanoGPT the causal
  half is not discounted, so MFU is comparable with those reports.

Must never: assert speed, or run the benchmark at import time.
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from model.config import ModelConfig
from utils.device import get_peak_flops_override, synchronize

_PEAK_CACHE: dict[tuple[str, torch.dtype], float] = {}


def matmul_params(cfg: ModelConfig) -> int:
    d, hd, kv = cfg.dim, cfg.head_dim, cfg.n_kv_heads
    attn = d * (cfg.n_heads * hd) * 2 + d * (kv * hd) * 2  # q, o, k, v
    mlp = 3 * d * cfg.hidden_dim
    norms = 2 * d
    return cfg.n_layers * (attn + mlp + norms) + d + cfg.vocab_size * d  # + final norm + LM head


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of `cfg` at sequence length `seq_len`."""
    return 6.0 * matmul_params(cfg) + 12.0 * cfg.n_layers * cfg.dim * seq_len


def measure_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       n: Optional[int] = None, seconds: float = 1.0) -> float:
    """Best observed FLOP/s of a square matmul of size n in `dtype` on `device` (cached).

    PEAK_FLOPS in the environment overrides the measurement.
    """
    override = get_peak_flops_override()
    if override:
        return override
    device = torch.device(device)
    key = (str(device), dtype)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    if n is None:
        n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):  # warm-up: thread pools, kernel selection
        a @ b
    synchronize(device)
    best = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        synchronize(device)
        dt = time.perf_counter() - t0
        best = max(best, 2.0 * n ** 3 / dt)
    _PEAK_CACHE[key] = best
    return best


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_len: int, peak_flops: Optional[float] = None,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Achieved training FLOP/s as a fraction of the peak (argument > PEAK_FLOPS env > measured)."""
    peak = peak_flops or measure_peak_flops(device, dtype)
    return tokens_per_second * flops_per_token(cfg, seq_len) / peak
