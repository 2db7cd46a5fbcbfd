"""GRPO with tools on the CPU: a tiny model learns to call a tool and use its answer. The task: `Value of "<key>"?` (a
key of two letters) as a chat user turn whose prompt offers one tool, `lookup(key)` (a fixed value 0..99 per key, a
hash: nothing to infer); the reply `#### <value>`. A first SFT on calling conversations with random values teaches
the model to copy (the key into its call, the result into its answer); the second shows it calling the tool
(--sft_call of the time) or guessing at once, always wrong (the rest), with the true values; the held-out keys'
values appear in no stage, so only the tool answers them. GRPO (--tools, numeric_match on the last turn) rewards the
right answers: those that called the tool and copied its result. The held-out greedy pass@1 (answers decoded with the
calls run, the trainer's own --eval_data_dir evaluation) and the share of answers that called the tool are printed
before and after.

Owns: its work directory (--work): the tool module, the task's records (training and held-out prompts, SFT
conversations with tool calls), a BPE tokenizer trained on the conversations as the chat template renders them (its
tool preamble then takes few tokens; numbers stay whole), a short pretraining on that text (SFT starts from
pretrained weights), the two SFT runs, the GRPO run.
Must never: assert (it prints; the reward's rise is a bench, not a timed test), download anything.

    .venv/bin/python bench/grpo_tools_demo.py [--work=/tmp/grpo_tools_demo] [--seed=0] [--grpo_steps=60]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.grpo_demo import PY, run  # noqa: E402

TOOL_MODULE = '''import hashlib


def lookup(key: str) -> int:
    """The value stored under a key.

    Args:
        key: The key.
    """
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
'''


def tool(work: str) -> Any:
    """The tool, written to `work`/demo_tools.py (what the trainer's --tools imports) and imported from there."""
    import importlib
    with open(os.path.join(work, "demo_tools.py"), "w", encoding="utf-8") as f:
        f.write(TOOL_MODULE)
    if work not in sys.path:
        sys.path.insert(0, work)
    sys.modules.pop("demo_tools", None)
    return importlib.import_module("demo_tools").lookup


def question(key: str) -> str:
    """The user's turn: the key between quotes, so that it is the same token there and in the call's JSON."""
    return f'Value of "{key}"?'


def conversation(key: str, value: int, call: bool, rng: random.Random) -> list:
    """A calling conversation (the call, its result, the result copied) or a wrong guess at once."""
    user = {"role": "user", "content": question(key)}
    if call:
        return [user, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}]},
                {"role": "tool", "name": "lookup", "content": str(value)},
                {"role": "assistant", "content": f"#### {value}"}]
    return [user, {"role": "assistant", "content": f"#### {(value + rng.randrange(1, 100)) % 100}"}]


def write_task(work: str, a: argparse.Namespace) -> dict:
    """Prompt records (training, held out: keys no stage trains on), SFT conversations (a call and its copied result
    --sft_call of the time, else a wrong guess at once), and the pretraining conversations: the same shapes with
    random values (the copy is learned there, no key's value)."""
    from transformers.utils import get_json_schema
    rng = random.Random(a.seed)
    keys = [x + y for x in "abcdefghijklmnopqrstuvwxyz" for y in "abcdefghijklmnopqrstuvwxyz"]
    rng.shuffle(keys)
    held, train = keys[:a.held_out], keys[a.held_out:]
    lookup = tool(work)
    tools = [get_json_schema(lookup)]
    paths = {k: os.path.join(work, f"{k}.jsonl") for k in ("grpo", "heldout", "sft", "pre")}
    for key, subset in (("grpo", train), ("heldout", held)):
        with open(paths[key], "w", encoding="utf-8") as f:
            for k in subset:
                f.write(json.dumps({"messages": [{"role": "user", "content": question(k)}],
                                    "answer": str(lookup(k))}) + "\n")
    with open(paths["sft"], "w", encoding="utf-8") as f, open(paths["pre"], "w", encoding="utf-8") as pre:
        for _ in range(a.sft_copies):
            for k in train:
                call = rng.random() < a.sft_call
                f.write(json.dumps({"tools": tools, "messages": conversation(k, lookup(k), call, rng)}) + "\n")
                for _ in range(a.copy_copies):  # (always a call, a random value: only copying answers)
                    pre.write(json.dumps({"tools": tools, "messages": conversation(k, rng.randrange(100), True, rng)})
                              + "\n")
    return paths


