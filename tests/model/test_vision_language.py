"""The text model of a vision-language checkpoint (model/hf_vision_language.py): Mistral Small 3.x's
Mistral3ForConditionalGeneration (a Mistral inside) gives its text logits through ours from transformers' saved layout
and from transformers 5's module names, and exports as the Llama it is; the vision tower is left out, counted.
(Gemma 3's: tests/model/test_gemma3.py.)"""
import pytest
import torch

from model.hf_interop import export_hf, import_hf
from model.hf_vision_language import text_config, text_weights

transformers = pytest.importorskip("transformers")


def test_mistral_small_3s_text_model_reads_and_exports(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, Mistral3Config, Mistral3ForConditionalGeneration
    torch.manual_seed(0)
    text = dict(model_type="mistral", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                sliding_window=None, rope_theta=1e6)
    vision = dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=8, image_size=28, patch_size=14)
    hf = Mistral3ForConditionalGeneration(Mistral3Config(text_config=text, vision_config=vision,
                                                         image_token_index=100)).eval()
    hf.save_pretrained(tmp_path / "vl")
    saved = load_file(str(tmp_path / "vl" / "model.safetensors"))
    kept, left_out = text_weights(saved)
    assert left_out > 0 and all(n.startswith(("model.", "lm_head.")) for n in kept)
    # transformers 5's module names on disk (model.language_model.*, model.vision_tower.*, lm_head)
    five = tmp_path / "vl5"
    five.mkdir()
    (five / "config.json").write_text((tmp_path / "vl" / "config.json").read_text())
    moved = {}
    for n, t in saved.items():
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if n.startswith(old):
                n = new + n[len(old):]
                break
        moved[n] = t
    save_file(moved, str(five / "model.safetensors"))
    x = torch.randint(0, 99, (2, 20))  # text only (no image token ids)
    with torch.no_grad():
        ref = hf(input_ids=x).logits
        for d in (tmp_path / "vl", five):
            ours = import_hf(str(d)).eval()
            assert ours.cfg.head_dim == 32 and ours.cfg.rope_theta == 1e6
            assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0), d
        export_hf(ours, str(tmp_path / "text"))
        back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "text")).eval()
        assert type(back).__name__ == "LlamaForCausalLM" and torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    assert text_config({"model_type": "llava", "text_config": {"hidden_size": 8}})["model_type"] == "llama"
