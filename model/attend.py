"""One attention call over [B, T, heads, D] tensors through the kernel an AttnSpec names (model/attention.py's, or
context parallelism's ring, model/ring_attention.py), with the KV cache's update where generation passes one: what
model/llama.py's grouped-query attention and model/mla.py's latent attention share after their projections.

Must never: decide the kernel (model/attention.py's build_spec did, from which inputs are present).
"""
from __future__ import annotations

import torch

from model import attention
from model.attention import AttnSpec


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: AttnSpec, dropout_p: float = 0.0,
           cache=None, layer_idx: int = 0, sinks=None, softcap=None) -> torch.Tensor:
    """q [B, T, H, D], k/v [B, T, Hkv, D] (after RoPE) -> [B, T, H, D]; `cache` (model/llama.py KVCache) takes this
    step's keys/values for layer `layer_idx` and gives back all so far; `sinks` [H] (gpt-oss's attention sinks):
    through SDPA (the model gives such batches an SDPA spec); `softcap` (Gemma 2's cap on the scores): FlexAttention's
    score_mod for a flex spec, else the written-out attention of model/attention.py softcap_attention."""
    if spec.kind in ("flash", "flash_varlen", "fa4_varlen"):  # flash-attn's [B, T, H, D] layout, GQA native
        return attention.flash_attention(q, k, v, spec, dropout_p)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H(kv), T, D]
    if cache is not None:
        k, v = cache.update(layer_idx, k, v)
    # k/v keep n_kv_heads: SDPA's and FlexAttention's enable_gqa share them inside the kernel
    if spec.kind == "ring":  # context parallel: this rank's chunks against the whole sequence
        # imported here: its torch.compiler.disable imports torch._dynamo (~2 s), which sample.py and
        # eval_lm.py should not pay for; a context-parallel run has loaded it when it set the spec up
        from model.ring_attention import ring_attention
        y = ring_attention(q, k, v, spec.group, spec.docs)
    elif sinks is not None:
        if spec.kind not in ("sdpa", "sdpa_masked"):
            raise ValueError(f"attention sinks run through SDPA, not the {spec.kind!r} kernel")
        y = attention.sink_attention(q, k, v, spec, sinks, dropout_p)
    elif spec.kind == "flex":  # (Gemma 2's capped scores: FlexAttention's score_mod)
        y = attention.flex_attention_(q, k, v, spec, None if softcap is None else attention.softcap_score_mod(softcap))
    elif softcap is not None:
        if spec.kind not in ("sdpa", "sdpa_masked"):
            raise ValueError(f"soft-capped attention scores run written out or in FlexAttention, not {spec.kind!r}")
        y = attention.softcap_attention(q, k, v, spec, softcap, dropout_p)
    else:
        y = attention.sdpa_attention(q, k, v, spec, dropout_p)
    return y.transpose(1, 2)