def write_corpus(work: str, records: str) -> str:
    """The pretraining text: each conversation of `records` as the chat template writes it (rendered with a
    character-level tokenizer's template, ours), so a BPE trained on it writes the template's tool preamble in few
    tokens."""
    from transformers import AutoTokenizer

    from tokenizer.train_tokenizer import train_tokenizer
    seed_dir = os.path.join(work, "corpus0")
    os.makedirs(seed_dir)
    with open(os.path.join(seed_dir, "t.jsonl"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"text": "0123456789 ?#"}) + "\n")
    train_tokenizer(seed_dir, os.path.join(work, "tok0"), vocab_size=263)
    render = AutoTokenizer.from_pretrained(os.path.join(work, "tok0"))
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    with open(records, encoding="utf-8") as src, \
            open(os.path.join(corpus, "text.jsonl"), "w", encoding="utf-8") as out:
        for line in src:
            rec = json.loads(line)
            text = render.apply_chat_template(rec["messages"], tools=rec["tools"], tokenize=False)
            out.write(json.dumps({"text": text}) + "\n")
    return corpus


def measure(run_dir: str, tok_dir: str, records: str, max_new: int, work: str) -> tuple[float, float]:
    """(greedy pass@1, share of answers that called the tool) of the run's latest checkpoint on `records`, decoded
    with the calls run, as the trainer's held-out evaluation does (trainer/tasks/grpo_eval.py)."""
    import torch

    from tokenizer import load_tokenizer, load_tokenizer_meta
    from trainer.config import TrainConfig
    from trainer.tasks.grpo import GRPOTask
    from trainer.tasks.grpo_eval import held_out_metrics, held_out_sums
    from trainer.weights import load_weights_from
    model, _ = load_weights_from(run_dir, lambda m: None, tokenizer_dir=tok_dir)
    cfg = TrainConfig(task_type="grpo", data_dir=records, tokenizer_dir=tok_dir, tools="demo_tools:lookup",
                      reward_funcs="numeric_match", max_prompt_length=280, max_completion_length=max_new,
                      max_seq_len=model.cfg.max_seq_len, init_from=run_dir)
    task = GRPOTask(cfg)
    data = task.datasets(load_tokenizer_meta(tok_dir), 0.0, False, None)
    task._load_tools(torch.device("cpu"))
    runners = []

    def tools(prompts):  # (kept, to count the answers whose calls ran)
        runners.append(task._runner(prompts))
        return runners[-1]
    tok = load_tokenizer(tok_dir)
    sums = held_out_sums(model, data.train.prompts, task._rewards,
                         lambda ids: tok.decode(ids, skip_special_tokens=True), rows=64, max_new_tokens=max_new,
                         stop_ids=task._stop_ids, device=torch.device("cpu"), tools=tools)
    called = sum(t.calls > 0 for r in runners for t in r.rows.values()) / max(1.0, sums[0])
    return held_out_metrics(sums, task.reward_names)["val_reward"], called


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/grpo_tools_demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--held_out", type=int, default=50, help="keys held out of every stage (scored only)")
    p.add_argument("--sft_call", type=float, default=0.3, help="the SFT replies call the tool this often")
    p.add_argument("--sft_copies", type=int, default=2)
    p.add_argument("--vocab_size", type=int, default=600, help="a BPE on the rendered conversations")
    p.add_argument("--copy_copies", type=int, default=2, help="calling conversations with random values per SFT one")
    p.add_argument("--copy_steps", type=int, default=1000,
                   help="SFT on calling conversations with random values first: the model learns to copy the key "
                        "into its call and the result into its answer")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--n_layers", type=int, default=2)
    p.add_argument("--pretrain_steps", type=int, default=200)
    p.add_argument("--sft_steps", type=int, default=300)
    p.add_argument("--sft_lr", type=float, default=2e-3)
    p.add_argument("--grpo_steps", type=int, default=60)
    p.add_argument("--grpo_lr", type=float, default=3e-4)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--grpo_batch", type=int, default=4)
    p.add_argument("--reuse", action="store_true", help="keep --work's SFT run (GRPO again)")
    a = p.parse_args(argv)
    tok, shards = os.path.join(a.work, "tok"), os.path.join(a.work, "shards")
    pre, copy, sft, rl = (os.path.join(a.work, n) for n in ("pretrain", "copy", "sft", "grpo"))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([a.work, ROOT, os.environ.get("PYTHONPATH", "")]))
    sys.path.insert(0, a.work)
    seq = 384
    model = [f"--dim={a.dim}", f"--n_layers={a.n_layers}", "--n_heads=4", "--multiple_of=16"]
    common = [f"--tokenizer_dir={tok}", "--device=cpu", "--progress=false", "--peak_flops=1e11", "--log_interval=25",
              f"--threads={a.threads}", f"--seed={a.seed}", "--warmup_iters=10", f"--max_seq_len={seq}"]
    max_new = 96  # the call (~25 tokens), the result fed back (~15), "#### 18" and the stop token
    t_start = time.time()
    paths = {k: os.path.join(a.work, f"{k}.jsonl") for k in ("grpo", "heldout", "sft", "pre")}
    if not (a.reuse and os.path.isdir(os.path.join(sft, "checkpoints"))):
        shutil.rmtree(a.work, ignore_errors=True)
        os.makedirs(a.work)
        paths = write_task(a.work, a)
        paths["corpus"] = write_corpus(a.work, paths["pre"])
        run([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={paths['corpus']}", f"--output_dir={tok}",
             f"--vocab_size={a.vocab_size}", "--tokenizer_type=hf_bbpe"], "tokenizer", env)
        run([PY, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={paths['corpus']}",
             f"--tokenizer_dir={tok}", f"--output_dir={shards}", "--num_workers=1", "--no_progress"], "shards", env)
        run([PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}",
             f"--max_seq_len={seq}", "--val_ratio=0.01"], "index", env)
        run([PY, "train_my_ddp.py", *common, *model, f"--data_dir={shards}", f"--out_dir={pre}",
             f"--max_iters={a.pretrain_steps}", "--batch_size=8", "--learning_rate=3e-3", "--eval_interval=0",
             f"--checkpoint_interval={a.pretrain_steps}"], "pretrain", env)
        for name, src, dst, data, steps in (("SFT to copy", pre, copy, paths["pre"], a.copy_steps),
                                            ("SFT", copy, sft, paths["sft"], a.sft_steps)):
            run([PY, "train_my_ddp.py", *common, "--task_type=sft", f"--init_from={src}", f"--data_dir={data}",
                 f"--out_dir={dst}", f"--max_iters={steps}", "--batch_size=16", f"--learning_rate={a.sft_lr}",
                 "--eval_interval=0", f"--checkpoint_interval={steps}"], name, env)
    shutil.rmtree(rl, ignore_errors=True)
    before, called_before = measure(sft, tok, paths["heldout"], max_new, a.work)
    print(f"[demo] after SFT, {a.held_out} held-out keys: greedy pass@1 {before:.3f}, answers that called the "
          f"tool {called_before:.3f}", flush=True)
    t0 = time.time()
    run([PY, "train_my_ddp.py", *common, "--task_type=grpo", f"--init_from={sft}", f"--data_dir={paths['grpo']}",
         f"--eval_data_dir={paths['heldout']}", f"--out_dir={rl}", f"--max_iters={a.grpo_steps}",
         f"--batch_size={a.grpo_batch}", f"--num_generations={a.num_generations}", "--max_prompt_length=280",
         f"--max_completion_length={max_new}", f"--learning_rate={a.grpo_lr}", "--lr_schedule=constant",
         "--temperature=1.0", "--weight_decay=0", "--reward_funcs=numeric_match", "--tools=demo_tools:lookup",
         "--max_tool_calling_iterations=1", f"--eval_interval={max(1, a.grpo_steps // 4)}",
         f"--checkpoint_interval={a.grpo_steps}"], "GRPO", env)
    grpo_s = time.time() - t0
    after, called_after = measure(rl, tok, paths["heldout"], max_new, a.work)
    from utils.metrics import dedupe_by_step, read_metrics
    rows = dedupe_by_step(read_metrics(os.path.join(rl, "metrics.jsonl")))
    steps = sorted(rows)
    k = max(1, len(steps) // 5)
    mean = lambda key, part: sum(rows[s][key] for s in part) / len(part)  # noqa: E731
    curve = ", ".join(f"{s}: {rows[s]['val_reward']:.3f}" for s in steps if "val_reward" in rows[s])
    print(f"[demo] GRPO {len(steps)} steps in {grpo_s:.0f} s: sampled reward {mean('reward', steps[:k]):.3f} (first "
          f"{k} steps) -> {mean('reward', steps[-k:]):.3f} (last {k}); tool calls per completion "
          f"{mean('tool_call_frequency', steps[:k]):.3f} -> {mean('tool_call_frequency', steps[-k:]):.3f}; "
          f"held-out val_reward during GRPO: {curve}")
    print(f"[demo] {a.held_out} held-out keys, greedy: pass@1 {before:.3f} -> {after:.3f}, answers that called the "
          f"tool {called_before:.3f} -> {called_after:.3f}; total {time.time() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
