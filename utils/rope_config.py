"""RoPE scaling settings: what `ModelConfig.rope_scaling` may hold, checked and completed in one place, and their
Hugging Face spelling (config.json's `rope_parameters` / `rope_scaling`) both ways.

Five kinds, with transformers' names and meanings (transformers/modeling_rope_utils.py), so that a Llama 3.x or
a YaRN checkpoint imports with the frequencies it was trained at:
  linear   every frequency divided by `factor` (position interpolation)
  dynamic  NTK-aware: the base grows once a sequence is longer than max_seq_len (computed per batch)
  llama3   Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth ramp between, set by
           `low_freq_factor`, `high_freq_factor` and the pretraining length `original_max_position_embeddings`
  yarn     YaRN (Peng et al. 2023): a ramp between interpolated and original frequencies over the dimensions
           whose rotations at `original_max_position_embeddings` fall between `beta_slow` and `beta_fast`, and
           cos / sin scaled by `attention_factor` (from `factor`, or `mscale` / `mscale_all_dim`, when not given)
  longrope LongRoPE (Phi-3.5, Phi-4-mini): each frequency divided by its own `short_factor` (sequences up to
           `original_max_position_embeddings`) or `long_factor` (longer ones), cos / sin scaled by `attention_factor`
           (sqrt(1 + ln(factor) / ln(original)) when not given; factor defaults to max_seq_len / original)

`normalize_rope_scaling` returns the canonical dict ModelConfig keeps (and model_config.json saves): "type", then
every field the kind uses, defaults filled in as transformers fills them, YaRN's attention factor resolved.

Must never: import torch or any package above utils/ (model/config.py and the trainer's torch-free pre-check read it).
"""
from __future__ import annotations

import math
from typing import Any, Optional

ROPE_SCALING_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")
# per kind: the fields besides "type" (required ones first); transformers' defaults for the optional ones
_FIELDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "mscale", "mscale_all_dim", "truncate"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor", "attention_factor"),
}
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": (), "longrope": ("short_factor", "long_factor")}
# keys a Hugging Face rope dict carries that are not scaling settings (read elsewhere: rope_theta, GLM's partial rotary)
HF_NON_SCALING_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _number(kind: str, key: str, value: Any, low: float, low_open: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (low_open and value == low):
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        raise ValueError(f"rope_scaling {kind}: {key} must be a finite number {bound}, got {value!r}")
    return float(value)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 at scale <= 1), as transformers computes it."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def normalize_rope_scaling(rs: Optional[dict], max_seq_len: int) -> Optional[dict]:
    """The canonical rope_scaling dict (None for none / "default"); ValueError naming the field that is wrong.

    `rs` may spell the kind "type" or "rope_type"; transformers' fill-ins apply: original_max_position_embeddings
    defaults to max_seq_len (llama3, yarn), YaRN's factor to max_seq_len / original_max_position_embeddings,
    beta_fast / beta_slow to 32 / 1, its attention_factor to yarn_mscale(factor) (or the mscale ratio); YaRN's
    mscale_all_dim is kept where given (model/mla.py's softmax factor)."""
    if rs is None:
        return None
    if not isinstance(rs, dict):
        raise ValueError(f"rope_scaling must be a dict with a 'type', got {rs!r}")
    kind = rs.get("type", rs.get("rope_type"))
    if kind in (None, "default"):
        return None
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope_scaling type must be one of {', '.join(ROPE_SCALING_TYPES)}, got {kind!r}")
    given = {k: v for k, v in rs.items() if k not in ("type", "rope_type") and v is not None}
    unknown = sorted(set(given) - set(_FIELDS[kind]))
    if unknown:
        raise ValueError(f"rope_scaling {kind}: unknown field(s) {', '.join(unknown)} "
                         f"(it takes {', '.join(_FIELDS[kind])})")
    missing = [k for k in _REQUIRED[kind] if k not in given]
    if missing:
        raise ValueError(f"rope_scaling {kind}: missing {', '.join(missing)}")
    out: dict = {"type": kind}
    if kind in ("linear", "dynamic"):
        out["factor"] = _number(kind, "factor", given["factor"], 1.0)
        return out
    original = given.get("original_max_position_embeddings", max_seq_len)
    if isinstance(original, float) and original.is_integer():  # 8192.0 in a config written by another tool
        original = int(original)
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ValueError(f"rope_scaling {kind}: original_max_position_embeddings must be an integer >= 1, "
                         f"got {original!r}")
    if kind == "llama3":
        out["factor"] = _number(kind, "factor", given["factor"], 1.0)
        low = _number(kind, "low_freq_factor", given["low_freq_factor"], 0.0, low_open=True)
        high = _number(kind, "high_freq_factor", given["high_freq_factor"], 0.0, low_open=True)
        if high <= low:
            raise ValueError(f"rope_scaling llama3: high_freq_factor ({high:g}) must be above low_freq_factor "
                             f"({low:g})")
        out.update(low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original)
        return out
    if kind == "longrope":
        return _longrope(given, original, max_seq_len)
    factor = _number(kind, "factor", given.get("factor", max_seq_len / original), 1.0)
    beta_fast = _number(kind, "beta_fast", given.get("beta_fast", 32), 0.0, low_open=True)
    beta_slow = _number(kind, "beta_slow", given.get("beta_slow", 1), 0.0, low_open=True)
    if beta_fast < beta_slow:
        raise ValueError(f"rope_scaling yarn: beta_fast ({beta_fast:g}) must be >= beta_slow ({beta_slow:g})")
    truncate = given.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"rope_scaling yarn: truncate must be true or false, got {truncate!r}")
    if "attention_factor" in given:
        attention = _number(kind, "attention_factor", given["attention_factor"], 0.0, low_open=True)
    elif given.get("mscale") and given.get("mscale_all_dim"):
        mscale = _number(kind, "mscale", given["mscale"], 0.0, low_open=True)
        mscale_all_dim = _number(kind, "mscale_all_dim", given["mscale_all_dim"], 0.0, low_open=True)
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention = yarn_mscale(factor)
    out.update(factor=factor, original_max_position_embeddings=original, beta_fast=beta_fast, beta_slow=beta_slow,
               attention_factor=attention, truncate=truncate)
    if given.get("mscale_all_dim"):  # (kept: DeepSeek's attention scales its scores by mscale(factor, it)^2 too)
        out["mscale_all_dim"] = _number(kind, "mscale_all_dim", given["mscale_all_dim"], 0.0, low_open=True)
    return out


