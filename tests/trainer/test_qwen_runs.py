"""Qwen2- and Qwen3-shaped models in the trainer: `--init_from=<Qwen2 dir>` trains its q/k/v biases (also split over
2 tensor ranks, whose run follows the one-process run) and `--init_from=<Qwen3 dir>` its q / k norms; a Qwen3-MoE
trains and exports back, and so do Qwen2-MoE, DeepSeek-V2 and DeepSeek-V3; `--qkv_bias=true` and `--qk_norm=true
--head_dim=N` build new ones."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from checkpoint.verify import find_latest_valid
from model.config import read_model_config
from tests.conftest import run_cmd, train_cmd
from tests.trainer.test_end_to_end import _env, final_weights, losses
from tests.trainer.test_rope_extension import from_weights, released_model


@pytest.fixture(scope="module")
def qwen2_dir(tiny_pretrain_data, tmp_path_factory) -> str:
    """A tiny Qwen2 (nonzero q/k/v biases) as a Hugging Face directory with the run's tokenizer."""
    def biases(model):
        with torch.no_grad():
            for layer in model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)

    out = released_model(tiny_pretrain_data, tmp_path_factory.mktemp("qwen2") / "hf", biases, n_kv_heads=2,
                         max_seq_len=64, qkv_bias=True)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen2"
    return out


def test_a_qwen2_trains_its_biases_and_two_tensor_ranks_follow_one_process(tiny_pretrain_run_args, qwen2_dir, tmp_path):
    args = from_weights(tiny_pretrain_run_args, qwen2_dir, "--max_iters=3", "--checkpoint_interval=3")
    one, tp = tmp_path / "one", tmp_path / "tp"
    run_cmd(train_cmd([*args, f"--out_dir={one}"], 1), env=_env())
    run_cmd(train_cmd([*args, f"--out_dir={tp}", "--parallel=fsdp", "--tensor_parallel_size=2"], 2), env=_env())
    assert read_model_config(find_latest_valid(str(one))).qkv_bias
    a, b = losses(one), losses(tp)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for s in a:  # the same sums in another order (as tests/trainer/test_tensor_parallel_runs.py)
        assert abs(a[s] - b[s]) <= 1e-4 * abs(a[s]), (s, a[s], b[s])
    from model.hf_interop import import_hf
    from trainer.weights import load_weights_from
    start = import_hf(qwen2_dir).state_dict()
    split = load_weights_from(str(tp), log=lambda m: None)[0].state_dict()  # the DCP shards gathered
    biases = [n for n in final_weights(one) if n.endswith("_proj.bias")]
    assert len(biases) == 6
    for name in biases:  # trained in both (the losses of steps 2 and 3 above are computed with them)
        assert not torch.equal(final_weights(one)[name], start[name]) and not torch.equal(split[name], start[name])


def test_qkv_bias_builds_a_new_model_with_biases(tiny_pretrain_run_args, tmp_path):
    out = tmp_path / "new"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2", "--checkpoint_interval=2",
                       "--qkv_bias=true"]), env=_env())
    names = set(final_weights(out))
    assert {"layers.0.self_attn.q_proj.bias", "layers.1.self_attn.v_proj.bias"} <= names
    assert "layers.0.self_attn.o_proj.bias" not in names


@pytest.fixture(scope="module")
def qwen3_dir(tiny_pretrain_data, tmp_path_factory) -> str:
    """A tiny Qwen3 (4 heads of 16 at dim 32, q / k norm weights not ones) as a Hugging Face directory."""
    def norms(model):
        with torch.no_grad():
            for layer in model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.3)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.3)

    out = released_model(tiny_pretrain_data, tmp_path_factory.mktemp("qwen3") / "hf", norms, n_kv_heads=2,
                         max_seq_len=64, qk_norm=True, attn_head_dim=16)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] == 16 and cfg["hidden_size"] == 32
    return out


