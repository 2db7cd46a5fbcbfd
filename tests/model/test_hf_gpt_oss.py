"""gpt-oss (model/hf_gpt_oss.py, attention sinks in model/attention.py, its experts in model/moe_experts.py): the sink
attention through SDPA equals the softmax with one more logit (values and gradients, causal, windowed, padded, one
query over a cache); the experts' grouped matmul equals the loop and transformers' per-token formula; transformers'
GptOssForCausalLM gives our logits both ways (its RMSNorm computes in fp32 even in an fp64 model: 16 fp32 eps of the
largest logit), the export imports back as the very tensors, an MXFP4 checkpoint imports to the same logits as its
dequantized weights; the KV cache gives the whole forward's logits; what gpt-oss cannot hold is refused."""
import json

import pytest
import torch

from model import ModelConfig, Transformer
from model.attention import AttnSpec, attention_ref, dense_mask, sink_attention
from model.hf_interop import export_hf, import_hf
from model.moe_experts import ExpertAct, experts_grouped, experts_loop

CPU = torch.device("cpu")
GPT_OSS = dict(attn_sinks=True, qkv_bias=True, o_bias=True, sliding_window=4, sliding_layers=[0, 2],
               moe_num_experts=4, moe_top_k=2, moe_hidden_dim=32, moe_router_bias=True, moe_expert_biases=True,
               moe_act="gpt_oss")
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False}


def _model(**kw) -> Transformer:
    """A tiny gpt-oss-shaped model whose sinks, biases and router are far from their zero / small initialisation."""
    torch.manual_seed(0)
    fields = dict(vocab_size=128, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, attn_head_dim=16, hidden_dim=32,
                  max_seq_len=64, rope_theta=150000.0, **GPT_OSS)
    fields.update(kw)
    m = Transformer(ModelConfig(**fields))
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith(("sinks", "bias")):
                p.normal_(0.0, 0.5)
            elif n.endswith(("router.weight", "gate_up_proj")):
                p.normal_(0.0, 0.3)
    return m.eval()


def _tol(ours: torch.Tensor) -> float:
    return 16 * torch.finfo(torch.float32).eps * float(ours.abs().max())


def _hf(path):
    from transformers import GptOssForCausalLM
    return GptOssForCausalLM.from_pretrained(path, torch_dtype=torch.float64, experts_implementation="eager",
                                             attn_implementation="eager").eval()


@pytest.mark.parametrize("pad_values", [False, True], ids=["values-as-they-are", "values-padded"])
@pytest.mark.parametrize("case", ["causal", "window", "padded", "one-query-over-a-cache"])
def test_sink_attention_is_the_softmax_with_one_more_logit(case, pad_values):
    g = torch.Generator(device=CPU).manual_seed(0)
    B, H, Hkv, T, D = 2, 4, 2, 9, 16
    q, k, v = (torch.randn(B, h, T, D, generator=g, dtype=torch.float64, device=CPU) for h in (H, Hkv, Hkv))
    sinks = torch.randn(H, generator=g, dtype=torch.float64, device=CPU) * 2
    if case == "causal":
        spec, mask = AttnSpec("sdpa", is_causal=True), None
    elif case == "window":
        mask = dense_mask(T, 0, CPU, window=3)
        spec = AttnSpec("sdpa_masked", is_causal=False, mask=mask)
    elif case == "padded":
        real = torch.ones(B, T, dtype=torch.bool, device=CPU)
        real[0, :3] = False
        mask = dense_mask(T, 0, CPU, real=real)
        spec = AttnSpec("sdpa_masked", is_causal=False, mask=mask)
    else:
        q = q[:, :, -1:]
        spec, mask = AttnSpec("sdpa", is_causal=False), torch.ones(1, 1, 1, T, dtype=torch.bool, device=CPU)
    ins = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    y = sink_attention(*ins[:3], spec, ins[3], pad_values=pad_values)  # (padded: CUDA's default)
    r = attention_ref(*ref[:3], mask, ref[3])
    assert torch.allclose(y, r, atol=1e-12, rtol=0), (y - r).abs().max()
    w = torch.randn(y.shape, generator=g, dtype=torch.float64, device=CPU)
    (y * w).sum().backward()
    (r * w).sum().backward()
    for a, b in zip(ins, ref):
        assert torch.allclose(a.grad, b.grad, atol=1e-12, rtol=0), (a.grad - b.grad).abs().max()
    # the sinks change the result: without them it is plain attention, which differs
    assert not torch.allclose(attention_ref(q, k, v, mask), r.detach(), atol=1e-3)


