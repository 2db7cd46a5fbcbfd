"""--sample_every: samples during training (trainer/samples.py, MetricsLogger.write_samples) never change
training (every global RNG restored, the model back in train mode): a run with samples, crashed and resumed,
has the losses and weights of a run without them, bit for bit; samples.jsonl holds each (step, prompt) once;
the prompt rules, the chat encoding of SFT/DPO runs, and the TensorBoard / W&B sinks."""
from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

import train_my_ddp as T
from tests.trainer.test_end_to_end import final_weights
from trainer.samples import DEFAULT_PROMPT, TrainSampler, prompts_problem, read_prompts
from utils.metrics import MetricsLogger, WandbSink, dedupe_by_step, format_sample, read_metrics


def test_prompt_rules(tmp_path):
    assert read_prompts("") == [DEFAULT_PROMPT]
    assert read_prompts(" Once upon a time | def main(|") == ["Once upon a time", "def main("]
    assert read_prompts("Hello") == ["Hello"]
    f = tmp_path / "prompts.txt"
    f.write_text("first prompt\n\n  second | still one prompt  \n", encoding="utf-8")
    assert read_prompts(str(f)) == ["first prompt", "second | still one prompt"]
    assert prompts_problem(str(tmp_path / "missing.txt")).startswith("no such file")
    assert prompts_problem(" | ") == "no prompt in it (prompts are separated by |)"
    assert prompts_problem(str(f)) is None and prompts_problem("a|b") is None
    (tmp_path / "blank.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(ValueError, match="holds no prompt"):
        read_prompts(str(tmp_path / "blank.txt"))
    assert format_sample({"step": 3, "prompt": "a b", "completion": " c\nd"}) == '[sample step 3] "a b" -> " c\\nd"'


def _rng_snapshot() -> tuple:
    return torch.get_rng_state().clone(), random.getstate(), np.random.get_state()[1].copy()


def test_sampling_restores_every_rng_and_the_train_mode(tiny_pretrain_data, monkeypatch):
    """Even a generator that draws from the global torch, python and numpy RNGs leaves them as they were;
    temperature sampling depends on (seed, step) only; SFT prompts are chat user turns."""
    import model.generate as G
    from model import ModelConfig, Transformer
    from tokenizer import load_tokenizer_meta
    tok_dir = tiny_pretrain_data["tokenizer_dir"]
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=load_tokenizer_meta(tok_dir)["vocab_size"], dim=32, n_layers=1,
                                    n_heads=4, multiple_of=16, max_seq_len=32, attn_dropout=0.1,
                                    resid_dropout=0.1)).train()
    real = G.generate

    def greedy_for_rng(*a, **k):  # a generator that (wrongly) consumes the training's random numbers
        torch.rand(3), random.random(), np.random.rand()
        return real(*a, **k)
    monkeypatch.setattr(G, "generate", greedy_for_rng)
    sampler = TrainSampler(["Once upon a time", "def f("], tok_dir, "pretrain", every=2, max_new_tokens=6,
                           temperature=0.9, seed=7)
    assert sampler.due(4) and not sampler.due(3)
    cpu = torch.device("cpu")
    torch.manual_seed(123)
    before = _rng_snapshot()
    first = sampler.sample(model, 4, cpu)
    after = _rng_snapshot()
    assert torch.equal(before[0], after[0]) and before[1] == after[1] and np.array_equal(before[2], after[2])
    assert model.training  # back in train mode (dropout on for the next step)
    assert [r["prompt"] for r in first] == ["Once upon a time", "def f("]
    assert all(r["step"] == 4 and 0 < r["new_tokens"] <= 6 for r in first)
    torch.manual_seed(999)  # another global state: the same samples (private generator seeded by seed, step)
    assert sampler.sample(model, 4, cpu) == first
    completions = [r["completion"] for r in first]
    assert [r["completion"] for r in sampler.sample(model, 6, cpu)] != completions  # another step, another draw
    meta = load_tokenizer_meta(tok_dir)["special_tokens"]
    assert sampler.ids[0][0] == meta["bos"]["id"]
    chat = TrainSampler(["Hi"], tok_dir, "sft", every=1, max_new_tokens=2)
    assert chat.ids[0][0] == meta["im_start"]["id"] and chat.ids[0][-1] != meta["im_end"]["id"]
    assert chat.stop_ids == [meta["eos"]["id"], meta["im_end"]["id"]]


class _FakeTB:
    def __init__(self):
        self.texts = []

    def add_text(self, tag, text, step):
        self.texts.append((tag, text, step))

    def add_scalar(self, tag, value, step):
        pass

    def close(self):
        pass


class _FakeRun:
    id = "fake"

    def __init__(self):
        self.logged = []

    def log(self, data, step):
        self.logged.append((data, step))


