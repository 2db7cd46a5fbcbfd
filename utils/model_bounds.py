"""Bounds of the model's size fields and an estimate of the model's bytes, checked before anything is
allocated.

Owns: `MODEL_INT_BOUNDS` / `MODEL_FLOAT_BOUNDS` (the largest value of each field a run can mean: beyond
them a value is a typo or a damaged file, e.g. "n_layers": 1000000 or --dim=1048576), `bound_problems`
(one phrase per field out of bounds), `head_shape_problem` (how dim splits into heads, as ModelConfig
refuses it), `param_count` (the Llama2 formula of model/llama.py, without
building it) and `fit_problem` (the fp32 weights alone against the memory the device has free: CPU via
psutil, an accelerator via utils/device.py free_memory_bytes, imported only there).
Used by trainer.validation.validate_config (the command line: exit 2) and utils/checkpoint_json.read_checkpoint_json
(a checkpoint's model_config.json: exit 5).
Must never: import torch at module level or any package above utils/ (the torch-free pre-check uses it).
"""
from __future__ import annotations

import math
from typing import Any, Optional

# field: (lowest, highest), inclusive. Generous: Llama-3 405B has dim 16384, 126 layers, 128 heads,
# hidden 53248, a 128k vocabulary and 128k positions.
MODEL_INT_BOUNDS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 2 ** 32), "dim": (1, 65536), "n_layers": (1, 1024), "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024), "hidden_dim": (1, 2 ** 20), "multiple_of": (1, 2 ** 16),
    "max_seq_len": (1, 2 ** 21), "loss_chunk_size": (1, 2 ** 24),
}
# field: (lowest, highest, lowest excluded, highest excluded)
MODEL_FLOAT_BOUNDS: dict[str, tuple[float, float, bool, bool]] = {
    "norm_eps": (0.0, 1.0, True, True), "rope_theta": (0.0, 1e12, True, False),
    "ffn_dim_multiplier": (0.0, 64.0, True, False), "attn_dropout": (0.0, 1.0, False, True),
    "resid_dropout": (0.0, 1.0, False, True), "initializer_range": (0.0, 1e3, False, False),
}


def bound_problems(fields: dict[str, Any], prefix: str = "") -> list[str]:
    """'<prefix><field>=<v>: must be in [lo, hi]' for each numeric field of `fields` out of bounds; values of
    another type (a string, None for an optional field) are left to the type checks of the caller."""
    out = []
    for name, (lo, hi) in MODEL_INT_BOUNDS.items():
        v = fields.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and not lo <= v <= hi:
            out.append(f"{prefix}{name}={v}: must be in [{lo}, {hi}]")
    for name, (lo, hi, lo_open, hi_open) in MODEL_FLOAT_BOUNDS.items():
        v = fields.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
            if not ok:
                out.append(f"{prefix}{name}={v}: must be in {'(' if lo_open else '['}{lo:g}, {hi:g}"
                           f"{')' if hi_open else ']'}")
    return out


def param_count(dim: int, n_layers: int, n_heads: int, vocab_size: int, n_kv_heads: Optional[int] = None,
                hidden_dim: Optional[int] = None, multiple_of: int = 256,
                ffn_dim_multiplier: Optional[float] = None, tie_embeddings: bool = False,
                head_dim: Optional[int] = None, qk_norm: bool = False, qkv_bias: bool = False,
                sandwich_norms: bool = False, pre_norms: bool = True, qk_norm_full: bool = False) -> int:
    """Parameters of the Llama2-style model (model/llama.py) with these sizes: embedding (+ a separate
    head), per layer q/k/v/o (their biases, Qwen2's; the q / k norms, Qwen3's), the SwiGLU's three matrices and two
    norms (four: Gemma's `sandwich_norms`; OLMo's: its two output norms only, `pre_norms` off, and q / k norms over all
    the heads, `qk_norm_full`), and the final norm."""
    kv = n_kv_heads or n_heads
    head_dim = head_dim or dim // max(1, n_heads)
    if not hidden_dim:  # model/config.llama_hidden_dim
        hidden = int(2 * 4 * dim / 3)
        if ffn_dim_multiplier is not None:
            hidden = int(ffn_dim_multiplier * hidden)
        hidden_dim = multiple_of * math.ceil(hidden / multiple_of)
    attn = 2 * dim * n_heads * head_dim + 2 * dim * kv * head_dim
    qk = (n_heads + kv) * head_dim if qk_norm_full else 2 * head_dim
    attn += (qk if qk_norm else 0) + ((n_heads + 2 * kv) * head_dim if qkv_bias else 0)
    layer = attn + 3 * dim * hidden_dim + (2 * pre_norms + 2 * sandwich_norms) * dim
    embed = vocab_size * dim * (1 if tie_embeddings else 2)
    return embed + n_layers * layer + dim


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def available_bytes(device: str) -> Optional[int]:
    """Free memory of `device`: psutil's available memory for the CPU; for an accelerator (and for "auto" when
    there is one) utils/device.py's `free_memory_bytes` (imports torch: the full start-up only); None when it
    cannot be told (the check is skipped)."""
    kind = str(device).split(":")[0]
    try:
        if kind not in ("cpu", "auto", ""):
            from utils.device import free_memory_bytes
            return free_memory_bytes(device)
        import psutil
        cpu = int(psutil.virtual_memory().available)
        if kind == "auto":
            from utils.device import accelerator_available, free_memory_bytes, resolve_device
            return free_memory_bytes(resolve_device("auto")) if accelerator_available() else cpu
        return cpu
    except (ImportError, RuntimeError, ValueError, IndexError, OSError):
        return None


