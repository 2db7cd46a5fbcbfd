"""Benchmark speculative decoding with a multi-token prediction depth (model/speculative.py `generate_mtp`) against
plain KV-cache decoding (model/generate.py `generate`) on the same trained model, prompts and budget, side by side
in one run.

Owns: a model trained with one MTP depth (the demo's pipeline and shape on the bundled corpus: a byte-level BPE
tokenizer of 2,048 tokens, dim 256, 4 layers, 128 positions, --steps steps at the demo's schedule, into --work_dir;
or --ckpt, an MTP run of your own), prompts (the first --prompt_len tokens of the corpus's documents, spread over
it), and the timing. For each decoding (greedy; temperature 0.8 with top-k 50) and each batch size, the two run
interleaved --repeats times after a warm-up; it prints the median tokens/s of each, the median and range of the
per-pair ratios, the share of drafts accepted, the tokens per forward of the model, and (greedy) whether both emit
the same tokens. Tokens/s counts the new tokens of every row.
Must never: assert anything (it prints) or download anything; it writes only under --work_dir.

    .venv/bin/python bench/bench_mtp_decode.py [--steps=300] [--work_dir=/tmp/bench_mtp] [--ckpt=RUN]
        [--batch=1,4] [--prompt_len=16] [--new_tokens=96] [--prompts=8] [--repeats=3] [--threads=0]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SEQ = 128


def train(work: str, steps: int) -> str:
    """The demo's stages with one MTP depth (each skipped when its output exists) -> the run directory."""
    tok, pretok, run_dir = (os.path.join(work, d) for d in ("tokenizer", "pretok", "run"))
    py = sys.executable
    stages = [
        ("tokenizer", [py, "-m", "tokenizer.train_tokenizer", "--data_dir=data/pretrain", f"--output_dir={tok}",
               "--vocab_size=2048", "--tokenizer_type=hf_bbpe"]),
        ("pretok", [py, "-m", "data_preprocess.pretokenize_pretrain_data", "--data_dir=data/pretrain",
                  f"--tokenizer_dir={tok}", f"--output_dir={pretok}", "--num_workers=2"]),
        ("index", [py, "-m", "data_preprocess.build_pretrain_sample_index_map",
                   f"--data_dir={pretok}", f"--max_seq_len={SEQ}", "--val_ratio=0.05"]),
        (f"trained_{steps}", [
            py, "train_my_ddp.py", f"--out_dir={run_dir}", f"--data_dir={pretok}", f"--tokenizer_dir={tok}",
            f"--max_seq_len={SEQ}", "--dim=256", "--n_layers=4", "--n_heads=8", "--batch_size=16",
            f"--max_iters={steps}", f"--eval_interval={steps}", "--eval_iters=5",
            f"--log_interval={max(1, steps // 5)}", f"--checkpoint_interval={steps}", "--learning_rate=3e-3",
            "--min_lr=3e-4", f"--warmup_iters={min(30, max(1, steps // 10))}", "--weight_decay=0.1",
            "--mtp_num_layers=1", "--mtp_loss_weight=0.3"]),
    ]
    for name, cmd in stages:
        done = os.path.join(work, f".done_{name}")  # a stage that finished is not run again
        if os.path.exists(done):
            continue
        print("$ " + " ".join(cmd), flush=True)
        t0 = time.time()
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        print(f"  done in {time.time() - t0:.0f}s", flush=True)
        open(done, "w").close()
    return run_dir


def prompts(tok, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of n documents spread over the bundled corpus (English and Chinese)."""
    from tokenizer import encode_texts
    docs = []
    for name in sorted(os.listdir(os.path.join(ROOT, "data", "pretrain"))):
        with open(os.path.join(ROOT, "data", "pretrain", name), encoding="utf-8") as f:
            docs += [json.loads(line)["text"] for line in f if line.strip()]
    picked = [docs[i * len(docs) // n] for i in range(n)]
    return [ids[:length] for ids in encode_texts(tok, picked)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--work_dir", default="/tmp/bench_mtp")
    p.add_argument("--ckpt", default=None, help="an MTP run to decode with instead of training one")
    p.add_argument("--batch", default="1,4")
    for name, default in (("prompt_len", 16), ("new_tokens", 96), ("prompts", 8), ("repeats", 3), ("threads", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args(argv)
    os.makedirs(a.work_dir, exist_ok=True)
    run_dir = a.ckpt or train(a.work_dir, a.steps)

    import torch

    from inference.loading import load_for_inference, recorded_tokenizer_dir
    from model.generate import generate
    from model.speculative import generate_mtp
    from tokenizer.loading import load_tokenizer_and_meta
    if a.threads:
        torch.set_num_threads(a.threads)
    model, _ = load_for_inference(run_dir, torch.device("cpu"), "latest")
    tok, _ = load_tokenizer_and_meta(recorded_tokenizer_dir(run_dir, "latest"))
    prs = prompts(tok, a.prompts, a.prompt_len)
    print(f"model: {run_dir} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters with the depth), "
          f"{a.prompts} prompts of {a.prompt_len} tokens, {a.new_tokens} new tokens, torch threads "
          f"{torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    for label, knobs in (("greedy", dict(temperature=0.0)), ("T 0.8, top-k 50", dict(temperature=0.8, top_k=50))):
        for B in (int(b) for b in a.batch.split(",")):
            batches = [torch.tensor([prs[(i + j) % len(prs)] for j in range(B)]) for i in range(0, len(prs), B)]

            def plain():
                torch.manual_seed(0)
                return [generate(model, x, a.new_tokens, **knobs) for x in batches]

            def spec():
                torch.manual_seed(0)
                outs = [generate_mtp(model, x, a.new_tokens, **knobs) for x in batches]
                return [o for o, _ in outs], [s for _, s in outs]

            plain(), spec()  # warm-up
            t_plain, t_spec, same = [], [], True
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                ref = plain()
                t_plain.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                outs, stats = spec()
                t_spec.append(time.perf_counter() - t0)
                same &= all(torch.equal(r, o) for r, o in zip(ref, outs))
            tokens = sum(o.shape[0] * (o.shape[1] - a.prompt_len) for o in ref)
            drafts = sum(s.row_drafts for s in stats)
            accepted = sum(s.row_accepted for s in stats)
            per_forward = sum(s.new_tokens for s in stats) / sum(s.forwards for s in stats)
            ratios = sorted(tp / ts for tp, ts in zip(t_plain, t_spec))
            print(f"{label:>16}, batch {B}: plain {tokens / statistics.median(t_plain):7.0f} tok/s, speculative "
                  f"{tokens / statistics.median(t_spec):7.0f} tok/s, ratio {statistics.median(ratios):.2f}x "
                  f"({ratios[0]:.2f}-{ratios[-1]:.2f}); drafts accepted {accepted / max(drafts, 1):.0%}, "
                  f"{per_forward:.2f} tokens per forward" + (f"; same tokens: {same}" if not knobs["temperature"]
                                                             else ""))
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
