"""FLOPs formula and peak-FLOPs measurement / override."""
import torch

from model import ModelConfig, Transformer
from model import flops


def test_flops_per_token_formula():
    cfg = ModelConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64)
    m = Transformer(cfg)
    n_matmul = m.num_params() - m.embed_tokens.weight.numel()  # untied: embedding is a lookup
    assert flops.matmul_params(cfg) == n_matmul
    assert flops.flops_per_token(cfg, 16) == 6 * n_matmul + 12 * 2 * 32 * 16


def test_peak_flops_measured_cached_and_overridable(monkeypatch):
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    p = flops.measure_peak_flops("cpu", torch.float32, n=128, seconds=0.05)
    assert p > 1e8
    assert flops.measure_peak_flops("cpu", torch.float32) == p  # cached
    monkeypatch.setenv("PEAK_FLOPS", "1e12")
    assert flops.measure_peak_flops("cpu", torch.float32) == 1e12
    cfg = ModelConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    assert abs(flops.mfu(1000.0, cfg, 16) - 1000.0 * flops.flops_per_token(cfg, 16) / 1e12) < 1e-12