def test_samples_go_to_jsonl_tensorboard_and_wandb(tmp_path):
    pytest.importorskip("wandb")
    lines = []
    logger = MetricsLogger(str(tmp_path), log=lines.append)
    logger.tb = _FakeTB()
    sink = object.__new__(WandbSink)  # the sink without wandb.init: its run is a recorder
    sink.run, sink.resumed_after, sink.last_step, sink.skipped = _FakeRun(), 4, 4, 0
    sink.state_path = str(tmp_path / "wandb_run.json")
    logger.wandb = sink
    logger.write({"step": 6, "loss": 1.0})
    records = [{"step": 6, "prompt": "p1", "completion": " c1", "new_tokens": 1},
               {"step": 6, "prompt": "p2", "completion": " c2", "new_tokens": 1}]
    logger.write_samples(records)
    logger.write_samples([dict(r, step=4) for r in records])  # a step the resumed W&B run already has
    rows = read_metrics(str(tmp_path / "samples.jsonl"))
    assert [(r["step"], r["prompt"], r["completion"]) for r in rows] == \
        [(6, "p1", " c1"), (6, "p2", " c2"), (4, "p1", " c1"), (4, "p2", " c2")]
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()][0]["step"] == 6  # untouched
    assert lines[:2] == ['[sample step 6] "p1" -> " c1"', '[sample step 6] "p2" -> " c2"']
    assert logger.tb.texts[:2] == [("samples/0", "**p1**  c1", 6), ("samples/1", "**p2**  c2", 6)]
    tables = [(d["samples"], s) for d, s in sink.run.logged if "samples" in d]
    assert len(tables) == 1 and tables[0][1] == 6
    assert tables[0][0].columns == ["prompt", "completion"] and tables[0][0].data == [["p1", " c1"], ["p2", " c2"]]


def _losses(out) -> dict[int, float]:
    return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl"))).items()}


def test_samples_leave_training_bit_exact_through_a_resume(tiny_pretrain_run_args, tmp_path, capsys, monkeypatch):
    """Dropout draws from the training's RNG every step, so a sampler that moved it would change the losses.
    The run with samples is also stopped at step 5 (checkpoint 3) and resumed: the same losses and weights
    as the run without samples, and the samples of step 4, generated again after the resume from the
    same weights, equal those of the attempt that stopped."""
    args = [*tiny_pretrain_run_args, "--max_iters=6", "--dropout=0.1", "--eval_interval=2"]
    plain, sampled = tmp_path / "plain", tmp_path / "sampled"
    assert T.main([*args, f"--out_dir={plain}"]) == 0
    extra = ["--sample_every=2", "--sample_prompts=Once upon a time|def main(", "--sample_max_new_tokens=8",
             "--sample_temperature=0.8"]
    monkeypatch.setenv("MYLLM_FAULT", "nan_loss@5")
    assert T.main([*args, *extra, f"--out_dir={sampled}"]) == 4
    monkeypatch.delenv("MYLLM_FAULT")
    first = capsys.readouterr().out
    assert '[sample step 2] "Once upon a time" -> "' in first
    assert first.index("[sample step 2]") > first.index("step 2/")  # after the step's line (and evaluation)
    assert T.main([*args, *extra, f"--out_dir={sampled}"]) == 0
    assert _losses(sampled) == _losses(plain)
    a, b = final_weights(plain), final_weights(sampled)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = read_metrics(str(sampled / "samples.jsonl"))
    assert [(r["step"], r["prompt"]) for r in rows] == [(s, p) for s in (2, 4, 6) for p in ("Once upon a time",
                                                                                             "def main(")]
    aside = [f for f in os.listdir(sampled) if f.startswith("samples.jsonl.after_step3.")]
    assert len(aside) == 1  # the stopped attempt's step-4 samples, kept aside like its metrics rows
    old = [(r["step"], r["prompt"], r["completion"]) for r in read_metrics(str(sampled / aside[0]))]
    assert old == [(r["step"], r["prompt"], r["completion"]) for r in rows if r["step"] == 4]
    assert all(r["new_tokens"] > 0 for r in rows)


@pytest.mark.slow
def test_two_ranks_zero1_sample_on_rank_0_without_changing_training(tiny_pretrain_run_args, tmp_path):
    """2 processes, ZeRO-1 with the parameter all-gather overlapped: rank 0 samples from the gathered weights
    while rank 1 trains on; the losses and weights equal the run without samples."""
    from tests.conftest import run_cmd
    from tests.trainer.test_end_to_end import _env, train_cmd
    args = [*tiny_pretrain_run_args, "--batch_size=2", "--max_iters=4", "--dropout=0.1", "--bucket_size=20000",
            "--use_distributed_optimizer=true", "--overlap_param_gather=true"]
    plain, sampled = tmp_path / "plain", tmp_path / "sampled"
    run_cmd(train_cmd([*args, f"--out_dir={plain}"], nproc=2), env=_env())
    out = run_cmd(train_cmd([*args, f"--out_dir={sampled}", "--sample_every=1", "--sample_temperature=0.7"], nproc=2),
                  env=_env()).stdout
    assert out.count('[sample step ') == 4  # rank 0 only, once per step
    assert _losses(sampled) == _losses(plain)
    a, b = final_weights(plain), final_weights(sampled)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in read_metrics(str(sampled / "samples.jsonl"))] == [1, 2, 3, 4]
