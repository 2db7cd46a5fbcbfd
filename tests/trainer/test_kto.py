"""KTO (--task_type=kto): the loss against its formula in Python floats, the unpaired examples and mismatched KL rows
the collate makes of DPO pairs, the micro-batch's KL estimate against the two models' own log-probabilities, and runs
from the pretrained tiny model: the margin between desirable and undesirable rewards grows, and two data-parallel
ranks give the one-process run's steps."""
from __future__ import annotations

import math
import os

import pytest
import torch

from tests.conftest import ROOT, run_cmd, train_cmd
from tests.trainer.test_end_to_end import _env
from utils.constants import IGNORE_INDEX
from utils.metrics import dedupe_by_step, read_metrics


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_kto_loss_is_the_papers_formula():
    from trainer.tasks.kto import kto_loss
    policy, ref = [-3.0, -5.5, -2.0, -7.25], [-3.5, -5.0, -2.5, -6.0]
    desirable = [True, True, False, False]
    beta, kl, wd, wu = 0.3, 0.4, 1.5, 0.75
    losses, rewards = kto_loss(torch.tensor(policy, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64),
                               torch.tensor(desirable), torch.tensor(kl, dtype=torch.float64), beta=beta,
                               desirable_weight=wd, undesirable_weight=wu)
    for i, (p, r, d) in enumerate(zip(policy, ref, desirable)):
        want = wd * (1 - _sigmoid(beta * (p - r - kl))) if d else wu * (1 - _sigmoid(beta * (kl - (p - r))))
        assert abs(float(losses[i]) - want) < 1e-12 and abs(float(rewards[i]) - beta * (p - r)) < 1e-12
    apo, _ = kto_loss(torch.tensor(policy), torch.tensor(ref), torch.tensor(desirable), torch.tensor(kl), beta=beta,
                      loss_type="apo_zero_unpaired")
    for i, (p, r, d) in enumerate(zip(policy, ref, desirable)):
        want = 1 - _sigmoid(beta * (p - r)) if d else _sigmoid(beta * (p - r))  # (no KL, no weights)
        assert abs(float(apo[i]) - want) < 1e-6


def _items():
    """Three pairs as KTOPairs gives them: (ids, labels) unshifted, the reply labelled."""
    def side(prompt, reply):
        ids = torch.tensor(prompt + reply)
        return ids, torch.cat((torch.full((len(prompt),), IGNORE_INDEX), torch.tensor(reply)))
    pairs = [([1, 2, 3], [10, 11], [20]), ([4, 5], [12, 13, 14], [21, 22]), ([6, 7, 8, 9], [15], [23, 24, 25])]
    out = []
    for prompt, chosen, rejected in pairs:
        (ci, cl), (ri, rl) = side(prompt, chosen), side(prompt, rejected)
        out.append({"chosen_ids": ci, "chosen_labels": cl, "rejected_ids": ri, "rejected_labels": rl})
    return pairs, out


def test_the_collate_unpairs_and_builds_the_mismatched_rows():
    from dataset.dataset_kto import kto_collate
    pairs, items = _items()
    batch = kto_collate(pad_id=0, max_seq_len=6)(items)
    rows = [(p, c) for p, c, _ in pairs] + [(p, r) for p, _, r in pairs]  # the chosen, then the rejected
    assert batch["desirable"].tolist() == [True] * 3 + [False] * 3
    for k, (prompt, reply) in enumerate(rows):
        n = len(prompt) + len(reply) - 1
        assert batch["input_ids"][k, :n].tolist() == (prompt + reply)[:-1]
        assert batch["labels"][k, :n].tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + reply
        assert batch["attention_mask"][k].sum() == n
        # example k's prompt with example k+1's reply (the last with the first's), at most max_seq_len + 1 tokens
        other = rows[(k + 1) % len(rows)][1]
        kl = (prompt + other)[:7]
        kl_targets = kl[len(prompt):]
        m = len(kl) - 1
        assert batch["kl_input_ids"][k, :m].tolist() == kl[:-1]
        assert batch["kl_labels"][k, :m].tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + kl_targets
        assert int(batch["kl_attention_mask"][k].sum()) == m
    assert "kl_input_ids" not in kto_collate(0, 6, kl_rows=False)(items)


