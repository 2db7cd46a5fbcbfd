"""The LM-head benches' plumbing at a tiny shape (bench/bench_token_logprobs.py, bench/bench_distill_head.py; and
bench/bench_moe_lora.py's, in process): both paths run in processes of their own and the table and ratios come out
(the figures themselves are docs/grpo.md's and docs/training.md's, measured at the benches' default shapes)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("bench, shape", [
    ("bench_token_logprobs.py", ["--rows", "2", "--seq", "16"]),
    ("bench_distill_head.py", ["--tokens", "24", "--loss", "jsd", "--teacher", "hidden"])])
def test_the_bench_prints_both_paths_and_their_ratios(bench, shape):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", bench), *shape, "--vocab", "300", "--dim", "16",
                        "--chunk", "8", "--iters", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (whole|chunked) \| [\d,]+ \| ([\d.]+) \|$",
                                                               r.stdout, re.M)}
    assert sorted(rows) == ["chunked", "whole"] and all(v > 0 for v in rows.values()), r.stdout
    assert re.search(r"chunked / whole: memory [\d.]+x, time [\d.]+x", r.stdout), r.stdout


def test_the_activation_checkpoint_bench_prints_the_policies_asked_against_none():
    """bench/bench_activation_checkpoint.py at a tiny shape, each policy in a process of its own (it shares
    bench/head_paths.py's): the rows asked for (two of the four: a process each), and the exact bytes kept ordered
    as the policies keep them (tests/model/test_checkpointing.py holds what each keeps)."""
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_activation_checkpoint.py"), "--dim", "32",
                        "--layers", "2", "--heads", "4", "--vocab", "64", "--batch", "2", "--seq", "32", "--iters", "1",
                        "--policies", "none,op"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    kept = {m.group(1): float(m.group(2)) for m in  # (the ratio to none's: the MiB round to 0 at this size)
            re.finditer(r"^\| (none|full|op|2) \| [\d,]+ \| ([\d.]+) \| [\d,]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$",
                        r.stdout, re.M)}
    assert sorted(kept) == ["none", "op"] and kept["none"] == 1.0 and 0 < kept["op"] < 1, r.stdout


def test_the_moe_lora_bench_checks_peft_and_prints_every_row(capsys):
    """bench/bench_moe_lora.py in process at a tiny shape (rank 4: fp32 rows of 16 bytes for the grouped matmul):
    PEFT's blocks give our block's output, the four rows come out, and ours on the grouped matmul keeps less for
    backward than PEFT's grouped row (which forms W + s B A); the figures are docs/model.md's."""
    pytest.importorskip("peft")
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_moe_lora", os.path.join(ROOT, "bench", "bench_moe_lora.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--dim", "32", "--experts", "4", "--top_k", "2", "--expert_width", "16", "--tokens", "64",
                "--rank", "4", "--rounds", "1"])
    out = capsys.readouterr().out
    diffs = [float(m.group(1)) / float(m.group(2)) for m in
             re.finditer(r"^check: peft \w+ output vs ours, max \|diff\| (\S+) \(scale (\S+)\)$", out, re.M)]
    assert len(diffs) == 2 and max(diffs) < 64 * 1.2e-7, out  # (fp32 on both sides: a few ulps of the scale)
    kept = {m.group(1): float(m.group(2)) for m in  # (the ratio to PEFT's grouped row: the MB round at this size)
            re.finditer(r"^(ours grouped_mm|ours fused_loop|peft eager|peft grouped_mm) +[\d.]+ +[\d.]+x +[\d.]+ +"
                        r"([\d.]+)x$", out, re.M)}
    assert len(kept) == 4 and kept["peft grouped_mm"] == 1.0 and kept["ours grouped_mm"] < 1, out
