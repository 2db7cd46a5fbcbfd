"""Gemma 2 (Gemma2ForCausalLM): Gemma 3's block without q / k norms, with logit soft-capping on the attention scores and
on the LM head's logits (model/softcap.py). A tiny Gemma2ForCausalLM, its caps small enough that tanh is far from
linear on its scores and logits, imports with transformers' logits, loss and gradients, decodes through the KV cache,
packs documents, gives GRPO's log-probabilities of its capped logits, and exports back as one; each cap moves the
logits; what our model lacks is refused by name."""
import copy
import dataclasses
import json

import pytest
import torch

from model import ModelConfig, Transformer
from model.attention import AttnSpec, attention_ref, dense_mask, softcap_attention
from model.hf_interop import config_from_hf, export_hf, hf_config_dict, import_hf
from tests.model.hf_family_checks import (cache_steps_equal_whole, each_switch_moves_the_logits,
                                          gradients_equal_transformers, packed_documents_attend_alone)

transformers = pytest.importorskip("transformers")

VOCAB = 97
# 4 heads of 16 at hidden 48 (head_dim * heads != hidden), 2 kv heads, the even layers sliding over 5 positions,
# scores over sqrt(24); caps of 0.5 (scores) and 1.0 (logits): the weights are drawn large enough that both bind
SHAPE = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5,
             query_pre_attn_scalar=24, attn_logit_softcapping=0.5, final_logit_softcapping=1.0,
             rope_parameters={"rope_type": "default", "rope_theta": 1000.0})


def _gemma2(tmp_path, tie: bool = True, dtype=torch.float64):
    """A tiny Gemma2ForCausalLM (eager attention: transformers' only one with soft-capping) with weights large enough
    that the caps bind and norm weights away from 0, saved."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(Gemma2Config(**SHAPE, tie_word_embeddings=tie, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.15)
    hf.save_pretrained(tmp_path / "gemma2")
    return hf.to(dtype), str(tmp_path / "gemma2")


def test_softcap_attention_equals_the_written_out_formula():
    """Causal, windowed and one query over a cache, with GQA: values and the gradients of q, k, v against the textbook
    attention with capped scores (fp64), and the cap changes the result (a cap ignored would equal plain attention)."""
    torch.manual_seed(0)
    B, H, Hkv, D = 2, 4, 2, 8
    for Tq, Tk, mask in ((7, 7, None), (7, 7, dense_mask(7, 0, torch.device("cpu"), window=3)), (1, 9, None)):
        q = (torch.randn(B, H, Tq, D, dtype=torch.float64) * 2).requires_grad_()
        k, v = (torch.randn(B, Hkv, Tk, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
        spec = AttnSpec("sdpa_masked", is_causal=False, mask=mask) if mask is not None else \
            AttnSpec("sdpa", is_causal=Tq == Tk)
        y = softcap_attention(q, k, v, spec, 0.7)
        ref_mask = mask if mask is not None else None if Tq == Tk else torch.ones(1, 1, Tq, Tk, dtype=torch.bool)
        ref = attention_ref(q, k, v, ref_mask, cap=0.7)
        assert torch.allclose(y, ref, atol=1e-12, rtol=0)
        g = torch.randn_like(y)
        grads = torch.autograd.grad(y, (q, k, v), g)
        ref_grads = torch.autograd.grad(ref, (q, k, v), g)
        assert all(torch.allclose(a, b, atol=1e-12, rtol=0) for a, b in zip(grads, ref_grads))
        assert not torch.allclose(y, attention_ref(q, k, v, ref_mask), atol=1e-3)


def test_a_gemma2_imports_with_transformers_logits_and_exports_as_a_gemma2(tmp_path):
    from transformers import Gemma2ForCausalLM
    hf, path = _gemma2(tmp_path)
    ours = import_hf(path).eval()
    c = ours.cfg
    assert (c.sandwich_norms, c.scale_embeddings, c.mlp_act, c.qk_norm, c.query_scale) == (True, True, "gelu_tanh",
                                                                                          False, 24.0)
    assert (c.attn_softcap, c.final_softcap, c.sliding_window, c.sliding_layers) == (0.5, 1.0, 5, [0, 2])
    assert c.rope_local_theta is None and c.rope_theta == 1000.0 and c.tie_embeddings
    x = torch.randint(0, VOCAB, (2, 12))  # past the window
    with torch.no_grad():
        ref = hf(x).logits
        logits = copy.deepcopy(ours).double()(x)
        # transformers' Gemma RMSNorm runs in fp32 in an fp64 model (the only fp32 step on either side)
        tol = 16 * torch.finfo(torch.float32).eps * float(ref.abs().max())
        assert torch.allclose(logits, ref, atol=tol, rtol=0), (logits - ref).abs().max()
        export_hf(ours, str(tmp_path / "out"))
        back = Gemma2ForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager").double().eval()
        assert back.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
        assert (back.config.attn_logit_softcapping, back.config.final_logit_softcapping) == (0.5, 1.0)
        assert torch.allclose(back(x).logits, ref, atol=tol, rtol=0)
    with open(tmp_path / "out" / "config.json") as f:
        d = json.load(f)
    assert d["architectures"] == ["Gemma2ForCausalLM"] and d["model_type"] == "gemma2"
    assert config_from_hf(d) == dataclasses.replace(c, fused_qkv=c.fused_qkv)


def test_each_cap_moves_the_logits(tmp_path):
    """Turn each cap off on the imported model: the logits leave transformers' (a cap the forward ignored would not)."""
    hf, path = _gemma2(tmp_path, dtype=torch.float32)
    x = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        ref = hf(x).logits
    mutations = {
        "attn_softcap": lambda m: [setattr(b.self_attn, "softcap", None) for b in m.layers],
        "final_softcap": lambda m: setattr(m, "cfg", dataclasses.replace(m.cfg, final_softcap=None)),
    }
    each_switch_moves_the_logits(path, ref, x, mutations)


