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


def test_mtp_depths_count_as_blocks_with_a_pass_of_the_lm_head_each():
    """Each multi-token prediction depth adds its own parameters (norms, projection, block; counted from the built
    model) and one more pass of the shared LM head, and its block's attention term."""
    cfg = ModelConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64, mtp_num_layers=2)
    plain = ModelConfig(**{**cfg.to_dict(), "mtp_num_layers": 0})
    depths = sum(p.numel() for n, p in Transformer(cfg).named_parameters() if n.startswith("mtp."))
    assert flops.matmul_params(cfg) == flops.matmul_params(plain) + depths + 2 * 100 * 32
    assert flops.flops_per_token(cfg, 16) == 6 * flops.matmul_params(cfg) + 12 * (2 + 2) * 32 * 16


def test_causal_half_counts_the_keys_a_causal_query_sees():
    """causal_half: the attention term is what a causal kernel computes: query t scores t + 1 keys and sums t + 1
    values (2 matmuls x 2 FLOPs x dim each), forward + backward = 3x, per layer; averaged over the T positions it
    is 6 * L * d * (T + 1), which the formula writes as 6 * L * d * T (within 1/T)."""
    cfg = ModelConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    T = 64
    exact = 3 * cfg.n_layers * sum(2 * 2 * cfg.dim * (t + 1) for t in range(T)) / T
    attn = flops.flops_per_token(cfg, T, causal_half=True) - 6 * flops.matmul_params(cfg)
    assert abs(attn - exact) / exact <= 1 / T
    full = flops.flops_per_token(cfg, T) - 6 * flops.matmul_params(cfg)
    assert abs(full - 2 * exact) / (2 * exact) <= 1 / T  # the default (PaLM / nanoGPT) counts every key


def test_moe_flops_count_active_parameters():
    """Of an MoE model: every parameter but the embedding and the routed experts not chosen (E - top_k of E)."""
    cfg = ModelConfig(vocab_size=100, dim=32, n_layers=3, n_heads=4, hidden_dim=64, moe_num_experts=8, moe_top_k=2,
                      moe_shared_experts=1, moe_hidden_dim=16, moe_first_dense_layers=1)
    m = Transformer(cfg)
    experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    active = m.num_params() - m.embed_tokens.weight.numel() - experts + experts * 2 // 8
    assert flops.matmul_params(cfg) == active
    assert flops.flops_per_token(cfg, 16) == 6 * active + 12 * 3 * 32 * 16
    from utils.model_bounds import param_count
    from utils.moe_flags import moe_param_delta  # the memory check's count of every parameter
    assert param_count(32, 3, 4, 100, hidden_dim=64) + moe_param_delta(cfg) == m.num_params()


