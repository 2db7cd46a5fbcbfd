"""Attention: which kernel computes softmax(q k^T / sqrt(d)) v for a batch, and the masking rule they share.

Owns: `AttnSpec` (how one batch attends: built once per forward from *which inputs are present*, shared
by every layer), the masking rule `allowed` (causal AND same document AND key is a real token; a padded
query always sees itself so no row is empty), and one function per backend beside its reference:

| kind          | function          | when `auto` picks it                                                     |
| ------------- | ----------------- | ------------------------------------------------------------------------ |
| `flash`       | `flash_attention` | flash-attn installed, accelerator, fp16/bf16, no padding or documents    |
| `flash_varlen`| `flash_attention` | as above, and the batch carries `cu_seqlens` (+ `max_seqlen`) from the data pipeline |
| `fa4`         | `sdpa_attention`  | FlashAttention-4 active (model/fa4.py), fp16/bf16, no dropout, no padding or documents: |
|               |                   | SDPA restricted to its flash backend, which FA4 overrides (wins over flash-attn 2) |
| `fa4_varlen`  | `flash_attention` | FA4 active and the batch carries `cu_seqlens`: torch's `varlen_attn` (GQA only where |
|               |                   | this torch's varlen_attn takes `enable_gqa`; else flash-attn 2 varlen or the masks) |
| `sdpa`        | `sdpa_attention`  | no padding or documents (is_causal), and every KV-cache (generation) step |
| `flex`        | `flex_attention_` | padding or documents on an accelerator: FlexAttention with a BlockMask  |
| `sdpa_masked` | `sdpa_attention`  | padding or documents elsewhere (CPU: FlexAttention has no CPU backward); |
|               |                   | the dense [B, 1, T, Tk] boolean mask is also the reference for `flex`    |
| `ring`        | `ring_attention`  | never: the model's context-parallel switch (model/ring_attention.py), causal |
|               |                   | over the cp group's whole sequence (no padding or documents)             |

`attention_ref` (materialised GQA, explicit softmax) is what the tests compare every backend against.
Documents come from `doc_ids`, else from `position_ids` (a document starts wherever the position does not
continue the previous one), else from `cu_seqlens`; padding from `attention_mask`. All of it is computed
on the device with tensor ops (cumsum, comparisons, searchsorted): no value is read back to the host.
flash-attn varlen is used only with `cu_seqlens`/`max_seqlen` from the caller: their length and the int
`max_seqlen` depend on the data, so deriving them on the device would be a sync. Its padding is the
collate's own segment (real tokens never see it), so `attention_mask` is not needed there.

GQA: keys/values keep their n_kv_heads; SDPA (`enable_gqa`), FlexAttention (`enable_gqa`), flash-attn and FA4
share each kv head across its query heads inside the kernel. No backend materialises [B, H, T, D] copies.

FlexAttention outside torch.compile is an unfused reference that materialises the [B, H, T, T] scores,
and `create_block_mask` outside torch.compile builds a dense [B, 1, T, T] mask first. So on an
accelerator, when the model itself is not being compiled, both are called through `torch.compile`d
wrappers made once per process (lazily, at the first packed/padded batch), as torchtitan does; under
torch.compile of the model the plain functions are traced into the model's graph. On CPU the plain
functions are used (only tests force `flex` there, forward only, and compiling it costs ~1 min).

Must never: decide anything from a tensor's value (`bool(t)`, `.item()`, `.nonzero()`, `unique`: each is
a device-to-host sync and a graph break under torch.compile), register or cache a mask across batches,
repeat/expand keys and values for GQA, or create parameters (checkpoints never depend on the backend).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model import fa4 as fa4_mod
from model import kernels
from model.softcap import softcap
from utils.device import is_accelerator

try:  # torch >= 2.5; optional like every accelerator path (importing it does not import Dynamo)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    FLEX_AVAILABLE = True
except ImportError:  # pragma: no cover - older torch
    create_block_mask = flex_attention = None  # type: ignore[assignment]
    FLEX_AVAILABLE = False

BACKENDS = ("auto", "sdpa", "flex", "flash")
HALF = (torch.float16, torch.bfloat16)


@dataclass
class AttnSpec:
    """How this batch attends: built once per forward, shared by all layers."""
    kind: str = "sdpa"                          # flash | flash_varlen | fa4 | fa4_varlen | sdpa | sdpa_masked | flex
    is_causal: bool = True                      # sdpa without a mask: causal or (one query over a cache) full
    mask: Optional[torch.Tensor] = None         # sdpa_masked: bool [B or 1, 1, Tq, Tk], True = attend
    block_mask: Optional[Any] = None            # flex: BlockMask of `allowed`
    cu_seqlens: Optional[torch.Tensor] = None   # flash_varlen: int32 boundaries over the flattened batch
    max_seqlen: int = 0                         # flash_varlen
    flash: Optional[tuple] = None               # (flash_attn_func, flash_attn_varlen_func)
    varlen: Optional[Any] = None                # fa4_varlen: model.fa4.VarlenCall (torch's varlen_attn)
    group: Any = None                           # ring: the context-parallel process group (model/ring_attention.py)
    docs: Optional[torch.Tensor] = None         # ring: the whole sequences' document ids [B, T] (None: one per row)
    window: int = 0                             # flash / flash_varlen: a sliding window's width (0: none)
    windowed: Optional["AttnSpec"] = None       # the spec of the model's sliding-window layers (None: this one)
    q_factor: Optional[torch.Tensor] = None     # [B, T] per-position query factor (Ministral 3's; None: none)


# ------------------------------------------------------------------------------------ the rule
def allowed(q_idx: torch.Tensor, kv_idx: torch.Tensor, same_doc: Optional[torch.Tensor] = None,
            kv_real: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
    """May query q attend to key kv? Causal, within one document, only to real (non-pad) keys, and with a sliding
    `window` (> 0) only to the last `window` positions, itself included (Mistral's and transformers' rule); a
    query always sees itself, so a padded query row is never empty (no NaN, no NaN gradients).
    Written once for broadcast index tensors (the dense mask) and scalar ones (FlexAttention's mask_mod)."""
    ok = kv_idx <= q_idx
    if window:
        ok = ok & (kv_idx > q_idx - window)
    if same_doc is not None:
        ok = ok & same_doc
    if kv_real is not None:
        ok = (ok & kv_real) | (kv_idx == q_idx)
    return ok


def documents_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Document number per token of packed rows [B, T]: a document starts wherever the position does
    not continue the previous one (e.g. resets to 0). Padding with position 0 gets one document per token."""
    cont = positions[:, 1:] == positions[:, :-1] + 1
    start = torch.cat((torch.ones_like(positions[:, :1], dtype=torch.bool), ~cont), dim=1)
    return start.cumsum(dim=1)


def documents_from_cu_seqlens(cu_seqlens: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """Document number per token [B, T] from flash-attn's cumulative boundaries over the flattened batch."""
    idx = torch.arange(B * T, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens, idx, right=True).view(B, T)


def batch_documents(B: int, T: int, device: torch.device, position_ids: Optional[torch.Tensor] = None,
                    doc_ids: Optional[torch.Tensor] = None,
                    cu_seqlens: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Document number per token [B, T] of a batch's packed rows, from what it carries: doc_ids, else where
    position_ids restart, else flash-attn's cu_seqlens; None when it carries none (every row one document)."""
    if doc_ids is not None:
        return doc_ids
    if position_ids is not None:
        return documents_from_positions(position_ids.expand(B, T))
    if cu_seqlens is not None:
        return documents_from_cu_seqlens(cu_seqlens.to(device), B, T)
    return None


def dense_mask(T: int, past: int, device: torch.device, docs: Optional[torch.Tensor] = None,
               real: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
    """The rule as a bool [B or 1, 1, T, past + T] tensor (queries are positions past..past+T-1)."""
    q = torch.arange(past, past + T, device=device)[None, None, :, None]
    k = torch.arange(past + T, device=device)[None, None, None, :]
    same = None if docs is None else docs[:, None, :, None] == docs[:, None, None, :]
    kv_real = None if real is None else real[:, None, None, :]
    return allowed(q, k, same, kv_real, window)


# ------------------------------------------------------------------------------ FlexAttention
_COMPILED: dict = {}


def _flex_functions(device: torch.device):
    """(create_block_mask, flex_attention) to call here (see the module docstring)."""
    if torch.compiler.is_compiling() or not is_accelerator(device):
        return create_block_mask, flex_attention
    if not _COMPILED:
        _COMPILED["cbm"] = torch.compile(create_block_mask)
        _COMPILED["flex"] = torch.compile(flex_attention)
    return _COMPILED["cbm"], _COMPILED["flex"]


def block_mask(B: int, T: int, device: torch.device, docs: Optional[torch.Tensor],
               attention_mask: Optional[torch.Tensor], window: int = 0):
    """FlexAttention BlockMask of `allowed` for a [B, T] batch (heads broadcast). The mask_mod captures the
    caller's attention_mask itself (compared with 0 inside) rather than a converted copy: Inductor's CPU
    lowering of FlexAttention (torch 2.13) fails on a captured tensor that is an unrealised pointwise
    result (`NotImplementedError: Pointwise`); graph inputs and cumsum results are fine."""
    def mask_mod(b, h, q_idx, kv_idx):
        same = None if docs is None else docs[b, q_idx] == docs[b, kv_idx]
        return allowed(q_idx, kv_idx, same, None if attention_mask is None else attention_mask[b, kv_idx] != 0,
                       window)
    cbm, _ = _flex_functions(device)
    return cbm(mask_mod, B, None, T, T, device=device)


def flex_usable(device: torch.device, head_dim: int = 64) -> bool:
    """FlexAttention trains (forward and backward) here: torch has it, the device is an accelerator
    (torch's FlexAttention refuses backward on CPU and MPS) and head_dim >= 16 (its Triton kernel's minimum)."""
    return FLEX_AVAILABLE and is_accelerator(device) and head_dim >= 16


def flex_attention_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                    score_mod: Optional[Any] = None) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, Hkv, T, D] -> [B, H, T, D]; GQA inside the kernel; `score_mod` FlexAttention's
    (`softcap_score_mod`: Gemma 2's capped scores).

    Each input is given the layout torchtitan feeds FlexAttention, a contiguous [B, T, heads, D] tensor
    viewed as [B, heads, T, D] (a no-op for q and k, fresh from RoPE). v, a slice of the fused q/k/v
    projection, is not: Inductor's CPU FlexAttention kernel (torch 2.13) read it wrongly (max error 0.6
    on the tiny model, exact once contiguous), and stride-dependent FlexAttention bugs have been reported
    on CUDA too (pytorch#146377), so the one [B, T, n_kv_heads, D] copy is paid on every device."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    _, flex = _flex_functions(q.device)
    return flex(q, k, v, score_mod=score_mod, block_mask=spec.block_mask, enable_gqa=q.shape[1] != k.shape[1])


@functools.lru_cache(maxsize=None)
def softcap_score_mod(cap: float):
    """FlexAttention's score_mod capping the scores at `cap` (one function per cap: a compiled FlexAttention
    specialises on it once)."""
    def mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap
    return mod


# --------------------------------------------------------------------------------------- SDPA
def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                   dropout_p: float = 0.0, scale: Optional[float] = None) -> torch.Tensor:
    """q [B, H, Tq, D], k/v [B, Hkv, Tk, D] -> [B, H, Tq, D] in q's dtype; `enable_gqa` shares each kv head
    across its query heads inside the kernel (CPU's flash kernel and CUDA's flash backend do it natively).
    scale: the scores' factor where it is not 1 / sqrt(D) (multi-head latent attention's latent cache)."""
    out_dtype = q.dtype
    adt = kernels.sdpa_dtype(q.device, q.dtype, q.shape[-1])
    if spec.kind == "fa4":  # FA4 is the flash backend's kernel: cuDNN or efficient attention must not take it
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
    args = dict(attn_mask=spec.mask, dropout_p=dropout_p, is_causal=spec.is_causal and spec.mask is None,
                enable_gqa=q.shape[1] != k.shape[1], scale=scale)
    if dropout_p > 0 and is_accelerator(q.device) and fa4_mod.active():  # FA4 (the flash kernel) has no dropout
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return F.scaled_dot_product_attention(q.to(adt), k.to(adt), v.to(adt), **args).to(out_dtype)
    return F.scaled_dot_product_attention(q.to(adt), k.to(adt), v.to(adt), **args).to(out_dtype)


# ----------------------------------------------------------------------------------- sinks
def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, sinks: torch.Tensor,
                   dropout_p: float = 0.0, pad_values: Optional[bool] = None) -> torch.Tensor:
    """SDPA with gpt-oss's attention sinks: each query head h adds exp(sinks[h]) to its softmax's denominator (a
    logit with no value). Exact through SDPA itself, with one extra key: every key gets one more dimension (0), the
    sink key is 1 there and 0 elsewhere with a zero value, and each query head carries sinks[h] / scale in that
    dimension, so its score against the sink key is sinks[h] and against the others unchanged; the dimensions are
    padded with zeros to a multiple of 8 (the kernels' alignment; zeros add nothing to a score). The sink key comes
    first and is seen by every query: a mask gains a True column, and the causal case a dummy first query (SDPA's
    is_causal aligns query i with key i from the top left), whose row is dropped. The sinks' gradient flows through
    the queries' extra dimension. q [B, H, Tq, D], k/v [B, Hkv, Tk, D], sinks [H] -> [B, H, Tq, D].
    `pad_values` (default: on CUDA) pads the values with zeros to the keys' width too, so that the causal case can
    take the flash backend (one width for q, k and v; the memory-efficient one takes the masks either way)."""
    B, H, Tq, D = q.shape
    scale = 1.0 / math.sqrt(D)
    extra = (D + 1 + 7) // 8 * 8 - D
    causal = spec.mask is None and spec.is_causal
    if causal and Tq != k.shape[2]:
        raise ValueError(f"causal attention with sinks needs as many keys as queries, got {Tq} and {k.shape[2]}")
    sink_q = (sinks.to(q.dtype) / scale).view(1, H, 1, 1).expand(B, H, Tq, 1)
    q2 = torch.cat((q, sink_q, q.new_zeros(B, H, Tq, extra - 1)), dim=-1)
    k2 = F.pad(k, (0, extra))
    sink_k = k2.new_zeros(B, k.shape[1], 1, D + extra)
    sink_k[..., D] = 1.0
    k2 = torch.cat((sink_k, k2), dim=2)
    dv = v.shape[-1]
    v2 = torch.cat((v.new_zeros(B, v.shape[1], 1, dv), v), dim=2)
    if q.is_cuda if pad_values is None else pad_values:
        v2 = F.pad(v2, (0, D + extra - dv))
    if causal:  # the dummy query (row 0) sees the sink key; query i + 1 sees it and keys 0 .. i
        q2 = torch.cat((q2.new_zeros(B, H, 1, D + extra), q2), dim=2)
        return sdpa_attention(q2, k2, v2, spec, dropout_p, scale)[:, :, 1:, :dv]
    mask = None if spec.mask is None else F.pad(spec.mask, (1, 0), value=True)
    y = sdpa_attention(q2, k2, v2, dataclasses.replace(spec, mask=mask, is_causal=False), dropout_p, scale)
    return y[..., :dv]