def test_the_micro_batch_kl_is_the_mean_log_ratio_of_the_mismatched_rows():
    """micro_batch_loss's loss equals kto_loss evaluated on the two models' log-probabilities computed here, with
    z = max(0, mean over the KL rows of log pi - log ref)."""
    from model import ModelConfig, Transformer
    from dataset.dataset_kto import kto_collate
    from trainer.config import TrainConfig
    from trainer.tasks.kto import KTOTask, kto_loss
    _, items = _items()
    batch = kto_collate(pad_id=0, max_seq_len=6)(items)
    torch.manual_seed(0)
    policy = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, multiple_of=16, max_seq_len=16))
    torch.manual_seed(2)
    ref = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, multiple_of=16, max_seq_len=16))
    cfg = TrainConfig(task_type="kto", dpo_beta=0.5, kto_desirable_weight=1.2)

    def logps(model, prefix="", b=None):
        b = batch if b is None else b
        logits = model(b[f"{prefix}input_ids"], attention_mask=b[f"{prefix}attention_mask"]).float()
        y = b[f"{prefix}labels"]
        lp = torch.log_softmax(logits, -1).gather(-1, y.clamp(min=0)[..., None])[..., 0]
        return (lp * (y != IGNORE_INDEX)).sum(-1)

    loss, stats = KTOTask(cfg).micro_batch_loss(policy, ref, batch, torch.device("cpu"))
    with torch.no_grad():
        z = max(0.0, float((logps(policy, "kl_") - logps(ref, "kl_")).mean()))
        assert z > 0.01  # (these two models' estimate is not clamped: the loss depends on it)
        want, _ = kto_loss(logps(policy), logps(ref), batch["desirable"], torch.tensor(z), beta=0.5,
                           desirable_weight=1.2)
    assert abs(float(loss) - float(want.sum())) < 1e-5 and abs(float(stats["kl"]) / 6 - z) < 1e-5
    assert float(stats["desirable"]) == 3
    # a training step: z is the step's, the mean over every micro-batch's KL rows (before_step), which each
    # micro-batch's loss then uses; here two micro-batches whose own estimates differ
    other = kto_collate(pad_id=0, max_seq_len=6)(items[1:])
    with torch.no_grad():
        kl_rows = [logps(policy, "kl_", b) - logps(ref, "kl_", b) for b in (batch, other)]
    step_z = max(0.0, float(torch.cat(kl_rows).mean()))
    assert abs(step_z - z) > 1e-3  # (the second micro-batch moves it)

    class _Engine:
        module = policy
        optimizer = type("O", (), {"finish_param_sync": staticmethod(lambda: None)})

        @staticmethod
        def sum_over_data(values, device):
            return torch.tensor(values, dtype=torch.float64)
    loop = type("L", (), {"engine": _Engine, "ref_model": ref, "info": type("I", (), {"device": torch.device("cpu")})})
    marked, skipped = KTOTask(cfg).before_step(loop, lambda: ([batch, other], ["s"]))
    assert skipped == ["s"] and [b["_kto_kl"] for b in marked] == [marked[0]["_kto_kl"]] * 2
    assert abs(marked[0]["_kto_kl"] - step_z) < 1e-6
    loss, stats = KTOTask(cfg).micro_batch_loss(policy, ref, marked[0], torch.device("cpu"))
    with torch.no_grad():
        want, _ = kto_loss(logps(policy), logps(ref), batch["desirable"], torch.tensor(step_z), beta=0.5,
                           desirable_weight=1.2)
    assert abs(float(loss) - float(want.sum())) < 1e-5 and abs(float(stats["kl"]) / 6 - step_z) < 1e-5


