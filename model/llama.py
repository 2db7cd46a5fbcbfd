"""The Llama2 model in one file: embedding -> N x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU) -> RMSNorm -> LM head.

Owns: the module tree and its parameter names (HF Llama names without the `model.` prefix, e.g.
`layers.0.self_attn.q_proj.weight`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`), rotary
embeddings (half-split layout as HF, linear and dynamic-NTK scaling), attention masking for padding and
packed samples (a right-padded-only batch needs no mask: SDPA's is_causal is exact at real positions), the
KV cache used by model/generate.py, and activation checkpointing.

Must never: register a full causal-mask buffer (trap 12: masks are built per batch only when padding or
packing needs one, otherwise SDPA's is_causal), let parameter names depend on which kernel ran (trap 11),
cast itself to a precision (the trainer owns precision, trap 10), or write accelerator literals.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from model import kernels
from model.config import ModelConfig
from model.loss import lm_head_loss


# -------------------------------------------------------------------------------------- RMSNorm
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: bool = True, backend: str = "auto"):
        super().__init__()
        self.eps, self.fused, self.backend = eps, fused, backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, fused=self.fused, backend=self.backend)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), fused into one kernel where Triton runs."""
        return kernels.add_rms_norm(x, residual, self.weight, self.eps, fused=self.fused, backend=self.backend)


