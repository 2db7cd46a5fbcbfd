"""Distillation (--task_type=distill): the loss against its formula in Python floats, a micro-batch's loss against
both models' full logits computed apart (every position, the targets selected afterwards), a run from the pretrained
model towards an SFT'd teacher whose KL falls, two data-parallel ranks against one process, and the refusals."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from tests.conftest import ROOT, run_cmd, run_trainer, train_cmd
from tests.trainer.test_end_to_end import _env
from utils.constants import IGNORE_INDEX
from utils.metrics import dedupe_by_step, read_metrics


def test_distill_loss_is_the_kl_of_the_tempered_distributions():
    from model.distill_head import distill_loss
    student, teacher, target = [1.0, -0.5, 2.0], [0.25, 0.75, 1.5], 2
    for loss_type in ("forward_kl", "reverse_kl", "jsd"):
        for temp, alpha in ((1.0, 0.0), (2.0, 0.25)):
            got, kl, ce = distill_loss(torch.tensor([student], dtype=torch.float64),
                                       torch.tensor([teacher], dtype=torch.float64), torch.tensor([target]),
                                       temperature=temp, alpha=alpha, loss_type=loss_type, beta=0.3)

            def softmax(z):
                e = [math.exp(v / temp) for v in z]
                return [v / sum(e) for v in e]
            q, p = softmax(student), softmax(teacher)
            a, b = (p, q) if loss_type == "forward_kl" else (q, p)
            want_kl = sum(x * (math.log(x) - math.log(y)) for x, y in zip(a, b))
            if loss_type == "jsd":  # beta 0.3: 0.3 KL(p || m) + 0.7 KL(q || m), m = 0.3 p + 0.7 q
                m = [0.3 * x + 0.7 * y for x, y in zip(p, q)]
                want_kl = sum(0.3 * x * math.log(x / z) + 0.7 * y * math.log(y / z) for x, y, z in zip(p, q, m))
            want_ce = -math.log(math.exp(student[target]) / sum(math.exp(v) for v in student))
            assert abs(float(kl[0]) - want_kl) < 1e-12 and abs(float(ce[0]) - want_ce) < 1e-12
            assert abs(float(got[0]) - (alpha * want_ce + (1 - alpha) * temp ** 2 * want_kl)) < 1e-12


def test_a_micro_batch_is_the_loss_of_both_models_full_logits_at_the_targets(tiny_pretrain_data):
    from data_preprocess.pretokenize_sft_data import tokenize_sft_records
    from dataset.dataset_sft import build_sft_splits
    from model import ModelConfig, Transformer
    from model.distill_head import distill_loss
    from trainer.config import TrainConfig
    from trainer.tasks.distill import DistillTask
    records = tokenize_sft_records(os.path.join(ROOT, "data", "sft"), tiny_pretrain_data["tokenizer_dir"], 64)
    train, _, collate = build_sft_splits(records, 64, val_ratio=0.0, seed=0)
    batch = collate([train[i] for i in range(3)])
    kw = dict(vocab_size=448, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=64)
    torch.manual_seed(0)
    student = Transformer(ModelConfig(**kw))
    torch.manual_seed(1)
    teacher = Transformer(ModelConfig(**kw)).requires_grad_(False)
    cfg = TrainConfig(task_type="distill", distill_temperature=2.0, distill_alpha=0.3)
    loss, stats = DistillTask(cfg).micro_batch_loss(student, teacher, batch, torch.device("cpu"))
    with torch.no_grad():
        mask = {k: batch[k] for k in ("attention_mask",) if k in batch}
        s, t = student(batch["input_ids"], **mask), teacher(batch["input_ids"], **mask)  # [B, T, V]: every position
        y = batch["labels"]
        keep = y != IGNORE_INDEX
        want, kl, _ = distill_loss(s[keep], t[keep], y[keep], temperature=2.0, alpha=0.3)
    assert int(keep.sum()) > 10 and abs(float(loss.detach()) - float(want.sum())) < 1e-4 * float(want.sum())
    assert abs(float(stats["kl"]) - float(kl.sum())) < 1e-4 * float(kl.sum())
    loss.backward()
    assert student.lm_head.weight.grad.abs().sum() > 0 and teacher.lm_head.weight.grad is None


def _args(tiny_pretrain_data, init, out, *extra):
    return [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--warmup_iters=2",
            "--seed=3", "--val_ratio=0.0", f"--data_dir={os.path.join(ROOT, 'data', 'sft')}", f"--init_from={init}",
            f"--out_dir={out}", "--learning_rate=3e-3", *extra]


@pytest.fixture(scope="module")
def teacher(pretrained, tiny_pretrain_data, tmp_path_factory):
    """A 10-step SFT run from the pretrained model: its distributions on the SFT replies differ from the student's."""
    out = tmp_path_factory.mktemp("distill") / "teacher"
    run_cmd(train_cmd(_args(tiny_pretrain_data, pretrained["out"], out, "--task_type=sft", "--max_iters=10",
                            "--batch_size=8", "--checkpoint_interval=10")), env=_env())
    return out


