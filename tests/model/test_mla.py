"""Multi-head latent attention (model/mla.py) and its Hugging Face family, DeepSeek-V3 (model/hf_deepseek_v3.py):
transformers' DeepseekV3ForCausalLM gives our logits and gradients (its interleaved RoPE rows permuted on the way),
the import gives back the very tensors, transformers' own checkpoints (interleaved or not) read; the KV cache, packed
documents and the padded-value kernels agree with the plain forward; the parameter and FLOP counts; the refusals;
a trainer run with the flags resumes exactly and exports."""
from __future__ import annotations

import json
import os

import pytest
import torch

from model import ModelConfig, Transformer
from model.hf_interop import config_from_hf, export_hf, import_hf
from tests.model.hf_family_checks import streamed_export_equals_whole

MLA = dict(kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
MOE = dict(moe_score="sigmoid", moe_num_experts=8, moe_top_k=2, moe_hidden_dim=16, moe_shared_experts=1,
           moe_first_dense_layers=1, moe_n_groups=2, moe_topk_groups=1, moe_routed_scaling=2.5)
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 0.7}


def _cfg(**kw) -> ModelConfig:
    d = dict(vocab_size=96, dim=32, n_layers=3, n_heads=4, hidden_dim=48, max_seq_len=64, norm_eps=1e-6, **MLA)
    d.update(kw)
    return ModelConfig(**d)


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(_cfg(**kw))
    for layer in m.layers:
        if hasattr(layer.mlp, "router"):  # a router sharp enough that the choice is not a near tie, and biases
            torch.nn.init.normal_(layer.mlp.router.weight, std=0.3)
            layer.mlp.expert_bias.copy_(torch.randn(m.cfg.moe_num_experts) * 0.2)
    return m.eval()


def _hf(path):
    from transformers import DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float64,
                                                 experts_implementation="eager").eval()  # (no grouped mm in fp64)


def _tol(ours: torch.Tensor) -> float:
    # transformers routes in fp32 even in an fp64 model: its router weights carry fp32 rounding (no router: exact)
    return 16 * torch.finfo(torch.float32).eps * float(ours.abs().max())


@pytest.mark.parametrize("kw", [{}, {"q_lora_rank": 24, "rope_scaling": YARN, **MOE}],
                         ids=["dense-q_proj", "moe-q_lora-yarn"])
