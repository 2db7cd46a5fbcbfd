"""Phi-4-mini's and Phi-3.5-mini's attention (Phi3ForCausalLM): LongRoPE (a short and a long factor per frequency,
the long ones for sequences past original_max_position_embeddings, cos / sin scaled) and a partial rotary (the first
0.75 of each head turns). Tiny transformers models give their logits through ours on both sides of the pretraining
length, and export back as a Phi-3 (fused projections) with the same logits, also streamed."""
import math

import pytest
import torch

from model.hf_interop import config_from_hf, export_hf, import_hf
from tests.model.hf_family_checks import streamed_export_equals_whole
from utils.rope_config import normalize_rope_scaling

transformers = pytest.importorskip("transformers")

VOCAB, ORIGINAL = 101, 16


def _phi(tmp_path, partial: float = 0.75, tie: bool = True):
    """A tiny Phi-4-mini-like Phi3ForCausalLM: LongRoPE from length 16 (its factors drawn away from 1), saved."""
    from transformers import Phi3Config, Phi3ForCausalLM
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(3)
    rotated = int(16 * partial)
    short = (1 + torch.rand(rotated // 2, generator=g)).tolist()
    long = (1 + 4 * torch.rand(rotated // 2, generator=g)).tolist()
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=ORIGINAL,
                     partial_rotary_factor=partial, tie_word_embeddings=tie, pad_token_id=0, bos_token_id=1,
                     eos_token_id=2, rope_parameters={"rope_type": "longrope", "short_factor": short,
                                                      "long_factor": long, "rope_theta": 10000.0,
                                                      "partial_rotary_factor": partial})
    hf = Phi3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "phi")
    return hf, str(tmp_path / "phi")


@pytest.mark.parametrize("partial,fused", [(0.75, True), (0.75, False), (1.0, True)],
                         ids=["phi4-mini", "phi4-mini-reference-kernels", "phi3.5-mini"])
def test_logits_on_both_sides_of_the_pretraining_length_and_the_export(tmp_path, partial, fused):
    from safetensors import safe_open
    from transformers import Phi3ForCausalLM

    from model.generate import generate
    hf, path = _phi(tmp_path, partial)
    ours = import_hf(path, fused_qkv=fused, fused_rmsnorm=fused, fused_rope=fused).eval()
    s = ours.cfg.rope_scaling
    assert ours.cfg.partial_rotary_factor == partial and s["type"] == "longrope"
    assert s["original_max_position_embeddings"] == ORIGINAL and s["factor"] == 64 / ORIGINAL
    with torch.no_grad():
        for T in (ORIGINAL - 3, ORIGINAL, ORIGINAL + 1, 40):  # short factors up to 16 positions, long ones past
            x = torch.randint(0, VOCAB, (2, T))
            assert torch.allclose(ours(x), hf(x).logits, atol=1e-5, rtol=0), T
        export_hf(ours, str(tmp_path / "out"))
        back = Phi3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        for T in (ORIGINAL - 3, 40):
            x = torch.randint(0, VOCAB, (2, T))
            assert torch.allclose(back(x).logits, hf(x).logits, atol=1e-5, rtol=0), T
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == {n for n in hf.state_dict() if n != "lm_head.weight"}  # (qkv_proj, gate_up_proj)
    prompt = torch.randint(0, VOCAB, (1, 5))  # (within the short regime: the cache's keys keep their rotation)
    assert torch.equal(generate(ours, prompt, 8, temperature=0.0, use_cache=True),
                       generate(ours, prompt, 8, temperature=0.0, use_cache=False))


def test_the_long_factors_are_what_turn_long_sequences(tmp_path):
    """Without the long table (every length on the short factors) the logits past the pretraining length leave
    transformers', and those within it do not."""
    hf, path = _phi(tmp_path)
    ours = import_hf(path).eval()
    ours.rotary_long = None
    with torch.no_grad():
        x = torch.randint(0, VOCAB, (2, 40))
        assert not torch.allclose(ours(x), hf(x).logits, atol=1e-3)
        assert torch.allclose(ours(x[:, :ORIGINAL]), hf(x[:, :ORIGINAL]).logits, atol=1e-5, rtol=0)


def test_a_streamed_export_keeps_the_fused_projections_whole(tmp_path):
    """A sharded run's export, a few tensors per safetensors shard: a layer's q/k/v (gate/up) stay in one shard, so
    the fused weights equal the whole-model export's."""
    _, path = _phi(tmp_path, tie=False)
    assert streamed_export_equals_whole(import_hf(path), tmp_path, 20_000)["architectures"] == ["Phi3ForCausalLM"]


def test_longrope_settings_are_checked_and_completed():
    s = normalize_rope_scaling({"type": "longrope", "short_factor": [1, 2], "long_factor": [3, 4],
                                "original_max_position_embeddings": 4096}, 131072)
    assert s["factor"] == 32 and abs(s["attention_factor"] - math.sqrt(1 + math.log(32) / math.log(4096))) < 1e-12
    for bad, why in (({"short_factor": [1], "long_factor": [1, 2]}, "1 short factors, 2 long ones"),
                     ({"short_factor": [1, -2], "long_factor": [1, 2]}, r"short_factor\[1\] must be a finite number"),
                     ({"long_factor": [1]}, "missing short_factor")):
        with pytest.raises(ValueError, match=why):
            normalize_rope_scaling({"type": "longrope", **bad}, 64)
    # Phi-3's older spelling "su" and its pretraining length beside the rope dict (transformers 4.x configs)
    c = config_from_hf({"model_type": "phi3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                        "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 128,
                        "original_max_position_embeddings": 32,
                        "rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}})
    assert c.rope_scaling["type"] == "longrope" and c.rope_scaling["original_max_position_embeddings"] == 32
