"""Ministral 3 (Ministral3ForCausalLM): a Mistral with YaRN whose queries are scaled by position after RoPE, x (1 +
beta ln(1 + floor(position / L))). A tiny transformers model gives its logits through ours below L (no scale) and past
it, the KV cache decodes past L as the whole sequence does, and the export loads back as a Ministral 3."""
import pytest
import torch

from model.hf_interop import export_hf, hf_config_dict, import_hf

transformers = pytest.importorskip("transformers")

VOCAB, L = 101, 8


def _ministral3(tmp_path):
    from transformers import Ministral3Config, Ministral3ForCausalLM
    torch.manual_seed(0)
    cfg = Ministral3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=32,
                           pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           rope_parameters={"type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                            "original_max_position_embeddings": L, "max_position_embeddings": 32,
                                            "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                            "llama_4_scaling_beta": 0.5})
    hf = Ministral3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "m3")
    return hf, str(tmp_path / "m3")


def test_logits_below_and_past_the_scale_length_and_the_export(tmp_path):
    from transformers import Ministral3ForCausalLM

    from model.generate import generate
    hf, path = _ministral3(tmp_path)
    ours = import_hf(path).eval()
    assert (ours.cfg.query_pos_scale_beta, ours.cfg.query_pos_scale_length) == (0.5, L)
    assert ours.cfg.rope_scaling["type"] == "yarn" and ours.cfg.head_dim == 32
    plain = import_hf(path).eval()
    plain.cfg.query_pos_scale_beta = None  # (the same weights without the query scale)
    with torch.no_grad():
        short, long = torch.randint(0, VOCAB, (2, L - 2)), torch.randint(0, VOCAB, (2, 20))
        assert torch.allclose(ours(short), hf(short).logits, atol=1e-5, rtol=0)
        assert torch.allclose(ours(long), hf(long).logits, atol=1e-5, rtol=0)
        assert torch.allclose(plain(short), hf(short).logits, atol=1e-5, rtol=0)  # x 1 below L
        assert not torch.allclose(plain(long), hf(long).logits, atol=1e-3)  # the scale past L is what matches
        export_hf(ours, str(tmp_path / "out"))
        back = Ministral3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert torch.allclose(back(long).logits, hf(long).logits, atol=1e-5, rtol=0)
    prompt = long[:1, :6]  # decoding from 6 to 20 positions, across L: each new token's query at its position
    assert torch.equal(generate(ours, prompt, 14, temperature=0.0, use_cache=True),
                       generate(ours, prompt, 14, temperature=0.0, use_cache=False))
    cfg = ours.cfg
    cfg.query_pos_scale_length = 16  # (one length for the YaRN and the query scale in a Ministral 3)
    with pytest.raises(ValueError, match="holds one length for both"):
        hf_config_dict(cfg)
