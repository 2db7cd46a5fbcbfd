"""HF interop (both directions, GQA, tied/untied, rope_theta, rope scaling), LoRA in PEFT layout, compile."""
import json
import os

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import export_hf, import_hf

transformers = pytest.importorskip("transformers")
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402


def _hf_model(tie: bool, rope_scaling=None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0,
                      max_position_embeddings=16, tie_word_embeddings=tie, rope_scaling=rope_scaling,
                      initializer_range=0.1)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tie,rope_scaling", [(False, None), (True, {"type": "linear", "factor": 2.0}),
                                               (False, {"type": "dynamic", "factor": 2.0})])
def test_import_hf_then_export_round_trip(tmp_path, tie, rope_scaling):
    hf = _hf_model(tie, rope_scaling)
    hf.save_pretrained(tmp_path / "hf")
    ours = import_hf(str(tmp_path / "hf"), gradient_checkpointing=True).eval()
    assert ours.cfg.gradient_checkpointing and ours.embed_tokens.weight.dtype == torch.float32
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tie
    assert ours.cfg.n_kv_heads == 2 and ours.cfg.rope_theta == 5000.0 and ours.cfg.tie_embeddings == tie
    x = torch.randint(0, 128, (2, 24))  # longer than max_position_embeddings: dynamic NTK kicks in
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5)
        export_hf(ours, str(tmp_path / "out"))
        back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert torch.allclose(back(x).logits, ref, atol=1e-5)


def _write_tokenizer(d):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"w{i}": i for i in range(120)}
    vocab.update({"<unk>": 120, "<s>": 121, "</s>": 122, "<pad>": 123})
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(d)
    with open(os.path.join(d, "tokenizer_meta.json"), "w") as f:
        json.dump({"vocab_size": 128, "special_tokens": {"bos": {"token": "<s>", "id": 121},
                   "eos": {"token": "</s>", "id": 122}, "pad": {"token": "<pad>", "id": 123}}}, f)


def test_export_ours_loads_in_hf_with_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=1, hidden_dim=96,
                      max_seq_len=32, rope_theta=1e6, initializer_range=0.1)
    ours = Transformer(cfg).eval()
    _write_tokenizer(str(tmp_path / "tok"))
    export_hf(ours, str(tmp_path / "hf"), tokenizer_dir=str(tmp_path / "tok"))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = tok("w1 w5 w7", add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.tolist() == [[1, 5, 7]]
    assert hf.config.eos_token_id == 122
    x = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ours(x), atol=1e-5)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "tok"]  # no hf.tmp / hf.old left by the atomic write


def test_lora_peft_layout_loads_in_peft_with_equal_outputs(tmp_path):
    peft = pytest.importorskip("peft")
    from safetensors.torch import load_file

    from model.lora import apply_lora, load_lora, merge_lora, save_lora, trainable_parameters
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=96, max_seq_len=32)
    ours = Transformer(cfg).eval()
    export_hf(ours, str(tmp_path / "base"))
    apply_lora(ours, r=4, alpha=8, target_modules="q_proj,v_proj,down_proj", train_lm_head=True)
    rep = trainable_parameters(ours)
    n_lora = sum(p.numel() for n, p in ours.named_parameters() if "lora_" in n)
    assert rep["trainable"] == n_lora + 128 * 64 and rep["total"] == sum(p.numel() for p in ours.parameters())
    assert ours.embed_tokens.weight.requires_grad is False
    assert "layers.0.self_attn.q_proj.weight" in ours.state_dict()  # base keys unchanged
    with torch.no_grad():  # make the adapters non-trivial
        for n, p in ours.named_parameters():
            if "lora_B" in n or n == "lm_head.weight":
                p.add_(torch.randn_like(p) * 0.05)
    x = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expect = ours(x)
    save_lora(ours, str(tmp_path / "adapter"))
    keys = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.lm_head.weight" in keys
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"))
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.allclose(pm(input_ids=x).logits, expect, atol=1e-5)
    # our own loader reproduces the outputs too, and merging keeps them
    again = Transformer(cfg).eval()
    again.load_state_dict(import_hf(str(tmp_path / "base")).state_dict())
    load_lora(again, str(tmp_path / "adapter"))
    with torch.no_grad():
        assert torch.allclose(again(x), expect, atol=1e-5)
        merge_lora(again)
        assert torch.allclose(again(x), expect, atol=1e-5)
    assert not any("lora" in k for k in again.state_dict())


def test_lora_only_adapters_get_gradients():
    from model.lora import apply_lora
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_seq_len=16))
    apply_lora(m, r=2, alpha=4, target_modules="all")
    x = torch.randint(0, 64, (1, 8))
    m(x, labels=x).backward()
    for n, p in m.named_parameters():
        assert (p.grad is not None) == ("lora_" in n), n