def test_the_student_comes_to_the_teachers_distributions(pretrained, tiny_pretrain_data, teacher, tmp_path):
    out = tmp_path / "student"
    run_cmd(train_cmd(_args(tiny_pretrain_data, pretrained["out"], out, "--task_type=distill", f"--ref_model={teacher}",
                            "--max_iters=10", "--batch_size=8", "--checkpoint_interval=10")), env=_env())
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert recs[1]["kl"] > 0, recs[1]  # (the teacher is not the student)
    assert sum(recs[s]["kl"] for s in (8, 9, 10)) < 0.5 * sum(recs[s]["kl"] for s in (1, 2, 3)), recs
    assert all(abs(r["loss"] - r["kl"]) < 1e-5 * max(1.0, r["kl"]) for r in recs.values())  # alpha 0, T 1


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_ranks_follow_one_process(pretrained, tiny_pretrain_data, teacher, tmp_path, engine):
    """(Our DDP runs GKD's generalized JSD, FSDP2 the forward KL: each divergence through a whole run once.) The
    second step trains on the student's own replies (--distill_lmbda=0.5 draws it at seed 3), sampled on each rank
    from the rows it holds (FSDP2: every rank forwarding as often), the first and third on the data's (our DDP) or
    on the teacher's samples (FSDP2, --distill_seq_kd: the sharded teacher sampling)."""
    from trainer.tasks.distill import replies_from_student
    loss = {"ddp": "jsd", "fsdp": "forward_kl"}[engine]
    seq_kd = engine == "fsdp"
    common = ["--task_type=distill", f"--ref_model={teacher}", "--max_iters=3", "--batch_size=2",
              "--checkpoint_interval=100", "--distill_alpha=0.5", "--distill_temperature=2", f"--distill_loss={loss}",
              "--distill_beta=0.3", "--distill_lmbda=0.5", "--max_completion_length=16",
              f"--distill_seq_kd={str(seq_kd).lower()}"]
    one, two = tmp_path / "one", tmp_path / engine
    run_cmd(train_cmd(_args(tiny_pretrain_data, pretrained["out"], one, *common, "--gradient_accumulation_steps=2")),
            env=_env())
    run_cmd(train_cmd(_args(tiny_pretrain_data, pretrained["out"], two, *common, f"--parallel={engine}"), 2),
            env=_env())
    a, b = (dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))) for d in (one, two))
    assert sorted(a) == sorted(b) == [1, 2, 3]
    assert [a[s]["on_policy"] for s in a] == [float(replies_from_student(3, s - 1, 0.5)) for s in a] == [0, 1, 0]
    assert [a[s].get("teacher_replies") for s in a] == ([1, 0, 1] if seq_kd else [None] * 3)
    for s in a:
        for key in ("loss", "kl", "ce", "on_policy", "reply_length") + (("teacher_replies",) if seq_kd else ()):
            assert abs(a[s][key] - b[s][key]) <= 1e-5 * max(1.0, abs(a[s][key])), (s, key, a[s][key], b[s][key])


