"""SmolLM3: a Llama whose every fourth layer attends without RoPE (NoPE; ModelConfig.nope_layers). Its logits through
our model (whole sequence and KV cache), exported back as a SmolLM3ForCausalLM with the same logits."""
import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import config_from_hf, export_hf, import_hf

transformers = pytest.importorskip("transformers")


def test_a_smollm3_imports_with_its_nope_layers_and_exports_back(tmp_path):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    from model.generate import generate
    torch.manual_seed(0)
    hf = SmolLM3ForCausalLM(SmolLM3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          pad_token_id=0, initializer_range=0.1)).eval()
    hf.save_pretrained(tmp_path / "smol")
    ours = import_hf(str(tmp_path / "smol")).eval()
    assert ours.cfg.nope_layers == [3] and ours.cfg.tie_embeddings
    x = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        roped = import_hf(str(tmp_path / "smol"), nope_layers=None).eval()  # the missing rotation matters
        assert not torch.allclose(roped(x), ref, atol=1e-3)
        export_hf(ours, str(tmp_path / "out"), special_ids={"pad_token_id": 0})  # (SmolLM3's default is 128004)
        back = SmolLM3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert back.config.no_rope_layers == [1, 1, 1, 0] and torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    prompt = x[:1, :5]
    assert torch.equal(generate(ours, prompt, 10, temperature=0.0, use_cache=True),
                       generate(ours, prompt, 10, temperature=0.0, use_cache=False))
    assert config_from_hf({**hf.config.to_dict(), "no_rope_layers": None,
                           "no_rope_layer_interval": 2}).nope_layers == [1, 3]
    with pytest.raises(ValueError, match=r"nope_layers=\[4\] must list layer indices in \[0, 4\)"):
        Transformer(ModelConfig(dim=32, n_heads=4, n_layers=4, nope_layers=[4]))
