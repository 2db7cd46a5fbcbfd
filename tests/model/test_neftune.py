"""model/neftune.py (--neftune_noise_alpha): NEFTune's noise on the input embeddings of training forwards, as
transformers' neftune_post_forward_hook draws it (the trainer's runs: tests/trainer/test_neftune_runs.py)."""
from __future__ import annotations

import math

import torch

from model import ModelConfig, Transformer
from model.neftune import add_neftune, noise_bound


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=97, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=64))


def test_the_noise_is_uniform_within_the_bound_only_in_training():
    """The noise [B, L, d] of a training forward lies in [-a, a], a = alpha / sqrt(L d) (transformers' formula), and
    is uniform there: its mean |x| is a / 2 and its variance a^2 / 3, each within 6 standard errors of the 2 x 64 x 32
    draws; the generator's next draw is exactly it (no other draw in the hook); eval forwards and a removed hook add
    nothing."""
    model = _model()
    x = torch.randint(0, 97, (2, 64), generator=torch.Generator().manual_seed(1))
    clean = model.embed_tokens(x).detach()
    handle = add_neftune(model, 5.0)
    a = noise_bound(5.0, 64, 32)
    assert a == 5.0 / math.sqrt(64 * 32)
    torch.manual_seed(3)
    noisy = model.embed_tokens(x).detach()
    torch.manual_seed(3)
    noise = torch.empty_like(clean).uniform_(-a, a)
    assert torch.equal(noisy, clean + noise)
    n = noise.numel()
    assert float(noise.abs().max()) <= a and float(noise.abs().max()) > 0.9 * a
    assert abs(float(noise.abs().mean()) - a / 2) <= 6 * (a / math.sqrt(12)) / math.sqrt(n)
    assert abs(float(noise.pow(2).mean()) - a * a / 3) <= 6 * (a * a * math.sqrt(4 / 45)) / math.sqrt(n)
    assert not torch.equal(model.embed_tokens(x), model.embed_tokens(x))  # a new draw each forward
    model.eval()
    assert torch.equal(model.embed_tokens(x), clean)
    model.train()
    handle.remove()
    assert torch.equal(model.embed_tokens(x), clean)
