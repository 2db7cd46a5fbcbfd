"""MXFP4 checkpoints (model/hf_mxfp4.py: gpt-oss's expert weights, quantization_config quant_method "mxfp4"): the
decoded values equal transformers' own dequantization bit for bit; the rebuilt tensors have the shape and orientation
of GptOssExperts' parameters (checked against a tiny GptOssForCausalLM and transformers' dequantizing load); every
E2M1 code; what is refused; what passes through; hf_fp8.dequantize dispatching to it."""
from __future__ import annotations

import json

import pytest
import torch

from model import hf_fp8
from model.hf_mxfp4 import dequantize, dequantize_blocks

CPU = torch.device("cpu")
MXFP4 = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
# E2M1 written out here on its own: code = sign bit, 2 exponent bits, 1 mantissa bit.
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # (bit patterns: -0 differs from 0)


def _random_packed(g: torch.Generator, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [*shape, 16] over every byte, scales [*shape] over 118..136 plus the extreme codes 0 and 254."""
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.int32, device=CPU).to(torch.uint8)
    scales = torch.randint(118, 137, shape, generator=g, dtype=torch.int32, device=CPU)
    flat = scales.view(-1)
    flat[:3], flat[-3:] = 0, 254
    return blocks, scales.to(torch.uint8)


def _pack(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An exactly representable stand-in for a GptOssExperts parameter w [E, in, out] (E2M1 values times a power of
    two per 32 inputs) and its hand-packed storage: blocks [E, out, in / 32, 16] and scales [E, out, in / 32]."""
    e, k, n = w.shape
    codes = torch.randint(0, 16, (e, n, k // 32, 32), generator=g, device=CPU)
    exps = torch.randint(120, 135, (e, n, k // 32), generator=g, dtype=torch.int32, device=CPU)
    vals = torch.tensor(GRID, device=CPU)[codes] * torch.pow(2.0, (exps - 127).float())[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # (first value in the low nibble)
    return vals.reshape(e, n, k).transpose(1, 2).contiguous(), blocks, exps.to(torch.uint8)


def test_decoding_equals_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator(device=CPU).manual_seed(0)
    blocks, scales = _random_packed(g, 5, 48, 6)  # (5 experts, 48 rows, 6 groups of 32)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, G * 32, rows]
    assert theirs.shape == (5, 192, 48) and torch.isinf(theirs).any() and (theirs.abs() < 2.0 ** -120).any()
    ours = dequantize_blocks(blocks, scales)
    assert ours.dtype == torch.float32 and ours.shape == (5, 48, 192)
    assert torch.equal(_bits(ours), _bits(theirs.transpose(1, 2)))
    sd = {"model.layers.0.mlp.experts.down_proj_blocks": blocks, "model.layers.0.mlp.experts.down_proj_scales": scales}
    out = dequantize(sd, MXFP4)
    assert list(out) == ["model.layers.0.mlp.experts.down_proj"]
    assert torch.equal(_bits(out["model.layers.0.mlp.experts.down_proj"]), _bits(theirs))


def test_every_e2m1_code_decodes_to_its_value():
    codes = torch.arange(16, dtype=torch.uint8, device=CPU)
    blocks = (codes | (codes.roll(1) << 4)).reshape(1, 16)  # (byte i: code i low, code i - 1 high)
    got = dequantize_blocks(blocks, torch.tensor([127], dtype=torch.uint8, device=CPU))  # (scale 2^0)
    assert _bits(got[0::2]).tolist() == _bits(torch.tensor(GRID)).tolist()
    assert _bits(got[1::2]).tolist() == _bits(torch.tensor(GRID).roll(1)).tolist()
    halved = dequantize_blocks(blocks, torch.tensor([126], dtype=torch.uint8, device=CPU))
    assert halved[0::2].tolist() == [v / 2 for v in GRID]


def test_rebuilt_experts_have_gpt_oss_layout_and_load_as_transformers_does(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM, Mxfp4Config
    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128)
    model = GptOssForCausalLM(cfg).float().eval()
    g = torch.Generator(device=CPU).manual_seed(1)
    stored, expected = {}, {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for proj in ("gate_up_proj", "down_proj"):
                param = getattr(layer.mlp.experts, proj)
                w, blocks, scales = _pack(param, g)
                param.copy_(w)
                name = f"model.layers.{i}.mlp.experts.{proj}"
                stored[name + "_blocks"], stored[name + "_scales"], expected[name] = blocks, scales, param
    assert tuple(expected["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 64, 64)  # [E, hidden, 2I]
    assert tuple(expected["model.layers.0.mlp.experts.down_proj"].shape) == (4, 32, 64)  # [E, I, hidden]
    model.save_pretrained(str(tmp_path))
    sd = {n: t for n, t in load_file(str(tmp_path / "model.safetensors")).items() if n not in expected}
    sd.update(stored)
    out = dequantize(sd, MXFP4)
    assert set(out) == set(sd) - set(stored) | set(expected)
    for name, param in expected.items():
        assert out[name].shape == param.shape and torch.equal(_bits(out[name]), _bits(param.detach())), name
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **MXFP4}))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path), quantization_config=Mxfp4Config(dequantize=True),
                                                  dtype=torch.float32).state_dict()
    for name, param in expected.items():
        assert torch.equal(_bits(loaded[name]), _bits(param.detach())), name
    assert torch.equal(_bits(hf_fp8.dequantize(sd, MXFP4)[name]), _bits(param.detach()))  # (the one entry point)


def test_unpaired_or_mismatched_tensors_are_refused_by_name():
    g = torch.Generator(device=CPU).manual_seed(2)
    blocks, scales = _random_packed(g, 2, 4, 3)
    name = "model.layers.7.mlp.experts.gate_up_proj"
    with pytest.raises(ValueError, match=f"{name}_blocks: MXFP4 blocks without their {name}_scales"):
        dequantize({name + "_blocks": blocks}, MXFP4)
    with pytest.raises(ValueError, match=f"{name}_scales: MXFP4 scales without their {name}_blocks"):
        dequantize({name + "_scales": scales}, MXFP4)
    with pytest.raises(ValueError, match=f"{name}_blocks .* and {name}_scales .* do not match"):
        dequantize({name + "_blocks": blocks, name + "_scales": scales[..., :2]}, MXFP4)
    with pytest.raises(ValueError, match=f"{name}_blocks .* do not match"):
        dequantize({name + "_blocks": blocks[..., :8], name + "_scales": scales}, MXFP4)
    with pytest.raises(ValueError, match=f"{name}: MXFP4 blocks and scales must be uint8"):
        dequantize({name + "_blocks": blocks.to(torch.int32), name + "_scales": scales}, MXFP4)


def test_other_quantization_methods_are_refused_naming_both_read_ones():
    with pytest.raises(ValueError, match="quant_method='bitsandbytes': only fine-grained FP8.*fp8.*mxfp4"):
        hf_fp8.dequantize({}, {"quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ValueError, match="quant_method='fp8'"):
        dequantize({}, {"quantization_config": {"quant_method": "fp8"}})


def test_other_tensors_pass_through_and_no_quantization_config_changes_nothing():
    g = torch.Generator(device=CPU).manual_seed(3)
    blocks, scales = _random_packed(g, 2, 4, 1)
    plain = {"model.layers.0.mlp.router.weight": torch.randn(4, 64, generator=g, device=CPU),
             "model.layers.0.mlp.experts.down_proj_bias": torch.randn(4, 64, generator=g, device=CPU),
             "model.embed_tokens.weight": torch.randn(8, 64, generator=g, device=CPU).bfloat16()}
    sd = {**plain, "model.layers.0.mlp.experts.down_proj_blocks": blocks,
          "model.layers.0.mlp.experts.down_proj_scales": scales}
    out = dequantize(sd, MXFP4)
    assert all(out[n] is t for n, t in plain.items()) and len(out) == len(plain) + 1
    assert hf_fp8.dequantize(sd, {}) is sd and dequantize(sd, {"quantization_config": None}) is sd
