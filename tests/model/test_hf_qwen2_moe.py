"""Qwen2-MoE (model/hf_qwen2_moe.py, `Qwen2MoeForCausalLM`: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) both ways: our MoE with
the chosen experts' raw softmax weights (--moe_norm_topk_prob=false), a shared expert of its own width
(--moe_shared_hidden_dim) gated per token (--moe_shared_gate) and Qwen2's q/k/v biases gives transformers' logits
(fp64 within its fp32 router), the import gives the config and tensors back, transformers' own saved layout reads;
the gate is live; the families that cannot hold a gate or a width of its own refuse them; the counts."""
import json

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import config_from_hf, export_hf, import_hf

QWEN2_MOE = dict(qkv_bias=True, moe_num_experts=8, moe_top_k=2, moe_hidden_dim=16, moe_shared_experts=1,
                 moe_shared_hidden_dim=40, moe_shared_gate=True, moe_norm_topk=False, moe_first_dense_layers=1)


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32, **QWEN2_MOE)
    cfg.update(kw)
    m = Transformer(ModelConfig(**cfg))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("_proj.bias"):  # (zero at init, not after training)
                p.normal_(0, 0.5)
        for layer in m.layers[1:]:  # a router sharp enough that the choice is not a near tie
            torch.nn.init.normal_(layer.mlp.router.weight, std=0.3)
    return m.eval()


def _tol(ours: torch.Tensor) -> float:
    return 16 * torch.finfo(torch.float32).eps * float(ours.abs().max())  # (transformers' router runs in fp32)


def test_round_trip_through_transformers_qwen2_moe(tmp_path):
    from transformers import Qwen2MoeForCausalLM
    model = _model()
    out = export_hf(model, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2MoeForCausalLM"] and cfg["shared_expert_intermediate_size"] == 40
    assert cfg["norm_topk_prob"] is False and cfg["qkv_bias"] is True and cfg["mlp_only_layers"] == [0]
    hf = Qwen2MoeForCausalLM.from_pretrained(out, dtype=torch.float64, experts_implementation="eager").eval()
    assert hf.model.layers[1].mlp.shared_expert_gate.weight.abs().sum() > 0  # the gate travelled
    x = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        ours = model.double()(x)
        assert torch.allclose(hf(x).logits, ours, atol=_tol(ours), rtol=0), (hf(x).logits - ours).abs().max()
        ungated = _model(moe_shared_gate=False).double()  # (the same seed: the gate is what moves the logits)
        assert not torch.allclose(ungated(x), ours, atol=1e-3)
    back = import_hf(out)
    assert back.cfg == model.cfg
    a, b = model.float().state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hf.save_pretrained(str(tmp_path / "hf5"))  # transformers' own layout on disk
    again = import_hf(str(tmp_path / "hf5"), dtype=torch.float64).eval()
    with torch.no_grad():
        assert torch.allclose(again(x), ours, atol=1e-12, rtol=0)


def test_what_the_families_cannot_hold_is_refused(tmp_path):
    for kw, needle in (({"moe_score": "sigmoid"}, "moe_score=sigmoid .Qwen2-MoE routes on softmax"),
                       ({"moe_score": "sigmoid", "moe_shared_gate": False}, "moe_shared_hidden_dim=40 .GLM-4-MoE"),
                       ({"moe_shared_gate": False, "moe_shared_hidden_dim": None}, "moe_shared_experts=1 .Mixtral "
                                                                                   "has no shared experts; a gated")):
        with pytest.raises(ValueError, match=needle):
            export_hf(_model(**kw), str(tmp_path / "no"))
        assert not (tmp_path / "no").exists()
    with pytest.raises(ValueError, match="moe_shared_gate .DeepSeek-V3 / V2's shared experts are not gated"):
        export_hf(_model(qkv_bias=False, n_kv_heads=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                         v_head_dim=4), str(tmp_path / "no"))
    with pytest.raises(ValueError, match="they need moe_shared_experts >= 1"):
        ModelConfig(moe_num_experts=4, moe_shared_gate=True)
    with pytest.raises(ValueError, match=r"mlp_only_layers=\[1\]"):
        config_from_hf({"model_type": "qwen2_moe", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
                        "num_hidden_layers": 3, "num_attention_heads": 4, "num_experts": 8,
                        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 40, "mlp_only_layers": [1]})


def test_the_counts_and_the_trainer_flags():
    from model.flops import matmul_params
    from trainer.config import TrainConfig
    from trainer.start import new_model_config
    from utils.model_bounds import param_count
    from utils.moe_flags import moe_param_delta
    model = _model(qkv_bias=False)
    c = model.cfg
    counted = param_count(c.dim, c.n_layers, c.n_heads, c.vocab_size, c.n_kv_heads, c.hidden_dim)
    assert counted + moe_param_delta(c) == model.num_params()
    # a token's matmuls: attention, the dense block's MLP, per MoE block the router, 2 of 8 experts, the shared
    # expert (40 wide) and its gate, the final norm and the head
    attn, norms = 2 * 32 * 32 + 2 * 32 * 16, 2 * 32
    moe = 8 * 32 + 2 * 3 * 32 * 16 + 3 * 32 * 40 + 32
    assert matmul_params(c) == 3 * (attn + norms) + 3 * 32 * 48 + 2 * moe + 32 + 96 * 32
    m = new_model_config(TrainConfig(data_dir="d", tokenizer_dir="t", moe_num_experts=4, moe_shared_experts=1,
                                     moe_shared_hidden_dim=24, moe_shared_gate=True), {"vocab_size": 64})
    assert (m.moe_shared_hidden_dim, m.moe_shared_gate, m.moe_shared_width) == (24, True, 24)