@pytest.mark.slow
def test_compiled_model_matches_eager():
    from parallel.transforms.compile import compile_in_place
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_seq_len=16)
    eager = Transformer(cfg)
    comp = Transformer(cfg)
    comp.load_state_dict(eager.state_dict())
    compile_in_place(comp)
    assert list(comp.state_dict()) == list(eager.state_dict())  # no _orig_mod. prefix
    x = torch.randint(0, 64, (2, 8))
    le, lc = eager(x, labels=x), comp(x, labels=x)
    le.backward()
    lc.backward()
    assert torch.allclose(le, lc, atol=1e-5)
    for (n, p), q in zip(eager.named_parameters(), comp.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), n


def test_a_mistral_without_a_sliding_window_imports_as_a_llama(tmp_path):
    """Mistral v0.2 on (sliding_window null) is a Llama: its logits, and its export loads as LlamaForCausalLM.
    (One with a window: tests/model/test_sliding_window.py.)"""
    from transformers import MistralConfig, MistralForCausalLM
    from model.hf_interop import config_from_hf
    torch.manual_seed(0)
    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rope_theta=1e6, max_position_embeddings=32, initializer_range=0.1)
    hf = MistralForCausalLM(MistralConfig(**kw, sliding_window=None)).eval()
    hf.save_pretrained(tmp_path / "mistral")
    ours = import_hf(str(tmp_path / "mistral")).eval()
    x = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        export_hf(ours, str(tmp_path / "out"))
        assert torch.allclose(LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()(x).logits, ref,
                              atol=1e-5, rtol=0)
    windowed = MistralConfig(**kw, sliding_window=8).to_dict()
    assert config_from_hf(windowed).sliding_window == 8
    assert config_from_hf({**windowed, "sliding_window": 32}).sliding_window is None  # as long as the model: none


def _qwen2(tmp_path, tie: bool = True):
    """A tiny Qwen2ForCausalLM (q/k/v biases, none on o_proj) with nonzero biases, saved."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6,
                                      max_position_embeddings=32, tie_word_embeddings=tie,
                                      initializer_range=0.1)).eval()
    with torch.no_grad():  # transformers starts them at 0: a released model's are not
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    hf.save_pretrained(tmp_path / "qwen2")
    return hf, str(tmp_path / "qwen2")


@pytest.mark.parametrize("fused_qkv", [True, False])
def test_a_qwen2_imports_with_its_qkv_biases_and_exports_as_a_qwen2(tmp_path, fused_qkv):
    """Qwen2 (TRL's GRPO examples' model family) is a Llama with q/k/v biases: its logits through our model, the
    q/k/v as one matmul or three, the KV cache, and the export loading as Qwen2ForCausalLM."""
    from transformers import Qwen2ForCausalLM
    from model.generate import generate
    hf, path = _qwen2(tmp_path)
    ours = import_hf(path, fused_qkv=fused_qkv).eval()
    assert ours.cfg.qkv_bias and ours.layers[0].self_attn.o_proj.bias is None
    assert float(ours.layers[1].self_attn.k_proj.bias.detach().abs().max()) > 0.1
    x = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        without = import_hf(path)  # the biases matter: zeroed, the logits move
        for layer in without.layers:
            layer.self_attn.q_proj.bias.zero_()
        assert not torch.allclose(without.eval()(x), ref, atol=1e-3)
        export_hf(ours, str(tmp_path / "out"))
        back = Qwen2ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert back.config.model_type == "qwen2" and torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    prompt = x[:1, :6]
    assert torch.equal(generate(ours, prompt, 12, temperature=0.0, use_cache=True),
                       generate(ours, prompt, 12, temperature=0.0, use_cache=False))


def test_qwen2_biases_train_under_lora_and_the_fused_qkv_gradients_equal_the_three_matmuls(tmp_path):
    from model.lora import apply_lora
    _, path = _qwen2(tmp_path, tie=False)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
    grads = []
    for fused in (True, False):
        model = import_hf(path, fused_qkv=fused)
        model(x, labels=y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert "layers.0.self_attn.v_proj.bias" in grads[0]
    for name, g0 in grads[0].items():
        assert torch.allclose(g0, grads[1][name], atol=1e-6, rtol=1e-5), name
    lora = import_hf(path)
    apply_lora(lora, r=2, alpha=4.0, target_modules="all")
    with torch.no_grad():  # adapters start at 0: the base's logits, biases included
        assert torch.allclose(lora(x), import_hf(path)(x), atol=1e-6)
