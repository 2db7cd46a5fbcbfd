"""On-policy distillation (--distill_lmbda, GKD's lambda): which steps the student's own replies replace the data's,
each row's prompt (everything before its last reply), the reply sampled as GRPO's rollouts from a generator of
(seed, step, the row's tokens) whatever the micro-batch, and the rows built from it. Whole runs (one process against
two ranks, the KL falling) are in test_distill.py beside its teacher."""
from __future__ import annotations

import os
import zlib
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import ROOT
from utils.constants import IGNORE_INDEX


def test_the_share_of_student_steps_is_lmbda_drawn_from_seed_and_step():
    from trainer.tasks.distill import replies_from_student
    n = 4000
    for lmbda in (0.1, 0.5, 0.8):
        share = sum(replies_from_student(7, s, lmbda) for s in range(n)) / n
        assert abs(share - lmbda) < 5 * (lmbda * (1 - lmbda) / n) ** 0.5, (lmbda, share)  # 5 binomial sigmas
    assert not any(replies_from_student(7, s, 0.0) for s in range(200))
    assert all(replies_from_student(7, s, 1.0) for s in range(200))
    a, b = ([replies_from_student(seed, s, 0.5) for s in range(64)] for seed in (7, 8))
    assert a == [replies_from_student(7, s, 0.5) for s in range(64)] and a != b  # a function of (seed, step)


def test_the_prompt_ends_before_the_last_reply_and_the_reply_is_the_only_target():
    from trainer.tasks.distill import last_reply_prompt, reply_rows
    ids = torch.tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, 0, 0])  # 9 real tokens, 2 of padding
    # shifted labels: labels[t] is the target of position t; two replies (positions 2-3 and 6-8)
    labels = torch.tensor([-100, -100, 13, 14, -100, -100, 17, 18, 19, -100, -100])
    assert last_reply_prompt(ids, labels, 9) == [10, 11, 12, 13, 14, 15, 16]  # up to the position predicting 17
    assert last_reply_prompt(ids, torch.full_like(labels, -100), 9) == ids[:9].tolist()  # no target: the whole row
    one = torch.tensor([-100, 11, 12, 13, -100, -100, -100, -100, -100, -100, -100])
    assert last_reply_prompt(ids, one, 9) == [10, 11]
    batch = reply_rows([([1, 2, 3], [7, 8, 9]), ([4, 5], [6])], pad_id=0, pad_to=8)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 7, 8, 0, 0, 0], [4, 5, 0, 0, 0, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, -100, 7, 8, 9, -100, -100, -100], [-100, 6] + [-100] * 6]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0] * 3, [1, 1] + [0] * 6]


class _Loop(SimpleNamespace):
    """What before_step reads of the training loop, for one process."""

    def __init__(self, model, step, teacher=None):
        super().__init__(progress=SimpleNamespace(step=step), info=SimpleNamespace(device=torch.device("cpu"),
                                                                                  world_size=1),
                         engine=SimpleNamespace(module=model, optimizer=SimpleNamespace(finish_param_sync=lambda: 0)),
                         ref_model=teacher)


@pytest.fixture(scope="module")
def sft_rows(tiny_pretrain_data):
    from data_preprocess.pretokenize_sft_data import tokenize_sft_records
    from dataset.dataset_sft import build_sft_splits
    records = tokenize_sft_records(os.path.join(ROOT, "data", "sft"), tiny_pretrain_data["tokenizer_dir"], 64)
    train, _, collate = build_sft_splits(records, 64, val_ratio=0.0, seed=0)
    return [train[i] for i in range(4)], collate


