"""model/decode.py's Decoder against the model's own forward: the logits of a prefill and of one-token steps differ
from a whole-sequence forward by rounding only (their error against a float64 forward of the same weights is of the
order of the model's own fp32 error), with packed and plain weights, GQA, LoRA-wrapped projections, MoE blocks,
dynamic RoPE, sliding windows, Gemma 2 / 3's and OLMo's blocks and several tokens over a non-empty cache; a prompt
shared by every row is prefilled once with the same result; the sampler draws what torch.multinomial draws (its
exponentials, computed faster, are torch's own); NaN logits stop a rollout with one line."""
import pytest
import torch

import model.decode as decode
from model import KVCache, ModelConfig, Transformer
from model.decode import Decoder, fast_path_applies
from model.generate import generate, multinomial_one

V, T, PREFILL = 96, 14, 6


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, hidden_dim=96,
                initializer_range=0.2)  # wide init: peaked, varied predictions
    base.update(kw)
    return ModelConfig(**base)


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(_cfg(**kw)).eval()


def _decoded(model, x: torch.Tensor, pack, shared: bool = False) -> torch.Tensor:
    """Logits [B, T - PREFILL + 1, V] of positions PREFILL-1 .. T-1: a prefill of the first PREFILL tokens, then one
    step per token."""
    d = Decoder(model, x.shape[0], x.shape[1], x.device, torch.float32, pack=pack)
    projections = [p for layer in d.layers for q in layer[1:] for p in (q if isinstance(q, tuple) else (q,))]
    packed = [p.packed is not None for p in projections if p is not None]
    if pack is False or decode.PACK_MIN > 0:  # (the tiny model's weights are all below PACK_MIN)
        assert not any(packed)
    else:
        assert all(packed) == torch.backends.mkldnn.is_available()
    out = [d.prefill_shared(x[0, :PREFILL]) if shared else d.prefill(x[:, :PREFILL])]
    for t in range(PREFILL, x.shape[1]):
        out.append(d.step(x[:, t]))
    assert d.cache.pos == x.shape[1]
    return torch.stack(out, 1)


def _errors(model, x, got, cached: bool = False) -> tuple[float, float]:
    """(decoder's max error, the model's fp32 forward's max error), both against the model in float64: its
    whole-sequence forward, or (cached) its own KV-cache forward, prefill then one token at a time (dynamic RoPE:
    a cached key keeps the rotation of the length it was computed at, so only that is the reference)."""
    import copy
    m64 = copy.deepcopy(model).double()
    fwd = _cached if cached else (lambda m, x: m(x)[:, PREFILL - 1:])
    with torch.no_grad():
        ref64, own = fwd(m64, x), fwd(model, x)
    return (got.double() - ref64).abs().max().item(), (own.double() - ref64).abs().max().item()


def _cached(model, x) -> torch.Tensor:
    cache = KVCache(model.cfg, x.shape[0], x.shape[1], x.device, model.embed_tokens.weight.dtype)
    out = [model(x[:, :PREFILL], cache=cache)[:, -1]]
    out += [model(x[:, t:t + 1], cache=cache)[:, -1] for t in range(PREFILL, x.shape[1])]
    return torch.stack(out, 1)


@pytest.mark.parametrize("pack", [True, False])
def test_prefill_and_steps_differ_from_the_full_forward_by_rounding_only(monkeypatch, pack):
    monkeypatch.setattr(decode, "PACK_MIN", 0)  # the tiny model's weights packed too (where oneDNN is built in)
    model = _model()
    assert fast_path_applies(model)
    x = torch.randint(0, V, (3, T))
    got = _decoded(model, x, pack=None if pack else False)
    err, own = _errors(model, x, got)
    assert 0 < own < 1e-4  # fp32 rounding of this model
    assert err <= 4 * own, (err, own)
    assert model.training is False and all(p.grad is None for p in model.parameters())


def test_a_shared_prompt_is_prefilled_once_with_the_same_result():
    model = _model()
    x = torch.randint(0, V, (1, T)).expand(4, T)
    each = _decoded(model, x, pack=None)
    shared = _decoded(model, x, pack=None, shared=True)
    err, own = _errors(model, x, shared)
    assert err <= 4 * own
    assert (shared - each).abs().max().item() <= 4 * own


