"""bench/bench_token_logprobs.py's plumbing at a tiny shape: both paths run in processes of their own and the table
and ratios come out (the figures themselves are docs/grpo.md's, measured at the bench's default shapes)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_bench_prints_both_paths_and_their_ratios():
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_token_logprobs.py"), "--rows", "2",
                        "--seq", "16", "--vocab", "300", "--dim", "16", "--chunk", "8", "--iters", "1"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (whole|chunked) \| [\d,]+ \| ([\d.]+) \|$",
                                                               r.stdout, re.M)}
    assert sorted(rows) == ["chunked", "whole"] and all(v > 0 for v in rows.values()), r.stdout
    assert re.search(r"chunked / whole: memory [\d.]+x, time [\d.]+x", r.stdout), r.stdout