def test_a_student_step_samples_each_rows_last_reply_from_its_prompt(sft_rows):
    from model import ModelConfig, Transformer
    from trainer.config import TrainConfig
    from trainer.tasks.distill import DistillTask, last_reply_prompt
    from trainer.tasks.grpo_rollout import rollout_seed, sample_group
    items, collate = sft_rows
    torch.manual_seed(0)
    student = Transformer(ModelConfig(vocab_size=448, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=64))
    cfg = TrainConfig(task_type="distill", distill_lmbda=1.0, max_seq_len=64, max_completion_length=24,
                      temperature=0.9, seed=5)
    task = DistillTask(cfg)
    task._stop_ids, task._pad_id = [2], 0
    batch = collate(items)
    [out], skipped = task.before_step(_Loop(student, 3), lambda: ([batch], ["s"]))
    assert skipped == ["s"] and out["_by"] == "student"
    n_real = batch["attention_mask"].sum(1).tolist()
    for r, n in enumerate(n_real):
        prompt = last_reply_prompt(batch["input_ids"][r], batch["labels"][r], int(n))
        assert len(prompt) < n  # (each of these rows has a reply to replace)
        gen = torch.Generator().manual_seed(rollout_seed(5, 3, zlib.crc32(batch["input_ids"][r, :int(n)].numpy()
                                                                          .tobytes())))
        toks, mask, _ = sample_group(student, prompt, 1, 24, temperature=0.9, top_p=1.0, stop_ids=[2], pad_id=0,
                                     generator=gen)
        reply = toks[0][mask[0]].tolist()[:65 - len(prompt)]
        m = int(out["attention_mask"][r].sum())
        assert m == len(prompt) + len(reply) - 1
        assert out["input_ids"][r, :m].tolist() == (prompt + reply)[:-1]
        assert out["labels"][r, :m].tolist() == [IGNORE_INDEX] * (len(prompt) - 1) + reply
        assert (out["labels"][r, m:] == IGNORE_INDEX).all() and (out["input_ids"][r, m:] == 0).all()
    assert all(x.shape[1] <= 64 for x in (out["input_ids"], out["labels"]))
    # the rows in another order, split over two micro-batches: each row gets the same reply
    order = [2, 0, 3, 1]
    parts = [collate([items[i] for i in order[:2]]), collate([items[i] for i in order[2:]])]
    again, _ = task.before_step(_Loop(student, 3), lambda: (parts, []))
    for k, r in enumerate(order):
        b, j = again[k // 2], k % 2
        m = int(b["attention_mask"][j].sum())
        assert m == int(out["attention_mask"][r].sum()) and b["labels"][j, :m].equal(out["labels"][r, :m])
    # the next step draws other replies; a step not drawn (lmbda 0.5, seed 5) leaves the data's rows as they are
    nxt, _ = task.before_step(_Loop(student, 4), lambda: ([batch], []))
    assert any(not nxt[0]["labels"][r].equal(out["labels"][r]) for r in range(len(items)))
    from trainer.tasks.distill import replies_from_student
    task.lmbda = 0.5
    step = next(s for s in range(50) if not replies_from_student(5, s, 0.5))
    assert task.before_step(_Loop(student, step), lambda: ([batch], []))[0] == [batch]
    # --distill_seq_kd: that step's replies are the teacher's samples, drawn from the same seeds
    torch.manual_seed(1)
    teacher = Transformer(ModelConfig(vocab_size=448, dim=48, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=64))
    task.seq_kd = True
    [kd], _ = task.before_step(_Loop(student, step, teacher), lambda: ([batch], []))
    assert kd["_by"] == "teacher"
    for r, n in enumerate(n_real):
        prompt = last_reply_prompt(batch["input_ids"][r], batch["labels"][r], int(n))
        gen = torch.Generator().manual_seed(rollout_seed(5, step, zlib.crc32(batch["input_ids"][r, :int(n)].numpy()
                                                                             .tobytes())))
        toks, mask, _ = sample_group(teacher, prompt, 1, 24, temperature=0.9, top_p=1.0, stop_ids=[2], pad_id=0,
                                     generator=gen)
        m = int(kd["attention_mask"][r].sum())
        assert kd["labels"][r, :m].tolist() == ([IGNORE_INDEX] * (len(prompt) - 1)
                                                + toks[0][mask[0]].tolist()[:65 - len(prompt)])


def test_a_reply_is_cut_to_the_rows_length_and_the_metrics_count_the_student_rows(sft_rows):
    from model import ModelConfig, Transformer
    from trainer.config import TrainConfig
    from trainer.tasks.distill import DistillTask
    items, collate = sft_rows
    batch = collate(items)
    longest = int(batch["attention_mask"].sum(1).max())
    torch.manual_seed(0)
    student = Transformer(ModelConfig(vocab_size=448, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=64))
    cfg = TrainConfig(task_type="distill", distill_lmbda=1.0, max_seq_len=longest, max_completion_length=64,
                      temperature=3.0, seed=1)  # (a hot sampler: no stop token for a while)
    task = DistillTask(cfg)
    task._stop_ids, task._pad_id = [2], 0
    [out], _ = task.before_step(_Loop(student, 0), lambda: ([batch], []))
    assert out["input_ids"].shape[1] == longest  # every row filled to --max_seq_len positions, none longer
    teacher = Transformer(ModelConfig(vocab_size=448, dim=32, n_layers=1, n_heads=4, multiple_of=16,
                                      max_seq_len=64)).requires_grad_(False)
    _, stats = task.micro_batch_loss(student, teacher, out, torch.device("cpu"))
    _, data = task.micro_batch_loss(student, teacher, batch, torch.device("cpu"))
    assert stats["rows"] == stats["student_rows"] == len(items) and data["student_rows"] == 0.0
    assert stats["teacher_rows"] == data["teacher_rows"] == 0.0
    units = float((out["labels"] != IGNORE_INDEX).sum())
    per_unit = {k: float(v) / units for k, v in stats.items()}
    got = task.step_metrics(per_unit)
    assert got["on_policy"] == 1.0 and abs(got["reply_length"] - units / len(items)) < 1e-9


def test_a_reply_ends_before_an_id_past_the_tokenizers(sft_rows):
    """A vocabulary padded beyond the tokenizer's ids (the student's 448 rows, a tokenizer of 200 here): a sampled
    padding id is no token, and the teacher may have no row for it: the reply ends before it."""
    from model import ModelConfig, Transformer
    from trainer.config import TrainConfig
    from trainer.tasks.distill import DistillTask
    items, collate = sft_rows
    batch = collate(items)
    torch.manual_seed(0)
    student = Transformer(ModelConfig(vocab_size=448, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=64))
    task = DistillTask(TrainConfig(task_type="distill", distill_lmbda=1.0, max_seq_len=64, max_completion_length=16,
                                   temperature=3.0, seed=2))
    task._stop_ids, task._pad_id = [2], 0
    [whole], _ = task.before_step(_Loop(student, 0), lambda: ([batch], []))
    task._vocab = 200
    [cut], _ = task.before_step(_Loop(student, 0), lambda: ([batch], []))
    for r in range(len(items)):
        a, b = (t["labels"][r][t["labels"][r] != IGNORE_INDEX].tolist() for t in (whole, cut))
        k = next((i for i, t in enumerate(a) if t >= 200), len(a))
        assert b == a[:k], (a, b)  # the same draw, up to the first id past the tokenizer's
    assert any(t >= 200 for t in whole["labels"][whole["labels"] != IGNORE_INDEX].tolist())


def test_on_policy_distillation_replies_decoded_together_equal_one_row_at_a_time(sft_rows):
    """--distill_lmbda's replies (G = 1 per row): the micro-batch's rows decoded together (their prompts of different
    lengths padded) build the same training rows as one row at a time (fp64 student: no draw flips by rounding)."""
    from model import ModelConfig, Transformer
    from trainer.config import TrainConfig
    from trainer.tasks.distill import DistillTask
    items, collate = sft_rows
    torch.manual_seed(0)
    student = Transformer(ModelConfig(vocab_size=448, dim=32, n_layers=1, n_heads=4, multiple_of=16,
                                      max_seq_len=64)).double()
    batch = collate(items)
    outs = {}
    for k in (1, 0, 3):  # one row at a time, the whole micro-batch, 3 + 1
        cfg = TrainConfig(task_type="distill", distill_lmbda=1.0, max_seq_len=64, max_completion_length=24,
                          temperature=0.9, seed=5, rollout_batch_prompts=k)
        task = DistillTask(cfg)
        task._stop_ids, task._pad_id = [2], 0
        [outs[k]], _ = task.before_step(_Loop(student, 3), lambda: ([batch], []))
    from trainer.tasks.distill import last_reply_prompt
    prompts = [last_reply_prompt(batch["input_ids"][r], batch["labels"][r], int(n))
               for r, n in enumerate(batch["attention_mask"].sum(1).tolist())]
    assert len({len(p) for p in prompts}) > 1  # prompts of different lengths: padded together
    for k in (0, 3):
        assert outs[k].keys() == outs[1].keys()
        for key, v in outs[1].items():
            assert v == outs[k][key] if not torch.is_tensor(v) else torch.equal(v, outs[k][key]), (k, key)