def fit_problem(n_params: int, device: str, what: str) -> Optional[str]:
    """A phrase when the model's fp32 weights alone (4 bytes a parameter; training needs about 4x that with
    gradients and Adam's two moments) exceed the memory `device` has free; None when they fit or the free
    memory cannot be told."""
    need = 4 * n_params
    free = available_bytes(device)
    if free is None or need <= free:
        return None
    return (f"{what}: the model has {n_params:,} parameters, {human_bytes(need)} of fp32 weights alone "
            f"(training needs about 4x that), more than the {human_bytes(free)} free on --device={device}; "
            "choose smaller --dim / --n_layers / --vocab_size")


def window_problem(window: Any, layers: Any, n_layers: int) -> Optional[str]:
    """What is wrong with a sliding window (an integer >= 1) and its layers (None = all, or a list of distinct layer
    indices), or None."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        return f"sliding_window={window!r} must be an integer >= 1 (positions a query sees, itself included)"
    if layers is not None and not (isinstance(layers, (list, tuple)) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in layers)
            and len(set(layers)) == len(layers)):
        return f"sliding_layers={layers!r} must list distinct layer indices in [0, {n_layers})"
    return None


def head_shape_problem(dim: int, n_heads: int, n_kv_heads: Optional[int] = None,
                       head_dim: Optional[int] = None) -> Optional[str]:
    """What is wrong with how dim splits into attention heads (or, with an explicit `head_dim`, Qwen3's, with the
    heads themselves), or None: model.config.ModelConfig raises it, and the trainer's pre-check asks it before torch
    is imported."""
    n_kv_heads = n_kv_heads or n_heads
    if n_heads < 1 or n_kv_heads < 1:
        return f"n_heads={n_heads} and n_kv_heads={n_kv_heads} must be >= 1"
    if head_dim is not None:
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            return f"head_dim={head_dim!r} must be an even integer >= 2 (RoPE rotates pairs)"
        if n_heads % n_kv_heads:
            return f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}"
        return None
    if dim % n_heads:
        return f"dim={dim} is not divisible by n_heads={n_heads}"
    if n_heads % n_kv_heads:
        return f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}"
    if (dim // n_heads) % 2:
        return f"head_dim must be even for RoPE (dim={dim} / n_heads={n_heads} = {dim // n_heads})"
    return None


def checkpoint_policy_problem(policy: Any) -> Optional[str]:
    """Why a block checkpointing policy (model/checkpointing.py: full | op | a positive integer N) is not one."""
    text = str(policy).strip()
    if text in ("full", "op") or (text.isdigit() and int(text) >= 1):
        return None
    return f"{policy!r} is not full, op or a positive integer (every N-th block)"


def parse_sliding_layers(text: str, n_layers: int) -> Optional[list]:
    """The --sliding_layers flag as a list of layer indices (None when empty: every layer slides): "0,2,4", or
    "every:N:K" for every N-th layer from K. ValueError naming the flag for anything else (the range is ModelConfig's
    window_problem's)."""
    text = text.strip()
    if not text:
        return None
    try:
        if text.startswith("every:"):
            step, first = (int(v) for v in text[len("every:"):].split(":"))
            if step < 1:
                raise ValueError
            return list(range(first, n_layers, step))
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"--sliding_layers={text!r}: expected layer indices as 0,2,4 or every:N:K (N >= 1)") from None