# ------------------------------------------------------------------------------------ soft-capping
def softcap_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, cap: float,
                      dropout_p: float = 0.0) -> torch.Tensor:
    """Attention whose scores are soft-capped before the mask and softmax (Gemma 2's attn_logit_softcapping):
    softmax(cap tanh(q k^T / (sqrt(D) cap))) v. Where FlexAttention trains (an accelerator, no dropout) the model
    gives such batches a `flex` spec and this cap as its score_mod (`softcap_score_mod`, fused, no [T, T] scores);
    elsewhere (CPU, dropout, KV-cache steps) it is this function, written out as transformers' eager attention is:
    the scores [B, H, Tq, Tk] materialised (O(T^2) memory), capped and softmaxed in fp32. GQA without copies: each
    kv head's query heads stacked along the rows (q viewed [B, Hkv, rep x Tq, D]). The mask: the spec's (its window,
    padding and documents), else causal, or none (one query over a cache).
    q [B, H, Tq, D], k/v [B, Hkv, Tk, D] -> [B, H, Tq, Dv] in q's dtype."""
    B, H, Tq, D = q.shape
    hkv, Tk = k.shape[1], k.shape[2]
    adt = kernels.sdpa_dtype(q.device, q.dtype, D)
    s = torch.matmul(q.to(adt).reshape(B, hkv, H // hkv * Tq, D), k.to(adt).transpose(-1, -2))
    s = softcap(s.to(torch.promote_types(s.dtype, torch.float32)) * (1.0 / math.sqrt(D)), cap).view(B, H, Tq, Tk)
    mask = spec.mask if spec.mask is not None else dense_mask(Tq, Tk - Tq, q.device) if spec.is_causal else None
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = s.softmax(-1)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    y = torch.matmul(p.to(adt).view(B, hkv, H // hkv * Tq, Tk), v.to(adt))
    return y.view(B, H, Tq, v.shape[-1]).to(q.dtype)


# ---------------------------------------------------------------------------------- flash-attn
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec,
                    dropout_p: float = 0.0) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, T, Hkv, D] (flash-attn's layout) -> [B, T, H, D]; GQA native. `fa4_varlen`:
    torch's varlen_attn over the flattened batch [B*T, heads, D], causal within each cu_seqlens segment."""
    if spec.kind == "fa4_varlen":
        B, T, H, D = q.shape
        hkv, call = k.shape[2], spec.varlen
        gqa = {"enable_gqa": True} if hkv != H else {}
        y = call.fn(q.reshape(B * T, H, D), k.reshape(B * T, hkv, D), v.reshape(B * T, hkv, D),
                    spec.cu_seqlens, spec.cu_seqlens, spec.max_seqlen, spec.max_seqlen, **call.causal, **gqa)
        return y.view(B, T, H, D)
    flash_func, flash_varlen = spec.flash
    window = {"window_size": (spec.window - 1, 0)} if spec.window else {}  # (flash-attn: keys i-left .. i)
    if spec.kind == "flash_varlen":
        B, T, H, D = q.shape
        y = flash_varlen(q.reshape(B * T, H, D), k.reshape(B * T, k.shape[2], D), v.reshape(B * T, v.shape[2], D),
                         spec.cu_seqlens, spec.cu_seqlens, spec.max_seqlen, spec.max_seqlen,
                         dropout_p=dropout_p, causal=True, **window)
        return y.view(B, T, H, D)
    return flash_func(q, k, v, dropout_p=dropout_p, causal=True, **window)


# ---------------------------------------------------------------------------------- reference
def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                  sinks: Optional[torch.Tensor] = None, cap: Optional[float] = None) -> torch.Tensor:
    """The textbook computation in fp32 (fp64 for fp64 inputs) with GQA materialised (repeat_interleave) and an
    explicit mask: what every backend is tested against. q [B, H, Tq, D], k/v [B, Hkv, Tk, D], mask bool
    broadcastable to [B, H, Tq, Tk] (None = causal); `sinks` [H]: one more logit per head in the softmax, dropped
    after it (gpt-oss's, as transformers' eager attention computes it); `cap`: the scores soft-capped (Gemma 2's)."""
    rep = q.shape[1] // k.shape[1]
    ct = torch.promote_types(q.dtype, torch.float32)
    qf, kf, vf = q.to(ct), k.to(ct).repeat_interleave(rep, dim=1), v.to(ct).repeat_interleave(rep, dim=1)
    s = softcap(qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1]), cap)
    if mask is None:
        mask = dense_mask(q.shape[2], k.shape[2] - q.shape[2], q.device)
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(ct).view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        return (torch.cat((s, sink), dim=-1).softmax(-1)[..., :-1] @ vf).to(q.dtype)
    return (s.softmax(-1) @ vf).to(q.dtype)