def test_the_experts_grouped_matmul_equals_the_loop_and_transformers_formula():
    """gpt-oss's experts (biases, its clamped SwiGLU, an expert without rows): the grouped matmul's values and
    gradients equal the loop's; the loop equals transformers' formula written per row (fp32, clamps reached)."""
    g = torch.Generator(device=CPU).manual_seed(1)
    E, D, I = 4, 8, 12
    counts = torch.tensor([3, 0, 5, 2], device=CPU)
    rows = torch.randn(int(counts.sum()), D, generator=g, device=CPU) * 3
    w_gu, w_d = torch.randn(E, 2 * I, D, generator=g, device=CPU), torch.randn(E, D, I, generator=g, device=CPU)
    b_gu, b_d = torch.randn(E, 2 * I, generator=g, device=CPU), torch.randn(E, D, generator=g, device=CPU)
    act = ExpertAct("gpt_oss", 7.0, 1.702)
    outs, grads = [], []
    for fn in (experts_grouped, experts_loop):
        ins = [t.clone().requires_grad_() for t in (rows, w_gu, w_d, b_gu, b_d)]
        out = fn(ins[0], counts, ins[1], ins[2], act, ins[3], ins[4])
        out.pow(2).sum().backward()
        outs.append(out.detach())
        grads.append([t.grad for t in ins])
    assert torch.allclose(outs[0], outs[1], atol=1e-4, rtol=1e-5)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-4), (a - b).abs().max()
    expert = torch.repeat_interleave(torch.arange(E), counts)
    hf_gu = torch.stack((w_gu[:, :I], w_gu[:, I:]), dim=2).flatten(1, 2)  # (the Hub's interleaved rows)
    hf_b = torch.stack((b_gu[:, :I], b_gu[:, I:]), dim=-1).flatten(-2)
    want = []
    for x, e in zip(rows, expert):
        gate_up = hf_gu[e] @ x + hf_b[e]
        gate, up = gate_up[0::2].clamp(max=7.0), gate_up[1::2].clamp(-7.0, 7.0)
        want.append(w_d[e] @ ((up + 1) * gate * torch.sigmoid(gate * 1.702)) + b_d[e])
    want = torch.stack(want)
    assert (rows.abs() > 7).any() and torch.allclose(outs[1], want, atol=1e-4, rtol=1e-5)