# ----------------------------------------------------------------------------------------- RoPE
class RotaryEmbedding(nn.Module):
    """cos/sin tables for the positions of this batch ([B, T, 1, head_dim/2]), computed on the fly:
    they are tiny, and computing them per call makes packed-sample positions free."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim, self.theta, self.max_seq_len = cfg.head_dim, cfg.rope_theta, cfg.max_seq_len
        self.scaling = cfg.rope_scaling or {}
        # non-persistent: derived from the config, so never part of a checkpoint
        self.register_buffer("inv_freq", self._inv_freq(self.theta), persistent=False)

    def _inv_freq(self, theta: float, device=None) -> torch.Tensor:
        d = self.head_dim
        return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq
        kind, factor = self.scaling.get("type"), self.scaling.get("factor", 1.0)
        if kind == "linear":
            inv_freq = inv_freq / factor  # positions stretched by `factor`
        elif kind == "dynamic":
            # dynamic NTK (as HF): grow the base once the sequence exceeds the trained length
            seq_len = int(positions.max().item()) + 1
            if seq_len > self.max_seq_len:
                d = self.head_dim
                base = self.theta * ((factor * seq_len / self.max_seq_len) - (factor - 1)) ** (d / (d - 2))
                inv_freq = self._inv_freq(base, device=positions.device)
        with torch.autocast(device_type=positions.device.type, enabled=False):
            freqs = positions[..., None].float() * inv_freq.float()  # [B, T, D/2], fp32
            return freqs.cos()[:, :, None, :], freqs.sin()[:, :, None, :]


# ------------------------------------------------------------------------------------ attention
@dataclass
class AttnSpec:
    """How this batch attends: built once per forward, shared by all layers."""
    is_causal: bool = True
    mask: Optional[torch.Tensor] = None        # bool [B or 1, 1, Tq, Tk], True = attend
    cu_seqlens: Optional[torch.Tensor] = None  # packed samples, for flash_attn_varlen_func
    max_seqlen: int = 0
    flash: Optional[tuple] = None              # (flash_attn_func, flash_attn_varlen_func) or None


class KVCache:
    """Preallocated keys/values per layer ([B, n_kv_heads, max_len, head_dim]) for generation."""

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device, dtype: torch.dtype):
        shape = (batch_size, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layers)]
        self.pos = 0
        self.max_len = max_len

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = k.shape[2]
        if self.pos + t > self.max_len:
            raise ValueError(f"KV cache overflow: {self.pos + t} > {self.max_len}")
        self.k[layer][:, :, self.pos:self.pos + t] = k
        self.v[layer][:, :, self.pos:self.pos + t] = v
        return self.k[layer][:, :, :self.pos + t], self.v[layer][:, :, :self.pos + t]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.attn_dropout = cfg.attn_dropout
        self.resid_dropout = nn.Dropout(cfg.resid_dropout)
        self.fused_rope, self.fused_qkv, self.backend = cfg.fused_rope, cfg.fused_qkv, cfg.kernel_backend

    def _qkv(self, x: torch.Tensor):
        # One matmul instead of three when the projections are plain Linear layers (not LoRA-wrapped).
        # The parameters stay separate (HF names); only the compute is concatenated.
        if self.fused_qkv and all(type(m) is nn.Linear for m in (self.q_proj, self.k_proj, self.v_proj)):
            w = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            return F.linear(x, w).split((nq, nkv, nkv), dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: AttnSpec,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q, k = kernels.apply_rope_qk(q, k, cos, sin, fused=self.fused_rope, backend=self.backend)
        dropout = self.attn_dropout if self.training else 0.0

        if spec.flash is not None and cache is None and spec.mask is None:
            flash_func, flash_varlen = spec.flash
            if spec.cu_seqlens is not None:  # packed samples: attend within each sample only
                y = flash_varlen(q.reshape(B * T, self.n_heads, self.head_dim),
                                 k.reshape(B * T, self.n_kv_heads, self.head_dim),
                                 v.reshape(B * T, self.n_kv_heads, self.head_dim),
                                 spec.cu_seqlens, spec.cu_seqlens, spec.max_seqlen, spec.max_seqlen,
                                 dropout_p=dropout, causal=True)
            else:
                y = flash_func(q, k, v, dropout_p=dropout, causal=True)  # GQA handled natively
            y = y.reshape(B, T, self.n_heads * self.head_dim)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, T, D]
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v)
            if self.n_kv_heads != self.n_heads:
                # expand shared kv heads (a view, materialised by SDPA); avoids enable_gqa fallbacks
                rep = self.n_heads // self.n_kv_heads
                Tk = k.shape[2]
                k = k[:, :, None].expand(B, self.n_kv_heads, rep, Tk, self.head_dim).reshape(B, self.n_heads, Tk, self.head_dim)
                v = v[:, :, None].expand(B, self.n_kv_heads, rep, Tk, self.head_dim).reshape(B, self.n_heads, Tk, self.head_dim)
            out_dtype = q.dtype
            adt = kernels.sdpa_dtype(q.device, q.dtype, self.head_dim)
            q, k, v = q.to(adt), k.to(adt), v.to(adt)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=spec.mask, dropout_p=dropout,
                                               is_causal=spec.is_causal and spec.mask is None)
            y = y.to(out_dtype).transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self.resid_dropout(self.o_proj(y))


# ------------------------------------------------------------------------------------------ MLP
class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.resid_dropout = nn.Dropout(cfg.resid_dropout)
        self.fused_swiglu, self.fused_qkv, self.backend = cfg.fused_swiglu, cfg.fused_qkv, cfg.kernel_backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_qkv and type(self.gate_proj) is nn.Linear and type(self.up_proj) is nn.Linear:
            gate, up = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight))).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.resid_dropout(self.down_proj(kernels.swiglu(gate, up, fused=self.fused_swiglu, backend=self.backend)))


# ---------------------------------------------------------------------------------------- block
class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, spec: AttnSpec, cache: Optional[KVCache] = None):
        attn = self.self_attn(self.input_layernorm(x), cos, sin, spec, cache)
        y, x = self.post_attention_layernorm.add_forward(attn, x)  # x + attn, and its norm (one kernel on GPU)
        return x + self.mlp(y)


# ---------------------------------------------------------------------------------- transformer
def _segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Sample id per token of packed rows: a new sample starts wherever the position does not
    continue the previous one (e.g. resets to 0)."""
    start = torch.ones_like(position_ids, dtype=torch.bool)
    start[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return start.cumsum(dim=1)


def _right_padded(attention_mask: torch.Tensor) -> bool:
    """True if no row of the [B, T] mask has a real token (non-zero) after a pad (zero)."""
    am = attention_mask.to(torch.bool)
    return not bool((am[:, 1:] & ~am[:, :-1]).any())


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)
        self.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=self.cfg.initializer_range)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # shared (tied) tensors counted once
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
        return n

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.embed_tokens.weight.dtype

    def _attn_spec(self, B: int, T: int, positions: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   position_ids_given: bool, cache: Optional[KVCache]) -> AttnSpec:
        device = positions.device
        past = cache.pos if cache is not None else 0
        Tk = past + T
        flash = kernels.flash_attn_functions(device) if self.cfg.flash_attn else None
        if flash is not None and self._compute_dtype(device) not in (torch.float16, torch.bfloat16):
            flash = None  # flash-attn kernels exist for half precisions only
        if flash is not None and attention_mask is None and cache is None and position_ids_given:
            seg = _segments(positions)
            if bool((seg[:, -1] > 1).any()) and flash[1] is not None:
                # cumulative sample lengths over the flattened batch for flash_attn_varlen_func
                counts = torch.cat([torch.unique_consecutive(s, return_counts=True)[1] for s in seg])
                cu = F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)
                return AttnSpec(is_causal=True, cu_seqlens=cu, max_seqlen=int(counts.max()), flash=flash)
        need_mask = attention_mask is not None or (cache is not None and past > 0 and T > 1)
        seg = None
        if position_ids_given and cache is None:
            seg = _segments(positions)
            if bool((seg[:, -1] > 1).any()):
                need_mask = True
            else:
                seg = None
        if attention_mask is not None and attention_mask.shape[-1] != Tk:
            raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns, expected {Tk}")
        if need_mask and seg is None and cache is None and _right_padded(attention_mask):
            # Right padding only (each row: 1s then 0s): a real token never sees a later pad under the
            # causal mask, so is_causal gives identical outputs at every real position and the
            # [B, 1, T, T] mask (and SDPA's slower masked path) is skipped. Outputs at pad positions
            # differ (they also see earlier pads): they are unspecified, as is their loss (labels -100).
            need_mask = False
        if not need_mask:
            if cache is not None and past > 0:  # one new query sees every cached key
                return AttnSpec(is_causal=False)
            return AttnSpec(is_causal=True, flash=flash if cache is None else None)
        q_idx = torch.arange(past, Tk, device=device)
        k_idx = torch.arange(Tk, device=device)
        mask = (k_idx[None, :] <= q_idx[:, None])[None, None]  # [1, 1, T, Tk] causal
        if seg is not None:
            mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
        if attention_mask is not None:
            am = attention_mask.to(torch.bool)
            mask = mask & am[:, None, None, :]
            # a padded query row with no visible key would give NaN (and NaN gradients): let it see itself
            mask = mask | (k_idx[None, :] == q_idx[:, None])[None, None]
        return AttnSpec(is_causal=False, mask=mask)

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                reduction: str = "mean", attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, *, cache: Optional[KVCache] = None,
                logits_to_keep: int = 0) -> torch.Tensor:
        """Logits [B, T, V] without labels; the loss of the chunked linear+CE with labels.

        labels are already shifted (labels[t] is the token after input_ids[t]), -100 = ignored.
        attention_mask [B, T(+cached)] marks real tokens (1) vs padding (0). position_ids [B, T] of
        packed samples restart at each sample, which also restricts attention to the sample.
        cache / logits_to_keep are for generation (logits of the last `logits_to_keep` positions).
        """
        B, T = input_ids.shape
        past = cache.pos if cache is not None else 0
        if position_ids is None:
            positions = torch.arange(past, past + T, device=input_ids.device)[None].expand(B, T)
        else:
            positions = position_ids.expand(B, T) if position_ids.shape[0] == 1 else position_ids
        spec = self._attn_spec(B, T, positions, attention_mask, position_ids is not None, cache)
        cos, sin = self.rotary(positions)

        h = self.embed_tokens(input_ids)
        ckpt = self.cfg.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in self.layers:
            if ckpt:
                h = checkpoint(layer, h, cos, sin, spec, cache, use_reentrant=False)
            else:
                h = layer(h, cos, sin, spec, cache)
        if cache is not None:
            cache.pos += T
        h = self.norm(h)

        if labels is None:
            if logits_to_keep:
                h = h[:, -logits_to_keep:]
            return self.lm_head(h)
        return lm_head_loss(h, self.lm_head.weight, labels, reduction, self.cfg)
