"""Multi-head latent attention (MLA, DeepSeek-V2 / V3): each token's keys and values come from one small latent.

Per token x: queries q = q_b_proj(norm(q_a_proj(x))) (or q_proj(x) without a query latent), n_heads heads of
qk_nope_head_dim + qk_rope_head_dim; kv_a_proj_with_mqa(x) gives the latent c (kv_lora_rank values, RMS-normed) and
one RoPE'd key part k_rot that every head shares; kv_b_proj(c) gives each head's k_nope (qk_nope_head_dim) and value
(v_head_dim); a head's key is [k_nope, k_rot], its query [q_nope, rotated q_rot]. Scores are q.k / sqrt(nope + rope)
(times YaRN's mscale(factor, mscale_all_dim)^2 where the RoPE scaling names mscale_all_dim, as transformers scales).
RoPE is ours (half-split pairs); a Hub checkpoint's interleaved pairs are permuted on import and export
(model/hf_deepseek_v3.py). The parameter names are transformers' DeepseekV3Attention's.

Training and whole-sequence forwards run model/attend.py's kernels, as the grouped-query module does: SDPA takes
values narrower than the keys; for the kernels that need one width (flash-attn, FlashAttention-4, context
parallelism's ring, FlexAttention) the values are zero-padded to the keys' width and the padding cut from the output
(exact: a padded column's output is 0, its gradient dropped).

Generation caches what MLA was made for: each token's normed latent and its shared RoPE key (model/llama.py KVCache:
kv_lora_rank + qk_rope_head_dim values per token and layer; DeepSeek-V3's 576 against 128 heads x 2 x 192 expanded),
and attends over it with kv_b_proj absorbed into the query and the output (`latent_attention`).
Must never: import model/llama.py (which builds this class; the norm class comes in as an argument).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import attention, kernels
from model.attend import attend
from model.attention import AttnSpec


def mla_softmax_factor(cfg) -> Optional[float]:
    """The factor on the scores beyond 1 / sqrt(head width): YaRN's mscale(factor, mscale_all_dim)^2 where the RoPE
    scaling is YaRN with mscale_all_dim (transformers' yarn_apply_mscale), else None."""
    s = cfg.rope_scaling or {}
    if s.get("type") != "yarn" or not s.get("mscale_all_dim"):
        return None
    from utils.rope_config import yarn_mscale
    return yarn_mscale(float(s["factor"]), float(s["mscale_all_dim"])) ** 2


# the latents' RMSNorm epsilon: DeepSeek's (and transformers' DeepseekV3RMSNorm default), whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    def __init__(self, cfg, layer_idx: int, norm_cls):
        super().__init__()
        self.layer_idx = layer_idx
        h, self.q_lora_rank, self.kv_lora_rank = cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.head_dim = self.nope + self.rope_dim
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.dim, self.q_lora_rank, bias=False)
            self.q_a_layernorm = norm_cls(self.q_lora_rank, LATENT_NORM_EPS, cfg.fused_rmsnorm, cfg.kernel_backend)
            self.q_b_proj = nn.Linear(self.q_lora_rank, h * self.head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.dim, h * self.head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = norm_cls(self.kv_lora_rank, LATENT_NORM_EPS, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, cfg.dim, bias=False)
        factor = mla_softmax_factor(cfg)  # (applied to q: every kernel keeps its 1 / sqrt(head width))
        self.q_scale = factor
        self.attn_dropout = cfg.attn_dropout
        self.resid_dropout = nn.Dropout(cfg.resid_dropout)
        self.fused_rope, self.backend = cfg.fused_rope, cfg.kernel_backend
        self.fused_qkv = False  # (the grouped-query module's switch; nothing here to concatenate)
        # tensor parallelism sets this (parallel/transforms/tensor_parallel.py): the shared RoPE key's gradient summed
        # over the tensor ranks, each of which used it for its own heads only
        self.shared_key_grad = None

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, dim] -> [B, T, heads, nope + rope], before RoPE."""
        q = self.q_proj(x) if not self.q_lora_rank else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], x.shape[1], -1, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: AttnSpec,
                cache=None) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.queries(x)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_nope, q_rot = q.split((self.nope, self.rope_dim), dim=-1)
        q_rot, k_rot = kernels.apply_rope_qk(q_rot.contiguous(), k_rot.reshape(B, T, 1, self.rope_dim).contiguous(),
                                             cos, sin, fused=self.fused_rope, backend=self.backend)
        if self.shared_key_grad is not None:
            k_rot = self.shared_key_grad(k_rot)
        if cache is not None:
            y = self.latent_attention(q_nope, q_rot, latent, k_rot, spec, cache)
        else:
            kv = self.kv_b_proj(latent).view(B, T, -1, self.nope + self.v_dim)
            k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
            heads = q.shape[2]
            q = torch.cat((q_nope, q_rot), dim=-1)
            k = torch.cat((k_nope, k_rot.expand(B, T, heads, self.rope_dim)), dim=-1)
            if self.q_scale is not None:
                q = q * self.q_scale
            pad = self.head_dim - self.v_dim if spec.kind not in ("sdpa", "sdpa_masked") else 0
            v = F.pad(v, (0, pad)) if pad else v.contiguous()
            y = attend(q, k, v, spec, self.attn_dropout if self.training else 0.0)
            y = y[..., :self.v_dim] if pad else y
        return self.resid_dropout(self.o_proj(y.reshape(B, T, -1)))

    def latent_attention(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor, k_rot: torch.Tensor,
                         spec: AttnSpec, cache, layer: Optional[int] = None) -> torch.Tensor:
        """Generation over the latent cache (`cache` keeps [latent, k_rot] per token): kv_b_proj's key half absorbed
        into the query (q_nope W_uk . c = k_nope . q_nope), attention of [q_nope W_uk, q_rot] over [c, k_rot] with c
        as the values, then its value half applied to the output: [B, T, heads, v_head_dim], the expanded keys and
        values never built (DeepSeek-V2's inference form). The same scores as `forward`'s, in another order. `layer`:
        the cache's layer (model/decode.py's own count: a multi-token prediction depth's one-layer cache), else this
        block's index."""
        heads = q_nope.shape[2]
        w = _effective_weight(self.kv_b_proj)
        w = (w.to_local() if hasattr(w, "to_local") else w).view(heads, self.nope + self.v_dim, self.kv_lora_rank)
        q_latent = torch.einsum("bthn,hnr->bhtr", q_nope, w[:, :self.nope].to(q_nope.dtype))
        q = torch.cat((q_latent, q_rot.transpose(1, 2)), dim=-1)  # [B, heads, T, rank + rope]
        if self.q_scale is not None:
            q = q * self.q_scale
        step = torch.cat((latent, k_rot.squeeze(2)), dim=-1)[:, None]  # [B, 1, T, rank + rope]
        keys, _ = cache.update(self.layer_idx if layer is None else layer, step, step[..., :0])
        y = attention.sdpa_attention(q, keys, keys[..., :self.kv_lora_rank], spec, 0.0, scale=self.head_dim ** -0.5)
        return torch.einsum("bhtr,hvr->bthv", y, w[:, self.nope:].to(y.dtype))


def _effective_weight(linear: nn.Module) -> torch.Tensor:
    """The weight a projection applies: a LoRA-wrapped one's (model/lora.py) with its adapter's product added (a
    DTensor under tensor parallelism: this rank's heads' rows once made local)."""
    if hasattr(linear, "lora_B"):
        return linear.weight + linear.scaling * (linear.lora_B.weight @ linear.lora_A.weight)
    return linear.weight
