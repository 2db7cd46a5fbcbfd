"""Generation: KV-cache result equals the no-cache result (greedy and sampled), stop tokens, sampling filters."""
import pytest
import torch

from model import ModelConfig, Transformer
from model.generate import generate, sample_next, truncate


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                      hidden_dim=96, initializer_range=0.2)  # wide init: peaked, varied predictions
    return Transformer(cfg)


def test_greedy_cache_equals_no_cache(model):
    x = torch.randint(0, 128, (3, 5))
    a = generate(model, x, 12, temperature=0.0, use_cache=True)
    b = generate(model, x, 12, temperature=0.0, use_cache=False)
    assert a.shape == (3, 17) and torch.equal(a, b) and torch.equal(a[:, :5], x)
    assert model.training  # mode restored


def test_sampled_cache_equals_no_cache_under_seed(model):
    x = torch.randint(0, 128, (2, 4))
    outs = []
    for use_cache in (True, False):
        gen = torch.Generator().manual_seed(123)
        outs.append(generate(model, x, 10, temperature=0.8, top_k=20, top_p=0.9, use_cache=use_cache, generator=gen))
    assert torch.equal(outs[0], outs[1])
    gen = torch.Generator().manual_seed(124)
    other = generate(model, x, 10, temperature=1.5, generator=gen)
    assert not torch.equal(other, outs[0])


def test_stop_tokens(model):
    x = torch.randint(0, 128, (2, 4))
    free = generate(model, x, 8, temperature=0.0)
    stop = int(free[0, 6])  # the 3rd generated token of row 0
    out = generate(model, x, 8, temperature=0.0, stop_ids=[stop])
    first = (out[0, 4:] == stop).nonzero()[0, 0].item()
    assert (out[0, 4 + first:] == stop).all()
    assert torch.equal(out[0, :4 + first + 1], free[0, :4 + first + 1])
    # all rows stopping at once ends generation early
    both = generate(model, x, 8, temperature=0.0, stop_ids=free[:, 4].tolist())
    assert both.shape[1] == 5


def test_sample_next_filters():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0, -1.0]])
    assert sample_next(logits, temperature=0).item() == 0
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, top_k=2, generator=g).item() for _ in range(200)}
    assert draws <= {0, 1} and len(draws) == 2
    # top_p: token 0 alone holds ~0.71 of the mass, so top_p=0.5 keeps only it
    draws = {sample_next(logits, 1.0, top_p=0.5, generator=g).item() for _ in range(50)}
    assert draws == {0}


def test_kv_cache_chunked_prefill_matches_full_forward(model):
    from model import KVCache
    model.eval()
    x = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        full = model(x)
        cache = KVCache(model.cfg, 2, 16, x.device, torch.float32)
        a = model(x[:, :4], cache=cache)       # prefill
        b = model(x[:, 4:9], cache=cache)      # several new tokens against a non-empty cache (mask path)
        c = model(x[:, 9:10], cache=cache)     # single token (no mask)
        d = model(x[:, 10:], cache=cache, logits_to_keep=1)
    model.train()
    got = torch.cat((a, b, c, d), dim=1)
    assert cache.pos == 11 and torch.allclose(got, full, atol=1e-5)


@pytest.mark.parametrize("top_k, top_p, min_p", [(None, None, 0.1), (None, None, 0.6), (20, 0.9, 0.05),
                                                  (5, None, 0.3), (None, 0.8, 0.2)])
