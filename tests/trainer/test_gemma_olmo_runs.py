"""Gemma 2, Gemma 3 (text), OLMo 3 and GLM-4.5-style GLM-4-MoE in the trainer: `--init_from=<their directory>` trains
the family's block (its sublayer output norms, or GLM-4.5's q/k/v biases under half-rotated heads, among the trained
weights), and export_hf.py writes the family back, which transformers loads (with the checkpoint's logits: the dense
families; the MoE one's fp64 logits are tests/model/test_hf_glm4_moe.py's)."""
from __future__ import annotations

import json
import sys

import pytest
import torch

from checkpoint.verify import find_latest_valid
from model.config import read_model_config
from tests.conftest import run_cmd, run_python, train_cmd
from tests.trainer.test_end_to_end import _env, final_weights, losses
from tests.trainer.test_rope_extension import from_weights, released_model

FAMILIES = {  # architecture: (our fields, the trained weights' name endings, how many)
    "Gemma3ForCausalLM": (dict(n_kv_heads=2, max_seq_len=64, qk_norm=True, attn_head_dim=16, sandwich_norms=True,
                              scale_embeddings=True, mlp_act="gelu_tanh", query_scale=12.0, sliding_window=5,
                              sliding_layers=[0], rope_local_theta=1000.0, rope_theta=1e5, tie_embeddings=True),
                          ("attn_output_norm.weight", "mlp_output_norm.weight"), 4),
    "Gemma2ForCausalLM": (dict(n_kv_heads=2, max_seq_len=64, attn_head_dim=16, sandwich_norms=True,
                               scale_embeddings=True, mlp_act="gelu_tanh", query_scale=12.0, sliding_window=5,
                               sliding_layers=[0], attn_softcap=5.0, final_softcap=3.0, tie_embeddings=True),
                          ("attn_output_norm.weight", "mlp_output_norm.weight"), 4),
    "Olmo3ForCausalLM": (dict(n_kv_heads=2, max_seq_len=64, qk_norm=True, qk_norm_full=True, pre_norms=False,
                              sandwich_norms=True, sliding_window=5, sliding_layers=[0], rope_theta=5e5),
                         ("attn_output_norm.weight", "mlp_output_norm.weight"), 4),
    "Glm4MoeForCausalLM": (dict(n_kv_heads=2, max_seq_len=64, moe_score="sigmoid", moe_num_experts=4, moe_top_k=2,
                                moe_hidden_dim=24, moe_shared_experts=1, moe_first_dense_layers=1,
                                partial_rotary_factor=0.5, qkv_bias=True),
                           ("q_proj.bias", "k_proj.bias", "v_proj.bias"), 6),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_trains_and_exports_back_as_itself(tiny_pretrain_data, tiny_pretrain_run_args, tmp_path, family):
    transformers = pytest.importorskip("transformers")

    def norms(model):  # away from transformers' initial values (a released model's are)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.3)

    fields, names, count = FAMILIES[family]
    hf = released_model(tiny_pretrain_data, tmp_path / "hf", norms, **fields)
    with open(f"{hf}/config.json") as f:
        assert json.load(f)["architectures"] == [family]
    out = tmp_path / "run"
    run_cmd(train_cmd([*from_weights(tiny_pretrain_run_args, hf, "--max_iters=3", "--checkpoint_interval=3"),
                       f"--out_dir={out}"]), env=_env())
    saved = read_model_config(find_latest_valid(str(out)))
    assert all(getattr(saved, k) == v for k, v in fields.items() if k != "max_seq_len"), saved
    assert sorted(losses(out)) == [1, 2, 3]
    from model.hf_interop import import_hf
    start, end = import_hf(hf).state_dict(), final_weights(out)
    trained = [n for n in end if n.endswith(names)]
    assert len(trained) == count and all(not torch.equal(end[n], start[n]) for n in trained)
    r = run_python([sys.executable, "export_hf.py", f"--ckpt={out}", f"--out_dir={tmp_path / 'back'}"])
    assert r.returncode == 0, r.stderr[-2000:]
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(back).__name__ == family
    ours = import_hf(str(tmp_path / "back")).eval()
    for name, t in ours.state_dict().items():  # the checkpoint's weights, through Gemma's (1 + w) and back
        assert torch.allclose(t, end[name], atol=1e-6, rtol=0), name
    if not saved.moe_num_experts:
        x = torch.randint(0, saved.vocab_size, (2, 12))
        with torch.no_grad():
            assert torch.allclose(back(x).logits, ours(x), atol=1e-5, rtol=0)
