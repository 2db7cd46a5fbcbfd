"""GRPO demo on the CPU: a generated addition task with a checkable answer (`a+b=` for a, b in 0..29, as a chat user
turn; the reply `#### <sum>`), a tiny model that learns the sums in pretraining and a bad habit in SFT (a sloppy
teacher's replies are one too high 60% of the time), then GRPO with the exact-match reward on the training prompts.
The greedy pass@1 on held-out prompts (pairs no stage ever trains on) is printed before and after, and logged
during GRPO by the trainer's own held-out evaluation (--eval_data_dir: val_reward).

Owns: its work directory (--work): the task's records (training and held-out prompts), a character-level tokenizer
(byte-level BPE without merges: one token per digit), the pretraining text (the true sums of the training pairs,
written as a user / assistant exchange in plain text, the reply where the chat template puts it) and run, the SFT
run, the GRPO run, and the evaluation (trainer/tasks/grpo_eval.py's `held_out_sums`, what the trainer logs).
Must never: assert (it prints; the reward's rise is a bench, not a timed test), download anything.

    .venv/bin/python bench/grpo_demo.py [--work=/tmp/grpo_demo] [--seed=0] [--grpo_steps=150] [--reuse=pretrain|sft]
        [--distill_steps=N]   # then the SFT model distilled on-policy from the GRPO one (--teacher_kl_coef)
        [--gkd_steps=N]       # and by GKD, whole distributions at its own replies (--distill_lmbda=1)
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


def question(a: int, b: int) -> str:
    return f"{a}+{b}="


def write_task(work: str, a: argparse.Namespace) -> dict:
    """Train / held-out prompt records, SFT conversations (the reply right with probability --sft_right, else one
    too high), pretraining text (the true sums of the training pairs only)."""
    rng = random.Random(a.seed)
    pairs = [(x, y) for x in range(a.max_n + 1) for y in range(a.max_n + 1)]
    rng.shuffle(pairs)
    held, train = pairs[:a.held_out], pairs[a.held_out:]
    paths = {k: os.path.join(work, f"{k}.jsonl") for k in ("grpo", "heldout", "sft")}
    for key, subset in (("grpo", train), ("heldout", held)):
        with open(paths[key], "w", encoding="utf-8") as f:
            for x, y in subset:
                f.write(json.dumps({"messages": [{"role": "user", "content": question(x, y)}],
                                    "answer": str(x + y)}) + "\n")
    write_sft(paths["sft"], train, a)
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    with open(os.path.join(corpus, "text.jsonl"), "w", encoding="utf-8") as f:
        for _ in range(a.pretrain_copies):
            rng.shuffle(train)
            for x, y in train:
                f.write(json.dumps({"text": pretraining_text(x, y, a.pretrain_format)}) + "\n")
    paths["corpus"] = corpus
    return paths


def pretraining_text(x: int, y: int, fmt: str) -> str:
    """One pretraining document: the true sum, as an equation (plain) or as a dialogue in plain text whose reply
    sits where the chat template puts the assistant's (chat: the special tokens are SFT's to teach)."""
    if fmt == "plain":
        return f"{question(x, y)}{x + y}"
    return f"user\n{question(x, y)}\nassistant\n#### {x + y}"


def write_sft(path: str, train: list, a: argparse.Namespace) -> None:
    """The SFT conversations: each training pair --sft_copies times, the reply right with probability --sft_right,
    else one too high."""
    rng = random.Random(a.seed + 1)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(a.sft_copies):
            for x, y in train:
                ans = x + y if rng.random() < a.sft_right else x + y + 1
                f.write(json.dumps({"messages": [{"role": "user", "content": question(x, y)},
                                                 {"role": "assistant", "content": f"#### {ans}"}]}) + "\n")


def run(cmd: list[str], what: str, env: dict) -> float:
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    dt = time.time() - t0
    print(f"[demo] {what}: {dt:.0f} s", flush=True)
    return dt


def greedy_pass_at_1(run_dir: str, tok_dir: str, records: str, max_new: int, limit: int = 0) -> float:
    """Greedy pass@1 (exact match after ####) of the run's latest checkpoint on `records`, as the trainer's
    held-out evaluation computes it (trainer/tasks/grpo_eval.py); the first `limit` records when given."""
    import torch

    from tokenizer import load_tokenizer, load_tokenizer_meta
    from trainer.config import TrainConfig
    from trainer.tasks.grpo_data import read_prompts_file
    from trainer.tasks.grpo_eval import held_out_sums, held_out_metrics
    from trainer.tasks.grpo_rewards import build_rewards
    from trainer.weights import load_weights_from
    model, _ = load_weights_from(run_dir, lambda m: None, tokenizer_dir=tok_dir)
    tok, meta = load_tokenizer(tok_dir), load_tokenizer_meta(tok_dir)
    cfg = TrainConfig()
    cfg.reward_funcs, cfg.max_prompt_length = "exact_match", 64
    rewards = build_rewards(cfg)
    prompts = read_prompts_file(records, cfg, tok, meta, True, None)[:limit or None]
    stops = [int(meta["special_tokens"][n]["id"]) for n in ("eos", "im_end")]
    sums = held_out_sums(model, prompts, rewards, lambda ids: tok.decode(ids, skip_special_tokens=True), rows=64,
                       max_new_tokens=max_new, stop_ids=stops, device=torch.device("cpu"))
    return held_out_metrics(sums, rewards.names)["val_reward"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/grpo_demo")
    p.add_argument("--seed", type=int, default=0, help="the task's split, the initial weights, the rollouts")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max_n", type=int, default=29, help="operands 0..max_n")
    p.add_argument("--held_out", type=int, default=150, help="pairs held out of every stage (scored only)")
    p.add_argument("--sft_right", type=float, default=0.4, help="the SFT teacher's reply is right this often")
    p.add_argument("--sft_copies", type=int, default=4)
    p.add_argument("--pretrain_format", choices=("chat", "plain"), default="chat")
    p.add_argument("--pretrain_copies", type=int, default=20)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--n_layers", type=int, default=2)
    p.add_argument("--pretrain_steps", type=int, default=800)
    p.add_argument("--sft_steps", type=int, default=400)
    p.add_argument("--sft_lr", type=float, default=1e-3)
    p.add_argument("--grpo_steps", type=int, default=150)
    p.add_argument("--grpo_lr", type=float, default=1e-4)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--grpo_batch", type=int, default=8, help="prompts per GRPO step")
    p.add_argument("--grpo_args", default="", help="more trainer flags for the GRPO run, space-separated")
    p.add_argument("--distill_steps", type=int, default=0,
                   help="then on-policy distillation (--teacher_kl_coef, no reward) of the SFT model towards the GRPO "
                        "one for this many steps, its held-out pass@1 printed beside GRPO's (0 = off)")
    p.add_argument("--gkd_steps", type=int, default=0,
                   help="then GKD (--task_type=distill --distill_lmbda=1, the JSD of TRL's defaults) of the SFT model "
                        "towards the GRPO one on the SFT conversations, their replies the student's own, for this "
                        "many steps of as many sampled replies as a GRPO step (0 = off)")
    p.add_argument("--reuse", choices=("", "pretrain", "sft"), default="",
                   help="keep --work's task, tokenizer and pretraining (SFT and GRPO again), or its SFT run too")
    a = p.parse_args(argv)
    tok, shards = os.path.join(a.work, "tok"), os.path.join(a.work, "shards")
    pre, sft, rl = (os.path.join(a.work, n) for n in ("pretrain", "sft", "grpo"))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1")
    model = [f"--dim={a.dim}", f"--n_layers={a.n_layers}", "--n_heads=4", "--multiple_of=16", "--max_seq_len=48"]
    common = [f"--tokenizer_dir={tok}", "--device=cpu", "--progress=false", "--peak_flops=1e11", "--log_interval=50",
              f"--threads={a.threads}", f"--seed={a.seed}", "--warmup_iters=10"]
    max_new = 10  # "#### 58" and the stop token need 8
    t_start = time.time()
    if a.reuse and os.path.isdir(os.path.join(pre if a.reuse == "pretrain" else sft, "checkpoints")):
        paths = {k: os.path.join(a.work, f"{k}.jsonl") for k in ("grpo", "heldout", "sft")}
        for d in (rl, sft) if a.reuse == "pretrain" else (rl,):
            shutil.rmtree(d, ignore_errors=True)
        if a.reuse == "pretrain":
            with open(paths["grpo"], encoding="utf-8") as f:
                train = [tuple(int(v) for v in json.loads(line)["messages"][0]["content"][:-1].split("+"))
                         for line in f]
            write_sft(paths["sft"], train, a)
            sft_run(a, paths, pre, sft, common, env)
    else:
        shutil.rmtree(a.work, ignore_errors=True)
        os.makedirs(a.work)
        paths = write_task(a.work, a)
        prepare(a, paths, tok, shards, pre, sft, model, common, env)
    before = greedy_pass_at_1(sft, tok, paths["heldout"], max_new)
    before_train = greedy_pass_at_1(sft, tok, paths["grpo"], max_new, a.held_out)
    print(f"[demo] greedy pass@1 after SFT: held-out {before:.3f}, first {a.held_out} training prompts "
          f"{before_train:.3f}", flush=True)
    t0 = time.time()
    run([PY, "train_my_ddp.py", *common, "--task_type=grpo", f"--init_from={sft}", f"--data_dir={paths['grpo']}",
         f"--eval_data_dir={paths['heldout']}", f"--out_dir={rl}", f"--max_iters={a.grpo_steps}",
         f"--batch_size={a.grpo_batch}", f"--num_generations={a.num_generations}", "--max_prompt_length=32",
         f"--max_completion_length={max_new}", f"--learning_rate={a.grpo_lr}", "--lr_schedule=constant",
         "--temperature=1.0", "--weight_decay=0", "--log_interval=25", "--reward_funcs=exact_match",
         f"--eval_interval={max(1, a.grpo_steps // 6)}", f"--checkpoint_interval={a.grpo_steps}",
         *a.grpo_args.split()], "GRPO", env)
    grpo_s = time.time() - t0
    after = greedy_pass_at_1(rl, tok, paths["heldout"], max_new)
    after_train = greedy_pass_at_1(rl, tok, paths["grpo"], max_new, a.held_out)
    from utils.metrics import dedupe_by_step, read_metrics
    rows = dedupe_by_step(read_metrics(os.path.join(rl, "metrics.jsonl")))
    steps = sorted(rows)
    k = max(1, len(steps) // 5)
    first = sum(rows[s]["reward"] for s in steps[:k]) / k
    last = sum(rows[s]["reward"] for s in steps[-k:]) / k
    curve = ", ".join(f"{s}: {rows[s]['val_reward']:.3f}" for s in steps if "val_reward" in rows[s])
    print(f"[demo] GRPO {len(steps)} steps in {grpo_s:.0f} s: sampled training reward {first:.3f} (first {k} steps) "
          f"-> {last:.3f} (last {k}); held-out val_reward during GRPO: {curve}")
    print(f"[demo] greedy pass@1, {a.held_out} held-out prompts: {before:.3f} -> {after:.3f} "
          f"({after - before:+.3f}); first {a.held_out} training prompts {before_train:.3f} -> {after_train:.3f}; "
          f"total {time.time() - t_start:.0f} s", flush=True)
    if a.distill_steps:
        distill(a, paths, common, env, sft, rl, max_new, before)
    if a.gkd_steps:
        distill(a, paths, common, env, sft, rl, max_new, before, gkd=True)
    return 0


def distill(a, paths: dict, common: list, env: dict, sft: str, teacher: str, max_new: int, before: float,
            gkd: bool = False) -> None:
    """On-policy distillation: the SFT model samples and learns the GRPO model's distributions at its own tokens.
    Sampled (GRPO's --teacher_kl_coef): on the training prompts, each token's log-probability under the teacher in
    its advantage (no reward; exact_match at weight 0 is only watched). GKD (gkd): on the SFT conversations, each
    reply replaced by the student's own, the teacher's whole distribution at every token of it (the JSD)."""
    out, steps_n = os.path.join(a.work, "gkd" if gkd else "distill"), a.gkd_steps if gkd else a.distill_steps
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.time()
    how = (["--task_type=distill", f"--data_dir={paths['sft']}", "--distill_lmbda=1", "--distill_loss=jsd",
            f"--batch_size={a.grpo_batch * a.num_generations}"] if gkd else
           ["--task_type=grpo", f"--data_dir={paths['grpo']}", "--teacher_kl_coef=1", "--reward_funcs=exact_match",
            "--reward_weights=0", f"--batch_size={a.grpo_batch}", f"--num_generations={a.num_generations}",
            "--max_prompt_length=32"])
    run([PY, "train_my_ddp.py", *common, *how, f"--init_from={sft}", f"--ref_model={teacher}", f"--out_dir={out}",
         f"--max_iters={steps_n}", f"--max_completion_length={max_new}", f"--learning_rate={a.grpo_lr}",
         "--lr_schedule=constant", "--temperature=1.0", "--weight_decay=0", "--log_interval=25", "--eval_interval=0",
         f"--checkpoint_interval={steps_n}"], "GKD" if gkd else "distillation", env)
    from utils.metrics import dedupe_by_step, read_metrics
    rows = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    steps = sorted(rows)
    k = max(1, len(steps) // 5)
    key = "kl" if gkd else "teacher_kl"
    kl = [sum(rows[s][key] for s in part) / len(part) for part in (steps[:k], steps[-k:])]
    watched = "" if gkd else "; sampled exact_match (watched, weight 0) {:.3f} -> {:.3f}".format(
        *(sum(rows[s]["reward_exact_match"] for s in part) / len(part) for part in (steps[:k], steps[-k:])))
    after = greedy_pass_at_1(out, os.path.join(a.work, "tok"), paths["heldout"], max_new)
    print(f"[demo] {'GKD (whole distributions, JSD)' if gkd else 'on-policy distillation (sampled)'} towards the "
          f"GRPO model, {len(steps)} steps in {time.time() - t0:.0f} s: {key} {kl[0]:.3f} (first {k} steps) -> "
          f"{kl[1]:.3f} (last {k}){watched}; held-out greedy pass@1 {before:.3f} -> {after:.3f} "
          f"({after - before:+.3f})", flush=True)


def prepare(a, paths: dict, tok: str, shards: str, pre: str, sft: str, model: list, common: list, env: dict) -> None:
    """The tokenizer, the pretraining shards and run, and the SFT run."""
    run([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={paths['corpus']}", f"--output_dir={tok}",
         "--vocab_size=263", "--tokenizer_type=hf_bbpe"], "tokenizer", env)
    run([PY, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={paths['corpus']}",
         f"--tokenizer_dir={tok}", f"--output_dir={shards}", "--num_workers=1", "--no_progress"], "shards", env)
    run([PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}", "--max_seq_len=48",
         "--val_ratio=0.01"], "index", env)
    run([PY, "train_my_ddp.py", *common, *model, f"--data_dir={shards}", f"--out_dir={pre}",
         f"--max_iters={a.pretrain_steps}", "--batch_size=32", "--learning_rate=3e-3", "--eval_interval=0",
         f"--checkpoint_interval={a.pretrain_steps}"], "pretrain", env)
    sft_run(a, paths, pre, sft, common, env)


def sft_run(a, paths: dict, pre: str, sft: str, common: list, env: dict) -> None:
    run([PY, "train_my_ddp.py", *common, "--task_type=sft", f"--init_from={pre}", f"--data_dir={paths['sft']}",
         f"--out_dir={sft}", f"--max_iters={a.sft_steps}", "--batch_size=32", f"--learning_rate={a.sft_lr}",
         "--eval_interval=0", f"--checkpoint_interval={a.sft_steps}"], "SFT", env)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
