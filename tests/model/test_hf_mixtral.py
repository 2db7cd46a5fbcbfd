"""An MoE model of ours to a Hugging Face Mixtral directory and back (model/hf_mixtral.py through
model/hf_interop.py): transformers' MixtralForCausalLM gives our logits (float64: equal to rounding), the import
gives back the very tensors; transformers 5's own saved layout imports too; what Mixtral cannot hold is refused (a
sigmoid router's model is a GLM-4-MoE: tests/model/test_hf_glm4_moe.py)."""
import json
import os

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import export_hf, import_hf


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32,
               moe_num_experts=4, moe_top_k=2, moe_hidden_dim=24, rope_theta=500000.0)
    cfg.update(kw)
    m = Transformer(ModelConfig(**cfg))
    for layer in m.layers:  # a router sharp enough that the choice is not a near tie
        if hasattr(layer.mlp, "router"):
            torch.nn.init.normal_(layer.mlp.router.weight, std=0.3)
    return m.eval()


def _hf_logits(path, x):
    from transformers import MixtralForCausalLM
    hf = MixtralForCausalLM.from_pretrained(path, torch_dtype=torch.float64,
                                            experts_implementation="eager").eval()  # (no grouped mm in fp64)
    with torch.no_grad():
        return hf(x).logits, hf


def test_round_trip_through_transformers_mixtral(tmp_path):
    model = _model()
    x = torch.randint(0, 96, (2, 12))
    out = export_hf(model, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and cfg["num_local_experts"] == 4 and cfg["intermediate_size"] == 24
    theirs, hf = _hf_logits(out, x)
    with torch.no_grad():
        ours = model.double()(x)
    # transformers computes the routing probabilities in fp32 even in an fp64 model (softmax(logits.float())):
    # its weights carry fp32 rounding, ~1.2e-7 relative; everything else is fp64 on both sides
    tol = 16 * torch.finfo(torch.float32).eps * float(ours.abs().max())
    assert torch.allclose(theirs, ours, atol=tol, rtol=0), ((theirs - ours).abs().max(), tol)
    imports_back(model, out, hf, tmp_path, x, ours)


def imports_back(model, out, hf, tmp_path, x, ours) -> None:
    """The export `out` of `model` imports as the very tensors, and transformers' own saved layout of `hf` (the
    export loaded in fp64) gives `ours`, the model's fp64 logits of `x`, through our model."""
    back = import_hf(out)
    a, b = model.float().state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hf.save_pretrained(str(tmp_path / "hf5"))  # transformers' own layout on disk, whichever it writes
    again = import_hf(str(tmp_path / "hf5"), dtype=torch.float64).eval()
    with torch.no_grad():
        assert torch.allclose(again(x), ours, atol=1e-12, rtol=0)  # the same fp64 weights through our model


def test_transformers5_fused_expert_names_import():
    from model.hf_mixtral import from_hub, to_hub
    model = _model()
    ours = model.state_dict()
    hub = to_hub(ours)
    assert "layers.0.block_sparse_moe.experts.3.w2.weight" in hub and not any("expert_bias" in k for k in hub)
    fused = {k: v for k, v in ours.items() if ".mlp." not in k}
    for i in range(2):
        p = f"layers.{i}.mlp"
        fused[f"{p}.gate.weight"] = ours[f"{p}.router.weight"]
        fused[f"{p}.experts.gate_up_proj"] = ours[f"{p}.experts.gate_up_proj"]
        fused[f"{p}.experts.down_proj"] = ours[f"{p}.experts.down_proj"]
    for back in (from_hub(hub, model.cfg), from_hub(fused, model.cfg)):
        assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)


@pytest.mark.parametrize("kw, needle", [
    ({"moe_shared_experts": 1}, "moe_shared_experts=1"),
    ({"moe_first_dense_layers": 1}, "moe_first_dense_layers=1"),
    ({"moe_top_k": 1}, "moe_top_k=1"),
    ({"moe_norm_topk": False}, "moe_norm_topk=false \\(Mixtral renormalises"),
    ({"moe_n_groups": 2}, "moe_n_groups=2"),
    ({"moe_routed_scaling": 2.5}, "moe_routed_scaling=2.5"),
    ({}, "non-zero selection biases"),
], ids=["shared", "first_dense", "top1", "raw-weights", "groups", "scaling", "bias"])
def test_what_mixtral_cannot_hold_is_refused(tmp_path, kw, needle):
    model = _model(**kw)
    if not kw:
        model.layers[1].mlp.expert_bias[2] = 0.01
    with pytest.raises(ValueError, match=needle):
        export_hf(model, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")