def _longrope(given: dict, original: int, max_seq_len: int) -> dict:
    """The canonical longrope dict: its two factor lists (numbers > 0, as many of each), its pretraining length, and
    the attention factor transformers derives from factor = max_seq_len / original when none is given."""
    lists = {}
    for key in ("short_factor", "long_factor"):
        v = given[key]
        if not isinstance(v, (list, tuple)) or not v:
            raise ValueError(f"rope_scaling longrope: {key} must be a non-empty list of numbers, got {v!r}")
        lists[key] = [_number("longrope", f"{key}[{i}]", x, 0.0, low_open=True) for i, x in enumerate(v)]
    if len(lists["short_factor"]) != len(lists["long_factor"]):
        raise ValueError(f"rope_scaling longrope: {len(lists['short_factor'])} short factors, "
                         f"{len(lists['long_factor'])} long ones")
    factor = _number("longrope", "factor", given.get("factor", max_seq_len / original), 0.0, low_open=True)
    if "attention_factor" in given:
        attention = _number("longrope", "attention_factor", given["attention_factor"], 0.0, low_open=True)
    else:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"type": "longrope", **lists, "original_max_position_embeddings": original, "factor": factor,
            "attention_factor": attention}


def rope_scaling_from_hf(d: dict) -> Optional[dict]:
    """The scaling settings of a Hugging Face config.json dict (5.x `rope_parameters` or 4.x `rope_scaling`),
    canonical (normalize_rope_scaling); None for plain RoPE. ValueError for a kind we do not implement."""
    rp = d.get("rope_parameters") or {}
    rs = d.get("rope_scaling") or {}
    src = rp if rp.get("rope_type", rp.get("type")) not in (None, "default") else rs
    settings = {k: v for k, v in src.items() if k not in HF_NON_SCALING_KEYS}
    kind = src.get("rope_type", src.get("type"))
    if kind in (None, "default"):
        return None
    kind = "longrope" if kind == "su" else kind  # (Phi-3's first name for it, as transformers reads it)
    if kind not in ROPE_SCALING_TYPES:
        raise ValueError(f"rope scaling {kind!r} is not supported ({', '.join(ROPE_SCALING_TYPES)})")
    if kind in ("llama3", "yarn", "longrope") and "original_max_position_embeddings" not in settings \
            and d.get("original_max_position_embeddings"):  # Phi-3 keeps it beside the rope dict
        settings["original_max_position_embeddings"] = d["original_max_position_embeddings"]
    return normalize_rope_scaling({"type": kind, **settings}, d.get("max_position_embeddings", 2048))


def rope_scaling_to_hf(scaling: Optional[dict]) -> dict:
    """The fields a Hugging Face rope dict gets for canonical `scaling`, beside rope_type and rope_theta (YaRN's
    resolved attention_factor among them: transformers then computes no other)."""
    return {k: v for k, v in (scaling or {}).items() if k != "type"}


def parse_rope_flag(text: str) -> Optional[dict]:
    """The trainer's --rope_scaling: "" (none), TYPE:FACTOR (`yarn:4`, `linear:2`, `dynamic:2`), or a JSON object
    with transformers' fields (`{"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}`).
    Returns the dict as given (not yet completed: the lengths it defaults to depend on the model it applies to);
    ValueError saying what is wrong, checked as normalize_rope_scaling checks it."""
    text = (text or "").strip()
    if not text:
        return None
    if text.startswith("{"):
        import json
        try:
            setting = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a JSON object ({e.msg} at character {e.pos})") from None
        if not isinstance(setting, dict):
            raise ValueError("not a JSON object")
    else:
        kind, sep, factor = text.partition(":")
        try:
            setting = {"type": kind.strip(), "factor": float(factor)}
        except ValueError:
            raise ValueError("expected TYPE:FACTOR (yarn:4, linear:2, dynamic:2) or a JSON object") from None
        if not sep:
            raise ValueError("expected TYPE:FACTOR (yarn:4, linear:2, dynamic:2) or a JSON object")
    normalize_rope_scaling(setting, 1 << 20)  # every field checked (the lengths are the model's, filled later)
    return setting
