"""Training FLOPs per token and model FLOPs utilisation (MFU).

Owns: the FLOPs formula, the table of dense peak FLOP/s of common accelerators, the CPU peak
measurement (best of several matmul rounds; the best ever seen on the machine is kept, so a busy
start cannot halve it; cached per run directory) and the MFU helper.
The peak comes from, in order: the `--peak_flops` flag, the PEAK_FLOPS environment variable, the
table (accelerators, by device name and dtype), a measurement (CPU, or an accelerator the table
does not know). Only a measured peak is an *estimate*: its MFU is clamped at 100% and labelled so.

Formula (training = forward + backward, backward = 2x forward):
    flops_per_token = 6 * N  +  12 * n_layers * dim * seq_len
- N: parameters that take part in a matmul per token = all layer weights + the LM head; of an MoE block
  the active ones only: router (E x dim) + (top_k + shared) experts x 3 x dim x expert width
  (the embedding lookup is a gather, not a matmul; with tied embeddings the shared matrix counts once,
  as the LM head). Norm weights are included (negligible).
- 12 * L * d * T: attention scores QK^T and the weighted sum AV, 2 * T * d multiply-adds each per token
  per layer forward (4 * T * d FLOPs), times 3 for forward + backward. As in PaLM/nanoGPT the causal
  half is not discounted, so MFU is comparable with those reports. `causal_half=True` counts the attention
  term at half (6 * L * d * T: the FLOPs a causal kernel actually does, the convention of FlashAttention's and
  torchtitan's papers), which gives a lower MFU at long sequences; benchmarks print both.

Must never: assert speed, or run the benchmark at import time.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Optional

import torch

from model.config import ModelConfig
from utils.device import get_peak_flops_override, synchronize
from utils.mla_flags import mla_attention_params
from utils.publish import atomic_write_text

_PEAK_CACHE: dict[tuple[str, torch.dtype], float] = {}

# Dense (no 2:4 sparsity) peak FLOP/s from the vendors' data sheets: (name fragments, bf16/fp16, fp32).
# fp32 is the plain (non-tensor-core) figure; checked in order, so the more specific names come first.
_PEAK_TABLE: list[tuple[tuple[str, ...], float, float]] = [
    (("h100", "nvl"), 835e12, 60e12),
    (("h100", "pcie"), 756e12, 51e12),
    (("h100",), 989e12, 67e12),          # SXM / HBM3
    (("h200",), 989e12, 67e12),
    (("gh200",), 989e12, 67e12),
    (("b200",), 2250e12, 80e12),
    (("a100",), 312e12, 19.5e12),
    (("a800",), 312e12, 19.5e12),
    (("l40s",), 362e12, 91.6e12),
    (("l40",), 181e12, 90.5e12),
    (("l4",), 121e12, 30.3e12),
    (("a10g",), 70e12, 31.2e12),
    (("a10",), 125e12, 31.2e12),
    (("v100",), 125e12, 15.7e12),        # fp16 tensor cores (no bf16 on Volta)
    (("4090",), 165e12, 82.6e12),
    (("3090",), 71e12, 35.6e12),
    (("mi300x",), 1307e12, 163.4e12),
    (("mi250",), 383e12, 47.9e12),
]


@dataclass(frozen=True)
class PeakFlops:
    flops: float   # FLOP/s of one device
    source: str    # "flag" | "env" | "table" | "measured"
    detail: str = ""

    @property
    def is_estimate(self) -> bool:
        return self.source == "measured"

    def describe(self) -> str:
        what = {"flag": "--peak_flops", "env": "PEAK_FLOPS", "table": f"table: {self.detail}",
                "measured": f"measured matmul, an estimate: {self.detail}"}[self.source]
        return f"{self.flops / 1e12:.3g} TFLOP/s ({what})"


def table_peak_flops(device_name: str, dtype: torch.dtype) -> Optional[float]:
    """Dense peak FLOP/s of a known accelerator in `dtype`, or None."""
    name = device_name.lower()
    for fragments, half, single in _PEAK_TABLE:
        if all(f in name for f in fragments):
            return single if dtype == torch.float32 else half
    return None


def matmul_params(cfg: ModelConfig) -> int:
    """The parameters a token's matmuls use (the active ones of an MoE block: its router, top_k routed experts
    and the shared experts; the other experts' weights do no work for that token). Multi-token prediction's
    depths (model/mtp.py) count as blocks n_layers.. with their projection, norms and a pass of the LM head each."""
    d, hd, kv = cfg.dim, cfg.head_dim, cfg.n_kv_heads
    attn = d * (cfg.n_heads * hd) * 2 + d * (kv * hd) * 2  # q, o, k, v
    if getattr(cfg, "kv_lora_rank", 0):  # multi-head latent attention's projections and latent norms instead
        attn = mla_attention_params(cfg)
    mlp = 3 * d * cfg.hidden_dim
    qk = (cfg.n_heads + kv) * hd if getattr(cfg, "qk_norm_full", False) else 2 * hd  # (OLMo 2's; Qwen3's per head)
    norms = (2 * d if getattr(cfg, "pre_norms", True) else 0) + (qk if getattr(cfg, "qk_norm", False) else 0)
    norms += 2 * d if getattr(cfg, "sandwich_norms", False) else 0  # (Gemma's, OLMo's norms of the sublayers' outputs)
    mtp = getattr(cfg, "mtp_num_layers", 0)
    blocks = cfg.n_layers + mtp
    n_moe = sum(cfg.is_moe_layer(i) for i in range(blocks))
    expert = 3 * d * (cfg.moe_hidden_dim or cfg.hidden_dim)
    shared = 3 * d * cfg.moe_shared_width + (d if getattr(cfg, "moe_shared_gate", False) else 0)
    moe = cfg.moe_num_experts * d + cfg.moe_top_k * expert + shared  # router + active experts + the shared ones
    head = d + (getattr(cfg, "num_labels", 0) or cfg.vocab_size) * d  # a final norm + the LM head (or a score head)
    return (blocks * (attn + norms) + (blocks - n_moe) * mlp + n_moe * moe + head
            + mtp * (2 * d * d + 2 * d + head))  # per depth: eh_proj, enorm + hnorm, its norm and the head


def flops_per_token(cfg: ModelConfig, seq_len: int, causal_half: bool = False) -> float:
    """Training FLOPs per token (forward + backward) of `cfg` at sequence length `seq_len`; causal_half: the
    attention term halved (the masked half of the scores is not computed by a causal kernel)."""
    width = cfg.n_heads * cfg.head_dim  # (dim, unless the heads are sized on their own: Qwen3)
    if getattr(cfg, "kv_lora_rank", 0):  # (MLA: the scores at the query / key width, the values' product at v's)
        width = cfg.n_heads * (cfg.head_dim + cfg.v_head_dim) / 2
    attention = (6.0 if causal_half else 12.0) * (cfg.n_layers + getattr(cfg, "mtp_num_layers", 0)) * width * seq_len
    return 6.0 * matmul_params(cfg) + attention


def measure_peak_flops(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                       n: Optional[int] = None, seconds: float = 1.0, rounds: int = 5) -> float:
    """Best observed FLOP/s of a square matmul of size n in `dtype` on `device` (cached per process).

    Best of `rounds` rounds of `seconds / rounds` each, after a warm-up: one short measurement on a
    busy CPU varied 10x between runs; the best of several is stable to a few percent.
    PEAK_FLOPS in the environment overrides the measurement.
    """
    override = get_peak_flops_override()
    if override:
        return override
    device = torch.device(device)
    key = (str(device), dtype)
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    if n is None:
        n = 1024 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(3):  # warm-up: thread pools, kernel selection, CPU frequency
        a @ b
    synchronize(device)
    best = 0.0
    for _ in range(max(1, rounds)):
        t_end = time.perf_counter() + seconds / max(1, rounds)
        while True:
            t0 = time.perf_counter()
            a @ b
            synchronize(device)
            dt = time.perf_counter() - t0
            best = max(best, 2.0 * n ** 3 / dt)
            if time.perf_counter() >= t_end:
                break
    _PEAK_CACHE[key] = best
    return best


def _device_name(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return device.type


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine() or "cpu"


def machine_cache_path() -> str:
    """Where the best matmul rate ever measured on this machine is kept: $MYLLM_CACHE_DIR or
    ~/.cache/myllm (per CPU model, dtype and thread count)."""
    root = os.environ.get("MYLLM_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "myllm")
    return os.path.join(root, "peak_flops.json")


def _read_json_dict(path: Optional[str]) -> dict:
    if not path or not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}  # a torn cache is re-measured, never trusted
    return data if isinstance(data, dict) else {}


def _write_json_dict(path: str, data: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        # unique: several processes on the machine may write the machine cache at once
        atomic_write_text(path, json.dumps(data, indent=1), unique=True)
    except OSError:
        pass  # a read-only home: the figure is still used for this run


def resolve_peak_flops(device: torch.device | str, dtype: torch.dtype, override: float = 0.0,
                       cache_dir: Optional[str] = None) -> PeakFlops:
    """Where MFU's denominator comes from (see the module docstring for the order).

    A CPU (or unknown accelerator) peak is measured, and a measurement is only as good as how idle
    the machine was: on one busy CPU single measurements ranged 2.1-12.3 GFLOP/s. So the figure
    used is the best rate ever measured on this machine (kept in `machine_cache_path()`, per CPU
    model, dtype and thread count), raised whenever a start measures more: load can no longer halve
    it. A run also caches the figure it started with in `<cache_dir>/peak_flops.json`, so a resumed
    run divides by the same number and its MFU curve stays continuous.
    """
    device = torch.device(device)
    if override and override > 0:
        return PeakFlops(float(override), "flag")
    env = get_peak_flops_override()
    if env:
        return PeakFlops(env, "env")
    name = _device_name(device)
    table = table_peak_flops(name, dtype) if device.type != "cpu" else None
    if table is not None:
        return PeakFlops(table, "table", f"{name} {str(dtype).replace('torch.', '')}")
    key = f"{name}|{str(dtype).replace('torch.', '')}|threads={torch.get_num_threads()}"
    path = os.path.join(cache_dir, "peak_flops.json") if cache_dir else None
    run_cache = _read_json_dict(path)
    if isinstance(run_cache.get(key), (int, float)) and run_cache[key] > 0:
        return PeakFlops(float(run_cache[key]), "measured", f"{key}, cached for this run")
    value = measure_peak_flops(device, dtype, seconds=2.0 if device.type == "cpu" else 1.0)
    machine_key = f"{_cpu_model() if device.type == 'cpu' else name}|{key}"
    machine = _read_json_dict(machine_cache_path())
    best = machine.get(machine_key)
    best = float(best) if isinstance(best, (int, float)) and best > 0 else 0.0
    detail = f"{key}, this start {value / 1e9:.3g} GFLOP/s"
    if best > value:
        detail += f", best seen on this machine {best / 1e9:.3g}"
        value = best
    else:
        machine[machine_key] = value
        _write_json_dict(machine_cache_path(), machine)
    if path:
        run_cache[key] = value
        _write_json_dict(path, run_cache)
    return PeakFlops(value, "measured", detail)


def mfu_from(achieved_flops_per_s: float, peak: PeakFlops) -> float:
    """Achieved / peak; an estimated (measured) peak is clamped at 100%: a busy or turbo-boosting CPU
    can beat its own short measurement, and a figure above 100% says nothing true."""
    value = achieved_flops_per_s / peak.flops
    return min(value, 1.0) if peak.is_estimate else value


def mfu(tokens_per_second: float, cfg: ModelConfig, seq_len: int, peak_flops: Optional[float] = None,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Achieved training FLOP/s as a fraction of the peak (argument > PEAK_FLOPS env > table > measured)."""
    peak = resolve_peak_flops(device, dtype, override=peak_flops or 0.0)
    return mfu_from(tokens_per_second * flops_per_token(cfg, seq_len), peak)