def test_gemma2_loss_and_gradients_equal_transformers(tmp_path):
    """The loss through the chunked head with capped logits (chunks smaller than the batch) and every gradient, against
    transformers' autograd on the same weights (untied: the embedding's gradient alone)."""
    from model.hf_gemma3 import to_hub
    hf, path = _gemma2(tmp_path, tie=False, dtype=torch.float32)
    ours = import_hf(path)
    ours.cfg = dataclasses.replace(ours.cfg, loss_chunk_size=7)
    gradients_equal_transformers(hf, ours, to_hub, VOCAB)


def test_the_kv_cache_packed_documents_and_logprobs_follow_the_whole_forward(tmp_path):
    """The KV cache (prefill, then one token at a time over the window) and packed documents give the whole forward's
    logits (fp64); GRPO's chunked log-probabilities and entropies are those of the capped logits / temperature."""
    _, path = _gemma2(tmp_path)
    ours = import_hf(path).double().eval()
    x = torch.randint(0, VOCAB, (2, 14))
    cache_steps_equal_whole(ours, x, prefill=6)
    packed_documents_attend_alone(ours, VOCAB)
    targets = torch.randint(0, VOCAB, (2, 14))
    with torch.no_grad():
        logp, entropy = ours(x, logprobs_of=targets, temperature=0.7)
        z = ours(x) / 0.7
    ref = z.log_softmax(-1)
    assert torch.allclose(logp, ref.gather(-1, targets[..., None])[..., 0], atol=1e-12, rtol=0)
    assert torch.allclose(entropy, -(ref.exp() * ref).sum(-1), atol=1e-12, rtol=0)


def test_transformers_defaults_and_refusals(tmp_path):
    """A config.json leaving the caps out means transformers' defaults (50, 30); null means none; a model without q / k
    norms but Gemma's block exports as Gemma 2, one with a sliding layers' RoPE base is refused;
    context parallelism refuses the capped scores by name."""
    hub = {k: v for k, v in SHAPE.items() if not k.endswith("softcapping")}
    c = config_from_hf({**hub, "model_type": "gemma2"})
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0)
    c = config_from_hf({**hub, "model_type": "gemma2", "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (c.attn_softcap, c.final_softcap) == (None, None) and hf_config_dict(c)["model_type"] == "gemma2"
    rm = config_from_hf({**hub, "model_type": "gemma2", "architectures": ["Gemma2ForSequenceClassification"],
                         "num_labels": 1})
    assert (rm.num_labels, rm.attn_softcap, rm.final_softcap) == (1, 50.0, None)  # (its scores are not capped)
    assert hf_config_dict(rm)["architectures"] == ["Gemma2ForSequenceClassification"]
    with pytest.raises(ValueError, match="bidirectional"):
        config_from_hf({**hub, "model_type": "gemma2", "use_bidirectional_attention": True})
    with pytest.raises(ValueError, match="sliding layers' own"):
        hf_config_dict(dataclasses.replace(c, rope_local_theta=1e4))
    for bad, why in ((dict(final_softcap=0.0), "final_softcap=0.0 must be a number > 0"),
                     (dict(final_softcap=30.0, mtp_num_layers=1), "not with num_labels"),
                     (dict(attn_softcap=50.0, attn_sinks=True), "attn_softcap and attn_sinks")):
        with pytest.raises(ValueError, match=why):
            ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, **bad)
    from types import SimpleNamespace

    from parallel.transforms.context_parallel import apply
    capped = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, attn_softcap=50.0))
    with pytest.raises(ValueError, match="soft-capped attention scores"):
        apply(capped, None, SimpleNamespace(context_parallel_size=2))


def test_flex_attentions_score_mod_gives_the_written_out_logits(tmp_path):
    """Where FlexAttention trains (an accelerator) a Gemma 2's batches take it with the cap as its score_mod: forced
    here on the CPU (forward only: FlexAttention has no CPU backward), plain, packed and padded batches give the
    written-out path's logits (fp64), sliding layers included."""
    _, path = _gemma2(tmp_path)
    ours = import_hf(path).double().eval()
    x = torch.randint(0, VOCAB, (2, 12))
    pos = torch.cat((torch.arange(5), torch.arange(7)))[None].expand(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # (left padding)
    with torch.no_grad():
        for kw in ({}, {"position_ids": pos}, {"attention_mask": mask}):
            ours.attn_backend = "sdpa"
            ref = ours(x, **kw)
            ours.attn_backend = "flex"
            got = ours(x, **kw)
            assert torch.allclose(got, ref, atol=1e-12, rtol=0), (kw.keys(), (got - ref).abs().max())