def test_peak_flops_measured_cached_and_overridable(monkeypatch):
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    p = flops.measure_peak_flops("cpu", torch.float32, n=128, seconds=0.05)
    assert p > 1e8
    assert flops.measure_peak_flops("cpu", torch.float32) == p  # cached
    monkeypatch.setenv("PEAK_FLOPS", "1e12")
    assert flops.measure_peak_flops("cpu", torch.float32) == 1e12
    cfg = ModelConfig(vocab_size=100, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
    assert abs(flops.mfu(1000.0, cfg, 16) - 1000.0 * flops.flops_per_token(cfg, 16) / 1e12) < 1e-12


def test_peak_table_by_device_name_and_dtype():
    assert flops.table_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert flops.table_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert flops.table_peak_flops("NVIDIA H100 NVL", torch.float16) == 835e12
    assert flops.table_peak_flops("NVIDIA A100-SXM4-80GB", torch.bfloat16) == 312e12
    assert flops.table_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert flops.table_peak_flops("NVIDIA A10G", torch.bfloat16) == 70e12  # not A10's figure
    assert flops.table_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_peak_resolution_order_and_cpu_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    monkeypatch.setenv("MYLLM_CACHE_DIR", str(tmp_path / "machine"))
    p = flops.resolve_peak_flops("cpu", torch.float32, override=5e11)
    assert (p.flops, p.source, p.is_estimate) == (5e11, "flag", False)
    monkeypatch.setenv("PEAK_FLOPS", "2e11")
    assert flops.resolve_peak_flops("cpu", torch.float32).source == "env"
    monkeypatch.delenv("PEAK_FLOPS")
    # A measured CPU peak is cached in the run directory: a resumed run reuses the same number.
    monkeypatch.setattr(flops, "measure_peak_flops", lambda *a, **k: 3.5e10)
    m = flops.resolve_peak_flops("cpu", torch.float32, cache_dir=str(tmp_path))
    assert (m.flops, m.source, m.is_estimate) == (3.5e10, "measured", True)
    monkeypatch.setattr(flops, "measure_peak_flops", lambda *a, **k: 9.9e10)
    again = flops.resolve_peak_flops("cpu", torch.float32, cache_dir=str(tmp_path))
    assert again.flops == 3.5e10 and "cached" in again.detail
    (tmp_path / "peak_flops.json").write_text("{torn")  # a damaged cache is re-measured
    assert flops.resolve_peak_flops("cpu", torch.float32, cache_dir=str(tmp_path)).flops == 9.9e10


def test_mfu_is_clamped_only_for_an_estimated_peak():
    measured = flops.PeakFlops(1e10, "measured", "cpu")
    assert flops.mfu_from(4e10, measured) == 1.0          # 400% on a measured CPU peak -> 100%
    assert flops.mfu_from(5e9, measured) == 0.5
    table = flops.PeakFlops(1e10, "table", "x")
    assert flops.mfu_from(4e10, table) == 4.0             # a table peak is exact: never hidden
    assert "estimate" in measured.describe() and "estimate" not in table.describe()


def test_measured_peak_is_best_of_rounds(monkeypatch):
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    flops._PEAK_CACHE.clear()
    p = flops.measure_peak_flops("cpu", torch.float32, n=64, seconds=0.05, rounds=3)
    assert p > 0 and flops._PEAK_CACHE[("cpu", torch.float32)] == p


def test_low_precision_warning_only_where_the_cpu_emulates_it(monkeypatch):
    import utils.device as ud
    monkeypatch.setattr(ud, "cpu_has_native_low_precision", lambda dtype: False)
    msg = ud.low_precision_cpu_warning("cpu", torch.bfloat16)
    assert msg is not None and "bf16" in msg and "--dtype=fp32" in msg
    assert ud.low_precision_cpu_warning("cpu", torch.float32) is None  # fp32 is always native
    monkeypatch.setattr(ud, "is_accelerator", lambda device: True)
    assert ud.low_precision_cpu_warning("cuda", torch.bfloat16) is None  # GPUs: no warning
    monkeypatch.undo()
    monkeypatch.setattr(ud, "cpu_has_native_low_precision", lambda dtype: True)
    assert ud.low_precision_cpu_warning("cpu", torch.float16) is None


def test_cpu_peak_is_the_best_seen_on_the_machine_so_load_cannot_halve_it(monkeypatch, tmp_path):
    """Runs started on a busy machine measure less; they divide by the best rate this CPU has shown."""
    monkeypatch.delenv("PEAK_FLOPS", raising=False)
    monkeypatch.setenv("MYLLM_CACHE_DIR", str(tmp_path / "machine"))
    seq = iter([1.2e10, 2.1e9, 4.0e9, 1.5e10])
    monkeypatch.setattr(flops, "measure_peak_flops", lambda *a, **k: next(seq))
    got = [flops.resolve_peak_flops("cpu", torch.float32, cache_dir=str(tmp_path / f"run{i}")) for i in range(4)]
    assert [p.flops for p in got] == [1.2e10, 1.2e10, 1.2e10, 1.5e10]
    assert "this start 2.1 GFLOP/s, best seen on this machine 12" in got[1].detail
    # each run keeps the figure it started with (a resume continues the same MFU curve)
    assert flops.resolve_peak_flops("cpu", torch.float32, cache_dir=str(tmp_path / "run1")).flops == 1.2e10
    # another dtype or thread count is another entry
    seq2 = iter([3.0e9])
    monkeypatch.setattr(flops, "measure_peak_flops", lambda *a, **k: next(seq2))
    assert flops.resolve_peak_flops("cpu", torch.bfloat16).flops == 3.0e9


def test_the_help_and_the_readme_say_where_the_measured_peak_is_kept(monkeypatch, tmp_path):
    """--help, the README and the code name one place for the CPU peak cache."""
    import dataclasses
    import os

    from model.flops import machine_cache_path
    from trainer.config import TrainConfig
    monkeypatch.delenv("MYLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert machine_cache_path() == os.path.join(str(tmp_path), ".cache", "myllm", "peak_flops.json")
    monkeypatch.setenv("MYLLM_CACHE_DIR", str(tmp_path / "c"))
    assert machine_cache_path() == str(tmp_path / "c" / "peak_flops.json")
    help_text = next(f for f in dataclasses.fields(TrainConfig) if f.name == "peak_flops").metadata.get("help", "")
    assert "peak_flops.json under $MYLLM_CACHE_DIR or ~/.cache/myllm" in help_text, help_text
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md"), encoding="utf-8").read()
    assert "~/.cache/myllm/peak_flops.json" in readme and "$MYLLM_CACHE_DIR" in readme
