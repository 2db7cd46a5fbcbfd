"""Decoding over a KV cache: the generators' forward (a prompt's prefill, then one new token per row), with the
projection weights laid out once per generation call for few-row matmuls.

Owns: `Decoder` (a model, its `KVCache`, the weights prepared for decoding; `prefill`, `step`), `fast_path_applies`.
Used by model/generate.py `generate` and trainer/tasks/grpo_rollout.py `sample_groups`.

Why a second forward: a decode step multiplies a few rows ([G, dim], G ~ 8) by every weight, so per-op overhead and
the matmuls' handling of the weight dominate, not arithmetic; the model's forward pays there for what training
needs (autograd Functions, the attention spec, dropout modules, three q/k/v matmuls or a weight concatenation per
call). Here, per generation call:
- q/k/v and gate/up are each one matmul, their weights concatenated once (not per step, as model/kernels.py
  concat_linear does for training, where the concatenation is a small part of a large matmul);
- on the CPU (fp32 weights, no autocast) the large projections and the LM head (`PACK_MIN`) run through oneDNN
  with the weight reordered once into its blocked layout (`torch.ops.mkldnn._linear_pointwise`, what Inductor's CPU
  weight prepacking calls): F.linear's MKL sgemm re-reads the [N, K] weight in its plain layout on every call, which
  for 8 rows costs about twice the packed multiply (the matmuls of a dim-256 decode step: 4.0 ms -> 2.1 ms);
- RoPE rotates q and k in one pass; RMSNorm in fp32 skips its casts (the same arithmetic); no dropout modules;
- multi-head latent attention (model/mla.py): its first projections (q_a_proj or q_proj, and kv_a_proj_with_mqa)
  as one matmul, RoPE on the queries and the shared key in one pass, then its latent cache's attention;
- sliding-window layers (Mistral's, Qwen2's, gpt-oss's) mask the cache to their last `sliding_window` positions (the
  model's rule, `attention.dense_mask`) once the cache is longer; gpt-oss's sinks through `attention.sink_attention`;
- Gemma 2 / 3's, OLMo 2 / 3's and Granite's blocks (`BLOCK_FIELDS`): the scaled embedding, the sublayers' output
  norms (and OLMo's missing input norms), GeGLU, the query scale, Gemma 3's sliding layers' own RoPE table, q / k
  norms over all the heads, Gemma 2's capped scores (`attention.softcap_attention`) and capped logits, Granite's
  multipliers;
- under torch.inference_mode (no version counters or autograd metadata per op).
A prompt shared by every row (GRPO's group) is prefilled once, as one row, and its keys/values copied to the rows;
several groups' prompts (`prefill_groups`) are left-padded to the longest, each row's positions counted from its
first real token and its pads masked out of every attention (the model's own padding rule, `attention.allowed`).

Numerics: the model's operations in the same dtypes (RoPE, SwiGLU, the residual adds, SDPA over the cache), but
matmul blocking and reduction order differ, so values differ from a whole-row forward by rounding: the KV-cache
path's contract (docs/grpo.md; tests/model/test_decode.py, tests/trainer/test_grpo_parity.py).
Falls back to the model's own forward on the same cache where the fast path does not apply (`fast_path_applies`):
a pruned model, context parallelism, DTensor parameters (FSDP2 / tensor parallel: their all-gathers run in the
blocks' forward hooks), blocks other than the model's own, a partial rotary, Ministral 3's query scale, LongRoPE.
A LoRA-wrapped or non-Linear projection is called as its module (no concatenation, no packing).
Must never: track gradients, change the model or its parameters, or keep prepared weights past the `Decoder`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import attention, kernels
from model.attention import AttnSpec
from model.kv_cache import KVCache, kv_heads_of
from model.llama import MLP, Attention, Transformer, blocks_of
from model.mla import LatentAttention
from model.moe import MoEFeedForward
from model.softcap import softcap


def fast_path_applies(model: nn.Module) -> bool:
    """Whether `Decoder` computes the blocks itself (else it calls the model's forward)."""
    if not isinstance(model, Transformer) or model.embed_tokens is None or model.lm_head is None:
        return False
    if not isinstance(model.layers, nn.ModuleList):
        return False
    cp = getattr(model, "context_parallel", None)
    if cp is not None and cp.size > 1:
        return False
    if any(hasattr(p, "placements") for p in model.parameters()):  # DTensor: sharded (FSDP2, TP, EP)
        return False
    # the model's forward: a partial rotary, Ministral 3's query scale, longrope's two tables
    if set(model.cfg.block_fields) - BLOCK_FIELDS or getattr(model, "rotary_long", None) is not None:
        return False
    return all(type(getattr(b, "self_attn", None)) in (Attention, LatentAttention)
               and type(getattr(b, "mlp", None)) in (MLP, MoEFeedForward) for b in model.layers)


# Gemma 2 / 3's and OLMo 2 / 3's block fields (model/config.py block_fields) the fast path computes
BLOCK_FIELDS = {"scale_embeddings", "sandwich_norms", "mlp_act", "query_scale", "rope_local_theta", "pre_norms",
                "qk_norm_full", "attn_softcap", "final_softcap", "embedding_multiplier", "residual_multiplier",
                "logits_scaling"}


# The smallest weight (elements) worth oneDNN's blocked layout. A oneDNN call costs ~15 us more than F.linear's,
# which its faster multiply repays only on large weights: [8, K] x [K, N] with the weight out of cache, F.linear /
# packed: K 256, N 256: 44 / 69 us; N 768: 104 / 94; N 4096: 869 / 401; K 128, N 1024: 72 / 166; K 128, N 4096:
# 643 / 359. In whole rollouts (bench/bench_grpo_generate.py, 1 thread): dim 64 and 128 models decode fastest
# with nothing packed (dim 64: 42 ms vs 62 ms a group), dim 256 with every weight from 196K elements up packed.
PACK_MIN = 1 << 17


def _onednn_packs(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class _Projection:
    """Several projections of the same input as one matmul: x [..., K] -> their outputs side by side [..., sum N_i].
    Plain nn.Linear layers without bias get one concatenated weight (oneDNN-packed on the CPU in fp32 when large);
    anything else (LoRA, FP8 layers) is called as its module."""

    def __init__(self, modules: Sequence[nn.Module], rows: int, pack: bool):
        self.modules = list(modules)
        self.plain = all(type(m) is nn.Linear and m.bias is None for m in self.modules)
        self.weight = self.packed = None
        if not self.plain:
            return
        ws = [m.weight.detach() for m in self.modules]
        self.weight = ws[0] if len(ws) == 1 else torch.cat(ws)
        if pack and _onednn_packs(self.weight) and self.weight.numel() >= PACK_MIN:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The projections' outputs side by side [..., sum N_i]."""
        if not self.plain:
            ys = [m(x) for m in self.modules]
            return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return F.linear(x, self.weight)


def _rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32:  # the model's arithmetic (model/kernels.py rms_norm_ref: no casts in fp32), fewer ops
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(norm.eps)) * norm.weight
    return norm(x)


def left_pad(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P], attention mask [B, P]: 1 on the real tokens) of prompts left-padded to the longest. A pad holds its
    row's first token: any id would do (the pads are masked), and this one is already in the row, so a repetition
    penalty over the row's ids sees no other."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[p[0]] * (P - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    return ids, mask