def test_refusals_name_the_flag(pretrained, tiny_pretrain_data, tmp_path):
    from model import ModelConfig
    from parallel.config import ParallelConfig
    from trainer.config import TrainConfig, engine_needs
    from trainer.tasks.distill import DistillTask
    r = run_trainer(train_cmd(_args(tiny_pretrain_data, pretrained["out"], tmp_path / "x", "--task_type=distill",
                                    "--max_iters=1")), env=_env())
    assert r.returncode == 2 and "--task_type=distill learns from a teacher: pass --ref_model=" in r.stderr
    from trainer.validation import validate_config
    from utils.errors import TrainingError
    for beta in (0.0, 1.0, float("nan")):
        cfg = TrainConfig(task_type="distill", ref_model="t", tokenizer_dir="tok", distill_loss="jsd",
                          distill_beta=beta)
        with pytest.raises(TrainingError, match=r"--distill_beta=.*: must be in \(0, 1\)"):
            validate_config(cfg, torch_free=True)
    for flags, words in (({"distill_lmbda": 1.5}, "--distill_lmbda=1.5: must be in [0, 1]"),
                         ({"distill_lmbda": float("nan")}, "--distill_lmbda=nan: must be in [0, 1]"),
                         ({"sft_packing": True}, "--distill_lmbda=0.5 with --sft_packing=true: each row's last reply"),
                         ({"temperature": 0.0}, "--temperature=0.0: must be a finite number > 0"),
                         ({"max_completion_length": 0}, "--max_completion_length=0: must be >= 1"),
                         ({"task_type": "sft"}, "--distill_lmbda=0.5: sampled replies are distillation's"),
                         ({"task_type": "sft", "distill_lmbda": 0.0, "distill_seq_kd": True},
                          "--distill_seq_kd=true: sampled replies are distillation's")):
        cfg = TrainConfig(**{"task_type": "distill", "ref_model": "t", "tokenizer_dir": "tok", "distill_lmbda": 0.5,
                             **flags})
        with pytest.raises(TrainingError) as err:
            validate_config(cfg, torch_free=True)
        assert words in str(err.value), (flags, str(err.value))
    on_pp = dataclasses.replace(TrainConfig(), task_type="distill", distill_lmbda=0.5, pipeline_parallel_size=2,
                                gradient_accumulation_steps=2)
    assert any(p.startswith("--distill_lmbda=0.5 cannot be combined with --pipeline_parallel_size=2 (sampling")
               for p in ParallelConfig.from_flags(on_pp).problems(world_size=2, needs=engine_needs(on_pp)))
    small, big = (ModelConfig(vocab_size=v, dim=16, n_layers=1, n_heads=2, max_seq_len=16) for v in (64, 128))
    task = DistillTask(TrainConfig(task_type="distill"))
    assert task.reference_problem(small, small) is None and task.reference_problem(small, big) is None
    assert "has 64 outputs, the student 128" in task.reference_problem(big, small)  # (the tokenizer's size unknown)
    # the same tokenizer (60 ids) under vocabularies padded differently: compared over the first 64 entries
    assert task.reference_problem(big, small, vocab=60) is None
    assert "has 64 outputs, the student 128 and the tokenizer 100 ids" in task.reference_problem(big, small, 100)
    from trainer.tasks.dpo import DPOTask  # the default check (DPO's reference): a row for every tokenizer id
    dpo = DPOTask(TrainConfig(task_type="dpo"))
    assert dpo.reference_problem(big, small, 64) is None
    assert "--ref_model has 64 outputs and the tokenizer 100 ids" in dpo.reference_problem(big, small, 100)
    base = dataclasses.replace(TrainConfig(), task_type="distill")
    for flags, words in (({"tensor_parallel_size": 2, "parallel": "fsdp"}, "--tensor_parallel_size=2 (the LM head"),
                         ({"context_parallel_size": 2}, "--context_parallel_size=2 (the logits at chosen"),
                         ({"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
                          "--pipeline_parallel_size=2 (distillation compares")):
        cfg = dataclasses.replace(base, **flags)
        problems = ParallelConfig.from_flags(cfg).problems(world_size=2, needs=engine_needs(cfg))
        assert sum(p.startswith(f"--task_type=distill cannot be combined with {words}") for p in problems) == 1, \
            problems


def test_on_policy_steps_train_on_the_students_own_replies_and_the_kl_there_falls(pretrained, tiny_pretrain_data,
                                                                                  teacher, tmp_path):
    """--distill_lmbda=1: every step on replies the student sampled (GKD's on-policy distillation); the KL is then
    the divergence at the student's own tokens, which it learns to bring down."""
    out = tmp_path / "on_policy"
    run_cmd(train_cmd(_args(tiny_pretrain_data, pretrained["out"], out, "--task_type=distill", f"--ref_model={teacher}",
                            "--max_iters=10", "--batch_size=8", "--checkpoint_interval=10", "--distill_lmbda=1",
                            "--max_completion_length=32")), env=_env())
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    print({s: (round(r["kl"], 4), r["on_policy"], round(r["reply_length"], 1)) for s, r in recs.items()})
    assert all(r["on_policy"] == 1.0 and 1 <= r["reply_length"] <= 32 for r in recs.values()), recs
    assert sum(recs[s]["kl"] for s in (8, 9, 10)) < 0.5 * sum(recs[s]["kl"] for s in (1, 2, 3)), recs
