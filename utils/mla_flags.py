"""The multi-head latent attention flags of the trainer (`MLAFlags`, mixed into trainer/config.py's TrainConfig) and
their checks: `mla_shape_problem` (the attention's shape, as ModelConfig refuses it), `mla_problems` (the flags, one
phrase each for the trainer's exit-2 line), and the parameter counts the memory check and the FLOP count use.

MLA (DeepSeek-V2 / V3; model/mla.py): keys and values come from one latent of `kv_lora_rank` values per token
(normed, then expanded per head by kv_b_proj), queries optionally from a latent of `q_lora_rank`; each head's query
and key are `qk_nope_head_dim` dimensions without RoPE and `qk_rope_head_dim` with it (the key's shared by the
heads), its value `v_head_dim` wide. transformers' DeepseekV3Config names, which the fields keep.

Must never: import torch or any package above utils/ (the torch-free pre-check reads it; model/config.py too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from utils.configurator import flag

# the ModelConfig fields MLA cannot be combined with (its block is DeepSeek's: plain pre-norms, one RoPE table)
MLA_EXCLUDES = ("qkv_bias", "qk_norm", "attn_head_dim", "sliding_window", "nope_layers", "query_pos_scale_beta",
                "rope_local_theta", "query_scale")


@dataclass
class MLAFlags:
    """Multi-head latent attention (model/mla.py; docs/model.md "Multi-head latent attention")."""
    kv_lora_rank: int = flag(0, "multi-head latent attention (DeepSeek-V2 / V3's MLA): keys and values from one latent "
                             "of this width per token (DeepSeek-V3: 512); 0 = grouped-query attention")
    q_lora_rank: int = flag(0, "with --kv_lora_rank: queries through a latent of this width (DeepSeek-V3: 1536); 0 = "
                            "one q_proj")
    qk_nope_head_dim: int = flag(0, "with --kv_lora_rank: each head's query / key dimensions without RoPE "
                                 "(DeepSeek-V3: 128); 0 = --dim / --n_heads")
    qk_rope_head_dim: int = flag(0, "with --kv_lora_rank: each head's query / key dimensions with RoPE, the key's "
                                 "shared by the heads (DeepSeek-V3: 64); 0 = half of --qk_nope_head_dim")
    v_head_dim: int = flag(0, "with --kv_lora_rank: each head's value width (DeepSeek-V3: 128); 0 = "
                           "--qk_nope_head_dim")


def mla_shape_problem(kv_lora_rank: Any, q_lora_rank: Any, nope: Any, rope: Any, v: Any) -> Optional[str]:
    """Why an MLA shape (kv_lora_rank > 0) cannot be built, or None."""
    named = {"kv_lora_rank": kv_lora_rank, "qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v}
    if q_lora_rank is not None:
        named["q_lora_rank"] = q_lora_rank
    for name, value in named.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return f"{name}={value!r} must be an integer >= 1 with multi-head latent attention"
    if rope % 2:
        return f"qk_rope_head_dim={rope} must be even (RoPE rotates pairs)"
    if v > nope + rope:
        return (f"v_head_dim={v} is wider than a head's query / key ({nope} + {rope}): the kernels that need one width "
                "pad the values to the keys'")
    return None


def mla_model_fields(cfg: Any) -> dict:
    """The ModelConfig fields of a new model from the trainer's MLA flags (none without --kv_lora_rank)."""
    if not cfg.kv_lora_rank:
        return {}
    nope = cfg.qk_nope_head_dim or cfg.dim // max(1, cfg.n_heads)
    return {"kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None, "qk_nope_head_dim": nope,
            "qk_rope_head_dim": cfg.qk_rope_head_dim or max(2, nope // 2 // 2 * 2),
            "v_head_dim": cfg.v_head_dim or nope}


def mla_problems(cfg: Any) -> list[str]:
    """Every MLA flag of a TrainConfig that a run cannot use, as '--flag=value: why' phrases."""
    names = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    p = [f"--{n}={getattr(cfg, n)}: must be >= 0" for n in names if getattr(cfg, n) < 0]
    if p:
        return p
    if not cfg.kv_lora_rank:
        return [f"--{n}={getattr(cfg, n)} needs --kv_lora_rank (multi-head latent attention)"
                for n in names[1:] if getattr(cfg, n)]
    f = mla_model_fields(cfg)
    problem = mla_shape_problem(f["kv_lora_rank"], f["q_lora_rank"], f["qk_nope_head_dim"], f["qk_rope_head_dim"],
                                f["v_head_dim"])
    if problem:
        p.append("--" + problem)
    given = {"qkv_bias": cfg.qkv_bias, "qk_norm": cfg.qk_norm, "head_dim": cfg.head_dim,
             "sliding_window": cfg.sliding_window, "n_kv_heads": cfg.n_kv_heads not in (0, cfg.n_heads)}
    p.extend(f"--kv_lora_rank={cfg.kv_lora_rank} cannot be combined with --{n}={getattr(cfg, n)} (DeepSeek's "
             "attention has its own head sizes and no GQA, biases, q / k norms or window)" for n, v in given.items()
             if v)
    return p


def mla_attention_params(mcfg: Any) -> int:
    """The parameters of one MLA attention (matmuls and its latent norms) of a ModelConfig with kv_lora_rank > 0."""
    d, h, r = mcfg.dim, mcfg.n_heads, mcfg.kv_lora_rank
    qk = mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim
    q = d * h * qk if not mcfg.q_lora_rank else d * mcfg.q_lora_rank + mcfg.q_lora_rank + mcfg.q_lora_rank * h * qk
    kv = d * (r + mcfg.qk_rope_head_dim) + r + r * h * (mcfg.qk_nope_head_dim + mcfg.v_head_dim)
    return q + kv + h * mcfg.v_head_dim * d


def mla_param_delta(mcfg: Any) -> int:
    """Parameters an MLA ModelConfig has beyond the grouped-query twin utils.model_bounds.param_count counts (its
    q / k / v / o at head_dim = nope + rope, n_kv_heads = n_heads): per block (MTP depths too) MLA's in place."""
    if not getattr(mcfg, "kv_lora_rank", 0):
        return 0
    gqa = 4 * mcfg.dim * mcfg.n_heads * (mcfg.qk_nope_head_dim + mcfg.qk_rope_head_dim)
    blocks = mcfg.n_layers + getattr(mcfg, "mtp_num_layers", 0)
    return blocks * (mla_attention_params(mcfg) - gqa)