def test_lora_projections_moe_blocks_and_dynamic_rope_take_the_fast_path():
    from model.lora import apply_lora
    dynamic = dict(rope_scaling={"type": "dynamic", "factor": 2.0}, max_seq_len=8)
    for kw in (dict(), dict(moe_num_experts=4, moe_top_k=2, moe_hidden_dim=32), dynamic):
        model = _model(**kw)
        if not kw:
            apply_lora(model, r=4, target_modules=("q_proj", "v_proj", "down_proj"))
            for name, p in model.named_parameters():
                if "lora_B" in name:  # nonzero adapters, so that the LoRA path shows in the logits
                    torch.nn.init.normal_(p, std=0.2)
        assert fast_path_applies(model)
        x = torch.randint(0, V, (2, T))
        err, own = _errors(model, x, _decoded(model, x, pack=None), cached=kw is dynamic)
        assert 0 < own < 1e-4 and err <= 4 * own, (kw, err, own)


@pytest.mark.parametrize("layers", [None, [0]], ids=["every-layer", "first-layer"])
def test_sliding_windows_take_the_fast_path(layers):
    """A window of 5 positions (Mistral's in every layer; Qwen2's / gpt-oss's in some): prefill and steps past the
    window mask the cache to it as the model's forward does (within its own fp32 error of a float64 forward), and
    the window is in the result (without it the logits move)."""
    model = _model(sliding_window=5, sliding_layers=layers)
    assert fast_path_applies(model)
    x = torch.randint(0, V, (2, T))
    got = _decoded(model, x, pack=None)
    err, own = _errors(model, x, got)
    assert 0 < own < 1e-4 and err <= 4 * own, (err, own)
    with torch.no_grad():
        unwindowed = _model()(x)[:, PREFILL - 1:]
    assert (unwindowed - got).abs().max() > 1e-3


GEMMA = dict(sandwich_norms=True, scale_embeddings=True, mlp_act="gelu_tanh", query_scale=12.0, attn_head_dim=16,
             sliding_window=5, sliding_layers=[0])
BLOCKS = {"gemma2": dict(GEMMA, attn_softcap=0.5, final_softcap=2.0),  # (caps that bind on these scores and logits)
          "gemma3": dict(GEMMA, qk_norm=True, rope_local_theta=100.0, rope_theta=1e4),
          "olmo3": dict(sandwich_norms=True, pre_norms=False, qk_norm=True, qk_norm_full=True, sliding_window=5,
                        sliding_layers=[0])}


@pytest.mark.parametrize("family", sorted(BLOCKS))
def test_gemma_and_olmo_blocks_take_the_fast_path(family):
    """Gemma 2's (soft-capped scores and logits), Gemma 3's (q / k norms, its sliding layer's own RoPE base) and OLMo
    3's blocks (output norms only, q / k norms over all the heads), norm weights away from 1 so that each norm shows:
    prefill and steps past the window within 4x the model's own fp32 error of a float64 forward."""
    model = _model(**BLOCKS[family])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    assert fast_path_applies(model)
    x = torch.randint(0, V, (2, T))
    err, own = _errors(model, x, _decoded(model, x, pack=None))
    assert 0 < own < 1e-4 and err <= 4 * own, (err, own)


MLA = dict(n_kv_heads=None, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)


@pytest.mark.parametrize("kw", [MLA, dict(MLA, q_lora_rank=24, moe_num_experts=4, moe_top_k=2, moe_hidden_dim=32),
                                dict(MLA, q_lora_rank=24, rope_scaling={"type": "yarn", "factor": 4.0,
                                                                        "original_max_position_embeddings": 4,
                                                                        "mscale": 1.0, "mscale_all_dim": 0.8}),
                                "lora"], ids=["q_proj", "q_lora-moe", "q_lora-yarn", "lora"])
