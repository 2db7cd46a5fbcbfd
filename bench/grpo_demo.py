"""GRPO demo on the CPU: a generated arithmetic task with a checkable answer, a tiny model taught the answer format
by SFT (on labels that are right only part of the time), then GRPO with the exact-match reward; the held-out
greedy pass@1 before and after is printed.

Owns: its work directory (--work): the task's records (train prompts and held-out prompts never trained on), a
byte-level BPE tokenizer trained on them, a short pretraining run (SFT starts from weights), the SFT run, the GRPO
run, and the evaluation (greedy decoding of every held-out prompt with the project's generator, the answer after
"####" compared with the sum).
Must never: assert (it prints; the reward's rise is a bench, not a timed test), download anything.

    .venv/bin/python bench/grpo_demo.py [--work=/tmp/grpo_demo] [--grpo_steps=100] [--sft_steps=150] [--threads=2]
        [--dim=64] [--n_layers=2] [--reuse_sft]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PY = sys.executable
MAX_N = 9  # operands 0..MAX_N


def question(a: int, b: int) -> str:
    return f"{a}+{b}="


def write_task(work: str, seed: int) -> dict:
    """train / held-out prompt records, SFT conversations (answer right with probability 0.5), pretraining text."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(MAX_N + 1) for b in range(MAX_N + 1)]
    rng.shuffle(pairs)
    held, train = pairs[:20], pairs[20:]
    paths = {k: os.path.join(work, f"{k}.jsonl") for k in ("grpo", "heldout", "sft")}
    for key, subset in (("grpo", train), ("heldout", held)):
        with open(paths[key], "w", encoding="utf-8") as f:
            for a, b in subset:
                f.write(json.dumps({"messages": [{"role": "user", "content": question(a, b)}],
                                    "answer": str(a + b)}) + "\n")
    with open(paths["sft"], "w", encoding="utf-8") as f:
        for _ in range(8):
            for a, b in train:
                ans = a + b if rng.random() < 0.5 else rng.randint(0, 2 * MAX_N)
                f.write(json.dumps({"messages": [{"role": "user", "content": question(a, b)},
                                                 {"role": "assistant", "content": f"#### {ans}"}]}) + "\n")
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    with open(os.path.join(corpus, "text.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(20):
            for a, b in pairs:
                f.write(json.dumps({"text": f"{question(a, b)} #### {a + b}"}) + "\n")
    paths["corpus"] = corpus
    return paths


def run(cmd: list[str], what: str, env: dict) -> None:
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    print(f"[demo] {what}: {time.time() - t0:.0f} s", flush=True)


def pass_at_1(run_dir: str, tok_dir: str, heldout: str, limit: int = 0) -> float:
    """Greedy pass@1 of the run's latest checkpoint on the held-out prompts."""
    import torch

    from model.generate import generate
    from tokenizer import encode_chat, load_tokenizer, load_tokenizer_meta
    from trainer.tasks.grpo_rewards import exact_match
    from trainer.weights import load_weights_from
    model, _ = load_weights_from(run_dir, lambda m: None, tokenizer_dir=tok_dir)
    model.eval()
    tok, special = load_tokenizer(tok_dir), load_tokenizer_meta(tok_dir)["special_tokens"]
    stops = [int(special[n]["id"]) for n in ("eos", "im_end")]
    right = total = 0
    with open(heldout, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if limit and i >= limit:
                break
            rec = json.loads(line)
            ids = list(encode_chat(tok, rec["messages"], add_generation_prompt=True)[0])
            out = generate(model, torch.tensor([ids]), max_new_tokens=8, temperature=0.0, stop_ids=stops)
            text = tok.decode([t for t in out[0, len(ids):].tolist() if t not in stops], skip_special_tokens=True)
            right += exact_match(text, rec["answer"], "####") == 1.0
            total += 1
    return right / total


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/grpo_demo")
    p.add_argument("--grpo_steps", type=int, default=100)
    p.add_argument("--sft_steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--n_layers", type=int, default=2)
    p.add_argument("--reuse_sft", action="store_true", help="keep --work's task, tokenizer and SFT run (GRPO again)")
    a = p.parse_args(argv)
    tok, shards = os.path.join(a.work, "tok"), os.path.join(a.work, "shards")
    pre, sft, rl = (os.path.join(a.work, n) for n in ("pretrain", "sft", "grpo"))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1")
    model = [f"--dim={a.dim}", f"--n_layers={a.n_layers}", "--n_heads=4", "--multiple_of=16", "--max_seq_len=32"]
    common = [f"--tokenizer_dir={tok}", "--device=cpu", "--progress=false", "--peak_flops=1e11", "--log_interval=20",
              f"--threads={a.threads}", f"--seed={a.seed}", "--warmup_iters=5"]
    if a.reuse_sft and os.path.isdir(os.path.join(sft, "checkpoints")):
        paths = {k: os.path.join(a.work, f"{k}.jsonl") for k in ("grpo", "heldout", "sft")}
        shutil.rmtree(rl, ignore_errors=True)
    else:
        shutil.rmtree(a.work, ignore_errors=True)
        os.makedirs(a.work)
        paths = write_task(a.work, a.seed)
        prepare(a, paths, tok, shards, pre, sft, model, common, env)
    before, before_train = pass_at_1(sft, tok, paths["heldout"]), pass_at_1(sft, tok, paths["grpo"], limit=20)
    print(f"[demo] greedy pass@1 after SFT: held-out {before:.2f}, first 20 training prompts {before_train:.2f}",
          flush=True)
    t0 = time.time()
    run([PY, "train_my_ddp.py", *common, "--task_type=grpo", f"--init_from={sft}", f"--data_dir={paths['grpo']}",
         f"--out_dir={rl}", f"--max_iters={a.grpo_steps}", "--batch_size=4", "--num_generations=8",
         "--max_prompt_length=24", "--max_completion_length=8", "--learning_rate=1e-3", "--lr_schedule=constant",
         "--temperature=0.8", "--log_interval=5",
         "--reward_funcs=exact_match", "--eval_interval=0", f"--checkpoint_interval={a.grpo_steps}"], "GRPO", env)
    after, after_train = pass_at_1(rl, tok, paths["heldout"]), pass_at_1(rl, tok, paths["grpo"], limit=20)
    from utils.metrics import dedupe_by_step, read_metrics
    rows = dedupe_by_step(read_metrics(os.path.join(rl, "metrics.jsonl")))
    steps = sorted(rows)
    k = max(1, len(steps) // 5)
    first = sum(rows[s]["reward"] for s in steps[:k]) / k
    last = sum(rows[s]["reward"] for s in steps[-k:]) / k
    print(f"[demo] GRPO {len(steps)} steps in {time.time() - t0:.0f} s: training reward {first:.3f} (first {k} steps) "
          f"-> {last:.3f} (last {k}); greedy pass@1 held-out {before:.2f} -> {after:.2f}, first 20 training prompts "
          f"{before_train:.2f} -> {after_train:.2f}")
    return 0


def prepare(a, paths: dict, tok: str, shards: str, pre: str, sft: str, model: list, common: list, env: dict) -> None:
    """The tokenizer, the pretraining shards and run, and the SFT run."""
    run([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={paths['corpus']}", f"--output_dir={tok}",
         "--vocab_size=300", "--tokenizer_type=hf_bbpe"], "tokenizer", env)
    run([PY, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={paths['corpus']}",
         f"--tokenizer_dir={tok}", f"--output_dir={shards}", "--num_workers=1", "--no_progress"], "shards", env)
    run([PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}", "--max_seq_len=32",
         "--val_ratio=0.05"], "index", env)
    run([PY, "train_my_ddp.py", *common, *model, f"--data_dir={shards}", f"--out_dir={pre}", "--max_iters=100",
         "--batch_size=16", "--learning_rate=3e-3", "--eval_interval=0", "--checkpoint_interval=100"], "pretrain", env)
    run([PY, "train_my_ddp.py", *common, "--task_type=sft", f"--init_from={pre}", f"--data_dir={paths['sft']}",
         f"--out_dir={sft}", f"--max_iters={a.sft_steps}", "--batch_size=16", "--learning_rate=2e-3",
         "--eval_interval=0", f"--checkpoint_interval={a.sft_steps}"], "SFT", env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