def test_a_qwen3_trains_its_qk_norms(tiny_pretrain_run_args, qwen3_dir, tmp_path):
    """(Under tensor parallelism the norms' partial gradients are summed over the tensor ranks: tested against one
    process in tests/parallel/test_tensor_parallel.py, the `tp2_qwen3` layouts.)"""
    args = from_weights(tiny_pretrain_run_args, qwen3_dir, "--max_iters=3", "--checkpoint_interval=3")
    one = tmp_path / "one"
    run_cmd(train_cmd([*args, f"--out_dir={one}"], 1), env=_env())
    saved = read_model_config(find_latest_valid(str(one)))
    assert saved.qk_norm and saved.head_dim == 16
    assert sorted(losses(one)) == [1, 2, 3]
    from model.hf_interop import import_hf
    start = import_hf(qwen3_dir).state_dict()
    norms = [n for n in final_weights(one) if n.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 4 and all(not torch.equal(final_weights(one)[n], start[n]) for n in norms)


def test_qk_norm_and_head_dim_build_a_new_qwen3_shaped_model(tiny_pretrain_run_args, tmp_path):
    out = tmp_path / "new"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2", "--checkpoint_interval=2",
                       "--qk_norm=true", "--head_dim=16"]), env=_env())
    weights = final_weights(out)
    assert weights["layers.0.self_attn.q_norm.weight"].shape == (16,)
    cfg = read_model_config(find_latest_valid(str(out)))
    assert weights["layers.1.self_attn.q_proj.weight"].shape == (cfg.n_heads * 16, cfg.dim)
    assert cfg.dim != cfg.n_heads * 16


def test_a_qwen3_moe_trains_and_exports_back_as_one(tiny_pretrain_data, tiny_pretrain_run_args, tmp_path):
    """Qwen3-MoE (Qwen3's attention over softmax-routed experts, a dense first block): `--init_from=<its dir>` trains
    it and export_hf.py writes a Qwen3MoeForCausalLM back."""
    from tests.conftest import run_python
    hf = released_model(tiny_pretrain_data, tmp_path / "hf", n_layers=2, n_kv_heads=2, max_seq_len=64, qk_norm=True,
                        attn_head_dim=16, moe_num_experts=4, moe_top_k=2, moe_hidden_dim=24, moe_first_dense_layers=1)
    out = tmp_path / "run"
    run_cmd(train_cmd([*from_weights(tiny_pretrain_run_args, hf, "--max_iters=2", "--checkpoint_interval=2"),
                       f"--out_dir={out}"]), env=_env())
    saved = read_model_config(find_latest_valid(str(out)))
    assert saved.qk_norm and saved.moe_num_experts == 4 and saved.moe_first_dense_layers == 1
    r = run_python([sys.executable, "export_hf.py", f"--ckpt={out}", f"--out_dir={tmp_path / 'back'}"])
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "back" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["mlp_only_layers"] == [0]


_MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)


@pytest.mark.parametrize("family, shape", [
    ("Qwen2MoeForCausalLM", dict(n_kv_heads=2, qkv_bias=True, moe_shared_experts=1, moe_shared_hidden_dim=48,
                                 moe_shared_gate=True, moe_norm_topk=False)),
    ("DeepseekV2ForCausalLM", dict(_MLA, moe_shared_experts=2, moe_norm_topk=False, moe_routed_scaling=2.0)),
    ("DeepseekV3ForCausalLM", dict(_MLA, q_lora_rank=24, moe_shared_experts=1, moe_score="sigmoid", moe_n_groups=2,
                                   moe_topk_groups=1)),
    ("GptOssForCausalLM", dict(n_kv_heads=2, qkv_bias=True, o_bias=True, attn_sinks=True, sliding_window=8,
                               sliding_layers=[0], moe_first_dense_layers=0, moe_router_bias=True,
                               moe_expert_biases=True, moe_act="gpt_oss"))],
    ids=["qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_a_hub_moe_family_trains_and_exports_back_as_itself(tiny_pretrain_data, tiny_pretrain_run_args, tmp_path,
                                                            family, shape):
    """Qwen2-MoE (a gated shared expert of its own width, raw top-k weights), DeepSeek-V2 (latent attention, a
    softmax router's raw weights), DeepSeek-V3 (latent attention with a query latent, sigmoid groups) and gpt-oss
    (attention sinks, biases, a sliding layer, its experts): `--init_from` its Hugging Face directory trains it, and
    export_hf.py writes the same family back, its routing switches kept."""
    from tests.conftest import run_python
    hf = released_model(tiny_pretrain_data, tmp_path / "hf", n_layers=2, max_seq_len=64, moe_num_experts=4,
                        moe_top_k=2, moe_hidden_dim=24, **{"moe_first_dense_layers": 1, **shape})
    out = tmp_path / "run"
    run_cmd(train_cmd([*from_weights(tiny_pretrain_run_args, hf, "--max_iters=2", "--checkpoint_interval=2"),
                       f"--out_dir={out}"]), env=_env())
    saved = read_model_config(find_latest_valid(str(out)))
    assert {k: getattr(saved, k) for k in shape} == shape
    r = run_python([sys.executable, "export_hf.py", f"--ckpt={out}", f"--out_dir={tmp_path / 'back'}"])
    assert r.returncode == 0, r.stderr[-2000:]
    with open(tmp_path / "back" / "config.json") as f:
        assert json.load(f)["architectures"] == [family]
