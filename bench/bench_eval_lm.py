"""Benchmark eval_lm.py's scoring: one forward per request (the unbatched reference, `choice_loglikelihood`, as
eval_lm.py scored before batching, on the thread count it then kept: the usable cores) against the batched scoring
(`loglikelihoods`: sorted longest first, --batch_size rows per forward, right-padded) on that fixed count, and the
batched scoring as eval_lm.py runs it now (the thread count chosen by measuring, utils/threads.plan_threads), side
by side in one run on the same model and the same requests.

Owns: building its inputs in a temp dir from the repo's data/pretrain files: a byte-level BPE tokenizer trained on
them, --items multiple-choice records (4 choices each; a paragraph's opening as the context, the openings of other
paragraphs' next sentences as the choices) and --docs short documents (paragraphs of 100..600 characters) for
perplexity; a Transformer with random weights of the given shape. Both paths score the same encoded requests
(tokenization is left out of the timings), after one warm-up forward each, interleaved chunk by chunk (a shared
machine's load weighs on all alike); it prints the times, the ratios, the largest per-request log-likelihood
difference and whether the accuracies and the perplexity agree. --busy=N runs N busy loops (other processes
holding cores, as on the shared machine the slow evaluation was reported from) for the whole timing.
Must never: assert anything (it prints), download anything, write outside its temp dir, or leave a busy loop running.

    .venv/bin/python bench/bench_eval_lm.py [--items=40] [--docs=400] [--batch_size=16] [--dim=256] [--n_layers=4]
        [--device=cpu] [--threads=0] [--busy=0]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def paragraphs() -> list[str]:
    out = []
    for name in ("en_python_docs.jsonl", "zh_written.jsonl"):
        with open(os.path.join(ROOT, "data", "pretrain", name), encoding="utf-8") as f:
            for line in f:
                for p in json.loads(line)["text"].split("\n\n"):
                    p = " ".join(p.split())
                    if 100 <= len(p) <= 600:
                        out.append(p)
    return out


def mc_records(paras: list[str], n: int, rng: random.Random) -> list[dict]:
    """Generic-format records: the first ~40 words of a paragraph, four continuations of 6..12 words (the gold one
    from the same paragraph)."""
    recs = []
    for i in range(n):
        p = paras[(i * 7) % len(paras)].split(" ")
        cut = min(len(p) - 2, rng.randint(15, 40))
        others = [paras[(i * 7 + 3 + k * 11) % len(paras)].split(" ") for k in range(3)]
        gold = rng.randrange(4)
        choices = [" " + " ".join(o[:rng.randint(6, 12)]) for o in others]
        choices.insert(gold, " " + " ".join(p[cut:cut + rng.randint(6, 12)]))
        recs.append({"context": " ".join(p[:cut]), "choices": choices, "label": gold})
    return recs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--batch_size", type=int, default=16)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--n_layers", type=int, default=4)
    ap.add_argument("--n_heads", type=int, default=4)
    ap.add_argument("--vocab_size", type=int, default=4096)
    ap.add_argument("--max_seq_len", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0,
                    help="fix every path's thread count (0 = as eval_lm.py: the usable cores, measured for the last)")
    ap.add_argument("--busy", type=int, default=0, help="busy loops running beside the timing")
    args = ap.parse_args()
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        run(args)
    finally:
        for p in loops:
            p.kill()
            p.wait()


def encoded_inputs(args: argparse.Namespace) -> tuple[list, list, list, int, dict]:
    """(multiple-choice records, their encoded requests, perplexity windows, documents, tokenizer meta), built in a
    temp dir: a tokenizer trained on the paragraphs, --items records and --docs documents."""
    from evals import lm_tasks
    from tokenizer import load_tokenizer, load_tokenizer_meta
    from tokenizer.train_tokenizer import train_tokenizer
    rng = random.Random(0)
    paras = paragraphs()
    with tempfile.TemporaryDirectory() as d:
        corpus = os.path.join(d, "corpus.jsonl")
        with open(corpus, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": p}) + "\n" for p in paras)
        train_tokenizer(corpus, os.path.join(d, "tok"), vocab_size=args.vocab_size)
        tok, meta = load_tokenizer(os.path.join(d, "tok")), load_tokenizer_meta(os.path.join(d, "tok"))
        bos, eos = (int(meta["special_tokens"][k]["id"]) for k in ("bos", "eos"))
        task = os.path.join(d, "mc.jsonl")
        with open(task, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in mc_records(paras, args.items, rng))
        held = os.path.join(d, "held.jsonl")
        with open(held, "w", encoding="utf-8") as f:
            f.writelines(json.dumps({"text": paras[(i * 13) % len(paras)]}) + "\n" for i in range(args.docs))
        reqs = lm_tasks.read_task(task)
        encoded = lm_tasks.encode_requests(tok, bos, reqs, args.max_seq_len)
        windows, docs, _ = lm_tasks.perplexity_requests(tok, bos, eos, [held], "text", args.max_seq_len)
    return reqs, encoded, windows, docs, meta


def run(args: argparse.Namespace) -> None:
    import torch

    from evals import lm_tasks
    from model import ModelConfig, Transformer
    from utils.threads import plan_threads
    fixed = plan_threads(args.threads, fixed=True).start  # what eval_lm.py kept before it measured
    torch.set_num_threads(fixed)
    reqs, encoded, windows, docs, meta = encoded_inputs(args)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=meta["vocab_size"], dim=args.dim, n_layers=args.n_layers,
                                    n_heads=args.n_heads, max_seq_len=args.max_seq_len)).to(args.device).eval()
    device = torch.device(args.device)
    flat = [r for item in encoded for r in item]
    lengths = [len(ids) - 1 for ids, _ in flat + windows]
    print(f"model: dim {args.dim}, {args.n_layers} layers, vocab {meta['vocab_size']}, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {args.device}, "
          f"{fixed} threads ({args.busy} busy loops beside it; load average {os.getloadavg()[0]:.1f} at the start)")
    print(f"requests: {args.items} multiple-choice items ({len(flat)} choices) + {docs} documents ({len(windows)} "
          f"windows); input lengths {min(lengths)}..{max(lengths)} tokens, mean {sum(lengths) / len(lengths):.0f}")

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    lm_tasks.choice_loglikelihood(model, flat[0][0], flat[0][1], args.max_seq_len, device)  # warm-up
    lm_tasks.loglikelihoods(model, flat[:args.batch_size], args.max_seq_len, device, args.batch_size)
    # Interleaved, so that a load that changes during the run (a shared machine) weighs on all alike: the
    # requests in loglikelihoods' order (longest first), cut into chunks of 4 batches (the batched paths' batches
    # are then exactly those of one call over everything), each chunk timed by every path, which goes first
    # rotating. The measured thread choice keeps one tuner for the whole run, as one eval_lm.py call does; it is
    # planned now, when the busy loops (if any) already run.
    plan = plan_threads(args.threads, cpu=device.type == "cpu")
    every = flat + windows
    order = sorted(range(len(every)), key=lambda i: -len(every[i][0][:-1][-args.max_seq_len:]))
    chunk = 4 * args.batch_size
    names = ("unbatched", "batched", "batched+threads")
    vals_of = {k: [0.0] * len(every) for k in names}
    secs = dict.fromkeys(names, 0.0)
    for c, start in enumerate(range(0, len(order), chunk)):
        rows = order[start:start + chunk]
        for which in names[c % 3:] + names[:c % 3]:
            torch.set_num_threads(fixed if which != "batched+threads" else plan.tuner.current if plan.tuner
                                  else plan.start)
            sync()
            t0 = time.perf_counter()
            if which == "unbatched":
                vals = [lm_tasks.choice_loglikelihood(model, *every[i], args.max_seq_len, device) for i in rows]
            else:
                vals = lm_tasks.loglikelihoods(model, [every[i] for i in rows], args.max_seq_len, device,
                                               args.batch_size, tuner=plan.tuner if which != "batched" else None)
            sync()
            secs[which] += time.perf_counter() - t0
            for i, v in zip(rows, vals):
                vals_of[which][i] = v
    old, new = vals_of["unbatched"], vals_of["batched+threads"]
    old_mc, old_ppl, new_mc, new_ppl = old[:len(flat)], old[len(flat):], new[:len(flat)], new[len(flat):]

    def per_item(values: list[float]) -> list[list[float]]:
        out, k = [], 0
        for item in encoded:
            out.append(values[k:k + len(item)])
            k += len(item)
        return out

    acc_old, acc_new = lm_tasks.tally(reqs, per_item(old_mc)), lm_tasks.tally(reqs, per_item(new_mc))
    ppl_old = lm_tasks.perplexity_result(windows, old_ppl, docs, 0)["ppl"]
    ppl_new = lm_tasks.perplexity_result(windows, new_ppl, docs, 0)["ppl"]
    n = len(flat) + len(windows)
    t_old = secs["unbatched"]
    for which, label in zip(names, ("one forward per request (before batching)",
                                    f"batched (--batch_size={args.batch_size})",
                                    "batched + measured thread count (eval_lm.py now)")):
        print(f"{label:52s} {secs[which]:8.2f} s  ({n / secs[which]:7.1f} requests/s)  speed-up "
              f"{t_old / secs[which]:.1f}x")
    if plan.tuner is not None:
        print(f"thread count of the last path: started on {plan.start}, ended on {plan.tuner.current}; "
              f"switches {[(old_n, new_n) for _, old_n, new_n, _, _ in plan.tuner.changes]}")
    diff = max(abs(a - b) for batched in (vals_of["batched"], new) for a, b in zip(old, batched))
    print(f"max |loglikelihood difference| {diff:.2e}; acc/acc_norm {acc_old['acc']:.4f}/{acc_old['acc_norm']:.4f} "
          f"vs {acc_new['acc']:.4f}/{acc_new['acc_norm']:.4f} ({'same' if acc_old == acc_new else 'DIFFERENT'}); "
          f"ppl {ppl_old:.4f} vs {ppl_new:.4f}")


if __name__ == "__main__":
    main()