def test_latent_attention_takes_the_fast_path(monkeypatch, kw):
    """Multi-head latent attention (model/mla.py): its first projections as one prepared matmul (packed too), RoPE in
    the decoder's pass, the latent cache's attention: logits within the model's own fp32 error of a float64 forward;
    LoRA adapters on its projections (kv_b_proj's folded into the absorbed weights)."""
    from model.lora import apply_lora
    if kw != "lora":  # (LoRA-wrapped projections are called as their modules: nothing to pack)
        monkeypatch.setattr(decode, "PACK_MIN", 0)
    model = _model(**(dict(MLA, q_lora_rank=24) if kw == "lora" else kw))
    if kw == "lora":
        apply_lora(model, r=4, target_modules=("q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.2)
    assert fast_path_applies(model)
    x = torch.randint(0, V, (3, T))
    err, own = _errors(model, x, _decoded(model, x, pack=None))
    assert 0 < own < 1e-4 and err <= 4 * own, (err, own)
    shared = _decoded(model, x[:1].expand(3, T), pack=None, shared=True)  # (the latent cache's rows copied)
    err, own = _errors(model, x[:1].expand(3, T), shared)
    assert err <= 4 * own, (err, own)


@pytest.mark.parametrize("kw", [{}, MLA], ids=["gqa", "mla"])
def test_several_tokens_over_a_filled_cache_use_the_masked_attention(kw):
    model = _model(**kw)
    x = torch.randint(0, V, (2, T))
    d = Decoder(model, 2, T, x.device, torch.float32)
    d.prefill(x[:, :4])
    with torch.inference_mode():
        got = d._forward(x[:, 4:9], d.cache)  # logits of position 8
    import copy
    with torch.no_grad():
        ref64 = copy.deepcopy(model).double()(x[:, :9])[:, -1]
        own = (model(x[:, :9])[:, -1].double() - ref64).abs().max().item()
    assert (got.double() - ref64).abs().max().item() <= 4 * own
    with pytest.raises(ValueError, match="KV cache overflow"):
        d.prefill(x)  # 9 cached + 14 > 14


def test_a_pruned_model_falls_back_to_its_own_forward():
    model = _model()
    part = Transformer.pruned(model, [0], embedding=True, head=False)
    assert not fast_path_applies(part) and fast_path_applies(model)


def test_the_sampler_draws_what_torch_multinomial_draws():
    for vocab in (5, 96, 4096):
        for seed in range(20):
            probs = (torch.randn(6, vocab, generator=torch.Generator().manual_seed(seed)) * 3).softmax(-1)
            g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            want = torch.multinomial(probs, 1, generator=g1)[:, 0]
            assert torch.equal(multinomial_one(probs, g2), want)
            assert torch.equal(g1.get_state(), g2.get_state())  # the generator consumed alike


def test_the_exponential_draws_are_torchs_with_the_rare_boundary_values_recomputed(monkeypatch):
    import model.generate as gen

    def draws(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = torch.empty(8, 4096).exponential_(1, generator=g1)
        got = gen.exponential(torch.empty(8, 4096), g2)
        assert torch.equal(g1.get_state(), g2.get_state())
        return got, want

    for seed in range(5):
        assert torch.equal(*draws(seed))
    # a vectorised log1p off by 2^-32 (relative) rounds ~1/256 of the values to the other float32: the values near a
    # boundary (here within 2^-30) must be the ones recomputed, and then every draw is torch's again
    real_log1p = torch.log1p
    monkeypatch.setattr(torch, "log1p", lambda x: real_log1p(x) * (1 + 2.0 ** -32))
    monkeypatch.setattr(gen, "_LOG1P_MARGIN", 2.0 ** -30)
    assert torch.equal(*draws(0))
    monkeypatch.setattr(gen, "_LOG1P_MARGIN", 0.0)  # nothing recomputed: the off values show
    got, want = draws(0)
    assert 0 < int((got != want).sum()) < 1000


def test_nan_logits_stop_a_rollout_with_one_line():
    from trainer.tasks.grpo_rollout import sample_group
    model = _model()
    with torch.no_grad():
        model.lm_head.weight[3, 0] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        sample_group(model, [1, 2, 3], 2, 4, temperature=1.0, top_p=1.0, stop_ids=[5], pad_id=0,
                     generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="not finite"):
        generate(model, torch.tensor([[1, 2, 3]]), 3)
