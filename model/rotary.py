"""Rotary position embeddings' cos / sin for the model's positions (model/llama.py's `rotary`, and Gemma 3's second
table, `rotary_local`, for its sliding layers at their own base).

Owns: the cos / sin tables of a head's rotation at a base with a scaling (model/rope_scaling.py computes the
frequencies), rebuilt in fp32 after any cast or move. Must never: be saved in a checkpoint (derived from the config).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from model.config import ModelConfig
from model.rope_scaling import attention_factor, base_inv_freq, scaled_inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of this batch ([B, T, 1, head_dim/2]), computed on the fly:
    they are tiny, and computing them per call makes packed-sample positions free."""

    def __init__(self, cfg: ModelConfig, local: bool = False, long: bool = False):
        """local: the sliding layers' table (Gemma 3's `rope_local_theta`, unscaled), else the model's; long:
        longrope's long factors (the table of sequences past original_max_position_embeddings), else its short."""
        super().__init__()
        self.long = long
        self.head_dim, self.max_seq_len = cfg.rotary_dim, cfg.max_seq_len  # (the rotated dimensions of a head)
        self.theta = cfg.rope_local_theta if local else cfg.rope_theta
        self.scaling = {} if local else (cfg.rope_scaling or {})
        self.attention_factor = attention_factor(self.scaling)  # YaRN's cos / sin factor, else 1
        # non-persistent: derived from the config, so never part of a checkpoint
        self.register_buffer("inv_freq", self._inv_freq(self.theta), persistent=False)
        self._build_tables()

    def _apply(self, fn, recurse=True):
        """`model.to(torch.bfloat16)` would cast inv_freq too: bf16 keeps 8 bits of it, so the angle
        position x inv_freq is off by up to ~0.4% (radians at positions in the hundreds). The frequencies
        are rebuilt in fp32 on the buffer's (new) device after any cast or move (also after `to_empty`)."""
        super()._apply(fn, recurse)
        self.inv_freq = self._inv_freq(self.theta, device=self.inv_freq.device)
        self._build_tables()
        return self

    def _build_tables(self) -> None:
        """cos/sin of positions 0 .. max_seq_len-1 ([L, D/2] fp32, non-persistent): `table` slices them.
        Read from memory instead of computed per call: under torch.compile Inductor fused the cos/sin
        computation into every layer's RoPE kernel, forward and backward (24 transcendental-bound kernels
        per 124M step on the H200, ~65 us each where the copy floor is ~25 us)."""
        if self.scaling.get("type") == "dynamic":
            self.cos_table = self.sin_table = None  # the base depends on the batch's length
            return
        device = self.inv_freq.device
        if device.type == "meta":  # shapes only: `to_empty` / `to` rebuild them (`_apply`)
            cos = sin = torch.empty(self.max_seq_len, self.head_dim // 2, device=device)
        else:
            cos, sin = (t[0, :, 0, :].contiguous() for t in self(torch.arange(self.max_seq_len, device=device)[None]))
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def table(self, start: int, length: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """cos/sin [1, length, 1, D/2] of positions start .. start+length-1 (the same values `forward`
        computes for them), or None where the table does not hold them (dynamic scaling, past max_seq_len)."""
        if self.cos_table is None or start + length > self.cos_table.shape[0]:
            return None
        return (self.cos_table[start:start + length][None, :, None, :],
                self.sin_table[start:start + length][None, :, None, :])

    def _inv_freq(self, theta: float, device=None) -> torch.Tensor:
        """The frequencies at base `theta` with the static scaling (linear, llama3, yarn, longrope) applied."""
        return scaled_inv_freq(self.head_dim, theta, self.scaling, device, long=self.long)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        if self.scaling.get("type") == "dynamic":
            # dynamic NTK (as HF): grow the base once the sequence exceeds the trained length
            factor, seq_len = self.scaling["factor"], int(positions.max().item()) + 1
            if seq_len > self.max_seq_len:
                d = self.head_dim
                base = self.theta * ((factor * seq_len / self.max_seq_len) - (factor - 1)) ** (d / (d - 2))
                inv_freq = base_inv_freq(d, base, device=positions.device)
        with torch.autocast(device_type=positions.device.type, enabled=False):
            freqs = positions[..., None].float() * inv_freq.float()  # [B, T, D/2], fp32
            cos, sin = freqs.cos(), freqs.sin()
            if self.attention_factor != 1.0:  # YaRN: cos and sin scaled, as transformers does
                cos, sin = cos * self.attention_factor, sin * self.attention_factor
            return cos[:, :, None, :], sin[:, :, None, :]
