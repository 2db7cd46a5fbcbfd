"""GRPO with tools on the CPU: a tiny model learns to call a calculator. The task is `a+b=` (a, b in 0..--max_n) as a
chat user turn whose prompt offers one tool, `add(a, b)`; the reply `#### <sum>`. The model never sees a true sum
outside a tool's result: SFT shows it calling the tool and copying its result (--sft_call of the time) or answering at
once with a wrong guess (the rest), so it cannot add by itself. GRPO (--tools, numeric_match on the last turn) then
rewards the completions whose answer is right: the ones that called the tool and copied its result. The held-out
greedy pass@1 (answers decoded with the calls run, the trainer's own --eval_data_dir evaluation) and the share of
completions that call the tool are printed before and after.

Owns: its work directory (--work): the tool module, the task's records (training and held-out prompts, SFT
conversations with tool calls), a character-level tokenizer, a short pretraining on the conversations' plain text
(GRPO and SFT start from pretrained weights), the SFT run, the GRPO run.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.grpo_demo import PY, run  # noqa: E402

TOOL_MODULE = '''def add(a: int, b: int) -> int:
    """Adds two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b
'''


def schema() -> dict:
    from transformers.utils import get_json_schema
    scope: dict = {}
    exec(TOOL_MODULE, scope)  # noqa: S102 - the demo's own tool, written above
    return get_json_schema(scope["add"])


def call_turn(x: int, y: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": x, "b": y}}}]}


def write_task(work: str, a: argparse.Namespace) -> dict:
    """Prompt records (training, held out), SFT conversations (a call and its copied result --sft_call of the time,
    else a wrong answer at once), pretraining text (the conversations' words, no special tokens)."""
    rng = random.Random(a.seed)
    pairs = [(x, y) for x in range(a.max_n + 1) for y in range(a.max_n + 1)]
    rng.shuffle(pairs)
    held, train = pairs[:a.held_out], pairs[a.held_out:]
    tools = [schema()]
    paths = {k: os.path.join(work, f"{k}.jsonl") for k in ("grpo", "heldout", "sft")}
    for key, subset in (("grpo", train), ("heldout", held)):
        with open(paths[key], "w", encoding="utf-8") as f:
            for x, y in subset:
                f.write(json.dumps({"messages": [{"role": "user", "content": f"{x}+{y}="}], "answer": str(x + y)})
                        + "\n")
    corpus = os.path.join(work, "corpus")
    os.makedirs(corpus)
    with open(paths["sft"], "w", encoding="utf-8") as f, open(os.path.join(corpus, "text.jsonl"), "w") as c:
        for _ in range(a.sft_copies):
            for x, y in train:
                user = {"role": "user", "content": f"{x}+{y}="}
                if rng.random() < a.sft_call:
                    msgs = [user, call_turn(x, y), {"role": "tool", "name": "add", "content": str(x + y)},
                            {"role": "assistant", "content": f"#### {x + y}"}]
                else:  # a guess, never right: the sums are the tool's to give
                    msgs = [user, {"role": "assistant", "content": f"#### {x + y + rng.choice([-2, -1, 1, 2])}"}]
                f.write(json.dumps({"tools": tools, "messages": msgs}) + "\n")
                c.write(json.dumps({"text": f"{x}+{y}= <tool_call> add a {x} b {y} </tool_call> {x + y} #### "})
                        + "\n")
    with open(os.path.join(work, "demo_tools.py"), "w", encoding="utf-8") as f:
        f.write(TOOL_MODULE)
    paths["corpus"] = corpus
    return paths


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
    cfg = TrainConfig(task_type="grpo", data_dir=records, tokenizer_dir=tok_dir, tools="demo_tools:add",
                      reward_funcs="numeric_match", max_prompt_length=1024, max_completion_length=max_new,
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
                         lambda ids: tok.decode(ids, skip_special_tokens=True), rows=64, max_new_tokens=max_new, stop_ids=task._stop_ids, device=torch.device("cpu"),
                         tools=tools)
    called = sum(t.calls > 0 for r in runners for t in r.rows.values()) / max(1.0, sums[0])
    return held_out_metrics(sums, task.reward_names)["val_reward"], called


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default="/tmp/grpo_tools_demo")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max_n", type=int, default=49, help="operands 0..max_n")
    p.add_argument("--held_out", type=int, default=100)
    p.add_argument("--sft_call", type=float, default=0.3, help="the SFT replies call the tool this often")
    p.add_argument("--sft_copies", type=int, default=1)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--n_layers", type=int, default=2)
    p.add_argument("--pretrain_steps", type=int, default=100)
    p.add_argument("--sft_steps", type=int, default=300)
    p.add_argument("--sft_lr", type=float, default=2e-3)
    p.add_argument("--grpo_steps", type=int, default=60)
    p.add_argument("--grpo_lr", type=float, default=3e-4)
    p.add_argument("--num_generations", type=int, default=8)
    p.add_argument("--grpo_batch", type=int, default=4)
    p.add_argument("--reuse", action="store_true", help="keep --work's SFT run (GRPO again)")
    a = p.parse_args(argv)
    tok, shards = os.path.join(a.work, "tok"), os.path.join(a.work, "shards")
    pre, sft, rl = (os.path.join(a.work, n) for n in ("pretrain", "sft", "grpo"))
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([a.work, ROOT, os.environ.get("PYTHONPATH", "")]))
    sys.path.insert(0, a.work)
    seq = 1024
    model = [f"--dim={a.dim}", f"--n_layers={a.n_layers}", "--n_heads=4", "--multiple_of=16"]
    common = [f"--tokenizer_dir={tok}", "--device=cpu", "--progress=false", "--peak_flops=1e11", "--log_interval=25",
              f"--threads={a.threads}", f"--seed={a.seed}", "--warmup_iters=10", f"--max_seq_len={seq}"]
    max_new = 160  # the call (~70 characters), the result fed back (~60), "#### 98" and the stop token
    t_start = time.time()
    paths = {k: os.path.join(a.work, f"{k}.jsonl") for k in ("grpo", "heldout", "sft")}
    if not (a.reuse and os.path.isdir(os.path.join(sft, "checkpoints"))):
        shutil.rmtree(a.work, ignore_errors=True)
        os.makedirs(a.work)
        paths = write_task(a.work, a)
        run([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={paths['corpus']}", f"--output_dir={tok}",
             "--vocab_size=263", "--tokenizer_type=hf_bbpe"], "tokenizer", env)
        run([PY, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={paths['corpus']}",
             f"--tokenizer_dir={tok}", f"--output_dir={shards}", "--num_workers=1", "--no_progress"], "shards", env)
        run([PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}",
             f"--max_seq_len={seq}", "--val_ratio=0.01"], "index", env)
        run([PY, "train_my_ddp.py", *common, *model, f"--data_dir={shards}", f"--out_dir={pre}",
             f"--max_iters={a.pretrain_steps}", "--batch_size=4", "--learning_rate=3e-3", "--eval_interval=0",
             f"--checkpoint_interval={a.pretrain_steps}"], "pretrain", env)
        run([PY, "train_my_ddp.py", *common, "--task_type=sft", f"--init_from={pre}", f"--data_dir={paths['sft']}",
             f"--out_dir={sft}", f"--max_iters={a.sft_steps}", "--batch_size=16", f"--learning_rate={a.sft_lr}",
             "--eval_interval=0", f"--checkpoint_interval={a.sft_steps}"], "SFT", env)
    shutil.rmtree(rl, ignore_errors=True)
    before, called_before = measure(sft, tok, paths["heldout"], max_new, a.work)
    print(f"[demo] after SFT, {a.held_out} held-out prompts: greedy pass@1 {before:.3f}, answers that called the "
          f"tool {called_before:.3f}", flush=True)
    t0 = time.time()
    run([PY, "train_my_ddp.py", *common, "--task_type=grpo", f"--init_from={sft}", f"--data_dir={paths['grpo']}",
         f"--eval_data_dir={paths['heldout']}", f"--out_dir={rl}", f"--max_iters={a.grpo_steps}",
         f"--batch_size={a.grpo_batch}", f"--num_generations={a.num_generations}", "--max_prompt_length=860",
         f"--max_completion_length={max_new}", f"--learning_rate={a.grpo_lr}", "--lr_schedule=constant",
         "--temperature=1.0", "--weight_decay=0", "--reward_funcs=numeric_match", "--tools=demo_tools:add",
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
    print(f"[demo] {a.held_out} held-out prompts, greedy: pass@1 {before:.3f} -> {after:.3f}, answers that called the "
          f"tool {called_before:.3f} -> {called_after:.3f}; total {time.time() - t_start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