def test_round_trip_through_transformers_deepseek_v3(tmp_path, kw):
    model = _model(**kw)
    x = torch.randint(0, 96, (2, 40))  # (past the YaRN case's original 16 positions)
    out = export_hf(model, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["rope_interleave"] is True
    assert (cfg["kv_lora_rank"], cfg["q_lora_rank"], cfg["v_head_dim"]) == (16, kw.get("q_lora_rank"), 10)
    assert cfg["first_k_dense_replace"] == (1 if kw else 3)  # (a dense model: every block dense)
    hf = _hf(out)
    with torch.no_grad():
        ours = model.double()(x)
        theirs = hf(x).logits
    assert torch.allclose(theirs, ours, atol=_tol(ours) if kw else 1e-12, rtol=0), (theirs - ours).abs().max()
    back = import_hf(out)
    a, b = model.float().state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert back.cfg == model.cfg
    hf.save_pretrained(str(tmp_path / "hf5"))  # transformers' own layout on disk, whichever it writes
    again = import_hf(str(tmp_path / "hf5"), dtype=torch.float64).eval()
    with torch.no_grad():
        assert torch.allclose(again(x), ours, atol=1e-12, rtol=0)


def test_the_interleaved_rope_rows_matter_and_a_non_interleaved_checkpoint_reads_as_it_is(tmp_path):
    """transformers' own random DeepSeek-V3 with rope_interleave false imports unpermuted (logits equal); the same
    weights read as interleaved (the flag flipped in config.json) give other logits: the permutation is not a no-op."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    torch.manual_seed(1)
    hc = DeepseekV3Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                          num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=12,
                          qk_rope_head_dim=8, v_head_dim=10, first_k_dense_replace=2, n_routed_experts=2,
                          n_group=1, topk_group=1, rope_interleave=False, max_position_embeddings=64)
    hf = DeepseekV3ForCausalLM(hc).double().eval()
    hf.save_pretrained(str(tmp_path / "plain"))
    x = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        ref = hf(x).logits
        ours = import_hf(str(tmp_path / "plain"), dtype=torch.float64).eval()
        assert torch.allclose(ours(x), ref, atol=1e-12, rtol=0)
        raw = json.loads((tmp_path / "plain" / "config.json").read_text())
        (tmp_path / "plain" / "config.json").write_text(json.dumps(dict(raw, rope_interleave=True)))
        flipped = import_hf(str(tmp_path / "plain"), dtype=torch.float64).eval()
        assert not torch.allclose(flipped(x), ref, atol=1e-3)


def test_gradients_equal_transformers_through_the_permutation(tmp_path):
    """One loss and backward through both: every gradient of ours, permuted as its weight is, equals transformers'
    (fp32 rounding of the two orders: rtol 1e-4 beside 1e-6 of the largest)."""
    from model.hf_deepseek_v3 import to_hub
    model = _model(q_lora_rank=24).train()
    hf = _hf(export_hf(model, str(tmp_path / "hf"))).float().train()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 96, (2, 16), generator=g), torch.randint(0, 96, (2, 16), generator=g)
    loss = model(x, labels=y)
    ref_loss = torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten())
    assert abs(float(loss.detach()) - float(ref_loss.detach())) < 1e-5
    loss.backward()
    ref_loss.backward()
    grads = to_hub({n: p.grad for n, p in model.named_parameters()}, model.cfg)
    theirs = {n: p.grad for n, p in hf.named_parameters()}
    assert any("kv_a_layernorm" in n for n in grads) and any("q_a_layernorm" in n for n in grads)
    for name, grad in grads.items():
        ref = theirs[name if name == "lm_head.weight" else "model." + name]
        assert torch.allclose(grad, ref, atol=1e-6 * float(ref.abs().max()) + 1e-8, rtol=1e-4), name


def test_streamed_export_writes_the_whole_exports_tensors(tmp_path):
    model = _model(q_lora_rank=24, **MOE)
    config = streamed_export_equals_whole(model, tmp_path, max_shard_bytes=20_000)
    assert config["model_type"] == "deepseek_v3"


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "lora-kv_b_proj"])
def test_the_latent_kv_cache_gives_the_plain_forwards_logits(lora):
    """Token by token through the latent cache (kv_b_proj absorbed into the query and the output; a LoRA adapter's
    product with it) each position's logits are the whole sequence's (fp64: 1e-12); the cache holds kv_lora_rank +
    qk_rope_head_dim values per token and layer; greedy generation with the cache equals it without."""
    from model.lora import apply_lora
    from tests.model.hf_family_checks import cache_steps_equal_whole
    model = _model(q_lora_rank=24, rope_scaling=YARN).double()
    if lora:
        apply_lora(model, r=4, target_modules="kv_b_proj,q_b_proj")
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.2)
    cache = cache_steps_equal_whole(model, torch.randint(0, 96, (2, 40)), prefill=25)
    assert cache.k[0].shape == (2, 1, 40, 16 + 8) and cache.v[0].numel() == 0


def test_packed_documents_attend_within_themselves():
    """Two documents packed in a row (position_ids restarting) give each document's logits alone (fp64)."""
    from tests.model.hf_family_checks import packed_documents_attend_alone
    packed_documents_attend_alone(_model().double(), 96)


def test_parameter_and_flop_counts_follow_the_modules():
    from model.flops import flops_per_token, matmul_params
    from utils.mla_flags import mla_param_delta
    from utils.model_bounds import param_count
    for kw in ({}, {"q_lora_rank": 24}, {"q_lora_rank": 24, "tie_embeddings": True, "mtp_num_layers": 1}):
        model = _model(**kw)
        c = model.cfg
        counted = param_count(c.dim, c.n_layers + c.mtp_num_layers, c.n_heads, c.vocab_size, c.n_kv_heads,
                              c.hidden_dim, tie_embeddings=c.tie_embeddings, head_dim=c.head_dim)
        mtp_extra = c.mtp_num_layers * (2 * c.dim * c.dim + 3 * c.dim)  # a depth's eh_proj and three norms
        assert counted + mla_param_delta(c) + mtp_extra == model.num_params(), kw
        if not c.mtp_num_layers:  # every parameter but the embedding does a token's matmul work
            assert matmul_params(c) == model.num_params() - (0 if c.tie_embeddings else c.vocab_size * c.dim), kw
    c = _cfg()
    # attention: 6 per layer x (scores at the query / key width 20 + values at 10) x heads x positions
    assert flops_per_token(c, 64) - 6 * matmul_params(c) == 6 * 3 * 4 * (20 + 10) * 64


def test_shapes_and_mixes_that_cannot_be_built_are_refused(tmp_path):
    for kw, words in (({"qk_norm": True}, "cannot be combined with qk_norm"),
                      ({"n_kv_heads": 2}, "n_kv_heads=2"),
                      ({"v_head_dim": 30}, "v_head_dim=30 is wider"),
                      ({"qk_rope_head_dim": 7}, "qk_rope_head_dim=7 must be even"),
                      ({"kv_lora_rank": 0}, "qk_nope_head_dim, qk_rope_head_dim, v_head_dim need kv_lora_rank"),
                      ({"sliding_window": 8}, "sliding_window")):
        with pytest.raises(ValueError, match=words):
            _cfg(**kw)
    from parallel.transforms.tensor_parallel import tensor_parallel_problems
    assert tensor_parallel_problems(_cfg(), 2) == [] and "n_heads=4 is not divisible" in tensor_parallel_problems(
        _cfg(), 3)[0]
    with pytest.raises(ValueError, match="moe_norm_topk=true .a softmax router with latent attention is written as "
                                         "DeepSeek-V2, which transformers never renormalises"):
        export_hf(Transformer(_cfg(**dict(MOE, moe_score="softmax", moe_n_groups=1))), str(tmp_path / "no"))
    assert not os.path.exists(tmp_path / "no")
    with pytest.raises(ValueError, match="moe_n_groups=2 with moe_group_score=top2 .DeepSeek-V2 ranks a group by its"):
        export_hf(Transformer(_cfg(**dict(MOE, moe_score="softmax", moe_norm_topk=False))), str(tmp_path / "no"))
    with pytest.raises(ValueError, match="moe_group_score=max .DeepSeek-V3 ranks a group by its two best scores"):
        export_hf(Transformer(_cfg(**dict(MOE, moe_group_score="max"))), str(tmp_path / "no"))
    with pytest.raises(ValueError, match=r"deepseek_v3 checkpoints with biases are not supported \(attention_bias"):
        config_from_hf({"model_type": "deepseek_v3", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 48,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "attention_bias": True})


def test_the_trainer_flags_build_mla_and_refuse_what_cannot_be():
    from trainer.config import TrainConfig
    from trainer.start import new_model_config
    from trainer.validation import validate_config
    base = dict(data_dir="d", tokenizer_dir="t", device="cpu", dim=64, n_heads=4)
    cfg = TrainConfig(**base, kv_lora_rank=32, q_lora_rank=48)
    validate_config(cfg, torch_free=True)
    m = new_model_config(cfg, {"vocab_size": 100})
    # the defaults: nope = dim / heads, rope half of it, v = nope
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (32, 48, 16, 8, 16)
    for bad, words in ((dict(q_lora_rank=8), "--q_lora_rank=8 needs --kv_lora_rank"),
                       (dict(kv_lora_rank=8, qk_norm=True), "--kv_lora_rank=8 cannot be combined with --qk_norm"),
                       (dict(kv_lora_rank=8, qk_rope_head_dim=3), "--qk_rope_head_dim=3 must be even"),
                       (dict(kv_lora_rank=-1), "--kv_lora_rank=-1: must be >= 0")):
        with pytest.raises(Exception) as e:
            validate_config(TrainConfig(**base, **bad), torch_free=True)
        assert words in str(e.value), str(e.value)


def test_a_run_with_latent_attention_resumes_exactly_and_exports(tiny_pretrain_run_args, tmp_path):
    """--kv_lora_rank (with a query latent) through the trainer: stopped at step 3 and continued gives the
    uninterrupted run's losses exactly; export_hf.py writes a DeepSeek-V3 that transformers runs to our logits."""
    from tests.conftest import PY, ROOT, run_cmd, train_cmd
    from utils.metrics import dedupe_by_step, read_metrics
    flags = ["--kv_lora_rank=16", "--q_lora_rank=24", "--qk_rope_head_dim=4"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    log = run_cmd(train_cmd([*tiny_pretrain_run_args, *flags, f"--out_dir={whole}", "--max_iters=5"])).stdout
    assert ", multi-head latent attention (kv latent 16, q latent 24, 4 heads of 8 + 4 RoPE / 8 values)" in log, log
    run_cmd(train_cmd([*tiny_pretrain_run_args, *flags, f"--out_dir={split}", "--max_iters=3"]))
    run_cmd(train_cmd([*tiny_pretrain_run_args, *flags, f"--out_dir={split}", "--max_iters=5"]))
    a, b = (dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))) for d in (whole, split))
    assert [a[s]["loss"] for s in range(1, 6)] == [b[s]["loss"] for s in range(1, 6)]
    hf_dir = tmp_path / "hf"
    run_cmd([PY, os.path.join(ROOT, "export_hf.py"), f"--ckpt={whole}", f"--out_dir={hf_dir}"])
    ours = import_hf(str(hf_dir), dtype=torch.float64).eval()
    assert (ours.cfg.kv_lora_rank, ours.cfg.q_lora_rank, ours.cfg.qk_rope_head_dim) == (16, 24, 4)
    x = torch.randint(0, ours.cfg.vocab_size, (1, 16))
    with torch.no_grad():
        assert torch.allclose(_hf(str(hf_dir))(x).logits, ours(x), atol=1e-12, rtol=0)