def test_min_p_and_its_order_after_top_k_and_top_p_are_transformers_warpers(top_k, top_p, min_p):
    """`truncate` keeps exactly the tokens transformers' TopK -> TopP -> MinP warpers keep (its sampling order), on
    random scaled logits; the most probable token always stays."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 64, generator=g) * 3
    theirs = logits.clone()
    for warp in ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p else []) + [
            MinPLogitsWarper(min_p)]:
        theirs = warp(None, theirs)
    ours = truncate(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.equal(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])
    assert not torch.isinf(ours.gather(1, logits.argmax(dim=1, keepdim=True))).any()
    kept = (~torch.isinf(ours)).sum(dim=1)
    assert (kept > 1).any() and (kept < 64).all()  # (a cut that does something, on some row)


def test_min_p_sampling_draws_only_kept_tokens(model):
    x = torch.randint(0, 128, (3, 4), generator=torch.Generator().manual_seed(0))  # (not the global generator's)
    g = torch.Generator().manual_seed(5)
    out = generate(model, x, 6, temperature=1.0, min_p=0.999, generator=g)  # only the most probable: greedy
    assert torch.equal(out, generate(model, x, 6, temperature=0.0))
    g = torch.Generator().manual_seed(5)
    loose = generate(model, x, 6, temperature=1.0, min_p=0.01, generator=g)
    assert not torch.equal(loose, out)  # (the model's predictions are varied: a loose cut samples others)


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_transformers_processor(penalty):
    """`penalize_repeats` changes exactly the logits transformers' RepetitionPenaltyLogitsProcessor changes, by the
    same rule (divide a positive logit, multiply a negative one), a token seen twice penalised once."""
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from model.generate import penalize_repeats
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, generator=g) * 3
    seen = torch.tensor([[1, 2, 2, 9, 30], [0, 0, 0, 0, 0], [39, 5, 17, 5, 1]])
    want = RepetitionPenaltyLogitsProcessor(penalty)(seen, logits.clone())
    got = penalize_repeats(logits, seen, penalty)
    assert torch.equal(got, want)
    assert int((got != logits).sum()) == sum(len(set(r)) for r in seen.tolist())  # only the seen tokens moved


def test_greedy_with_a_repetition_penalty_is_transformers_generate(model, tmp_path):
    """Our greedy decoding with the penalty over the prompt and the output so far picks transformers' tokens
    (LlamaForCausalLM.generate(repetition_penalty=...) on the exported weights), with and without the KV cache;
    the penalty changes the output (this model repeats tokens without it)."""
    from transformers import LlamaForCausalLM

    from model.hf_interop import export_hf
    export_hf(model, str(tmp_path / "hf"))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    x = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(7))
    x = generate(model, x, 2, temperature=0.0)  # a prompt ending in its own greedy tokens: the prompt is penalised
    plain = generate(model, x, 16, temperature=0.0)
    ours = generate(model, x, 16, temperature=0.0, repetition_penalty=1.8)
    assert torch.equal(ours, generate(model, x, 16, temperature=0.0, repetition_penalty=1.8, use_cache=False))
    with torch.no_grad():
        theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=16, do_sample=False,
                             repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, theirs)
    assert not torch.equal(plain, ours)
    assert not torch.equal(plain[:, 8], ours[:, 8])  # the first new token already: a prompt token is penalised
    distinct = [[len(set(r)) for r in out[:, 8:].tolist()] for out in (plain, ours)]  # fewer repeats
    assert all(a <= b for a, b in zip(*distinct)) and sum(distinct[0]) < sum(distinct[1]), distinct
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        generate(model, x, 2, repetition_penalty=0.0)


def test_left_padded_prompts_decode_as_each_alone_and_as_transformers(model, tmp_path):
    """Prompts of different lengths, left-padded with their attention mask (transformers' convention): each row's
    greedy tokens are those of its prompt alone, with and without the KV cache, with the repetition penalty too (which
    does not see the pads), and those of LlamaForCausalLM.generate on the same padded batch; the pads come back as
    given; a mask that is not left padding is refused."""
    from transformers import LlamaForCausalLM

    from model.hf_interop import export_hf
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (3, 7, 5)]
    T = max(map(len, prompts))
    x = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    for penalty in (1.0, 1.8):
        for cache in (True, False):
            out = generate(model, x, 12, temperature=0.0, attention_mask=mask, use_cache=cache,
                           repetition_penalty=penalty)
            assert torch.equal(out[:, :T], x)
            for row, p in zip(out, prompts):
                alone = generate(model, torch.tensor([p]), 12, temperature=0.0, repetition_penalty=penalty)
                assert row[T:].tolist() == alone[0, len(p):].tolist(), (penalty, cache)
        if penalty == 1.0:
            export_hf(model, str(tmp_path / "hf"))
            hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
            with torch.no_grad():
                theirs = hf.generate(x, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)
            assert torch.equal(out, theirs)
    right = torch.tensor([[1] * len(p) + [0] * (T - len(p)) for p in prompts])
    with pytest.raises(ValueError, match="attention_mask must be left padding"):
        generate(model, x, 2, attention_mask=right)