# ------------------------------------------------------------------------------------- choice
def build_spec(B: int, T: int, positions: torch.Tensor, *, window: Optional[int] = None, **kw) -> AttnSpec:
    """The AttnSpec of one batch (`full_spec`'s arguments, below); with a sliding `window` (the model's sliding layers'
    width), its `windowed` spec for those layers as well, where the window is shorter than the keys (else they attend
    as the others do). The windowed layers run flash-attn with its window_size where flash-attn runs, else
    FlexAttention's or SDPA's masks with the window in the rule (`allowed`)."""
    spec = full_spec(B, T, positions, **kw)
    past = kw.get("past")
    if not window or T + (past or 0) <= window:
        return spec
    device = positions.device
    mask = kw.get("attention_mask")
    real = None if mask is None else mask.to(torch.bool)
    if past is not None:  # KV-cache generation: the cache's last `window` positions
        spec.windowed = AttnSpec("sdpa_masked", is_causal=False, mask=dense_mask(T, past, device, None, real, window))
        return spec
    backend = kw.get("backend", "auto")
    if kw.get("flash") is not None and backend in ("auto", "flash"):
        alt = full_spec(B, T, positions, **{**kw, "fa4": None})  # (FA4's kernels here take no window)
        if alt.kind in ("flash", "flash_varlen"):
            spec.windowed = dataclasses.replace(alt, window=int(window))
            return spec
    docs = batch_documents(B, T, device, positions if kw.get("position_ids_given") else None, kw.get("doc_ids"),
                           kw.get("cu_seqlens"))
    if backend != "sdpa" and flex_usable(device, kw.get("head_dim", 64)) and not kw.get("dropout"):
        spec.windowed = AttnSpec("flex", block_mask=block_mask(B, T, device, docs, mask, int(window)))
    else:
        spec.windowed = AttnSpec("sdpa_masked", is_causal=False, mask=dense_mask(T, 0, device, docs, real, window))
    return spec


