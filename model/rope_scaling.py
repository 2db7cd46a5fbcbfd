"""RoPE's frequencies under a scaling setting (utils/rope_config.py says which kinds and what their fields mean).

Owns: the inverse frequencies of a head of `head_dim` at base `theta`, and the static scalings' changes to them
(linear, llama3, yarn) and YaRN's cos / sin factor, computed in fp32 in transformers' order of operations so that an
imported checkpoint rotates by the same angles (tests/model/test_rope_scaling.py compares them bit for bit).
Dynamic NTK depends on the batch's length: model/rotary.py RotaryEmbedding computes it per call with `base_inv_freq`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


def base_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """theta ** (-2i / head_dim) for i < head_dim / 2, fp32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)  # long waves: interpolated
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, s: dict, device) -> torch.Tensor:
    factor, original = s["factor"], s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # (transformers': no division by zero)
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).to(device=device, dtype=torch.float)  # 1: the original frequency kept
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(device=device, dtype=torch.float) / head_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def scaled_inv_freq(head_dim: int, theta: float, scaling: Optional[dict], device=None,
                    long: bool = False) -> torch.Tensor:
    """The inverse frequencies positions rotate at: theta's, changed by a static scaling (none and dynamic:
    unchanged here); longrope's (Phi-3's): theta's divided per frequency by its short factors, or by its long ones
    (`long`: for sequences past original_max_position_embeddings), in transformers' order of operations."""
    kind = (scaling or {}).get("type")
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, device)
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        if factors.numel() != head_dim // 2:
            raise ValueError(f"rope_scaling longrope: {factors.numel()} factors for the {head_dim // 2} frequencies "
                             f"of the {head_dim} rotated dimensions")
        return 1.0 / (factors * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float()
                                          / head_dim))
    inv_freq = base_inv_freq(head_dim, theta, device)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def attention_factor(scaling: Optional[dict]) -> float:
    """What cos and sin are multiplied by: YaRN's and longrope's attention factor, 1 otherwise."""
    kind = (scaling or {}).get("type")
    return float((scaling or {}).get("attention_factor", 1.0)) if kind in ("yarn", "longrope") else 1.0
