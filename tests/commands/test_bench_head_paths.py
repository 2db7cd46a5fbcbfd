"""The LM-head benches' plumbing at a tiny shape (bench/bench_token_logprobs.py, bench/bench_distill_head.py): both
paths run in processes of their own and the table and ratios come out (the figures themselves are docs/grpo.md's and
docs/training.md's, measured at the benches' default shapes)."""
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
