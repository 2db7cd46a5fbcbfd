"""The Llama2 model in one file: embedding -> N x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU) -> RMSNorm -> LM head.

Owns: the module tree and its parameter names (HF Llama names without the `model.` prefix, e.g.
`layers.0.self_attn.q_proj.weight`, `embed_tokens.weight`, `norm.weight`, `lm_head.weight`), where rotary
embeddings apply (half-split layout as HF, or on a head's first dimensions only: a partial rotary; their tables are
model/rotary.py's), Gemma 3's, OLMo's and Ministral 3's block switches (model/config.py), the KV cache used by
model/generate.py, activation checkpointing, and pruning (`Transformer.pruned`: a Transformer holding some of a
model's own submodules, which parallel/pipeline.py's stages are; one forward serves both).
Which attention kernel runs, and how padding and packed documents are masked, is model/attention.py's
(`AttnSpec`, built once per forward from which inputs are present, never from their values: no host
sync, no graph break); FlashAttention-4's activation is model/fa4.py's, asked once here when a model is built.

Must never: register a full causal-mask buffer (trap 12: masks are built per batch only when padding or
packing needs one, otherwise SDPA's is_causal), let parameter names depend on which kernel ran (trap 11),
cast itself to a precision (the trainer owns precision, trap 10), write accelerator literals, or branch
on a tensor's value in the forward (DESIGN.md, host syncs).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

from model import attention, fa4, kernels
from model.attend import attend
from model.attention import AttnSpec
from model.checkpointing import run_block
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.loss import lm_head_loss
from model.mla import LatentAttention
from model.moe import MoEFeedForward
from model.moe_experts import GroupedExperts
from model.mtp import MultiTokenPrediction
from model.rotary import RotaryEmbedding
from model.softcap import softcap
from model.token_logprobs import token_logprobs


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


# ------------------------------------------------------------------------------------ attention
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)
        # gpt-oss's attention sinks: one logit per query head in the softmax's denominator (model/attention.py
        # sink_attention); 0 at initialisation (an extra exp(0) = 1 beside the keys' terms)
        self.sinks = nn.Parameter(torch.zeros(cfg.n_heads)) if cfg.attn_sinks else None
        self.softcap = cfg.attn_softcap  # (Gemma 2's cap on the scores: model/attention.py softcap_attention)
        if cfg.qk_norm:  # Qwen3: each head's q and k RMS-normalised (one weight over head_dim, shared by the heads);
            # OLMo 2 (qk_norm_full): one norm over all the heads' q, one over all k, before they split into heads
            q_width, k_width = (cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim) if cfg.qk_norm_full \
                else (cfg.head_dim, cfg.head_dim)
            self.q_norm = RMSNorm(q_width, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
            self.k_norm = RMSNorm(k_width, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.qk_norm, self.sliding = cfg.qk_norm and not cfg.qk_norm_full, cfg.slides(layer_idx)
        self.qk_norm_full = cfg.qk_norm_full
        self.rope = layer_idx not in (cfg.nope_layers or ())  # (SmolLM3's NoPE layers: no rotation)
        self.rotary_dim = cfg.rotary_dim  # (GLM-4.5: half of each head turns, the rest passes through)
        # Gemma's query_pre_attn_scalar: scores q.k / sqrt(query_scale), as q x sqrt(head_dim / query_scale) before the
        # kernels' 1 / sqrt(head_dim) (every attention path unchanged)
        self.q_scale = (cfg.head_dim / cfg.query_scale) ** 0.5 if cfg.query_scale not in (None, cfg.head_dim) else None
        self.attn_dropout, self.resid_dropout = cfg.attn_dropout, nn.Dropout(cfg.resid_dropout)
        self.fused_rope, self.fused_qkv, self.backend = cfg.fused_rope, cfg.fused_qkv, cfg.kernel_backend

    def _qkv(self, x: torch.Tensor):
        # One matmul instead of three when the projections are plain Linear layers (not LoRA-wrapped).
        # The parameters stay separate (HF names); only the compute is concatenated.
        # v is copied out of the one output: a view would keep the pre-RoPE q and k alive until backward
        # (SDPA saves v; RoPE saves only cos/sin), [h + hk] more per token than the copy's [hk].
        if (self.fused_qkv and all(type(m) is nn.Linear for m in (self.q_proj, self.k_proj, self.v_proj))
                and kernels.concat_projections(x, self.backend)):
            qkv = kernels.concat_linear(x, (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))
            if self.q_proj.bias is not None:  # (Qwen2's q/k/v biases)
                qkv = qkv + torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias))
            nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
            q, k, v = qkv.split((nq, nkv, nkv), dim=-1)
            return q, k, v.contiguous()
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spec: AttnSpec,
                cache: Optional[KVCache] = None) -> torch.Tensor:
        B, T, _ = x.shape
        q_factor = spec.q_factor  # (Ministral 3's per-position query scale: every layer's)
        if self.sliding and spec.windowed is not None:  # (the batch is longer than the window)
            spec = spec.windowed
        q, k, v = self._qkv(x)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        # heads from the shapes: under tensor parallelism (parallel/transforms/tensor_parallel.py) q/k/v hold this
        # rank's heads only (n_heads / tp and n_kv_heads / tp, contiguous, so GQA's grouping stays local)
        q = q.view(B, T, -1, self.head_dim)
        k = k.view(B, T, -1, self.head_dim)
        v = v.view(B, T, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope and self.rotary_dim < self.head_dim:
            r = self.rotary_dim
            qr, kr = kernels.apply_rope_qk(q[..., :r].contiguous(), k[..., :r].contiguous(), cos, sin,
                                           fused=self.fused_rope, backend=self.backend)
            q, k = torch.cat((qr, q[..., r:]), dim=-1), torch.cat((kr, k[..., r:]), dim=-1)
        elif self.rope:
            q, k = kernels.apply_rope_qk(q, k, cos, sin, fused=self.fused_rope, backend=self.backend)
        if self.q_scale is not None:
            q = q * self.q_scale
        if q_factor is not None:
            q = q * q_factor[:, :, None, None].to(q.dtype)
        sinks = self.sinks
        if sinks is not None and hasattr(sinks, "to_local"):  # (tensor parallel: this rank's heads' sinks)
            sinks = sinks.to_local()
        y = attend(q, k, v, spec, self.attn_dropout if self.training else 0.0, cache, self.layer_idx, sinks,
                   self.softcap)
        return self.resid_dropout(self.o_proj(y.reshape(B, T, -1)))


# ------------------------------------------------------------------------------------------ MLP
class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.down_proj = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.resid_dropout = nn.Dropout(cfg.resid_dropout)
        self.fused_swiglu, self.fused_qkv, self.backend = cfg.fused_swiglu, cfg.fused_qkv, cfg.kernel_backend
        self.act = cfg.mlp_act  # silu (SwiGLU) or gelu_tanh (Gemma's GeGLU: plain PyTorch, which compile fuses)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.fused_qkv and type(self.gate_proj) is nn.Linear and type(self.up_proj) is nn.Linear
                and kernels.concat_projections(x, self.backend)):
            gate_up = kernels.concat_linear(x, (self.gate_proj.weight, self.up_proj.weight))
            if self.act == "silu":
                y = kernels.swiglu_packed(gate_up, fused=self.fused_swiglu, backend=self.backend)
            else:
                y = kernels.geglu(*gate_up.chunk(2, dim=-1))
        elif self.act == "silu":
            y = kernels.swiglu(self.gate_proj(x), self.up_proj(x), fused=self.fused_swiglu, backend=self.backend)
        else:
            y = kernels.geglu(self.gate_proj(x), self.up_proj(x))
        return self.resid_dropout(self.down_proj(y))


# ---------------------------------------------------------------------------------------- block
class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        if cfg.pre_norms:  # (OLMo 2 has none: its norms are the sublayers' output norms below)
            self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        # DeepSeek's multi-head latent attention where kv_lora_rank is set (model/mla.py)
        self.self_attn = LatentAttention(cfg, layer_idx, RMSNorm) if cfg.kv_lora_rank else Attention(cfg, layer_idx)
        if cfg.pre_norms:
            self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.mlp = MoEFeedForward(cfg) if cfg.is_moe_layer(layer_idx) else MLP(cfg)
        if cfg.sandwich_norms:  # Gemma's and OLMo's norms of the attention's and the MLP's outputs (their checkpoints'
            # post_attention_layernorm, post_feedforward_layernorm; Gemma's pre_feedforward_layernorm is our
            # post_attention_layernorm)
            self.attn_output_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
            self.mlp_output_norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.sandwich, self.pre_norms = cfg.sandwich_norms, cfg.pre_norms
        self.local_rope = cfg.rope_local_theta is not None and cfg.slides(layer_idx)  # (Gemma 3: `rotary_local`'s)
        self.residual_scale = cfg.residual_multiplier  # (Granite's: each sublayer's output times it; None: 1)

    def forward(self, x, cos, sin, spec: AttnSpec, cache: Optional[KVCache] = None):
        attn = self.self_attn(self.input_layernorm(x) if self.pre_norms else x, cos, sin, spec, cache)
        if self.sandwich:
            attn = self.attn_output_norm(attn)
        if self.residual_scale is not None:
            attn = attn * self.residual_scale
        if self.pre_norms:
            y, x = self.post_attention_layernorm.add_forward(attn, x)  # x + attn, and its norm (one kernel on GPU)
        else:
            x = y = x + attn
        y = self.mlp_output_norm(self.mlp(y)) if self.sandwich else self.mlp(y)
        return x + (y if self.residual_scale is None else y * self.residual_scale)


# ---------------------------------------------------------------------------------- transformer


def _longrope(cfg: ModelConfig) -> bool:
    return (cfg.rope_scaling or {}).get("type") == "longrope"


def blocks_of(layers: nn.Module) -> list[nn.Module]:
    """The transformer blocks of a `layers` container in order: a full model's nn.ModuleList, or a pruned
    model's (a pipeline stage's) nn.ModuleDict keyed by global layer index."""
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


class Transformer(nn.Module):
    """The full model (`layers` an nn.ModuleList), or a pruned part of one (`pruned`): `embed_tokens`
    None (the input is the hidden state [B, T, D] of the layers before), `layers` an nn.ModuleDict keyed
    by the global layer index (state_dict keys stay the full model's: `layers.5.mlp.up_proj.weight`),
    `norm` and `lm_head` None (forward returns the hidden state after the blocks, before the norm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.lm_head = nn.Linear(cfg.dim, cfg.num_labels or cfg.vocab_size, bias=False)  # (a reward model's score)
        self.rotary = RotaryEmbedding(cfg)
        # Gemma 3: the sliding layers rotate at their own base (blocks' `local_rope`)
        self.rotary_local = RotaryEmbedding(cfg, local=True) if cfg.rope_local_theta is not None else None
        # longrope (Phi-3.5, Phi-4-mini): the long factors' table for sequences past the pretraining length
        self.rotary_long = RotaryEmbedding(cfg, long=True) if _longrope(cfg) else None
        # attention backend: "auto" (model/attention.py picks per batch), or "sdpa" | "flex" | "flash" to
        # force one (tests, benchmarks). A plain attribute: never in the config or a checkpoint.
        self.attn_backend = "auto"
        # context parallelism: a model.ring_attention.ContextParallel set by parallel/transforms/context_parallel.py
        # (None: the whole sequence on this rank). A plain attribute, like attn_backend.
        self.context_parallel = None
        # a pruned part without the embedding (a later pipeline stage) under sequence parallelism receives each
        # tensor rank's 1/N of the positions: N, set by parallel/transforms/tensor_parallel.py (positions, masks
        # and rotary tables are the whole sequence's). A plain attribute, like attn_backend.
        self.hidden_input_seq_split = 1
        # tensor parallelism's size (parallel/transforms/tensor_parallel.py): each rank's attention holds
        # n_kv_heads / N key/value heads, and so does a KV cache for it. A plain attribute, like attn_backend.
        self.tensor_parallel_size = 1
        if cfg.flash_attn:  # imported here, never inside a (compiled) forward
            kernels.detect_flash_attn()
        fa4.prepare(cfg)  # FlashAttention-4 activated once per process where this model would use it
        self.apply(self._init_weights)
        # multi-token prediction's blocks (model/mtp.py; no `mtp.*` keys without), built last: a seed, the same weights
        if cfg.mtp_num_layers:
            self.mtp = MultiTokenPrediction(cfg, RMSNorm, TransformerBlock)
            self.mtp.apply(self._init_weights)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def add_mtp_depths(self, n: int) -> int:
        """Grow to n multi-token prediction depths, keeping the model's, the new ones initialised as a new model's
        (on its device, in its dtype; buffers such as expert biases keep theirs); returns how many were added."""
        have = len(self.mtp.depths) if getattr(self, "mtp", None) is not None else 0
        if n <= have:
            return 0
        self.cfg = dataclasses.replace(self.cfg, mtp_num_layers=n)
        grown = MultiTokenPrediction(self.cfg, RMSNorm, TransformerBlock).to(self.embed_tokens.weight.device)
        grown.apply(self._init_weights)
        for p in grown.parameters():
            p.data = p.data.to(self.embed_tokens.weight.dtype)
        for k in range(have):
            grown.depths[k] = self.mtp.depths[k]
        self.mtp = grown
        return n - have

    def _apply(self, fn, recurse=True):
        """After a move or cast: FA4 is checked (and activated) once the model is on a GPU (model/fa4.py)."""
        super()._apply(fn, recurse)
        fa4.prepare(self.cfg)
        return self

    @classmethod
    def pruned(cls, model: "Transformer", layer_ids: Iterable[int], *, embedding: bool,
               head: bool) -> "Transformer":
        """A `cls` holding only some of `model`'s submodules - the same objects, not copies (parameters,
        LoRA wrappers and hooks are shared): the layers `layer_ids` (global indices), the embedding if
        `embedding`, the final norm and the LM head if `head`; the rotary tables (a non-persistent
        buffer) always. Its state_dict keys are a subset of `model`'s."""
        if model.embed_tokens is None or not isinstance(model.layers, nn.ModuleList) or model.lm_head is None:
            raise ValueError("prune the full model, not an already pruned one")
        part = cls.__new__(cls)
        nn.Module.__init__(part)
        # the plain attributes (cfg, attn_backend, training), then the kept submodules
        part.__dict__.update({k: v for k, v in vars(model).items() if not k.startswith("_")})
        part.embed_tokens = model.embed_tokens if embedding else None
        part.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        part.norm = model.norm if head else None
        part.lm_head = model.lm_head if head else None
        part.rotary, part.rotary_local, part.rotary_long = model.rotary, model.rotary_local, model.rotary_long
        if head and getattr(model, "mtp", None) is not None:  # the depths live with the LM head (the last stage)
            part.mtp = model.mtp
        return part

    def set_rope(self, rope_scaling: Optional[dict], max_seq_len: int) -> None:
        """Another RoPE scaling and length for this (full, not yet parallelised) model: context extension of
        loaded weights. The config changes with it (checkpoints record it); the frequencies are rebuilt."""
        self.cfg = dataclasses.replace(self.cfg, rope_scaling=rope_scaling, max_seq_len=max_seq_len)
        self.rotary = RotaryEmbedding(self.cfg).to(self.rotary.inv_freq.device)  # (Gemma's local table: unscaled)
        self.rotary_long = RotaryEmbedding(self.cfg, long=True).to(self.rotary.inv_freq.device) \
            if _longrope(self.cfg) else None

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=self.cfg.initializer_range)
            if getattr(m, "bias", None) is not None:  # q/k/v biases start at 0 (as transformers' Qwen2)
                nn.init.zeros_(m.bias)
        elif isinstance(m, GroupedExperts):
            m.init_weights(self.cfg.initializer_range)
        elif isinstance(m, Attention) and m.sinks is not None:
            nn.init.zeros_(m.sinks)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())  # shared (tied) tensors counted once
        if exclude_embeddings and self.embed_tokens is not None:
            n -= self.embed_tokens.weight.numel()
        return n

    def _compute_dtype(self, device: torch.device) -> torch.dtype:
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        if self.embed_tokens is None:  # a pruned model without the embedding
            return next(self.parameters()).dtype
        return self.embed_tokens.weight.dtype

    def _attn_spec(self, B: int, T: int, positions: torch.Tensor, attention_mask: Optional[torch.Tensor],
                   position_ids_given: bool, cache: Optional[KVCache], doc_ids: Optional[torch.Tensor] = None,
                   cu_seqlens: Optional[torch.Tensor] = None, max_seqlen=None) -> AttnSpec:
        """This batch's AttnSpec (model/attention.py), decided from which inputs are present and static
        facts (device, compute dtype, training, cache), never from tensor values."""
        device, dtype, cfg = positions.device, self._compute_dtype(positions.device), self.cfg
        plain = cfg.attn_sinks or cfg.attn_softcap is not None  # (SDPA's specs only: sinks, soft-capped scores)
        flash = kernels.flash_attn_functions(device) if cfg.flash_attn and not plain else None
        if flash is not None and dtype not in attention.HALF:
            flash = None  # flash-attn kernels exist for half precisions only
        dropout = self.training and cfg.attn_dropout > 0
        forced = fa4.forced_error(cfg, device, dtype, dropout, check=False) if cache is None else None
        if forced:
            raise ValueError(forced)
        return attention.build_spec(
            B, T, positions, attention_mask=attention_mask, position_ids_given=position_ids_given,
            doc_ids=doc_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            past=cache.pos if cache is not None else None, flash=flash, dropout=dropout, head_dim=cfg.head_dim,
            backend=self._backend(cfg, device, dropout, cache),
            fa4=None if plain else fa4.plan(cfg, device, dtype, dropout),
            gqa=cfg.n_kv_heads != cfg.n_heads, window=cfg.sliding_window)

    def _backend(self, cfg: ModelConfig, device: torch.device, dropout: bool, cache) -> str:
        """The attention backend asked of build_spec: SDPA's kinds for sinks; for soft-capped scores FlexAttention
        where it trains (its score_mod caps them), else the written-out path's SDPA specs (a test may force either)."""
        forced = getattr(self, "attn_backend", "auto")
        if cfg.attn_softcap is not None:
            if forced in ("sdpa", "flex") and cache is None:
                return forced
            return "flex" if cache is None and not dropout and attention.flex_usable(device, cfg.head_dim) else "sdpa"
        return "sdpa" if cfg.attn_sinks else forced

    @staticmethod
    def _rope(rotary: RotaryEmbedding, positions: torch.Tensor, past: int, T: int, contiguous: bool):
        """cos / sin of this batch's positions: the cached tables of past .. past+T-1 where the positions are those
        (no position_ids, no cp split: `contiguous`) and the table holds them, else computed."""
        cached = rotary.table(past, T) if contiguous else None
        return cached if cached is not None else rotary(positions)

    def _position_terms(self, spec: AttnSpec, positions: torch.Tensor, past: int, T: int, whole: int,
                        contiguous: bool) -> tuple[AttnSpec, tuple, Optional[tuple]]:
        """This batch's position-dependent terms: `spec` with Ministral 3's query factor (1 up to its length), the
        cos / sin of the model's table (longrope's long one once the `whole` sequence passes the pretraining length;
        transformers': its largest position), and those of Gemma 3's local table (None without one)."""
        cfg = self.cfg
        if cfg.query_pos_scale_beta is not None:
            spec = dataclasses.replace(spec, q_factor=1 + cfg.query_pos_scale_beta * torch.log1p(
                torch.floor(positions.float() / cfg.query_pos_scale_length)))
        long = self.rotary_long is not None and whole > cfg.rope_scaling["original_max_position_embeddings"]
        rope = self._rope(self.rotary_long if long else self.rotary, positions, past, T, contiguous)
        local = None if self.rotary_local is None else self._rope(self.rotary_local, positions, past, T, contiguous)
        return spec, rope, local

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of input_ids [B, T] -> [B, T, D] (Gemma's x sqrt(dim) where `scale_embeddings`,
        the factor in the embedding's dtype as transformers rounds it)."""
        h = self.embed_tokens(input_ids)
        if self.cfg.scale_embeddings:
            h = h * torch.tensor(self.cfg.dim ** 0.5, dtype=h.dtype)
        if self.cfg.embedding_multiplier is not None:  # (Granite's)
            h = h * self.cfg.embedding_multiplier
        return h

    def forward(self, input_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                reduction: str = "mean", attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None, *, cache: Optional[KVCache] = None,
                logits_to_keep: "int | torch.Tensor" = 0, doc_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None, max_seqlen=None,
                logprobs_of: Optional[torch.Tensor] = None, temperature: float = 1.0,
                mtp_embedded: Optional[list] = None, head: Optional[Callable] = None) -> torch.Tensor:
        """Logits [B, T, V] without labels; the loss of the chunked linear+CE with labels; with logprobs_of (token
        ids [B, T], shifted as labels, every one a real id) the pair (log p(logprobs_of), entropy), each [B, T], of
        the logits / temperature, computed chunk by chunk without the whole logits (model/token_logprobs.py; RL).
        With head: its result instead, on the final normed hidden state (`_outputs`; distillation's loss).
        Pruned (`pruned`): input_ids is the hidden state [B, T, D] when there is no embedding, and the
        hidden state after the blocks (before the norm) is returned when there is no LM head; a pruned last stage's
        multi-token prediction depths take their inputs embedded by the first stage (`mtp_embedded`, model/mtp.py
        shifted_embeddings).

        labels are already shifted (labels[t] is the token after input_ids[t]), -100 = ignored.
        attention_mask [B, T(+cached)] marks real tokens (1) vs padding (0). position_ids [B, T] of
        packed samples restart at each sample, which also restricts attention to the sample; doc_ids
        [B, T] (document number per token) says the same explicitly, and cu_seqlens (int32 boundaries
        over the flattened batch) with max_seqlen (a Python int) select flash-attn varlen where it runs
        (dataset/dataset_sft.py's packed_collate makes all three). Which attention runs is decided from
        which of these are present, never from their values (model/attention.py).
        cache / logits_to_keep are for generation (logits of the last `logits_to_keep` positions); a bool
        logits_to_keep [B, T] returns the logits of its True positions only, [N, V] in row-major order (scoring
        a few positions of each row: the LM head, often most of a small model's FLOPs, runs on those alone).
        """
        B, T = input_ids.shape[0], input_ids.shape[1]
        if self.embed_tokens is None:
            T *= self.hidden_input_seq_split  # the whole sequence of which the hidden input is this rank's slice
        past = cache.pos if cache is not None else 0
        cp = getattr(self, "context_parallel", None)
        mtp = getattr(self, "mtp", None)
        if (mtp is None or labels is None or reduction == "none" or not self.training or not torch.is_grad_enabled()
                or (self.embed_tokens is None and mtp_embedded is None) or self.lm_head is None):
            mtp = None  # multi-token prediction trains beside a training loss only (model/mtp.py)
        else:  # its shifted inputs and targets from the whole sequences (before a context-parallel split)
            ids = input_ids if mtp_embedded is None else None
            shifted = mtp.targets(ids, labels, position_ids, doc_ids, attention_mask)
        if cp is not None and cp.size > 1:
            # whole sequences in (with their attention_mask / position_ids / doc_ids / cu_seqlens: padding and packed
            # documents), this rank's two chunks kept (model/ring_attention.py); the loss comes back summed over the
            # cp group, the logits (labels None) are this rank's positions only
            if cache is not None or self.hidden_input_seq_split != 1 or head is not None:
                raise ValueError("context parallelism takes whole sequences: no KV cache, sequence-parallel input or "
                                 "loss in the head (docs/parallel.md)")
            if self.embed_tokens is None:  # a later pipeline stage: the hidden input is this rank's chunks already
                T *= cp.size
            else:
                input_ids = cp.shard(input_ids)
            from model.ring_attention import sequence_documents  # (loaded already: the cp switch's module)
            docs = sequence_documents(B, T, input_ids.device, attention_mask, position_ids, doc_ids, cu_seqlens)
            positions = cp.positions(B, T, input_ids.device) if position_ids is None else \
                cp.shard(position_ids.expand(B, T))
            labels, logprobs_of, T = cp.shard(labels), cp.shard(logprobs_of), T // cp.size
            if mtp is not None:
                shifted = [(None if ids is None else cp.shard(ids), cp.shard(lab)) for ids, lab in shifted]
            spec = AttnSpec("ring", group=cp.group, docs=docs)
        elif position_ids is None:
            positions = torch.arange(past, past + T, device=input_ids.device)[None].expand(B, T)
        else:
            positions = position_ids.expand(B, T) if position_ids.shape[0] == 1 else position_ids
        cp_on = cp is not None and cp.size > 1
        if not cp_on:
            spec = self._attn_spec(B, T, positions, attention_mask, position_ids is not None, cache,
                                   doc_ids=doc_ids, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        spec, (cos, sin), local = self._position_terms(spec, positions, past, T, past + T * (cp.size if cp_on else 1),
                                                       position_ids is None and not cp_on)

        h = input_ids if self.embed_tokens is None else self.embed(input_ids)
        ckpt = self.cfg.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for layer in blocks_of(self.layers):
            c, s = local if local is not None and layer.local_rope else (cos, sin)
            args = (h, c, s, spec, cache)
            h = run_block(layer, self.cfg.checkpoint_policy, *args) if ckpt else layer(*args)
        if cache is not None:
            cache.pos += T
        if self.lm_head is None:  # a pruned model without the head: the next part's input
            return h
        h = self.norm(h)
        if mtp is not None:  # records its losses for the trainer (the returned loss stays the next-token one)
            mtp(h, self.embed_tokens, self.lm_head.weight, cos, sin, spec, shifted, ckpt, mtp_embedded)
        return self._outputs(h, labels, reduction, logits_to_keep, logprobs_of, temperature, head,
                             cp if cp_on else None)

    def _outputs(self, h: torch.Tensor, labels, reduction, logits_to_keep, logprobs_of, temperature, head, cp):
        """forward's result from the final normed hidden state: head(h, the LM head's weight, --loss_chunk_size) (a
        loss computed in the head, the weight whole here under FSDP2 too: model/distill_head.py), the chunked
        log-probabilities, the logits or the loss; `cp` the ContextParallel when it splits the sequences."""
        cap = self.cfg.final_softcap  # (Gemma 2's soft-capped logits: model/softcap.py)
        if self.cfg.logits_scaling is not None:  # (Granite's logits / s, as (h / s) W^T: every head the same)
            h = h / self.cfg.logits_scaling
        if head is not None:  # (a capped model hands the head its cap)
            return head(h, self.lm_head.weight, self.cfg.loss_chunk_size, *(() if cap is None else (cap,)))
        if logprobs_of is not None:
            logp, entropy = token_logprobs(h, self.lm_head.weight, logprobs_of, temperature, self.cfg.loss_chunk_size,
                                           softcap=cap)
            if cp is not None:  # the whole rows' values on every cp rank, gradients through this rank's positions
                return cp.gather_tokens(logp), cp.gather_tokens(entropy)
            return logp, entropy
        if labels is None:
            if isinstance(logits_to_keep, torch.Tensor):
                h = h[logits_to_keep]
            elif logits_to_keep:
                h = h[:, -logits_to_keep:]
            return softcap(self.lm_head(h), cap)
        if cp is not None:
            if reduction == "none":  # the whole rows' per-token losses on every cp rank
                return cp.gather_tokens(lm_head_loss(h, self.lm_head.weight, labels, "none", self.cfg))
            return cp.reduce_loss(lm_head_loss(h, self.lm_head.weight, labels, "sum", self.cfg), labels, reduction)
        return lm_head_loss(h, self.lm_head.weight, labels, reduction, self.cfg)
