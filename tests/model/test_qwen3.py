"""Qwen3-shaped attention: heads sized on their own (n_heads x head_dim != dim) and q / k RMS norms before RoPE.
A Qwen3ForCausalLM imports with transformers' logits and gradients and exports back as one; a Llama whose heads are
sized on their own (Mistral-Nemo's shape) too; the parameter and FLOP counts follow the shapes."""
import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import config_from_hf, export_hf, import_hf

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=64, initializer_range=0.1)


def _qwen3(tmp_path, tie: bool = True):
    """A tiny Qwen3ForCausalLM (4 heads of 32 at hidden 64) whose q / k norm weights are not ones, saved."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**SHAPE, rope_theta=1e6, tie_word_embeddings=tie)).eval()
    with torch.no_grad():  # transformers starts them at 1: a released model's are not
        for layer in hf.model.layers:
            layer.self_attn.q_norm.weight.normal_(1.0, 0.5)
            layer.self_attn.k_norm.weight.normal_(1.0, 0.5)
    hf.save_pretrained(tmp_path / "qwen3")
    return hf, str(tmp_path / "qwen3")


@pytest.mark.parametrize("fused", [True, False])
def test_a_qwen3_imports_with_transformers_logits_and_exports_as_a_qwen3(tmp_path, fused):
    from transformers import Qwen3ForCausalLM

    from model.generate import generate
    hf, path = _qwen3(tmp_path)
    ours = import_hf(path, fused_qkv=fused, fused_rmsnorm=fused, fused_rope=fused).eval()
    assert ours.cfg.qk_norm and ours.cfg.head_dim == 32 and ours.cfg.dim == 64 and ours.cfg.attn_head_dim == 32
    assert ours.layers[0].self_attn.q_proj.weight.shape == (128, 64)
    x = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        plain = import_hf(path)  # the norms matter: at weight 1, the logits move
        for layer in plain.layers:
            layer.self_attn.q_norm.weight.fill_(1.0)
        assert not torch.allclose(plain.eval()(x), ref, atol=1e-3)
        export_hf(ours, str(tmp_path / "out"))
        back = Qwen3ForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert back.config.model_type == "qwen3" and back.config.head_dim == 32
        assert torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    prompt = x[:1, :6]
    assert torch.equal(generate(ours, prompt, 12, temperature=0.0, use_cache=True),
                       generate(ours, prompt, 12, temperature=0.0, use_cache=False))


def test_qwen3_gradients_equal_transformers(tmp_path):
    """The backward through the q / k norms (our hand-written RMSNorm backward over [B, T, H, D]) against
    transformers' autograd on the same weights and batch; the tolerance is fp32's rounding of the two orders."""
    hf, path = _qwen3(tmp_path, tie=False)
    hf.train()
    ours = import_hf(path)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 128, (2, 16), generator=g), torch.randint(0, 128, (2, 16), generator=g)
    loss = ours(x, labels=y)  # the mean over positions of CE(logits[t], y[t]) (our labels are the targets)
    ref_loss = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    loss.backward()
    ref_loss.backward()
    theirs = {n[len("model."):] if n.startswith("model.") else n: p.grad for n, p in hf.named_parameters()}
    for name, p in ours.named_parameters():
        ref = theirs[name]
        assert torch.allclose(p.grad, ref, atol=1e-6 * float(ref.abs().max()) + 1e-8, rtol=1e-4), name
    assert float(ours.layers[0].self_attn.k_norm.weight.grad.abs().max()) > 0


def test_a_llama_with_heads_sized_on_their_own_round_trips(tmp_path):
    """Mistral-Nemo's shape (head_dim 128 at hidden 5120 with 32 heads), as a LlamaConfig with head_dim."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = import_hf(str(tmp_path / "hf")).eval()
    assert ours.cfg.head_dim == 32 and not ours.cfg.qk_norm
    x = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        assert torch.allclose(ours(x), hf(x).logits, atol=1e-5, rtol=0)
        export_hf(ours, str(tmp_path / "out"))
        back = LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
        assert back.config.model_type == "llama" and torch.allclose(back(x).logits, hf(x).logits, atol=1e-5)


def test_counts_follow_the_shapes_and_bad_shapes_are_named():
    from model.flops import flops_per_token, matmul_params
    from utils.model_bounds import param_count
    for kw in (dict(qk_norm=True, attn_head_dim=16), dict(attn_head_dim=4), dict(qkv_bias=True, attn_head_dim=12),
               dict(qk_norm=True)):
        cfg = ModelConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, **kw)
        model = Transformer(cfg)
        assert param_count(32, 2, 4, 96, 2, multiple_of=16, head_dim=kw.get("attn_head_dim"),
                           qk_norm=kw.get("qk_norm", False), qkv_bias=kw.get("qkv_bias", False)) \
            == sum(p.numel() for p in model.parameters()), kw
        weights = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
        assert matmul_params(cfg) == weights - (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * cfg.qkv_bias * 2
        # the attention scores' FLOPs: 12 x layers x (heads x head_dim) per token and position
        assert flops_per_token(cfg, 10) - 6 * matmul_params(cfg) == 12 * 2 * 4 * cfg.head_dim * 10
    for bad, why in ((dict(attn_head_dim=7), "head_dim=7 must be an even integer"),
                     (dict(attn_head_dim=8, n_kv_heads=3), "n_heads=4 is not a multiple of n_kv_heads=3")):
        with pytest.raises(ValueError, match=why):
            ModelConfig(dim=32, n_heads=4, **bad)
    assert config_from_hf({**SHAPE, "model_type": "qwen3"}).attn_head_dim == 32
    with pytest.raises(ValueError, match="biases are not supported"):
        config_from_hf({**SHAPE, "model_type": "qwen3", "attention_bias": True})