def test_the_whole_model_compiles_as_one_graph_and_follows_eager():
    """torch.compile(fullgraph=True) (aot_eager: the tracing, which a graph break would fail) of an MLA model on
    packed documents: the loss and every gradient equal eager's (the same operations). (MoE blocks break the graph
    on the CPU by design: their expert loop runs eagerly, model/eager_region.py.)"""
    import torch._dynamo
    model = _model(q_lora_rank=24, rope_scaling=YARN).train()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 96, (2, 16), generator=g), torch.randint(0, 96, (2, 16), generator=g)
    pos = torch.tensor([list(range(9)) + list(range(7)), list(range(16))])

    def run(m):
        model.zero_grad(set_to_none=True)
        loss = m(x, labels=y, position_ids=pos)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch._dynamo.reset()
    (a, ga), (b, gb) = run(model), run(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert torch.allclose(a, b, rtol=1e-6, atol=0) and ga.keys() == gb.keys()
    assert all(torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-7) for n in ga)


def test_a_deepseek_v3_hub_config_and_its_mtp_layer_import(tmp_path):
    """What --init_from reads from the Hub (DeepSeek-V3 / R1, Moonlight and Kimi K2, whose model_type is its own, use
    this family): the config.json as DeepSeek wrote it (transformers 4.x spelling: rope_scaling YaRN with mscale / mscale_all_dim, scoring_func,
    topk_method, num_nextn_predict_layers) and a checkpoint holding an MTP layer after the model's: the layer is left
    out, and the logits are transformers' (fp64) past YaRN's original length."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    raw = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 96,
           "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 3,
           "num_nextn_predict_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
           "n_routed_experts": 8, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 16, "q_lora_rank": 24,
           "qk_rope_head_dim": 8, "v_head_dim": 10, "qk_nope_head_dim": 12, "topk_method": "noaux_tc", "n_group": 2,
           "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
           "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 64,
           "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False, "attention_bias": False,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 4, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 16, "type": "yarn"}}
    torch.manual_seed(2)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**raw, experts_implementation="eager")).double().eval()
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            torch.nn.init.normal_(layer.mlp.gate.weight, std=0.3)
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.2)
    hf.save_pretrained(str(tmp_path / "hub"))
    (tmp_path / "hub" / "config.json").write_text(json.dumps(raw))  # DeepSeek's own spelling
    weights = load_file(str(tmp_path / "hub" / "model.safetensors"))
    mtp = {f"model.layers.3.{k}": torch.zeros(2, 2) for k in ("eh_proj.weight", "enorm.weight",
                                                               "self_attn.kv_b_proj.weight", "shared_head.head.weight")}
    save_file({**weights, **mtp}, str(tmp_path / "hub" / "model.safetensors"), metadata={"format": "pt"})
    cfg = config_from_hf(raw)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.moe_score, cfg.moe_n_groups, cfg.moe_routed_scaling) == (
        16, 24, "sigmoid", 2, 2.5)
    assert cfg.rope_scaling["type"] == "yarn" and cfg.rope_scaling["mscale_all_dim"] == 1.0
    ours = import_hf(str(tmp_path / "hub"), dtype=torch.float64).eval()
    assert ours.cfg.mtp_num_layers == 0 and not any(k.startswith("mtp") for k in ours.state_dict())
    x = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        want, got = hf(x).logits, ours(x)
    assert torch.allclose(got, want, atol=_tol(want), rtol=0), (got - want).abs().max()
    # Kimi K2's config.json names the same architecture model_type "kimi_k2": read as DeepSeek-V3
    from utils.run_dir import is_hf_dir
    (tmp_path / "hub" / "config.json").write_text(json.dumps(dict(raw, model_type="kimi_k2")))
    assert is_hf_dir(str(tmp_path / "hub"))
    with torch.no_grad():
        assert torch.equal(import_hf(str(tmp_path / "hub"), dtype=torch.float64).eval()(x), got)


@pytest.mark.parametrize("groups", [1, 2], ids=["greedy", "group_limited_greedy"])
def test_a_softmax_router_round_trips_through_transformers_deepseek_v2(tmp_path, groups):
    """DeepSeek-V2(-Lite)'s routing (softmax over every expert, the chosen raw scores: --moe_norm_topk_prob=false,
    routed scaling, shared experts, a dense first block; DeepSeek-V2's group_limited_greedy: groups ranked by their
    best score, --moe_group_score=max) with latent attention is written as DeepseekV2ForCausalLM (its rotary always
    interleaved): transformers' logits (fp64), the import gives the tensors and config back."""
    from transformers import DeepseekV2ForCausalLM
    model = _model(**dict(MOE, moe_score="softmax", moe_norm_topk=False, moe_n_groups=groups, moe_topk_groups=1,
                          moe_group_score="max" if groups > 1 else "top2"))
    for layer in model.layers[1:]:
        layer.mlp.expert_bias.zero_()  # (DeepSeek-V2 has no selection bias)
    out = export_hf(model, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["topk_method"] == ("group_limited_greedy" if groups > 1 else "greedy")
    assert cfg["norm_topk_prob"] is False and cfg["routed_scaling_factor"] == 2.5 and "rope_interleave" not in cfg
    hf = DeepseekV2ForCausalLM.from_pretrained(out, dtype=torch.float64, experts_implementation="eager").eval()
    x = torch.randint(0, 96, (2, 24))
    with torch.no_grad():
        ours = model.double()(x)
        assert torch.allclose(hf(x).logits, ours, atol=_tol(ours), rtol=0), (hf(x).logits - ours).abs().max()
    back = import_hf(out)
    assert back.cfg == model.cfg
    a, b = model.float().state_dict(), back.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="topk_method='noaux_tc' .greedy or group_limited_greedy are read"):
        config_from_hf(dict(cfg, topk_method="noaux_tc"))
