"""Hugging Face checkpoints stored in fine-grained FP8 (DeepSeek-V3 / R1, Kimi K2, Qwen3's -FP8 releases:
config.json `quantization_config` with quant_method "fp8"), read as the full-precision weights they stand for.

The format (DeepSeek's, transformers' FineGrainedFP8): a weight W [N, K] is stored as float8_e4m3fn values q and,
beside it, `<name>_scale_inv` s of shape [ceil(N / bn), ceil(K / bk)] for `weight_block_size` [bn, bk] (or one value
per tensor without a block size); W = q x s, each scale multiplying its block (the last blocks of a row or column
may be partial). `dequantize` does that in fp32 for every weight that has a scale beside it and drops the scales
(and static activation scales, which only an FP8 forward uses); every other tensor passes through. Another
quantization method is refused in one line naming it (its packed tensors would not load as weights), except MXFP4
(gpt-oss's experts, quant_method "mxfp4"), which `dequantize` hands to model/hf_mxfp4.py.
Must never: import transformers; change a tensor that has no scale.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from model import hf_mxfp4

SCALE_SUFFIX = "_scale_inv"
ACTIVATION_SCALES = (".activation_scale", ".input_scale")  # (static activation quantization's: not weights)


def block_size(config: dict) -> Optional[tuple[int, int]]:
    """The FP8 block size [rows, columns] of a config.json dict's quantization_config (None: one scale per tensor);
    ValueError for a quantization method other than fine-grained FP8. Call only where quantization_config is set."""
    q = config["quantization_config"]
    method = q.get("quant_method") if isinstance(q, dict) else None
    if method != "fp8":
        raise ValueError(f"quantization_config quant_method={method!r}: only fine-grained FP8 checkpoints "
                         "(quant_method fp8: DeepSeek-V3's, Qwen3-FP8's) and MXFP4 ones (quant_method mxfp4: "
                         "gpt-oss's) are read; dequantize this one with its own tool first")
    size = q.get("weight_block_size")
    if size is None:
        return None
    if not (isinstance(size, (list, tuple)) and len(size) == 2 and all(isinstance(v, int) and v >= 1 for v in size)):
        raise ValueError(f"quantization_config weight_block_size={size!r}: expected two positive integers")
    return int(size[0]), int(size[1])


def dequantize(sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every FP8 weight that has a `<name>_scale_inv` beside it multiplied out in fp32
    (the scales and activation scales dropped); `sd` as it is when config.json has no quantization_config. An MXFP4
    checkpoint (quant_method mxfp4) is read by hf_mxfp4.dequantize instead."""
    if not config.get("quantization_config"):
        return sd
    if hf_mxfp4.method(config) == "mxfp4":
        return hf_mxfp4.dequantize(sd, config)
    block = block_size(config)
    out = {}
    for name, t in sd.items():
        if name.endswith(SCALE_SUFFIX) or name.endswith(ACTIVATION_SCALES):
            continue
        scale = sd.get(name + SCALE_SUFFIX)
        out[name] = t if scale is None else dequantize_weight(t, scale, block, name)
    return out


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: Optional[tuple[int, int]],
                      name: str = "weight") -> torch.Tensor:
    """q [..., N, K] (FP8) times its block scales [..., ceil(N / bn), ceil(K / bk)] (or one per tensor) in fp32."""
    w = q.to(torch.float32)
    s = scale.to(torch.float32)
    if s.numel() == 1:
        return w * s.reshape(())
    if block is None:  # (scales that broadcast over the weight as they are)
        return w * s
    (n, k), (bn, bk) = w.shape[-2:], block
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(s.shape[-2:]) != want:
        raise ValueError(f"{name}{SCALE_SUFFIX}: shape {tuple(s.shape)} does not tile {tuple(w.shape)} in blocks of "
                         f"{bn} x {bk} (expected {want} last)")
    full = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return w * full
