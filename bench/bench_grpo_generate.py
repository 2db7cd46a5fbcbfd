"""Benchmark GRPO's rollout generator (trainer/tasks/grpo_rollout.py `sample_group`: one prompt's G completions,
KV cache, temperature / top-p sampling, every sampled token's log-probability recorded) against Hugging Face
`LlamaForCausalLM.generate(do_sample=True)` on the same weights (model/hf_interop.py), the same prompt and batch,
side by side in one run.

Owns: a Transformer with random weights of the given shape, its HF copy, and the timing. Both sides get the same
sampling (temperature 1, no top-k, top-p 1), the same stop id (HF's config's eos id: ours as stop_ids, HF's as its
eos_token_id) and the same --new_tokens limit; HF runs as it runs by default on the CPU (SDPA attention, its dynamic
KV cache: its static cache and eager attention measured no faster here). Tokens/s counts the positions each side
decoded (steps x rows: a finished row is decoded on by both, masked). After one warm-up each, the two run
interleaved --repeats times (a shared machine's load weighs on both alike); it prints the median tokens/s of each,
the median and the range of the per-pair ratios, the load average before and after, and whether greedy decoding
(temperature 0 on both) gives the same tokens.
Must never: assert anything (it prints), download anything, or write files.

--mla: both models with DeepSeek's multi-head latent attention (model/mla.py; HF's DeepseekV3ForCausalLM, every block
dense): ours decodes over the latent cache with kv_b_proj absorbed, HF's caches the latent and expands it each step.
--gpt_oss: both models gpt-oss-shaped (model/hf_gpt_oss.py; HF's GptOssForCausalLM as it runs by default): attention
sinks, q/k/v/o biases, every other layer sliding over 32 positions (the rollout passes it), 4 query heads per key/value
head, every block an MoE of 8 experts (top 2) with biases and the clamped SwiGLU.
--gemma=2 | 3: both models Gemma-shaped (HF's Gemma2ForCausalLM with its eager attention, transformers' only one with
soft-capping; Gemma3ForCausalLM with SDPA): the scaled embedding, the sublayers' output norms, GeGLU, 2 query heads per
key/value head; Gemma 2 every other layer sliding over 32 positions with its caps (50 on the scores, 30 on the logits),
Gemma 3 all but the last layer sliding at their own RoPE base, q / k norms.

    .venv/bin/python bench/bench_grpo_generate.py [--dim=256] [--n_layers=4] [--vocab=4096] [--group=8]
        [--prompt_len=32] [--new_tokens=64] [--repeats=5] [--threads=0] [--device=cpu] [--mla | --gpt_oss | --gemma=2|3]
        [--prompts=K]

--prompts=K (> 1): K prompts of different lengths, their groups decoded one at a time (--rollout_batch_prompts=1, K
calls) and together (one call of K x G rows, the prompts left-padded), beside HF generate on the same rows left-padded.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("dim", 256), ("n_layers", 4), ("vocab", 4096), ("group", 8), ("prompt_len", 32),
                          ("new_tokens", 64), ("repeats", 5), ("threads", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cpu")
    p.add_argument("--mla", action="store_true", help="multi-head latent attention (DeepSeek-V3's shape, scaled)")
    p.add_argument("--gpt_oss", action="store_true", help="gpt-oss's block (sinks, biases, windows, its experts)")
    p.add_argument("--gemma", type=int, choices=(0, 2, 3), default=0, help="Gemma 2's or Gemma 3's block")
    p.add_argument("--prompts", type=int, default=1, help="K > 1: K prompts of different lengths (--prompt_len down "
                   "to half of it), decoded one group at a time and together (--rollout_batch_prompts), beside HF "
                   "generate on the K x G rows left-padded")
    a = p.parse_args(argv)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from model import ModelConfig, Transformer
    from model.hf_interop import hf_config_dict, to_hf_state_dict
    from trainer.tasks.grpo_rollout import sample_group
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    torch.manual_seed(0)
    heads = max(1, a.dim // 64)
    # DeepSeek-V3's ratios (7168 wide: latents of 512 and 1536, heads of 128 + 64 and 128 values) at this width
    mla = dict(kv_lora_rank=max(16, a.dim // 14 // 8 * 8), q_lora_rank=max(16, 3 * a.dim // 14 // 8 * 8),
               qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64) if a.mla else {}
    gpt_oss = dict(n_kv_heads=max(1, heads // 4), attn_sinks=True, qkv_bias=True, o_bias=True, sliding_window=32,
                   sliding_layers=list(range(0, a.n_layers, 2)), moe_num_experts=8, moe_top_k=2, moe_hidden_dim=a.dim,
                   moe_router_bias=True, moe_expert_biases=True, moe_act="gpt_oss") if a.gpt_oss else {}
    gemma = dict(n_kv_heads=max(1, heads // 2), sandwich_norms=True, scale_embeddings=True, mlp_act="gelu_tanh",
                 tie_embeddings=True, sliding_window=32) if a.gemma else {}
    if a.gemma == 2:
        gemma.update(sliding_layers=list(range(0, a.n_layers, 2)), attn_softcap=50.0, final_softcap=30.0)
    elif a.gemma == 3:
        gemma.update(sliding_layers=list(range(a.n_layers - 1)), qk_norm=True, rope_local_theta=1e4, rope_theta=1e6)
    ours = Transformer(ModelConfig(vocab_size=a.vocab, dim=a.dim, n_layers=a.n_layers, n_heads=heads,
                                   max_seq_len=a.prompt_len + a.new_tokens, **mla, **gpt_oss, **gemma))
    ours = ours.to(device).eval()
    d = hf_config_dict(ours.cfg)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(d.pop("model_type"), **d)).to(device).eval()
    hf.load_state_dict(to_hf_state_dict(ours), strict=False)
    prompt = torch.randint(3, a.vocab, (a.prompt_len,)).tolist()
    x = torch.tensor([prompt] * a.group, device=device)
    eos = hf.generation_config.eos_token_id
    stop_ids = [eos] if isinstance(eos, int) else list(eos or [])
    load_before = os.getloadavg()[0]
    if a.prompts > 1:
        return _batched(a, ours, hf, stop_ids, device, load_before)

    def run_ours(temperature: float = 1.0):
        g = torch.Generator(device=device).manual_seed(1)
        return sample_group(ours, prompt, a.group, a.new_tokens, temperature=temperature or 1e-6, top_p=1.0,
                            stop_ids=stop_ids, pad_id=0, generator=g)[0]

    def run_hf(greedy: bool = False):
        with torch.no_grad():
            kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=a.new_tokens,
                              eos_token_id=stop_ids, pad_token_id=0, **kw)
        return out[:, a.prompt_len:]

    run_ours(), run_hf()  # warm-up
    tps_ours, tps_hf = [], []
    for _ in range(a.repeats):
        for run, tps in ((run_ours, tps_ours), (run_hf, tps_hf)):
            t0 = time.perf_counter()
            out = run()
            tps.append(out.numel() / (time.perf_counter() - t0))  # rows x steps decoded
    ratios = sorted(o / h for o, h in zip(tps_ours, tps_hf))
    greedy_same = bool(torch.equal(run_ours(temperature=0.0).cpu(), run_hf(greedy=True).cpu()))
    print(f"[bench_grpo_generate] {type(hf).__name__}, dim {a.dim} x {a.n_layers} layers, vocab {a.vocab}, group "
          f"{a.group}, prompt {a.prompt_len}, {a.new_tokens} new tokens, {torch.get_num_threads()} threads, {device}, "
          f"{a.repeats} interleaved repeats, load average {load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"ours (KV cache, logprobs recorded): {statistics.median(tps_ours):,.0f} tokens/s; HF generate: "
          f"{statistics.median(tps_hf):,.0f} tokens/s; ratio {statistics.median(ratios):.2f}x (per repeat "
          f"{ratios[0]:.2f}-{ratios[-1]:.2f}); near-greedy (T=1e-6) tokens equal to HF greedy: {greedy_same}")
    return 0


def _batched(a, ours, hf, stop_ids: list, device, load_before: float) -> int:
    """--prompts K: K groups one at a time (K sample_groups calls), together (one call, the prompts left-padded) and
    HF generate on the K x G rows left-padded, interleaved --repeats times after a warm-up; tokens/s count the rows x
    steps each decoded."""
    import torch

    from model.decode import left_pad
    from trainer.tasks.grpo_rollout import sample_groups
    g = torch.Generator().manual_seed(2)
    lengths = [a.prompt_len - (a.prompt_len // 2) * k // max(1, a.prompts - 1) for k in range(a.prompts)]
    prompts = [torch.randint(3, a.vocab, (n,), generator=g).tolist() for n in lengths]
    P = max(lengths)
    x, mask = left_pad([p for p in prompts for _ in range(a.group)], device)

    def ours_call(batch: list, temperature: float = 1.0) -> list:
        gens = [torch.Generator(device=device).manual_seed(1 + k) for k in range(len(batch))]
        return sample_groups(ours, batch, a.group, a.new_tokens, temperature=temperature, top_p=1.0,
                             stop_ids=stop_ids, pad_id=0, generators=gens)

    def one_by_one() -> int:
        return sum(t.numel() for p in prompts for t, _, _ in ours_call([p]))

    def together() -> int:
        return sum(t.numel() for t, _, _ in ours_call(prompts))

    def hf_run(greedy: bool = False):
        kw = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        with torch.no_grad():
            out = hf.generate(x, attention_mask=mask, max_new_tokens=a.new_tokens, eos_token_id=stop_ids,
                              pad_token_id=0, **kw)
        return out[:, P:] if greedy else out[:, P:].numel()

    runs = {"ours, one group at a time": one_by_one, "ours, together": together, "HF generate": hf_run}
    for run in runs.values():
        run()  # warm-up
    tps: dict = {name: [] for name in runs}
    for _ in range(a.repeats):
        for name, run in runs.items():
            t0 = time.perf_counter()
            n = run()
            tps[name].append(n / (time.perf_counter() - t0))
    med = {name: statistics.median(v) for name, v in tps.items()}
    print(f"[bench_grpo_generate] {type(hf).__name__}, dim {a.dim} x {a.n_layers} layers, vocab {a.vocab}, "
          f"{a.prompts} prompts of {min(lengths)}-{P} tokens x group {a.group}, {a.new_tokens} new tokens, "
          f"{torch.get_num_threads()} threads, {device}, {a.repeats} interleaved repeats, load average "
          f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}")
    base = med["ours, one group at a time"]
    print("; ".join(f"{name}: {v:,.0f} tokens/s ({v / base:.2f}x)" for name, v in med.items()))
    greedy = torch.cat([t for t, _, _ in ours_call(prompts, temperature=1e-6)]).cpu()
    print(f"near-greedy (T=1e-6) tokens decoded together equal to HF greedy on the left-padded rows: "
          f"{bool(torch.equal(greedy, hf_run(greedy=True).cpu()))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
