"""bench/bench_grpo_generate.py's plumbing at a tiny shape, in this process: both generators run, the tokens/s and
ratio come out, and greedy decoding gives HF's tokens for a Llama, with --mla for a DeepSeek-V3 (our latent cache
with kv_b_proj absorbed against transformers' expanded keys and values) and with --gemma=2 for a Gemma 2 (its caps);
with --prompts=3 (prompts of different lengths) the three rates, and greedy tokens decoded together equal HF's on the
same rows left-padded.
The figures themselves are docs/grpo.md's."""
import os
import re
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("flag,family", [("", "LlamaForCausalLM"), ("--mla", "DeepseekV3ForCausalLM"),
                                         ("--gemma=2", "Gemma2ForCausalLM")], ids=["llama", "mla", "gemma2"])
def test_the_bench_prints_both_rates_and_greedy_tokens_equal_hfs(flag, family, capsys):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import bench_grpo_generate
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    args = ["--dim=64", "--n_layers=2", "--vocab=256", "--group=2", "--prompt_len=6", "--new_tokens=6",
            "--repeats=1"] + ([flag] if flag else [])
    assert bench_grpo_generate.main(args) == 0
    out = capsys.readouterr().out
    assert family in out, out
    assert re.search(r"ours \(KV cache, logprobs recorded\): [\d,]+ tokens/s; HF generate: [\d,]+ tokens/s; "
                     r"ratio [\d.]+x", out), out
    assert "tokens equal to HF greedy: True" in out, out


@pytest.mark.parametrize("flag", ["", "--gemma=3"], ids=["llama", "gemma3"])
def test_prompts_decoded_together_print_three_rates_and_equal_hfs_left_padded_greedy_tokens(flag, capsys):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import bench_grpo_generate
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    args = ["--dim=64", "--n_layers=2", "--vocab=256", "--group=2", "--prompt_len=8", "--new_tokens=6",
            "--repeats=1", "--prompts=3"] + ([flag] if flag else [])
    assert bench_grpo_generate.main(args) == 0
    out = capsys.readouterr().out
    assert "3 prompts of 4-8 tokens x group 2" in out, out
    assert re.search(r"ours, one group at a time: [\d,]+ tokens/s \(1\.00x\); ours, together: [\d,]+ tokens/s "
                     r"\([\d.]+x\); HF generate: [\d,]+ tokens/s", out), out
    assert "equal to HF greedy on the left-padded rows: True" in out, out
