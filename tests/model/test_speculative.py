"""Speculative decoding with the first multi-token prediction depth (model/speculative.py): greedy output equal to
plain greedy decoding through accepted and rejected drafts (stops and odd budgets included), every draft equal to
the depth's own forward over the whole sequence (its KV cache holds the verified positions only), and sampling
drawing plain sampling's distribution (the speculative rule against the model's exact joint probabilities)."""
from __future__ import annotations

import copy

import pytest
import torch

from model import ModelConfig, Transformer
from model.generate import generate
from model.speculative import MTPDraft, generate_mtp, why_not

V = 48


def _model(moe: bool = False, **kw) -> Transformer:
    base = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=64,
                mtp_num_layers=1)
    if moe:
        base.update(moe_num_experts=4, moe_top_k=2, moe_first_dense_layers=1)
    if moe == "mla":  # DeepSeek-V3's shape: latent attention over the MoE (the depth's cache is a latent one)
        base.update(n_kv_heads=None, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8)
    if moe == "gpt_oss":  # gpt-oss's block: sinks, biases, a sliding first layer, biased experts (model/hf_gpt_oss.py)
        base.update(moe_first_dense_layers=0, attn_sinks=True, qkv_bias=True, o_bias=True, sliding_window=6,
                    sliding_layers=[0], moe_router_bias=True, moe_expert_biases=True, moe_act="gpt_oss")
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**{**base, **kw})).eval()
    if moe == "gpt_oss":  # (sinks and biases away from their zero initialisation)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith(("sinks", "bias")):
                    p.normal_(0.0, 0.5)
    return m


def _depth_logits(m: Transformer, seq: torch.Tensor) -> torch.Tensor:
    """[B, L - 1, V]: at i the first depth's logits of token i + 2 (the model's normed hidden state at i and token
    i + 1), the model's own modules over the whole sequence (model/mtp.py's formula)."""
    got = {}
    hook = m.norm.register_forward_pre_hook(lambda mod, args: got.__setitem__("h", args[0]))
    with torch.no_grad():
        m(seq)
        hook.remove()
        d = m.mtp.depths[0]
        x = d.eh_proj(torch.cat([d.enorm(m.embed_tokens(seq[:, 1:])), d.hnorm(m.norm(got["h"][:, :-1]))], dim=-1))
        B, T = x.shape[:2]
        positions = torch.arange(T)[None].expand(B, T)
        cos, sin = m.rotary(positions)
        return m.lm_head(d.norm(d.block(x, cos, sin, m._attn_spec(B, T, positions, None, False, None), None)))


def _min_margin(m: Transformer, out: torch.Tensor, T: int, penalty: float = 1.0) -> float:
    """The smallest gap between the best and second-best logit (penalized over the ids before it) where greedy
    decoding chose a token."""
    from model.generate import penalize_repeats
    with torch.no_grad():
        logits = m(out[:, :-1])[:, T - 1:]
        if penalty != 1.0:
            logits = torch.stack([penalize_repeats(logits[:, i], out[:, :T + i], penalty)
                                  for i in range(logits.shape[1])], dim=1)
        top2 = logits.topk(2, dim=-1).values
    return float((top2[..., 0] - top2[..., 1]).min())


@pytest.mark.parametrize("moe, penalty", [(False, 1.0), (True, 1.0), ("mla", 1.0), ("gpt_oss", 1.0), (False, 1.3)],
                         ids=["dense", "moe", "mla-moe", "gpt-oss", "dense-repetition-penalty"])
def test_greedy_equals_plain_greedy_and_drafts_equal_the_depths_forward(moe, penalty, monkeypatch):
    """Drafts made right on every other call (the greedy token after next added to their logits) so that both
    paths run: greedy output equals plain greedy decoding's (with the repetition penalty too: each position's logits
    penalized over the ids before it, as plain decoding does), drafts stand exactly where they were made right, and
    every draft the decoder computed equals the depth's forward over the final sequence (in float64) within 8x the
    model's own fp32 error: after a rejected draft the depth's cache must not hold it."""
    m = _model(moe)
    x = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(1))
    n = 17
    ref = generate(m, x, n, temperature=0, repetition_penalty=penalty)
    if penalty != 1.0:  # the penalty changes what greedy decoding emits here
        assert not torch.equal(ref, generate(m, x, n, temperature=0))
    assert _min_margin(m, ref, x.shape[1], penalty) > 1e-4  # no argmax tie within rounding on this path
    seen, made_right = [], []
    extend = MTPDraft.extend

    def spy(self, h, next_tokens):
        logits = extend(self, h, next_tokens)
        j = self.cache.pos - 1  # the draft is of token j + 2
        seen.append((j, logits.clone()))
        if len(seen) % 2 == 0 and j + 2 < ref.shape[1]:
            made_right.append(j)
            return logits.scatter_add(1, ref[:, j + 2, None], torch.full((3, 1), 1e3))
        return logits

    monkeypatch.setattr(MTPDraft, "extend", spy)
    out, stats = generate_mtp(m, x, n, temperature=0, pack=False, repetition_penalty=penalty)
    assert torch.equal(out, ref)
    assert 0 < stats.accepted < stats.steps and stats.accepted == len(made_right)
    assert stats.forwards == 1 + stats.steps + (n - 1 - stats.steps - stats.accepted)
    assert stats.new_tokens == n

    m64 = copy.deepcopy(m).double()
    want = _depth_logits(m64, out)
    with torch.no_grad():
        err = (m(out).double() - m64(out)).abs().max().item()
    for j, logits in seen:
        assert (logits.double() - want[:, j]).abs().max().item() <= 8 * err + 1e-12, j


