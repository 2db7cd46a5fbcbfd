"""model/token_logprobs.py: per-token log-probabilities and entropies chunk by chunk, against the whole logits.

The truth is the whole-logits computation in float64; the chunked fp32 values and gradients may be at most 4x the
whole-logits fp32 error against it, plus 8 fp32 ulps of the value's scale. Under tensor parallelism the same
Function runs on a vocabulary shard (tests/trainer/test_grpo_runs.py's tp2_chunked case: the trainer at tp 2
against one process)."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer
from model.token_logprobs import token_logprobs, token_logprobs_ref
from trainer.tasks.grpo_rollout import token_logps

EPS = torch.finfo(torch.float32).eps


def _within(got: torch.Tensor, whole: torch.Tensor, truth: torch.Tensor, what: str) -> None:
    scale = truth.abs().max().item()
    err, ref_err = (got.double() - truth).abs().max().item(), (whole.double() - truth).abs().max().item()
    assert err <= 4 * ref_err + 8 * EPS * scale, (what, err, ref_err, scale)


def _values_and_grads(fn, h, w, y, g):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logp, ent = fn(h, w, y)
    (logp * g).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("temperature, chunk", [(1.0, 5), (0.7, 64), (1.3, 1)])
def test_chunked_equals_whole_logits_values_entropy_and_gradients(temperature, chunk):
    torch.manual_seed(0)
    h, w = torch.randn(3, 7, 16) * 2, torch.randn(50, 16)
    y = torch.randint(0, 50, (3, 7))
    g = torch.randn(3, 7)

    def whole(h_, w_, y_):
        return token_logprobs_ref(h_ @ w_.t(), y_, temperature)

    def whole64(h_, w_, y_):
        la = torch.log_softmax((h_ @ w_.t()) / temperature, dim=-1)
        return la.gather(-1, y_[..., None])[..., 0], -(la.exp() * la).sum(-1)

    got = _values_and_grads(lambda *a: token_logprobs(*a, temperature=temperature, chunk_size=chunk), h, w, y, g)
    ref = _values_and_grads(whole, h, w, y, g)
    truth = _values_and_grads(whole64, h.double(), w.double(), y, g.double())
    for name, a, b, t in zip(("logp", "entropy", "d hidden", "d weight"), got, ref, truth):
        _within(a, b, t, name)
    assert (got[0] <= 0).all() and (got[1] >= 0).all()


def test_entropy_takes_no_gradient_and_temperature_is_checked():
    h, w = torch.randn(4, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    logp, ent = token_logprobs(h, w, torch.arange(4), chunk_size=3)
    assert logp.requires_grad and not ent.requires_grad
    with pytest.raises(ValueError, match="temperature must be > 0"):
        token_logprobs(h, w, torch.arange(4), temperature=0.0)


def test_model_forward_logprobs_of_equals_the_whole_logits_path():
    """Transformer.forward(x, logprobs_of=next tokens, temperature): GRPO's log-probabilities and entropies, and the
    gradients they give every parameter, equal those from the model's whole logits (trainer/tasks/grpo.py's two
    paths, --chunked_logprobs true and false)."""
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16, multiple_of=16,
                      loss_chunk_size=7)
    torch.manual_seed(0)
    x = torch.randint(0, 97, (3, 12))
    nxt = torch.cat([x[:, 1:], x[:, :1]], dim=1)
    g = torch.randn(3, 11)
    out = []
    for dtype, chunked in ((torch.float32, True), (torch.float32, False), (torch.float64, False)):
        torch.manual_seed(1)
        m = Transformer(cfg).to(dtype)
        if chunked:
            logp, ent = m(x, logprobs_of=nxt, temperature=0.8)
            logp, ent = logp[:, :-1], ent[:, :-1]
        else:
            logp, ent = token_logps(m(x), x, 0.8, with_entropy=True)
            if dtype == torch.float64:  # token_logps computes in fp32: the truth redone in fp64
                la = torch.log_softmax(m(x)[:, :-1] / 0.8, dim=-1)
                logp, ent = la.gather(-1, x[:, 1:, None])[..., 0], -(la.exp() * la).sum(-1)
        (logp * g.to(dtype)).sum().backward()
        out.append((logp.detach(), ent.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (c, c_ent, c_grads), (w, w_ent, w_grads), (t, t_ent, t_grads) = out
    _within(c, w, t, "logp")
    _within(c_ent, w_ent, t_ent, "entropy")
    for n in t_grads:
        _within(c_grads[n], w_grads[n], t_grads[n], n)


def test_under_autocast_values_and_gradients_are_within_the_whole_logits_bf16_error():
    """Under CPU autocast (bf16) the chunked values and gradients are within 4x the whole-logits path's bf16 error
    against float64, fp32 values and gradients in the parameters' dtypes."""
    torch.manual_seed(0)
    h, w = torch.randn(2, 9, 32), torch.randn(70, 32) * 0.3
    y = torch.randint(0, 70, (2, 9))
    g = torch.randn(2, 9)

    def in_bf16(fn):
        def run(h_, w_, y_):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h_, w_, y_)
        return run

    got = _values_and_grads(in_bf16(lambda *a: token_logprobs(*a, temperature=0.9, chunk_size=4)), h, w, y, g)
    ref = _values_and_grads(in_bf16(lambda h_, w_, y_: token_logprobs_ref(h_ @ w_.t(), y_, 0.9)), h, w, y, g)
    truth = _values_and_grads(lambda h_, w_, y_: token_logprobs_ref(h_ @ w_.t(), y_, 0.9), h.double(), w.double(),
                              y, g.double())
    assert got[0].dtype == torch.float32 and got[2].dtype == h.dtype and got[3].dtype == w.dtype
    for name, a, b, t in zip(("logp", "entropy", "d hidden", "d weight"), got, ref, truth):
        _within(a, b, t, name)