def _toy(tmp_path, n: int):
    toy = tmp_path / "toy_prefs.jsonl"
    with open(os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl"), encoding="utf-8") as f:
        toy.write_text("".join(line for _, line in zip(range(n), f)), encoding="utf-8")
    return toy


def _args(tiny_pretrain_data, toy, init, out, *extra):
    return [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--warmup_iters=2",
            "--seed=3", "--val_ratio=0.0", "--task_type=kto", f"--data_dir={toy}", f"--init_from={init}",
            f"--out_dir={out}", "--learning_rate=3e-3", "--dpo_beta=0.5", *extra]


def test_kto_learns_the_preferences(pretrained, tiny_pretrain_data, tmp_path):
    out = tmp_path / "kto"
    run_cmd(train_cmd(_args(tiny_pretrain_data, _toy(tmp_path, 16), pretrained["out"], out, "--max_iters=10",
                            "--batch_size=8", "--checkpoint_interval=10")), env=_env())
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert recs[1]["reward_margin"] == 0.0 and recs[1]["kl"] == 0.0  # policy == reference at step 1
    assert sum(recs[s]["reward_margin"] for s in (8, 9, 10)) > 0.5, recs
    assert sum(recs[s]["loss"] for s in (8, 9, 10)) < sum(recs[s]["loss"] for s in (1, 2, 3))
    assert all(recs[s]["kl"] >= 0 for s in recs)


@pytest.mark.parametrize("loss,engines", [("kto", ("ddp", "fsdp")), ("apo_zero_unpaired", ("ddp",))])
def test_two_ranks_follow_one_process(pretrained, tiny_pretrain_data, tmp_path, loss, engines):
    """Our DDP (and FSDP2) at 2 ranks of 2 pairs each against one process accumulating the same two micro-batches:
    the KL estimate is the step's (every micro-batch's rows, summed over the ranks), so the steps are the same (to
    fp32 summation order)."""
    toy = _toy(tmp_path, 12)
    common = ["--max_iters=3", "--batch_size=2", "--checkpoint_interval=100", f"--kto_loss={loss}"]
    one = tmp_path / "one"
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], one, *common,
                            "--gradient_accumulation_steps=2")), env=_env())
    a = dedupe_by_step(read_metrics(os.path.join(one, "metrics.jsonl")))
    assert sorted(a) == [1, 2, 3] and a[3]["reward_margin"] != 0.0
    for engine in engines:
        two = tmp_path / engine
        run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], two, *common, f"--parallel={engine}"), 2),
                env=_env())
        b = dedupe_by_step(read_metrics(os.path.join(two, "metrics.jsonl")))
        assert sorted(b) == [1, 2, 3]
        for s in a:
            for key in ("loss", "kl", "reward_margin"):
                assert abs(a[s][key] - b[s][key]) <= 1e-5 * max(1.0, abs(a[s][key])), (engine, s, key, a[s][key],
                                                                                      b[s][key])


