"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM / Olmo3ForCausalLM): a Llama whose block norms only the sublayers' outputs
(`pre_norms` off, `sandwich_norms`) and whose q / k norms run over all the heads' width (`qk_norm_full`); OLMo 3 adds
sliding layers whose RoPE is unscaled where the full layers' has YaRN. Tiny transformers models import with their
logits and gradients, decode past the window with the KV cache, export back as themselves; each switch moves the
logits; tensor parallelism (a rank holds some heads: the full-width norms need all) is refused by name."""
import dataclasses

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import config_from_hf, export_hf, hf_config_dict, import_hf
from tests.model.hf_family_checks import each_switch_moves_the_logits, gradients_equal_transformers

transformers = pytest.importorskip("transformers")

VOCAB = 101
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
# OLMo 3's long-context kind: YaRN on the full layers only, 3 of 4 layers sliding over 6 positions
OLMO3 = dict(sliding_window=6, rope_parameters={
    "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 5e5, "original_max_position_embeddings": 32},
    "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}})


def _olmo(tmp_path, kind: str, tie: bool = False):
    """A tiny OLMo 2 / 3 with norm weights away from transformers' ones (a released model's are), saved."""
    from transformers import Olmo2Config, Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM
    torch.manual_seed(0)
    config, cls, extra = {"olmo2": (Olmo2Config, Olmo2ForCausalLM, dict(rope_theta=5e5)),
                          "olmo3": (Olmo3Config, Olmo3ForCausalLM, OLMO3)}[kind]
    hf = cls(config(**SHAPE, **extra, tie_word_embeddings=tie)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    hf.save_pretrained(tmp_path / kind)
    return hf, str(tmp_path / kind)


@pytest.mark.parametrize("kind,fused", [("olmo2", True), ("olmo2", False), ("olmo3", True)])
def test_an_olmo_imports_with_transformers_logits_and_exports_as_itself(tmp_path, kind, fused):
    from safetensors import safe_open

    from model.generate import generate
    hf, path = _olmo(tmp_path, kind)
    ours = import_hf(path, fused_qkv=fused, fused_rmsnorm=fused, fused_rope=fused).eval()
    c = ours.cfg
    assert (c.pre_norms, c.sandwich_norms, c.qk_norm, c.qk_norm_full) == (False, True, True, True)
    attn = ours.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
    if kind == "olmo3":
        assert (c.sliding_window, c.sliding_layers, c.rope_local_theta) == (6, [0, 1, 2], 5e5)
        assert c.rope_scaling["type"] == "yarn" and c.rope_scaling["factor"] == 2.0
    x = torch.randint(0, VOCAB, (2, 20))  # (past OLMo 3's window)
    with torch.no_grad():
        ref = hf(x).logits
        assert torch.allclose(ours(x), ref, atol=1e-5, rtol=0)
        export_hf(ours, str(tmp_path / "out"))
        back = type(hf).from_pretrained(str(tmp_path / "out")).eval()
        assert back.config.model_type == kind and torch.allclose(back(x).logits, ref, atol=1e-5, rtol=0)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(hf.state_dict())
    prompt = x[:1, :5]
    assert torch.equal(generate(ours, prompt, 14, temperature=0.0, use_cache=True),
                       generate(ours, prompt, 14, temperature=0.0, use_cache=False))


def test_each_switch_moves_the_logits(tmp_path):
    hf, path = _olmo(tmp_path, "olmo3")
    x = torch.randint(0, VOCAB, (2, 20))
    with torch.no_grad():
        ref = hf(x).logits
    mutations = {
        "sandwich_norms": lambda m: [setattr(b, "sandwich", False) for b in m.layers],
        "qk_norm_full": lambda m: [setattr(b.self_attn, "qk_norm_full", False) for b in m.layers],
        "rope_local_theta": lambda m: [setattr(b, "local_rope", False) for b in m.layers],
        "sliding_window": lambda m: [setattr(b.self_attn, "sliding", False) for b in m.layers],
    }
    each_switch_moves_the_logits(path, ref, x, mutations)


def test_olmo2_gradients_equal_transformers(tmp_path):
    """Through the full-width q / k norms and the output norms, against transformers' autograd on the same weights
    and batch; fp32 rounding of the two orders."""
    hf, path = _olmo(tmp_path, "olmo2")
    from model.hf_olmo import to_hub
    ours = import_hf(path)
    gradients_equal_transformers(hf, ours, to_hub, VOCAB)
    assert float(ours.layers[1].self_attn.q_norm.weight.grad.abs().max()) > 0


def test_refusals_and_counts():
    from model.flops import matmul_params
    from parallel.transforms.tensor_parallel import tensor_parallel_problems
    from utils.model_bounds import param_count
    base = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16)
    cfg = ModelConfig(**base, pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_full=True)
    model = Transformer(cfg)
    assert not hasattr(model.layers[0], "input_layernorm")
    assert param_count(32, 2, 4, 96, 2, multiple_of=16, qk_norm=True, sandwich_norms=True, pre_norms=False,
                       qk_norm_full=True) == model.num_params()
    assert matmul_params(cfg) == sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    assert any("all the heads' width" in p for p in tensor_parallel_problems(cfg, 2))
    assert hf_config_dict(cfg)["architectures"] == ["Olmo2ForCausalLM"]
    with pytest.raises(ValueError, match="does not fit: no q / k norms over all the heads"):
        hf_config_dict(dataclasses.replace(cfg, qk_norm_full=False))
    for bad, why in ((dict(pre_norms=False), "leaves the blocks no norm"),
                     (dict(qk_norm_full=True), "needs qk_norm")):
        with pytest.raises(ValueError, match=why):
            ModelConfig(**base, **bad)
    with pytest.raises(ValueError, match="biases are not supported"):
        config_from_hf({**SHAPE, "model_type": "olmo2", "attention_bias": True})
    # transformers' OLMo 3 defaults: every 4th layer full, one RoPE for all (no local base where nothing differs)
    c = config_from_hf({**SHAPE, "model_type": "olmo3", "num_hidden_layers": 8, "sliding_window": 16})
    assert c.sliding_layers == [0, 1, 2, 4, 5, 6] and c.rope_local_theta is None and c.rope_theta == 5e5
