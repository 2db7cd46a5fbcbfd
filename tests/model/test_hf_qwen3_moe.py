"""An MoE model of ours with Qwen3's attention (q / k norms, heads sized on their own) to a Hugging Face Qwen3-MoE
directory and back (model/hf_qwen3_moe.py through model/hf_interop.py): transformers' Qwen3MoeForCausalLM gives our
logits (float64: equal to its fp32 routing), the import gives back the very tensors, transformers' own saved layout
imports too; what Qwen3-MoE cannot hold is refused both ways. Also a GLM-4-MoE with q / k norms (its use_qk_norm)."""
import json

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import config_from_hf, export_hf, import_hf
from tests.model.test_hf_mixtral import imports_back

QWEN3_MOE = dict(qk_norm=True, attn_head_dim=16, moe_num_experts=8, moe_top_k=2, moe_hidden_dim=24,
                 moe_first_dense_layers=1)


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32,
               rope_theta=1e6, **QWEN3_MOE)
    cfg.update(kw)
    m = Transformer(ModelConfig(**cfg))
    with torch.no_grad():
        for layer in m.layers:
            if hasattr(layer.mlp, "router"):  # a router sharp enough that the choice is not a near tie
                torch.nn.init.normal_(layer.mlp.router.weight, std=0.3)
            if cfg["qk_norm"]:  # norm weights a released model would have (not ones)
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)
    return m.eval()


def _tol(ours: torch.Tensor) -> float:
    # transformers computes the routing probabilities in fp32 even in an fp64 model: its weights carry fp32
    # rounding, ~1.2e-7 relative; everything else is fp64 on both sides
    return 16 * torch.finfo(torch.float32).eps * float(ours.abs().max())


def test_round_trip_through_transformers_qwen3_moe(tmp_path):
    from transformers import Qwen3MoeForCausalLM
    model = _model()
    x = torch.randint(0, 96, (2, 12))
    out = export_hf(model, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts"] == 8 and cfg["mlp_only_layers"] == [0]
    assert cfg["head_dim"] == 16 and cfg["moe_intermediate_size"] == 24 and cfg["intermediate_size"] == 48
    hf = Qwen3MoeForCausalLM.from_pretrained(out, torch_dtype=torch.float64, experts_implementation="eager").eval()
    assert type(hf.model.layers[0].mlp).__name__ == "Qwen3MoeMLP"  # the dense first block
    with torch.no_grad():
        ours = model.double()(x)
        theirs = hf(x).logits
        assert torch.allclose(theirs, ours, atol=_tol(ours), rtol=0), ((theirs - ours).abs().max(), _tol(ours))
        plain = _model(qk_norm=False).double()  # (the same seed: the q / k norms are what moves the logits)
        assert not torch.allclose(plain(x), ours, atol=1e-3)
    imports_back(model, out, hf, tmp_path, x, ours)


@pytest.mark.parametrize("kw", [{"moe_norm_topk": False}, {"moe_top_k": 1}], ids=["raw-top2", "top1"])
def test_raw_weights_round_trip_as_norm_topk_prob_false(tmp_path, kw):
    """--moe_norm_topk_prob=false (Qwen1.5 / Qwen2-MoE's raw softmax weights) and top 1 (where ours keep the raw score)
    are written as norm_topk_prob false: transformers' logits, and the import gives the same config back; the
    renormalised model's logits differ (the switch is live)."""
    from transformers import Qwen3MoeForCausalLM
    model = _model(**kw)
    out = export_hf(model, str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["norm_topk_prob"] is False
    hf = Qwen3MoeForCausalLM.from_pretrained(out, torch_dtype=torch.float64, experts_implementation="eager").eval()
    x = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        ours = model.double()(x)
        assert torch.allclose(hf(x).logits, ours, atol=_tol(ours), rtol=0)
        if "moe_norm_topk" in kw:
            assert not torch.allclose(_model().double()(x), ours, atol=1e-3)
    assert config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text())).moe_norm_topk == (
        "moe_top_k" in kw)  # (at top 1 the switch does nothing: written false, read as false)


@pytest.mark.parametrize("kw, needle", [
    ({"moe_shared_experts": 1}, "moe_shared_experts=1"),
    ({"moe_n_groups": 2}, "moe_n_groups=2"),
    ({"moe_routed_scaling": 2.5}, "moe_routed_scaling=2.5"),
])
def test_what_qwen3_moe_cannot_hold_is_refused(tmp_path, kw, needle):
    with pytest.raises(ValueError, match=needle):
        export_hf(_model(**kw), str(tmp_path / "no"))
    assert not (tmp_path / "no").exists()


def _qwen3_moe_config(**kw) -> dict:
    from transformers import Qwen3MoeConfig
    d = Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=24, norm_topk_prob=True, mlp_only_layers=[0]).to_dict()
    d.update(kw)
    return d


@pytest.mark.parametrize("kw, needle", [
    ({"num_experts_per_tok": 1}, "norm_topk_prob=True with num_experts_per_tok=1"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
])
def test_what_our_model_cannot_read_is_refused_on_import(kw, needle):
    cfg = config_from_hf(_qwen3_moe_config())  # the plain one loads
    assert cfg.qk_norm and cfg.head_dim == 16 and cfg.moe_first_dense_layers == 1 and cfg.hidden_dim == 48
    with pytest.raises(ValueError, match=needle):
        config_from_hf(_qwen3_moe_config(**kw))


def test_a_glm4_moe_with_qk_norms_round_trips(tmp_path):
    """GLM-4-MoE's use_qk_norm is the same q / k norms: a sigmoid-routed model with them exports and imports."""
    from transformers import Glm4MoeForCausalLM
    model = _model(moe_score="sigmoid", moe_shared_experts=1)
    out = export_hf(model, str(tmp_path / "hf"))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["use_qk_norm"] is True
    x = torch.randint(0, 96, (1, 10))
    hf = Glm4MoeForCausalLM.from_pretrained(out, torch_dtype=torch.float64, experts_implementation="eager").eval()
    with torch.no_grad():
        ours = model.double()(x)
        assert torch.allclose(hf(x).logits, ours, atol=_tol(ours), rtol=0)
    back = import_hf(out)
    assert back.cfg.qk_norm and torch.equal(back.layers[1].self_attn.k_norm.weight,
                                            model.float().layers[1].self_attn.k_norm.weight)