def _labelled(tmp_path, n: int, bad: bool = False):
    """The first n pairs as TRL's unpaired examples: the chosen reply labelled true, the rejected false (one record
    each, interleaved); `bad` adds records a reader must skip: a label that is not a bool, a missing completion."""
    import json
    out = tmp_path / "labelled.jsonl"
    lines = []
    with open(os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl"), encoding="utf-8") as f:
        for _, line in zip(range(n), f):
            rec = json.loads(line)
            lines += [json.dumps({"prompt": rec["prompt"], "completion": rec["chosen"], "label": True}),
                      json.dumps({"prompt": [{"role": "user", "content": rec["prompt"]}],
                                  "completion": [{"role": "assistant", "content": rec["rejected"]}], "label": False})]
    if bad:
        lines.insert(1, json.dumps({"prompt": "p", "completion": "c", "label": "yes"}))
        lines.insert(3, json.dumps({"prompt": "p", "label": True}))
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def test_labelled_examples_pretokenize_as_the_trainer_reads_them(tiny_pretrain_data, tmp_path):
    """pretokenize_kto_data's folder holds what the trainer makes of the raw records in memory (ids, labels, the
    desirable column), bad records counted and skipped with their line; the reader tells the two data shapes apart."""
    import numpy as np

    from data_preprocess.chat_tokens import KTO
    from data_preprocess.pretokenize_kto_data import holds_pairs, main, tokenize_kto_records
    from dataset.dataset_kto import KTOExamples
    tok = tiny_pretrain_data["tokenizer_dir"]
    raw = _labelled(tmp_path, 6, bad=True)
    out = tmp_path / "kto_tok"
    assert main([f"--data_dir={raw}", f"--tokenizer_dir={tok}", "--max_seq_len=64", f"--out_dir={out}",
                 "--num_workers=1"]) == 0
    mem = tokenize_kto_records(str(raw), tok, 64)
    assert mem.kind is KTO and sum(mem.meta["files"][0]["skipped"].values()) == 2, mem.meta["files"][0]
    folder, memory = KTOExamples(str(out)), KTOExamples(mem)
    assert len(folder) == len(memory) == 12
    for i in range(12):
        a, b = folder[i], memory[i]
        assert torch.equal(a["ids"], b["ids"]) and torch.equal(a["labels"], b["labels"])
        assert a["desirable"] == b["desirable"] == (i % 2 == 0)
        # labels on the completion only: one run of its ids (the prompt's turns before it are -100)
        lab = a["labels"].numpy()
        on = np.flatnonzero(lab != IGNORE_INDEX)
        assert on.size >= 2 and (np.diff(on) == 1).all() and (lab[on] == a["ids"].numpy()[on]).all()
    assert not holds_pairs(str(raw)) and not holds_pairs(str(out))
    assert holds_pairs(os.path.join(ROOT, "data", "dpo"))
    strict = main([f"--data_dir={raw}", f"--tokenizer_dir={tok}", "--max_seq_len=64",
                   f"--out_dir={tmp_path / 'strict'}", "--num_workers=1", "--strict=true"])
    assert strict == 3


def test_kto_learns_from_labelled_examples(pretrained, tiny_pretrain_data, tmp_path):
    out = tmp_path / "kto"
    r = run_cmd(train_cmd(_args(tiny_pretrain_data, _labelled(tmp_path, 16), pretrained["out"], out, "--max_iters=10",
                                "--batch_size=16", "--checkpoint_interval=10", "--kto_desirable_weight=1.2")),
                env=_env())
    assert "[data] kto: 16 desirable and 16 undesirable examples; " in r.stdout and "= 1.20 (" in r.stdout
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert sum(recs[s]["reward_margin"] for s in (8, 9, 10)) > 0.5, recs
    assert sum(recs[s]["loss"] for s in (8, 9, 10)) < sum(recs[s]["loss"] for s in (1, 2, 3))


def test_pipeline_stages_are_refused_in_one_line():
    """The KL rows are forwards of the task's own: pipeline stages run their schedule's only (task_forwards)."""
    import dataclasses

    from parallel.config import ParallelConfig
    from trainer.config import TrainConfig, engine_needs
    cfg = dataclasses.replace(TrainConfig(), task_type="kto", pipeline_parallel_size=2, gradient_accumulation_steps=2)
    problems = ParallelConfig.from_flags(cfg).problems(world_size=2, needs=engine_needs(cfg))
    assert any(p.startswith("--task_type=kto cannot be combined with --pipeline_parallel_size=2 (KTO's KL rows")
               for p in problems), problems
    ddp = dataclasses.replace(cfg, pipeline_parallel_size=1)
    assert not ParallelConfig.from_flags(ddp).problems(world_size=2, needs=engine_needs(ddp))