def full_spec(B: int, T: int, positions: torch.Tensor, *, attention_mask: Optional[torch.Tensor] = None,
              position_ids_given: bool = False, doc_ids: Optional[torch.Tensor] = None,
              cu_seqlens: Optional[torch.Tensor] = None, max_seqlen: Any = None,
              past: Optional[int] = None, flash: Optional[tuple] = None, dropout: bool = False,
              head_dim: int = 64, backend: str = "auto", fa4: Optional[Any] = None,
              gqa: bool = False) -> AttnSpec:
    """The AttnSpec of one batch, from which inputs are present (never their values).

    past: None without a KV cache, else the number of cached positions (generation: always SDPA).
    flash: flash-attn's functions when usable for this batch (installed, accelerator, half precision).
    fa4: model.fa4.plan()'s FA4Plan when FlashAttention-4 is active and usable for this batch (it wins over
    flash-attn 2 with backend "auto"); gqa: the model has fewer kv heads than query heads.
    dropout: attention dropout is active (FlexAttention has none: the masked path then uses SDPA).
    head_dim: FlexAttention's GPU kernel needs >= 16 (smaller: the masked path uses SDPA).
    backend: "auto", or force "sdpa" | "flex" | "flash" for tests and benchmarks.
    """
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    device = positions.device
    Tk = T + (past or 0)
    if attention_mask is not None and attention_mask.shape[-1] != Tk:
        raise ValueError(f"attention_mask has {attention_mask.shape[-1]} columns, expected {Tk}")
    real = None if attention_mask is None else attention_mask.to(torch.bool)
    if past is not None:  # KV-cache generation; packed documents do not apply
        if real is None and not (past > 0 and T > 1):
            return AttnSpec("sdpa", is_causal=past == 0)  # prefill: causal; one new token: sees the cache
        return AttnSpec("sdpa_masked", is_causal=False, mask=dense_mask(T, past, device, None, real))
    if backend == "flash" and flash is None:
        raise ValueError("attention backend 'flash' forced, but flash-attn is not usable here "
                         "(not installed, not an accelerator, or not fp16/bf16)")
    use_fa4 = fa4 is not None and backend == "auto"
    if (use_fa4 and cu_seqlens is not None and fa4.varlen is not None and (fa4.varlen.gqa or not gqa)):
        if max_seqlen is None:
            raise ValueError("cu_seqlens needs max_seqlen (a Python int from the collate function)")
        return AttnSpec("fa4_varlen", cu_seqlens=cu_seqlens.to(device=device, dtype=torch.int32),
                        max_seqlen=int(max_seqlen), varlen=fa4.varlen)
    use_flash = flash is not None and backend in ("auto", "flash")
    if use_flash and cu_seqlens is not None and flash[1] is not None:
        if max_seqlen is None:
            raise ValueError("cu_seqlens needs max_seqlen (a Python int from the collate function)")
        # a 0-d tensor from the collate is read on the host, before it is moved: no device sync then
        return AttnSpec("flash_varlen", cu_seqlens=cu_seqlens.to(device=device, dtype=torch.int32),
                        max_seqlen=int(max_seqlen), flash=flash)
    docs = batch_documents(B, T, device, positions if position_ids_given else None, doc_ids, cu_seqlens)
    if docs is None and real is None:
        if use_fa4:
            return AttnSpec("fa4")
        if use_flash:
            return AttnSpec("flash", flash=flash)
        if backend == "flex":  # forced: plain causal through FlexAttention
            return AttnSpec("flex", block_mask=block_mask(B, T, device, None, None))
        return AttnSpec("sdpa", is_causal=True)
    if backend == "flash":
        raise ValueError("attention backend 'flash' cannot mask padding or packed documents without cu_seqlens")
    kind = backend if backend in ("sdpa", "flex") else ("flex" if flex_usable(device, head_dim) and not dropout else "sdpa")
    if kind == "flex":
        if not FLEX_AVAILABLE:
            raise ValueError("attention backend 'flex' forced, but this torch has no FlexAttention")
        if dropout:
            raise ValueError("FlexAttention has no attention dropout: use attn_dropout=0 or the sdpa backend")
        return AttnSpec("flex", block_mask=block_mask(B, T, device, docs, attention_mask))
    return AttnSpec("sdpa_masked", is_causal=False, mask=dense_mask(T, 0, device, docs, real))