def test_round_trip_through_transformers_gpt_oss(tmp_path):
    model = _model(rope_scaling=YARN)
    out = export_hf(model, str(tmp_path / "hf"))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["num_local_experts"] == 4 and cfg["attention_bias"] is True
    assert cfg["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    hf = _hf(out)
    x = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        ours = model.double()(x)
        theirs = hf(x).logits
        assert torch.allclose(theirs, ours, atol=_tol(ours), rtol=0), ((theirs - ours).abs().max(), _tol(ours))
        for name in ("sinks", "router.bias"):  # each part moves the logits
            other = _model(rope_scaling=YARN).double()
            for n, p in other.named_parameters():
                if n.endswith(name):
                    p.zero_()
            assert not torch.allclose(other(x), ours, atol=1e-3), name
    back = import_hf(out)
    a, b = model.float().state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    hf.save_pretrained(str(tmp_path / "hf5"))  # transformers' own files: the same logits through ours
    again = import_hf(str(tmp_path / "hf5"), dtype=torch.float64).eval()
    assert again.cfg.sliding_layers == [0, 2] and again.cfg.moe_act == "gpt_oss" and again.cfg.attn_sinks
    with torch.no_grad():
        assert torch.allclose(again(x), ours, atol=1e-12, rtol=0)


def test_missing_biases_are_written_as_zeros_and_what_gpt_oss_cannot_hold_is_refused(tmp_path):
    model = _model(qkv_bias=False, o_bias=False, moe_router_bias=False, moe_expert_biases=False)
    hf = _hf(export_hf(model, str(tmp_path / "hf")))
    x = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        ours = model.double()(x)
        assert torch.allclose(hf(x).logits, ours, atol=_tol(ours), rtol=0)
    assert float(hf.model.layers[1].self_attn.o_proj.bias.detach().abs().sum()) == 0.0
    for kw, words in (({"moe_act": "silu"}, "moe_act=silu"), ({"moe_first_dense_layers": 1}, "every gpt-oss block"),
                      ({"moe_top_k": 1}, "moe_top_k=1")):
        with pytest.raises(ValueError, match=words):
            export_hf(_model(**kw), str(tmp_path / "no"))
    for kw, words in (({"moe_shared_experts": 1}, "shared experts"), ({"moe_act": "gelu"}, "moe_act must be"),
                      ({"moe_num_experts": 0}, "need moe_num_experts")):
        with pytest.raises(ValueError, match=words):
            _model(**kw)


def test_an_mxfp4_checkpoint_imports_as_its_dequantized_weights(tmp_path):
    """gpt-oss as released: experts in MXFP4 (quantization_config mxfp4, `_blocks` / `_scales`), read dequantized;
    the logits equal those of the same (exactly representable) weights stored plainly."""
    from safetensors.torch import load_file, save_file
    from tests.model.test_hf_mxfp4 import _pack
    model = _model()
    out = export_hf(model, str(tmp_path / "hf"))
    sd = load_file(f"{out}/model.safetensors")
    g = torch.Generator(device=CPU).manual_seed(2)
    qsd = {}
    for name, t in list(sd.items()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            sd[name], blocks, scales = _pack(t, g)  # the plain checkpoint: the values the MXFP4 one encodes
            qsd[name + "_blocks"], qsd[name + "_scales"] = blocks, scales
        else:
            qsd[name] = t
    save_file(sd, f"{out}/model.safetensors", metadata={"format": "pt"})
    plain = import_hf(out, dtype=torch.float64).eval()
    quant = tmp_path / "mxfp4"
    quant.mkdir()
    save_file(qsd, str(quant / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (quant / "config.json").write_text(json.dumps(config))
    read = import_hf(str(quant), dtype=torch.float64).eval()
    x = torch.randint(0, 128, (1, 10))
    with torch.no_grad():
        assert torch.equal(read(x), plain(x))


def test_the_kv_cache_gives_the_whole_forwards_logits():
    """Token by token through the cache (sliding layers masked to their window, the sinks in every softmax) each
    position's logits are the whole sequence's (fp64); greedy generation with the cache equals it without."""
    from tests.model.hf_family_checks import cache_steps_equal_whole
    cache_steps_equal_whole(_model().double(), torch.randint(0, 128, (2, 20)), prefill=7)


def test_packed_documents_attend_within_themselves():
    from tests.model.hf_family_checks import packed_documents_attend_alone
    packed_documents_attend_alone(_model().double(), 128)


def test_the_trainer_flags_build_a_gpt_oss_shaped_model_and_refuse_what_cannot_be():
    from trainer.config import TrainConfig
    from trainer.start import new_model_config
    from trainer.validation import validate_config
    base = dict(data_dir="d", tokenizer_dir="t", device="cpu", dim=64, n_heads=4, n_layers=6)
    gpt_oss = dict(attn_sinks=True, o_bias=True, qkv_bias=True, sliding_window=16, sliding_layers="every:2:0",
                   moe_num_experts=4, moe_router_bias=True, moe_expert_biases=True, moe_act="gpt_oss")
    cfg = TrainConfig(**base, **gpt_oss)
    validate_config(cfg, torch_free=True)
    m = new_model_config(cfg, {"vocab_size": 100})
    assert m.sliding_layers == [0, 2, 4] and m.attn_sinks and m.o_bias and m.moe_act == "gpt_oss"
    assert new_model_config(TrainConfig(**base, sliding_window=16, sliding_layers="1,3"), {"vocab_size": 100}
                            ).sliding_layers == [1, 3]
    assert Transformer(m).layers[0].mlp.experts.gate_up_proj_bias.shape == (4 * 2 * m.hidden_dim,)
    for bad, words in ((dict(sliding_layers="0,2"), "--sliding_layers='0,2' names the layers that slide"),
                       (dict(sliding_window=8, sliding_layers="a,b"), "--sliding_layers='a,b': expected"),
                       (dict(sliding_window=8, sliding_layers="every:0:1"), "expected layer indices"),
                       (dict(sliding_window=8, sliding_layers="0,9"), "sliding_layers=[0, 9] must list distinct"),
                       (dict(moe_num_experts=4, moe_act="relu"), "--moe_act='relu' (silu | gpt_oss)"),
                       (dict(moe_num_experts=4, moe_shared_experts=1, moe_router_bias=True), "gpt-oss's experts"),
                       (dict(moe_num_experts=4, moe_swiglu_limit=0.0), "--moe_swiglu_limit=0.0: must be")):
        with pytest.raises(Exception) as e:
            validate_config(TrainConfig(**base, **bad), torch_free=True)
        assert words in str(e.value), str(e.value)


def test_context_parallelism_refuses_the_sinks():
    from types import SimpleNamespace
    from parallel.transforms import context_parallel
    model = _model(sliding_window=None, sliding_layers=None)
    with pytest.raises(ValueError, match="attention sinks"):
        context_parallel.apply(model, None, SimpleNamespace(context_parallel_size=2))


def test_the_fast_decoder_computes_the_sinks():
    """model/decode.py's fast path: prefill and each step give the whole forward's logits at those positions (fp64;
    the sliding layers' window of 4 passed), and the sinks are in them (zeroed, the logits move)."""
    from model.decode import Decoder, fast_path_applies
    model = _model().double()
    assert fast_path_applies(model)
    x = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        whole = model(x)
        d = Decoder(model, 2, 12, x.device, torch.float64, pack=False)
        got = [d.prefill(x[:, :5])] + [d.step(x[:, t]) for t in range(5, 12)]
    assert torch.allclose(torch.stack(got, dim=1), whole[:, 4:], atol=1e-12, rtol=0)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.sinks.zero_()
        assert not torch.allclose(Decoder(model, 2, 12, x.device, torch.float64, pack=False).prefill(x[:, :5]),
                                  whole[:, 4], atol=1e-3)


def test_streamed_export_writes_the_whole_exports_tensors(tmp_path):
    """A sharded run's export (a few tensors at a time): the same tensors as the whole export, the zero biases of a
    model without them included."""
    from tests.model.hf_family_checks import streamed_export_equals_whole
    config = streamed_export_equals_whole(_model(moe_router_bias=False, o_bias=False), tmp_path, max_shard_bytes=20_000)
    assert config["model_type"] == "gpt_oss"


@pytest.mark.parametrize("targets", ["q_proj,k_proj,v_proj,o_proj", "q_proj,experts", "experts.gate_up_proj"],
                         ids=["attention", "attention-and-experts", "experts-gate-up"])
def test_lora_adapters_in_peft_on_the_gpt_oss_export(tmp_path, targets):
    """LoRA on the attention projections (which have biases here), and on the routed experts (PEFT's
    target_parameters on the stacked [E, D, 2I] weight, gate and up interleaved along 2I: B's rows follow), saved in
    the PEFT layout, loaded with `peft.PeftModel` on the exported GptOssForCausalLM: our model's logits."""
    pytest.importorskip("peft")
    from tests.model.hf_family_checks import peft_logits_on_export
    ours, base, theirs = peft_logits_on_export(_model(), tmp_path, targets, _hf, 128)
    assert (ours - base).abs().max() > 100 * _tol(ours)
    assert torch.allclose(theirs, ours, atol=_tol(ours), rtol=0), ((theirs - ours).abs().max(), _tol(ours))
