"""Fine-grained FP8 checkpoints (model/hf_fp8.py: DeepSeek-V3's format, quantization_config quant_method "fp8"):
import_hf multiplies each FP8 weight by its block scales; the weights are exactly q x s, and the logits are those of
transformers' own dequantizing load (FineGrainedFP8Config(dequantize=True)); partial blocks and per-tensor scales;
what is refused."""
from __future__ import annotations

import json
import math

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_fp8 import dequantize, dequantize_weight
from model.hf_interop import export_hf, import_hf

FP8_MAX = 448.0  # float8_e4m3fn's largest value


def _quantize(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantization written out: each bn x bk block over its absolute maximum / 448."""
    n, k = w.shape
    s = torch.zeros(math.ceil(n / bn), math.ceil(k / bk))
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s[i, j] = block.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (block / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def _expected(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    w = q.float()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] *= s[i, j]
    return w


def test_an_fp8_deepseek_checkpoint_imports_as_transformers_dequantizes_it(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_seq_len=64, norm_eps=1e-6,
                      kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                      moe_num_experts=4, moe_top_k=2, moe_hidden_dim=16, moe_first_dense_layers=1,
                      moe_score="sigmoid", moe_shared_experts=1)
    export_hf(Transformer(cfg).eval(), str(tmp_path))
    sd = load_file(str(tmp_path / "model.safetensors"))
    stored, expected = {}, {}
    for name, t in sd.items():  # (DeepSeek quantizes every projection; norms, router, embedding and head stay)
        if name.endswith("_proj.weight") or name.endswith("_mqa.weight"):
            q, s = _quantize(t, 8, 8)
            stored[name], stored[name + "_scale_inv"] = q, s
            expected[name] = _expected(q, s, 8, 8)
        else:
            stored[name] = t
    assert any(".experts.3." in n for n in expected) and len(expected) > 15
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [8, 8]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    got = dequantize(stored, config)
    assert not any(n.endswith("_scale_inv") for n in got)
    assert all(torch.equal(got[n], expected[n]) for n in expected)  # exactly q x s, block by block
    ours = import_hf(str(tmp_path)).eval()
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    x = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        want, have = hf(x).logits, ours(x)
    # the same fp32 weights on both sides: fp32 rounding of the two forwards (transformers routes in fp32 too)
    assert torch.allclose(have, want, atol=16 * torch.finfo(torch.float32).eps * float(want.abs().max()), rtol=0)


def test_partial_blocks_and_one_scale_per_tensor():
    """Weights whose sides are not multiples of the block (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in blocks of
    128) take the last, partial blocks' scales; without a block size one scale multiplies the whole tensor."""
    torch.manual_seed(1)
    w = torch.randn(88, 20)
    q, s = _quantize(w, 16, 16)
    assert s.shape == (6, 2)
    got = dequantize_weight(q, s, (16, 16))
    assert torch.equal(got, _expected(q, s, 16, 16))
    assert (got - w).abs().max() <= 0.07 * w.abs().max()  # e4m3's 3 mantissa bits: within 1/16 of a block's max
    one = torch.tensor(0.01)
    assert torch.equal(dequantize_weight(q, one, None), q.float() * 0.01)
    sd = {"a.weight": q, "a.weight_scale_inv": s, "a.input_scale": torch.ones(()), "norm.weight": torch.ones(3)}
    out = dequantize(sd, {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}})
    assert sorted(out) == ["a.weight", "norm.weight"] and out["norm.weight"] is sd["norm.weight"]


def test_other_quantizations_and_wrong_scales_are_refused():
    with pytest.raises(ValueError, match="quant_method='bitsandbytes': only fine-grained FP8"):
        dequantize({}, {"quantization_config": {"quant_method": "bitsandbytes"}})
    q, s = _quantize(torch.randn(32, 32), 16, 16)
    with pytest.raises(ValueError, match=r"a.weight_scale_inv: shape \(2, 2\) does not tile \(32, 32\) in blocks of "
                                         r"8 x 8 \(expected \(4, 4\) last\)"):
        dequantize({"a.weight": q, "a.weight_scale_inv": s},
                   {"quantization_config": {"quant_method": "fp8", "weight_block_size": [8, 8]}})
    assert dequantize({"a": q}, {}) == {"a": q}