class Decoder:
    """A model's generation state: its KV cache for `batch_size` rows of up to `max_len` positions, and (fast path)
    its projection weights prepared once. `prefill` / `prefill_shared` / `prefill_groups` run the prompts, `step`
    one token per row; each returns the logits of the last position [B, V]. pack: None = oneDNN packing where it
    applies (CPU, fp32, weights of PACK_MIN elements or more); False = never (tests). The fast path runs under
    torch.inference_mode (~10% of a small model's step); the fallback under no_grad: FSDP2 keeps buffers its forward
    allocates, which inference mode would make unusable in training."""

    def __init__(self, model: nn.Module, batch_size: int, max_len: int, device: torch.device, dtype: torch.dtype,
                 pack: Optional[bool] = None):
        self.model, self.rows, self.max_len, self.dtype = model, batch_size, max_len, dtype
        self.pads: Optional[torch.Tensor] = None  # [B] left pads of the rows (prefill_groups), None: none
        self.cache = KVCache(model.cfg, batch_size, max_len, device, dtype, kv_heads_of(model))
        self.fast = fast_path_applies(model)
        self.layers, self.rope = [], None
        if not self.fast:
            return
        self.pack = pack is not False
        self.layers = [self.prepare(block) for block in blocks_of(model.layers)]
        self.head = _Projection((model.lm_head,), batch_size, self.pack)
        # SDPA in the cache's dtype unless the model's attention casts it (model/kernels.py sdpa_dtype: CPU bf16)
        self.sdpa_direct = kernels.sdpa_dtype(device, dtype, model.cfg.head_dim) == dtype
        self.rope = self._table(model.rotary, max_len)
        # Gemma 3's sliding layers rotate at their own base (the blocks' `local_rope`)
        self.rope_local = None if model.rotary_local is None else self._table(model.rotary_local, max_len)

    def _table(self, rotary: nn.Module, max_len: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(cat(cos, cos), cat(-sin, sin)) [L, D] of a RotaryEmbedding's cached table, None where it has none."""
        table = rotary.table(0, max_len)
        if table is None:
            return None
        with torch.no_grad():
            cos, sin = (t[0, :, 0].to(self.dtype) for t in table)  # [L, D/2], cast as the model's RoPE casts them
            return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)  # [L, D]

    def prepare(self, block: nn.Module) -> tuple:
        """A transformer block's weights laid out for decoding (fast path): (block, qkv, o, gate_up, down), the
        MLP's projections None for an MoE block (called as its module). Also used for multi-token prediction's
        block (model/speculative.py)."""
        a, mlp = block.self_attn, block.mlp
        plain_mlp = type(mlp) is MLP
        if isinstance(a, LatentAttention):  # (multi-head latent attention: its first projections and q_b_proj)
            first = (a.q_a_proj if a.q_lora_rank else a.q_proj, a.kv_a_proj_with_mqa)
            qkv = (_Projection(first, self.rows, self.pack),
                   _Projection((a.q_b_proj,), self.rows, self.pack) if a.q_lora_rank else None)
        else:
            qkv = _Projection((a.q_proj, a.k_proj, a.v_proj), self.rows, self.pack)
        return (block, qkv,
                _Projection((a.o_proj,), self.rows, self.pack),
                _Projection((mlp.gate_proj, mlp.up_proj), self.rows, self.pack) if plain_mlp else None,
                _Projection((mlp.down_proj,), self.rows, self.pack) if plain_mlp else None)

    def project(self, modules: Sequence[nn.Module]) -> "_Projection":
        """Projections of the same input as one prepared matmul (fast path; model/speculative.py's eh_proj)."""
        return _Projection(modules, self.rows, self.pack)

    @staticmethod
    def norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """An RMSNorm module's output, in fp32 without its casts (the decode path's)."""
        return _rms_norm(norm, x)

    def prefill(self, tokens: torch.Tensor, pads: Optional[torch.Tensor] = None) -> torch.Tensor:
        """tokens [B, T] (B = batch_size) from position 0 -> logits [B, V] of the last position. pads [B]: rows
        left-padded by that many positions (as `prefill_groups` pads them: masked out of every attention, each row's
        positions counted from its first real token)."""
        self.pads = pads if pads is not None and bool(pads.any()) else None
        with self._mode():
            return self._forward(tokens, self.cache, self.pads)

    def prefill_shared(self, prompt: torch.Tensor) -> torch.Tensor:
        """One prompt [T] for every row: computed once, as one row, its keys/values copied to every row of the
        cache -> logits [B, V] (the one row's, repeated)."""
        return self.prefill_groups([prompt.tolist()], self.rows)

    def prefill_groups(self, prompts: Sequence[Sequence[int]], group: int) -> torch.Tensor:
        """Several prompts, each shared by `group` consecutive rows (batch_size = len(prompts) x group): each prompt
        computed once (one row each, left-padded to the longest), its keys/values copied to its rows -> logits
        [B, V]. A padded row's positions count from its first real token and its pads are masked out of every later
        attention (`step` too), so each row computes what it would alone, up to rounding. Prompts of one length
        need no padding."""
        K = len(prompts)
        if K * group != self.rows or min(len(p) for p in prompts) < 1:
            raise ValueError(f"prefill_groups: {K} non-empty prompts x {group} rows each for {self.rows} rows")
        device = self.cache.k[0].device
        tokens, mask = left_pad(prompts, device)
        P = tokens.shape[1]
        pads = P - mask.sum(1)
        padded = pads if bool(pads.any()) else None
        with self._mode():
            part = KVCache(self.model.cfg, K, P, device, self.dtype, kv_heads_of(self.model))
            logits = self._forward(tokens, part, padded)
            for dst, src in zip(self.cache.k + self.cache.v, part.k + part.v):
                dst[:, :, :P] = src.repeat_interleave(group, dim=0)
        self.cache.pos = P
        self.pads = None if padded is None else padded.repeat_interleave(group)
        return logits.repeat_interleave(group, dim=0)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] (one new token per row) -> logits [B, V]."""
        with self._mode():
            return self._forward(tokens[:, None], self.cache, self.pads)

    def _mode(self):
        return torch.inference_mode() if self.fast else torch.no_grad()

    def _rope(self, past: int, T: int, device: torch.device, local: bool = False,
              positions: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cat(cos, cos), cat(-sin, sin)) [T, 1, D] of positions past .. past+T-1, or [B, T, 1, D] of each row's
        `positions` [B, T] (`local`: Gemma 3's sliding layers' table)."""
        rope = self.rope_local if local else self.rope
        if rope is not None:
            if positions is not None:
                return rope[0][positions][:, :, None], rope[1][positions][:, :, None]
            return rope[0][past:past + T, None], rope[1][past:past + T, None]
        # dynamic RoPE scaling: the tables depend on the length, computed as the model's forward does
        rotary = self.model.rotary_local if local else self.model.rotary
        if positions is None:
            cos, sin = (t[0, :, 0].to(self.dtype) for t in rotary(torch.arange(past, past + T, device=device)[None]))
        else:
            cos, sin = (t[:, :, 0].to(self.dtype) for t in rotary(positions))
        return torch.cat((cos, cos), -1)[..., None, :], torch.cat((-sin, sin), -1)[..., None, :]

    @staticmethod
    def padded(pads: torch.Tensor, past: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions [B, T] of cache positions past .. past+T-1, counted from each row's first real token; which of
        the keys [B, past + T] are real) of rows left-padded by `pads` [B]."""
        idx = torch.arange(past + T, device=pads.device)
        return (idx[None, past:] - pads[:, None]).clamp_min(0), idx[None] >= pads[:, None]

    def _forward(self, tokens: torch.Tensor, cache: KVCache, pads: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.fast:
            kw = {}
            if pads is not None:  # the model's own padding: a key mask and each row's positions
                positions, real = self.padded(pads, cache.pos, tokens.shape[1])
                kw = dict(attention_mask=real, position_ids=positions)
            return self.model(tokens, cache=cache, logits_to_keep=1, **kw)[:, -1]
        return self.logits(self.hidden(self.model.embed(tokens), self.layers, cache, pads)[:, -1])

    def logits(self, h: torch.Tensor, norm: Optional[nn.Module] = None) -> torch.Tensor:
        """The LM head's logits [..., V] of hidden states h [..., D] before the final norm (the model's, or
        `norm`), soft-capped where the model caps them (Gemma 2), over Granite's logits_scaling (fast path)."""
        cfg = self.model.cfg
        h = _rms_norm(self.model.norm if norm is None else norm, h)
        return softcap(self.head(h if cfg.logits_scaling is None else h / cfg.logits_scaling), cfg.final_softcap)

    def hidden(self, h: torch.Tensor, layers: list, cache: KVCache, pads: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """Embedded inputs h [B, T, D] at positions cache.pos .. + T - 1 through `layers` (`prepare`d blocks, the
        cache's layer i for the i-th) -> their hidden states [B, T, D] (before any final norm); advances
        cache.pos (fast path). pads [B]: rows left-padded by that many positions (`prefill_groups`)."""
        B, T = h.shape[:2]
        past = cache.pos
        if past + T > cache.max_len:
            raise ValueError(f"KV cache overflow: {past + T} > {cache.max_len}")
        window = self.model.cfg.sliding_window
        spec = windowed = real = positions = None
        if pads is not None:  # every step masked: the pads are no keys
            positions, real = self.padded(pads, past, T)
            spec = AttnSpec("sdpa_masked", is_causal=False, mask=attention.dense_mask(T, past, h.device, None, real))
        elif T > 1 and past > 0:  # several new tokens over a cache: the model's masked attention
            spec = attention.build_spec(B, T, torch.arange(past, past + T, device=h.device)[None].expand(B, T),
                                        past=past, head_dim=self.model.cfg.head_dim)
        if window and past + T > window:  # the sliding layers see the cache's last `window` positions
            windowed = AttnSpec("sdpa_masked", is_causal=False,
                                mask=attention.dense_mask(T, past, h.device, None, real, window))
        cos2, sin2 = self._rope(past, T, h.device, positions=positions)
        local = self._rope(past, T, h.device, local=True, positions=positions) \
            if self.model.rotary_local is not None else None
        for i, (block, qkv, o, gate_up, down) in enumerate(layers):
            a = block.self_attn
            x = _rms_norm(block.input_layernorm, h) if block.pre_norms else h
            if isinstance(a, LatentAttention):
                att = self._latent(a, qkv, x, cos2, sin2, cache, i, spec or AttnSpec("sdpa", is_causal=past == 0))
            else:
                layer_spec = windowed if windowed is not None and a.sliding else spec
                att = self._attend(a, qkv, x, local if block.local_rope else (cos2, sin2), cache, i, layer_spec)
            att = o(att.reshape(B, T, -1))
            if block.sandwich:  # (Gemma's, OLMo's norm of the attention's output)
                att = _rms_norm(block.attn_output_norm, att)
            if block.residual_scale is not None:  # (Granite's residual_multiplier)
                att = att * block.residual_scale
            h = att + h  # the model's order: attn + x
            h = self._mlp(block, gate_up, down, h)
        cache.pos += T
        return h

    def _attend(self, a: Attention, qkv: "_Projection", x: torch.Tensor, rope: tuple, cache: KVCache, layer: int,
                spec: Optional[AttnSpec]) -> torch.Tensor:
        """Grouped-query attention's step from its input x [B, T, D] over the cache -> [B, T, heads, D]; `spec` None:
        causal from position 0, or the new positions seeing the whole cache."""
        B, T = x.shape[:2]
        past = cache.pos
        nq, nk, D = a.n_heads, a.n_kv_heads, a.head_dim
        y = qkv(x).view(B, T, -1, D)  # q, k, v heads side by side
        qk = y[:, :, :nq + nk]
        if a.qk_norm_full:  # (OLMo 2 / 3: one norm over all the heads' q, one over all k)
            qk = torch.cat((_rms_norm(a.q_norm, qk[:, :, :nq].reshape(B, T, -1)).view(B, T, nq, D),
                            _rms_norm(a.k_norm, qk[:, :, nq:].reshape(B, T, -1)).view(B, T, nk, D)), dim=2)
        elif a.qk_norm:  # (Qwen3, Gemma 3: each head's q and k normalised before RoPE)
            qk = torch.cat((_rms_norm(a.q_norm, qk[:, :, :nq]), _rms_norm(a.k_norm, qk[:, :, nq:])), dim=2)
        if a.rope:  # (SmolLM3's NoPE layers: none)
            # RoPE on q and k in one pass, the model's arithmetic (x1 cos - x2 sin, x2 cos + x1 sin) as
            # x * cat(cos, cos) + swap_halves(x) * cat(-sin, sin): a + (-b) is a - b exactly
            cos2, sin2 = rope
            qk = qk * cos2 + qk.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin2
        q, k, v = qk[:, :, :nq].transpose(1, 2), qk[:, :, nq:].transpose(1, 2), y[:, :, nq + nk:].transpose(1, 2)
        if a.q_scale is not None:  # (Gemma's query_pre_attn_scalar)
            q = q * a.q_scale
        kc, vc = cache.update(layer, k, v)
        plain = AttnSpec("sdpa", is_causal=past == 0)
        if a.sinks is not None:  # (gpt-oss's attention sinks: one extra key through SDPA)
            att = attention.sink_attention(q, kc, vc, spec or plain, a.sinks)
        elif a.softcap is not None:  # (Gemma 2's capped scores, written out)
            att = attention.softcap_attention(q, kc, vc, spec or plain, a.softcap)
        elif spec is not None or not self.sdpa_direct:
            att = attention.sdpa_attention(q, kc, vc, spec or plain)
        else:  # one new token sees the whole cache; a prefill from position 0 is causal
            att = F.scaled_dot_product_attention(q, kc, vc, is_causal=past == 0 and T > 1, enable_gqa=nq != nk)
        return att.transpose(1, 2)

    @staticmethod
    def _mlp(block: nn.Module, gate_up, down, h: torch.Tensor) -> torch.Tensor:
        x = _rms_norm(block.post_attention_layernorm, h) if block.pre_norms else h
        if gate_up is not None:
            g, u = gate_up(x).chunk(2, dim=-1)
            y = down(F.silu(g) * u if block.mlp.act == "silu" else kernels.geglu(g, u))
        else:
            y = block.mlp(x)
        y = _rms_norm(block.mlp_output_norm, y) if block.sandwich else y  # (Gemma's, OLMo's output norm)
        return h + (y if block.residual_scale is None else y * block.residual_scale)

    @staticmethod
    def _latent(a: LatentAttention, projections: tuple, x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor,
                cache: KVCache, layer: int, spec: AttnSpec) -> torch.Tensor:
        """Multi-head latent attention's step from the normed input x [B, T, D]: its first projections as one matmul,
        RoPE in one pass as above, then the latent cache's attention (model/mla.py latent_attention) -> [B, T, heads,
        v_head_dim]."""
        first, q_b = projections
        B, T = x.shape[:2]
        q, latent, k_rot = first(x).split((first.modules[0].out_features, a.kv_lora_rank, a.rope_dim), dim=-1)
        q = (q_b(_rms_norm(a.q_a_layernorm, q)) if q_b is not None else q).view(B, T, -1, a.head_dim)
        rot = torch.cat((q[..., a.nope:], k_rot[:, :, None]), dim=2)  # [B, T, heads + 1, rope]
        rot = rot * cos2 + rot.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * sin2
        return a.latent_attention(q[..., :a.nope], rot[:, :, :-1], _rms_norm(a.kv_a_layernorm, latent), rot[:, :, -1:],
                                  spec, cache, layer)