@pytest.mark.parametrize("n", [1, 2, 6, 7])
def test_stops_and_budget_follow_plain_decoding(n, monkeypatch):
    """Every draft made right (two tokens per forward): odd and even budgets end exactly at n tokens, a row that
    emits a stop id repeats it, and the batch stops when every row has stopped, as plain decoding does."""
    m = _model()
    x = torch.randint(0, V, (2, 4), generator=torch.Generator().manual_seed(2))
    free = generate(m, x, 8, temperature=0)
    stops = [int(free[0, 6]), int(free[1, 7])]  # row 0 stops at its 3rd new token, row 1 at its 4th (or sooner)
    ref = generate(m, x, n, temperature=0, stop_ids=stops)
    extend = MTPDraft.extend

    def right(self, h, next_tokens):
        logits = extend(self, h, next_tokens)
        j = self.cache.pos - 1
        return logits.scatter_add(1, free[:, j + 2, None], torch.full((2, 1), 1e3)) if j + 2 < 12 else logits

    monkeypatch.setattr(MTPDraft, "extend", right)
    out, stats = generate_mtp(m, x, n, temperature=0, stop_ids=stops)
    assert torch.equal(out, ref), (out, ref)
    assert stats.accepted == stats.steps


@pytest.mark.parametrize("penalty", [1.0, 2.0], ids=["plain", "repetition-penalty"])
def test_sampling_draws_the_models_distribution(penalty):
    """20,000 rows, temperature 0.9 and top-k 5 over a 6-token vocabulary: the second new token passes the
    speculative rule (an untrained depth drafts from a distribution far from the model's), and the frequencies of
    the first two new tokens match the model's joint probabilities, p(a) p(b | a) from full forwards (each with the
    repetition penalty over the ids before it), within 5 standard deviations per cell. Accepting every draft (the
    rule left out) puts the second token at the draft's distribution and fails this."""
    from model.generate import penalize_repeats, truncate
    m = _model(vocab_size=6, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, hidden_dim=32, initializer_range=0.5)
    N, temp, k = 20000, 0.9, 5
    prompt = torch.tensor([[1, 2, 3]])
    out, stats = generate_mtp(m, prompt.expand(N, 3), 3, temperature=temp, top_k=k,
                              generator=torch.Generator().manual_seed(0), repetition_penalty=penalty)
    assert stats.steps == 1 and 0.05 < stats.row_accepted / stats.row_drafts < 0.95  # the rule decides
    with torch.no_grad():
        def dist(seqs):  # the next token's sampling distribution after each of `seqs`
            return truncate(penalize_repeats(m(seqs)[:, -1], seqs, penalty) / temp, k).softmax(-1)
        pa = dist(prompt)[0]                                                                   # [6]
        pb = dist(torch.cat([prompt.expand(6, 3), torch.arange(6)[:, None]], dim=1))            # [6, 6]
    joint = (pa[:, None] * pb).double()
    counts = torch.zeros(6, 6, dtype=torch.float64)
    counts.index_put_((out[:, 3], out[:, 4]), torch.ones(N, dtype=torch.float64), accumulate=True)
    freq = counts / N
    sd = (joint * (1 - joint) / N).sqrt()
    assert ((freq - joint).abs() <= 5 * sd + 1e-12).all(), (freq, joint)
    assert counts[joint == 0].sum() == 0  # top-k respected


def test_where_it_cannot_run():
    assert "no multi-token prediction depth" in why_not(_model(mtp_num_layers=0))
    with pytest.raises(ValueError, match="speculative decoding: the model has no multi-token"):
        generate_mtp(_model(mtp_num_layers=0), torch.zeros(1, 2, dtype=torch.long), 3)
    m = _model()
    m.train()
    out, _ = generate_mtp(m, torch.zeros(1, 2, dtype=torch.long), 3, temperature=0)
    assert m.training and out.shape == (1, 5)  # the mode restored
