"""Hugging Face checkpoints whose MoE expert weights are stored in MXFP4 (OpenAI's gpt-oss-20b / 120b: config.json
`quantization_config` with quant_method "mxfp4"), read as the full-precision weights they stand for.

The format (OCP microscaling, as gpt-oss stores it): values are 4-bit floats FP4 E2M1 (sign, 2 exponent bits, 1
mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; code 8 is -0), two to a uint8 byte with the element
of lower index in the low nibble. Every run of 32 consecutive values shares one E8M0 scale byte e (a bare exponent,
bias 127), so a value is fp4 x 2^(e - 127). A weight `<name>` is stored as `<name>_blocks` [..., R, G, 16] (uint8,
G groups of 16 bytes = 32 values along the last axis) and `<name>_scales` [..., R, G] (uint8); it stands for the
[..., R, G * 32] matrix, whose last two axes the unquantized gpt-oss checkpoints (and transformers' GptOssExperts)
keep the other way round: `gate_up_proj` [E, hidden, 2 * intermediate] and `down_proj` [E, intermediate, hidden].
`dequantize` does that in fp32 for every `_blocks` / `_scales` pair; every other tensor passes through.
Owns: the E2M1 table, nibble order and scale bias of MXFP4, and the orientation of the tensors it rebuilds.
Must never: import transformers; change a tensor that is not a `_blocks` / `_scales` pair.
"""
from __future__ import annotations

import torch

BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
VALUES_PER_BLOCK = 32  # (one scale byte for each 16 packed bytes)
SCALE_BIAS = 127
# The 16 E2M1 codes in order: bit 3 is the sign, bits 2-1 the exponent (bias 1), bit 0 the mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
CHUNK_ROWS = 1 << 20  # (blocks decoded at a time: bounds the transient index tensors on a 120b layer)


def dequantize_blocks(blocks: torch.Tensor, scales: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] (uint8, two E2M1 codes a byte, low nibble first) and their E8M0 scales [..., G]
    (uint8) as the fp32 values [..., G * 32] they encode, in storage order (no transpose)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    half = VALUES_PER_BLOCK // 2
    if blocks.dim() < 2 or blocks.shape[-1] != half or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"{name}{BLOCKS_SUFFIX} {tuple(blocks.shape)} and {name}{SCALES_SUFFIX} "
                         f"{tuple(scales.shape)} do not match (expected [..., G, {half}] and [..., G])")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    packed = blocks.reshape(-1, half)
    exponent = scales.reshape(-1, 1).to(torch.int32) - SCALE_BIAS
    out = torch.empty(packed.shape[0], VALUES_PER_BLOCK, dtype=torch.float32, device=blocks.device)
    for r0 in range(0, packed.shape[0], CHUNK_ROWS):
        rows = packed[r0:r0 + CHUNK_ROWS]
        part = out[r0:r0 + CHUNK_ROWS]
        part[:, 0::2] = table[(rows & 0x0F).to(torch.int64)]
        part[:, 1::2] = table[(rows >> 4).to(torch.int64)]
        torch.ldexp(part, exponent[r0:r0 + CHUNK_ROWS], out=part)  # (x 2^e: exact unless it overflows fp32)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * VALUES_PER_BLOCK)


def method(config: dict) -> object:
    """The quant_method of a config.json dict's quantization_config (None when it has none or it is not a dict)."""
    q = config.get("quantization_config")
    return q.get("quant_method") if isinstance(q, dict) else None


def dequantize(sd: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors with every `<name>_blocks` + `<name>_scales` pair replaced by `<name>` in fp32, its
    last two axes swapped into the unquantized layout (gate_up_proj [E, hidden, 2I], down_proj [E, I, hidden]);
    `sd` as it is when config.json has no quantization_config. ValueError for another quantization method, or a
    `_blocks` / `_scales` without its partner, or one whose shapes do not match."""
    if not config.get("quantization_config"):
        return sd
    if method(config) != "mxfp4":
        raise ValueError(f"quantization_config quant_method={method(config)!r}: this reader takes only mxfp4")
    for name in sd:
        if name.endswith(SCALES_SUFFIX) and name[:-len(SCALES_SUFFIX)] + BLOCKS_SUFFIX not in sd:
            raise ValueError(f"{name}: MXFP4 scales without their {name[:-len(SCALES_SUFFIX)]}{BLOCKS_SUFFIX}")
    out = {}
    for name, t in sd.items():
        if name.endswith(SCALES_SUFFIX):
            continue
        if not name.endswith(BLOCKS_SUFFIX):
            out[name] = t
            continue
        base = name[:-len(BLOCKS_SUFFIX)]
        if base + SCALES_SUFFIX not in sd:
            raise ValueError(f"{name}: MXFP4 blocks without their {base}{SCALES_SUFFIX}")
        if base in sd:
            raise ValueError(f"{base}: stored both unquantized and as {name}")
        if t.dim() < 3:
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected [..., rows, G, 16] (a matrix per tensor)")
        out[base] = dequantize_blocks(t, sd[base + SCALES_SUFFIX], base).transpose(-1, -2).contiguous()
    return out
