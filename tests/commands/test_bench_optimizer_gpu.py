"""bench/bench_optimizer_gpu.py's plumbing on the CPU (its Triton rows in the interpreter): every row is there,
each with the bytes a parameter its kernel must move, and our norm kernel's result agrees with a float64 sum. What it measures on a GPU is not tested here (ratios are printed, never asserted)."""
import importlib.util
import os
import re

import pytest
import torch

from optimizer.flat_adamw import SUMSQ_ROWS, triton_runs_on
from tests.conftest import ROOT


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
def test_the_optimizer_bench_runs_every_row_on_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the bench sets it on import; restored after
    spec = importlib.util.spec_from_file_location("bench_optimizer_gpu_under_test",
                                                  os.path.join(ROOT, "bench", "bench_optimizer_gpu.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.main(["--device", "cpu", "--configs", "tiny", "--iters", "1", "--warmup", "0",
                       "--json-out", str(tmp_path / "o.json")])
    got = [(r["kernel"], r["impl"], r["bytes_per_param"]) for r in rows]
    scalar = " (unaligned)"
    assert got == [("grad norm", "torch _foreach_norm", 2.0),
                   ("grad norm", f"ours, {SUMSQ_ROWS} rows a program", 2.0),
                   ("grad norm", f"ours, {SUMSQ_ROWS} rows a program, scalar accesses" + scalar, 2.0),
                   ("AdamW", "torch foreach (CPU)", 28.0),
                   ("AdamW", "ours, one launch, fp32 moments", 28.0),
                   ("AdamW", "ours, one launch, fp32 moments, scalar accesses" + scalar, 28.0),
                   ("AdamW", "ours, one launch, bf16 moments", 20.0)]
    assert all(r["ms"] > 0 and r["params"] == rows[0]["params"] > 100_000 for r in rows)
    # the squared norm in fp32, in another order than the float64 sum; the model's gradients aligned (vectors)
    assert float(re.search(r"squared norm (\S+) from the float64 sum", rows[1]["note"]).group(1)) < 1e-5, rows[1]
    assert "NOT aligned" not in rows[1]["note"]
    # each of ours over torch's (5), and the two vector rows over their scalar twins
    table = bench.ratios(rows)
    assert len(table) == 7 and sum("scalar accesses" in t for t in table) == 4 and (tmp_path / "o.json").exists()