def describe_attention(device: torch.device, cfg: Any, dtype: torch.dtype, compiled: bool = False) -> str:
    """One line for the start-up log: which attention each kind of batch gets on `device`."""
    if getattr(cfg, "attn_sinks", False):
        return ("SDPA with gpt-oss's attention sinks as one extra key (sink_attention): unmasked is_causal, "
                "packed/padded/windowed a dense [B,1,T,T] mask")
    if getattr(cfg, "attn_softcap", None) is not None:
        if flex_usable(device, cfg.head_dim) and not cfg.attn_dropout:
            return (f"FlexAttention with Gemma 2's soft-capped scores as its score_mod (cap {cfg.attn_softcap:g}; "
                    "causal / packed / padded / windowed block masks); KV-cache steps written out (softcap_attention)")
        return (f"written out with Gemma 2's soft-capped scores (softcap_attention, cap {cfg.attn_softcap:g}): the "
                "[B,H,T,T] scores in fp32, causal / packed / padded / windowed through one dense mask")
    flash = (cfg.flash_attn and dtype in HALF and kernels.flash_attn_functions(device) is not None)
    no_fa4 = fa4_mod.problem(cfg, device, dtype, dropout=cfg.attn_dropout > 0)
    plain = ("FlashAttention-4 (SDPA, flash backend only)" if no_fa4 is None else
             "flash-attn" if flash else "SDPA (is_causal, enable_gqa)")
    if flex_usable(device, cfg.head_dim) and not cfg.attn_dropout:
        how = "torch.compile'd with the model" if compiled else "compiled once per process"
        masked = f"FlexAttention ({how}; block mask: causal & same document & real key)"
    else:
        why = ("no FlexAttention in this torch" if not FLEX_AVAILABLE else
               "no FlexAttention backward here" if not is_accelerator(device) else
               "attention dropout" if cfg.attn_dropout else "head_dim < 16")
        masked = f"SDPA with a dense [B,1,T,T] mask ({why})"
    varlen = "; packed batches with cu_seqlens: flash-attn varlen" if flash else ""
    if no_fa4 is None:
        call = fa4_mod.plan(cfg, device, dtype, cfg.attn_dropout > 0).varlen
        if call is not None and (call.gqa or cfg.n_kv_heads == cfg.n_heads):
            varlen = "; packed batches with cu_seqlens: FlashAttention-4 (varlen_attn)"
        else:
            why = "no varlen_attn in this torch" if call is None else "this torch's varlen_attn has no enable_gqa"
            varlen = f"{varlen or '; packed batches with cu_seqlens: as packed/padded'} (FA4 varlen: {why})"
    elif is_accelerator(device) and cfg.fa4 != "false":
        varlen += f" (FlashAttention-4 not used: {no_fa4})"
    return f"unmasked {plain}; packed/padded {masked}{varlen}"
