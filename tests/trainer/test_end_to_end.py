"""train_my_ddp.py end to end on tiny real data: learning, exact resume (1 and 2 processes, ZeRO-1,
PowerSGD), gradient accumulation == big batch, SFT masking, DPO preference learning, NaN stop,
SIGTERM save-and-exit, bad configuration.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from trainer.weights import load_weights_from
from tests.conftest import ROOT, child_env, run_cmd, run_trainer, sigterm_after_two_steps, train_cmd
from checkpoint.files import load_model_state
from checkpoint.verify import find_latest_valid
from utils.constants import EXIT_BAD_CONFIG, EXIT_INTERRUPTED, EXIT_NONFINITE_LOSS, IGNORE_INDEX
from utils.metrics import dedupe_by_step, read_metrics

_env = child_env  # tests/conftest.py: one thread per process, unbuffered output


def losses(out_dir) -> dict[int, float]:
    return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(out_dir, "metrics.jsonl"))).items()}


def final_weights(out_dir) -> dict[str, torch.Tensor]:
    return load_model_state(find_latest_valid(str(out_dir)))


# `pretrained` (a 12-step pretraining run whose checkpoint seeds SFT and DPO) is a session fixture in
# tests/conftest.py: test_day_to_day.py uses the same run.


def test_pretrain_reduces_loss_and_logs(pretrained):
    recs = read_metrics(os.path.join(pretrained["out"], "metrics.jsonl"))
    by_step = dedupe_by_step(recs)
    assert sorted(by_step) == list(range(1, 13))
    first, last = by_step[1]["loss"], by_step[12]["loss"]
    assert last < first - 0.3, (first, last)
    for key in ("lr", "tokens_per_sec", "grad_norm", "mfu"):
        assert isinstance(by_step[5][key], float) and by_step[5][key] > 0
    vals = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    assert len(vals) == 2 and vals[1] < vals[0]
    cfg = json.loads((pretrained["out"] / "config.json").read_text())
    assert cfg["max_iters"] == 12 and cfg["task_type"] == "pretrain"


@pytest.mark.parametrize("nproc, extra", [
    (1, ["--dropout=0.1"]),  # dropout draws from the RNG every step: exact only when the resume restores it
    (2, ["--use_distributed_optimizer=true", "--zero_stage=1"]),
    (2, ["--comm_hook=powersgd", "--powersgd_rank=2", "--powersgd_start_iter=2"]),
], ids=["1proc", "2proc-zero1", "2proc-powersgd"])
def test_resume_is_exact(tiny_pretrain_run_args, tmp_path, nproc, extra):
    """Crash at the start of step 5 (checkpoint at 3), resume, finish: same losses and weights. With dropout (1proc)
    the steps after the resume draw random numbers: equal only when the checkpoint's RNG state is restored."""
    args = [*tiny_pretrain_run_args, *extra, "--max_iters=6", "--bucket_size=20000"]
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"], nproc), env=_env())
    once = tmp_path / "fired"
    proc = run_trainer(train_cmd([*args, f"--out_dir={crashed}"], nproc),
                       env=_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists()
    assert max(losses(crashed)) == 4
    run_cmd(train_cmd([*args, f"--out_dir={crashed}", "--init_from=resume"], nproc), env=_env())
    assert losses(crashed) == losses(ref)  # bit-identical floats, steps 1..6
    # each step once in metrics.jsonl; the crashed attempt's step 4 (after the step-3 checkpoint) kept aside
    assert [s for s, _ in _raw_losses(crashed)] == [1, 2, 3, 4, 5, 6]
    aside = [f for f in os.listdir(crashed) if f.startswith("metrics.jsonl.after_step3.")]
    assert len(aside) == 1 and [s for s, _ in _raw_losses(crashed, aside[0])] == [4]
    a, b = final_weights(ref), final_weights(crashed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_grad_accumulation_equals_big_batch(tiny_pretrain_run_args, tmp_path):
    """4 micro-batches of 2 == one batch of 8 (token-weighted loss), after two optimizer steps."""
    base = [*tiny_pretrain_run_args, "--max_iters=2", "--checkpoint_interval=2"]
    run_cmd(train_cmd([*base, f"--out_dir={tmp_path / 'acc'}", "--batch_size=2", "--gradient_accumulation_steps=4"]),
            env=_env())
    run_cmd(train_cmd([*base, f"--out_dir={tmp_path / 'big'}", "--batch_size=8", "--gradient_accumulation_steps=1"]),
            env=_env())
    la, lb = losses(tmp_path / "acc"), losses(tmp_path / "big")
    assert la.keys() == lb.keys() and all(abs(la[s] - lb[s]) < 1e-5 for s in la)
    wa, wb = final_weights(tmp_path / "acc"), final_weights(tmp_path / "big")
    for k in wa:  # Adam divides by sqrt(v): float noise on near-zero gradients shows up as ~1e-6 here
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_sft_loss_counts_only_assistant_tokens(tiny_pretrain_data):
    """The trainer's per-micro-batch loss equals CE over the assistant positions and nothing else."""
    from trainer.config import TrainConfig
    from trainer.task import task_of
    from data_preprocess.pretokenize_sft_data import tokenize_sft_records
    from dataset.dataset_sft import build_sft_splits
    from model import ModelConfig, Transformer

    records = tokenize_sft_records(os.path.join(ROOT, "data", "sft"), tiny_pretrain_data["tokenizer_dir"], 64)
    train, _, collate = build_sft_splits(records, 64, val_ratio=0.1, seed=0)
    batch = collate([train[i] for i in range(4)])
    labels = batch["labels"]
    real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones_like(labels, dtype=torch.bool)
    assert 0 < int((labels != IGNORE_INDEX).sum()) < int(real.sum())  # prompts and system turns excluded
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=448, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=64))
    cfg = TrainConfig(task_type="sft")
    loss_sum, _ = task_of(cfg).micro_batch_loss(model, None, batch, torch.device("cpu"))
    logits = model(batch["input_ids"], attention_mask=batch.get("attention_mask"))
    mask = labels != IGNORE_INDEX
    expected = F.cross_entropy(logits[mask].float(), labels[mask], reduction="sum")
    torch.testing.assert_close(loss_sum, expected, rtol=1e-5, atol=1e-4)
    assert task_of(cfg).count_units(batch) == int(mask.sum())


def test_sft_then_dpo(pretrained, tiny_pretrain_data, tmp_path):
    """SFT from the pretrained run lowers its loss; DPO from the SFT run learns the preferences."""
    common = [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
              "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--eval_iters=2",
              "--warmup_iters=2", "--seed=3", "--val_ratio=0.05"]
    sft = tmp_path / "sft"
    run_cmd(train_cmd([*common, "--task_type=sft", f"--data_dir={os.path.join(ROOT, 'data', 'sft')}",
                       f"--init_from={pretrained['out']}", f"--out_dir={sft}", "--max_iters=10",
                       "--batch_size=8", "--learning_rate=3e-3", "--checkpoint_interval=10"]), env=_env())
    ls = losses(sft)
    assert sum(ls[s] for s in (8, 9, 10)) < sum(ls[s] for s in (1, 2, 3)), ls
    dpo, toy = tmp_path / "dpo", tmp_path / "toy_prefs.jsonl"
    with open(os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl"), encoding="utf-8") as f:
        toy.write_text("".join(line for _, line in zip(range(24), f)), encoding="utf-8")  # a toy set: 24 pairs
    run_cmd(train_cmd([*common, "--task_type=dpo", f"--data_dir={toy}",
                       f"--init_from={sft}", f"--out_dir={dpo}", "--max_iters=16", "--batch_size=8",
                       "--learning_rate=3e-3", "--dpo_beta=0.5", "--checkpoint_interval=16"]), env=_env())
    recs = dedupe_by_step(read_metrics(os.path.join(dpo, "metrics.jsonl")))
    assert recs[1]["reward_acc"] == 0.0  # policy == reference at step 1: no margin yet
    late = [recs[s]["reward_acc"] for s in range(12, 17)]
    assert sum(late) / len(late) > 0.7, late
    assert recs[16]["loss"] < recs[1]["loss"]
    # tokens_seen counts the tokens DPO reads (chosen and rejected, no padding): each step adds between one token
    # a sequence and the padded rows' size
    seen = [0] + [recs[s]["tokens_seen"] for s in range(1, 17)]
    assert all(2 * 8 < b - a <= 2 * 8 * 96 for a, b in zip(seen, seen[1:])), seen
    state = json.loads(open(os.path.join(find_latest_valid(str(dpo)), "trainer_state.json")).read())
    assert state["init_info"]["ref_source"].startswith(str(sft))  # frozen reference = initial weights


@pytest.mark.parametrize("loss,beta", [("simpo", "2.0"), ("orpo", "0.1")])
def test_reference_free_preference_losses_load_no_reference_and_learn(pretrained, tiny_pretrain_data, tmp_path, loss,
                                                                    beta):
    """--dpo_loss=simpo / orpo: no reference model is loaded (none recorded in the trainer state), the loss falls and
    the chosen replies' mean log-probability pulls ahead of the rejected ones'."""
    toy, out = tmp_path / "toy_prefs.jsonl", tmp_path / loss
    with open(os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl"), encoding="utf-8") as f:
        toy.write_text("".join(line for _, line in zip(range(16), f)), encoding="utf-8")
    run_cmd(train_cmd([f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
                       "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0",
                       "--warmup_iters=2", "--seed=3", "--val_ratio=0.0", "--task_type=dpo", f"--data_dir={toy}",
                       f"--init_from={pretrained['out']}", f"--out_dir={out}", "--max_iters=10", "--batch_size=8",
                       "--learning_rate=3e-3", f"--dpo_loss={loss}", f"--dpo_beta={beta}",
                       "--checkpoint_interval=10"]), env=_env())
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert sum(recs[s]["loss"] for s in (8, 9, 10)) < sum(recs[s]["loss"] for s in (1, 2, 3)), recs
    margin = lambda s: recs[s]["chosen_reward"] - recs[s]["rejected_reward"]  # noqa: E731
    assert sum(margin(s) for s in (8, 9, 10)) > sum(margin(s) for s in (1, 2, 3))
    state = json.loads(open(os.path.join(find_latest_valid(str(out)), "trainer_state.json")).read())
    assert "ref_source" not in state["init_info"]


def _raw_losses(out_dir, name: str = "metrics.jsonl") -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(os.path.join(out_dir, name))]


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_crash_before_first_checkpoint_restarts_from_the_recorded_start(pretrained, tiny_pretrain_data, tmp_path,
                                                                         task):
    """Issue 11 / 3.1: a fine-tuning run that crashes before its first checkpoint, restarted with
    --init_from=resume (what the supervisor does), starts again from the pretrained weights it began
    with (recorded in run_start.json), not from random weights of the default size; without the
    record it refuses (exit 2) instead of guessing."""
    if task == "sft":
        data = os.path.join(ROOT, "data", "sft")
    else:
        data = tmp_path / "toy_prefs.jsonl"
        with open(os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl"), encoding="utf-8") as f:
            data.write_text("".join(line for _, line in zip(range(24), f)), encoding="utf-8")
    args = [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--eval_iters=2",
            "--warmup_iters=2", "--seed=3", "--val_ratio=0.1", f"--task_type={task}", f"--data_dir={data}",
            "--max_iters=3", "--batch_size=4", "--learning_rate=3e-3", "--checkpoint_interval=100"]
    out = tmp_path / "run"
    crashed = run_trainer(train_cmd([*args, f"--init_from={pretrained['out']}", f"--out_dir={out}"]),
                          env=_env(MYLLM_FAULT="crash@3"))
    assert crashed.returncode == 1 and find_latest_valid(str(out)) is None, crashed.stderr[-2000:]
    no_record = tmp_path / "no_record"
    shutil.copytree(out, no_record)
    os.remove(no_record / "run_start.json")
    restarted = run_cmd(train_cmd([*args, "--init_from=resume", f"--out_dir={out}"]), env=_env()).stdout
    # the log says where the weights came from: the recorded start (no stray colon inside the parentheses)
    assert f"(the start recorded in {out / 'run_start.json'})" in restarted, restarted[-2000:]
    raw = _raw_losses(out)
    assert [s for s, _ in raw] == [1, 2, 3]  # each step once: the crashed attempt's rows are kept aside
    aside = [f for f in os.listdir(out) if f.startswith("metrics.jsonl.after_step0.")]
    assert len(aside) == 1
    assert _raw_losses(out, aside[0]) == raw[:2]  # the same start: the same weights, data order and losses
    final = find_latest_valid(str(out))
    assert json.loads(open(os.path.join(final, "model_config.json")).read())["dim"] == 32  # not the default 256
    init_info = json.loads(open(os.path.join(final, "trainer_state.json")).read())["init_info"]
    assert init_info["source"].startswith(str(pretrained["out"]))
    if task == "dpo":
        assert init_info["ref_source"].startswith(str(pretrained["out"]))
    refused = run_trainer(train_cmd([*args, "--init_from=resume", f"--out_dir={no_record}"]), env=_env())
    assert refused.returncode == EXIT_BAD_CONFIG, refused.stderr[-2000:]
    assert "no record of how the run started" in refused.stderr and "Traceback" not in refused.stderr


def test_resume_fallback_starts_a_run_that_has_no_checkpoint(tiny_pretrain_run_args, tmp_path):
    """--init_from=resume --resume_fallback=...: the first start of a run relaunched with the same
    arguments (torchrun --max-restarts) starts from the fallback and records it; a bad fallback is
    named as such."""
    out = tmp_path / "fb"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=1", "--init_from=resume",
                       "--resume_fallback=scratch"]), env=_env())
    record = json.loads((out / "run_start.json").read_text())
    assert (record["init_from"], record["task_type"]) == ("scratch", "pretrain")
    proc = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'bad'}", "--max_iters=1",
                                     "--init_from=resume", f"--resume_fallback={tmp_path / 'nothing'}"]), env=_env())
    assert proc.returncode == EXIT_BAD_CONFIG
    assert f"--resume_fallback={tmp_path / 'nothing'}: no complete checkpoint" in proc.stderr


def test_nonfinite_loss_stops_with_checkpoint_intact(tiny_pretrain_run_args, tmp_path):
    """A NaN loss at step 5 (injected: a huge learning rate need not diverge on every CPU) stops the
    run with exit 4 and one line; the step-3 checkpoint is the newest, intact and finite."""
    out = tmp_path / "nan"
    proc = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=8"]),
                       env=_env(MYLLM_FAULT="nan_loss@5"))
    assert proc.returncode == EXIT_NONFINITE_LOSS, proc.stderr[-2000:]
    assert "non-finite loss nan at step 5" in proc.stderr and "Traceback" not in proc.stderr
    assert max(losses(out)) == 4  # the NaN step was not logged
    path = find_latest_valid(str(out))
    assert path is not None and path.endswith("step_00000003")
    state = load_model_state(path)
    assert state and all(torch.isfinite(t).all() for t in state.values())


def test_sigterm_saves_and_exits_75(tiny_pretrain_run_args, tmp_path):
    out = tmp_path / "term"
    rc, _, err = sigterm_after_two_steps([*tiny_pretrain_run_args, "--max_iters=100000",
                                          "--checkpoint_interval=100000"], out, _env())
    assert rc == EXIT_INTERRUPTED, err[-2000:]
    path = find_latest_valid(str(out))
    saved_step = json.loads(open(os.path.join(path, "trainer_state.json")).read())["step"]
    assert saved_step == max(losses(out)) >= 2


def test_a_time_budget_saves_the_step_and_exits_75_and_the_same_command_continues(tiny_pretrain_run_args, tmp_path):
    """--exit_duration_in_mins (a job's time limit): a budget every step overruns stops each invocation after one
    step, saved, exit 75; the same command continues, and the last one, reaching --max_iters, exits 0. The losses
    are those of a run never stopped."""
    ref, out = tmp_path / "ref", tmp_path / "budget"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={ref}", "--max_iters=3"]), env=_env())
    cmd = train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=3", "--checkpoint_interval=100",
                     "--exit_duration_in_mins=1e-6"])
    for step in (1, 2):
        proc = run_trainer(cmd, env=_env())
        assert proc.returncode == EXIT_INTERRUPTED, proc.stderr[-2000:]
        assert f"stop requested by --exit_duration_in_mins=1e-06 (the same command continues the run): saved step " \
               f"{step}" in proc.stdout, proc.stdout[-2000:]
    proc = run_trainer(cmd, env=_env())
    assert proc.returncode == 0 and "done: 3 steps" in proc.stdout, proc.stdout[-2000:]
    assert losses(out) == losses(ref) and sorted(losses(out)) == [1, 2, 3]
    bad = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'bad'}",
                                 "--exit_duration_in_mins=-1"]), env=_env())
    assert bad.returncode == EXIT_BAD_CONFIG and "--exit_duration_in_mins=-1.0: must be a finite number >= 0" \
        in bad.stderr, bad.stderr[-1000:]


def test_fresh_run_refuses_an_out_dir_with_checkpoints(pretrained):
    """--resume=never: a new run must not write into a run directory (the default, auto, continues it)."""
    before = (pretrained["out"] / "metrics.jsonl").read_text()
    proc = run_trainer(train_cmd([*pretrained["args"], f"--out_dir={pretrained['out']}", "--max_iters=2",
                                     "--resume=never"]), env=_env())
    assert proc.returncode == EXIT_BAD_CONFIG and "--resume" in proc.stderr, proc.stderr[-1000:]
    assert (pretrained["out"] / "metrics.jsonl").read_text() == before  # nothing of the old run touched


def test_resuming_a_finished_run_reports_its_final_validation_loss(pretrained, tmp_path):
    """Nothing left to train: the run says so with the validation loss it ended with (was: nan)."""
    run = tmp_path / "run"
    shutil.copytree(pretrained["out"], run)
    final = [r for r in read_metrics(str(run / "metrics.jsonl")) if r["step"] == 12][-1]["val_loss"]
    proc = run_cmd(train_cmd([f"--out_dir={run}", "--init_from=resume"]), env=_env())
    assert f"done: 12 steps, final val_loss {final:.4f}," in proc.stdout, proc.stdout[-1500:]


def test_bad_configuration_exits_2(tiny_pretrain_run_args, tmp_path):
    for bad in (["--max_iterz=3"], ["--batch_size=two"], ["--task_type=rlhf"], ["--task_type=sft"]):
        proc = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'bad'}", *bad]), env=_env())
        assert proc.returncode == EXIT_BAD_CONFIG, (bad, proc.stderr[-1500:])


def test_lora_run_exports_to_hf_and_peft(pretrained, tiny_pretrain_data, tmp_path):
    """Continue pretraining with LoRA (+ embeddings/LM head), then export merged and as PEFT adapters:
    transformers and peft reproduce our logits."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    out = tmp_path / "lora"
    run_cmd(train_cmd([*pretrained["args"], f"--out_dir={out}", f"--init_from={pretrained['out']}", "--max_iters=3",
                       "--lora_rank=4", "--lora_targets=all", "--lora_train_embeddings=true"]), env=_env())
    log = run_cmd(train_cmd([*pretrained["args"], f"--out_dir={tmp_path / 'lora2'}", f"--init_from={pretrained['out']}",
                             "--max_iters=1", "--lora_rank=4"]), env=_env()).stdout
    assert "[lora] rank 4 on q_proj,v_proj:" in log and "trainable of" in log
    ours, _ = load_weights_from(str(out), log=lambda m: None)  # adapters merged on load
    ours.eval()
    x = torch.randint(0, 300, (2, 16))
    with torch.no_grad():
        want = ours(x)
    run_cmd([sys.executable, "export_hf.py", f"--ckpt={out}", f"--output_dir={tmp_path / 'hf_merged'}"])
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf_merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, want, rtol=1e-4, atol=1e-4)
    run_cmd([sys.executable, "export_hf.py", f"--ckpt={out}", f"--output_dir={tmp_path / 'hf_base'}",
             f"--adapters_output_dir={tmp_path / 'adapters'}"])
    base = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf_base")).eval()
    with torch.no_grad():
        base_logits = base(x).logits
        peft_logits = PeftModel.from_pretrained(base, str(tmp_path / "adapters")).eval()(x).logits
    torch.testing.assert_close(peft_logits, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(base_logits, want, atol=1e-3)  # the adapters really changed the model


@pytest.mark.slow
def test_powersgd_loss_stays_within_margin_of_allreduce(tiny_pretrain_run_args, tmp_path):
    """2 ranks on the bundled corpus: PowerSGD rank 4 (compressing from step 3 on) ends within the
    documented margin (0.15 nats of validation loss) of plain all-reduce."""
    base = [*tiny_pretrain_run_args, "--max_iters=24", "--eval_interval=24", "--eval_iters=8",
            "--checkpoint_interval=24", "--bucket_size=20000"]
    finals = {}
    for name, extra in (("allreduce", []), ("powersgd", ["--comm_hook=powersgd", "--powersgd_rank=4",
                                                         "--powersgd_start_iter=3"])):
        out = tmp_path / name
        run_cmd(train_cmd([*base, *extra, f"--out_dir={out}"], nproc=2), env=_env())
        vals = [r["val_loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r.get("val_loss")]
        finals[name] = vals[-1]
    first = losses(tmp_path / "powersgd")[1]
    assert finals["powersgd"] < first - 0.3  # it learns
    assert abs(finals["powersgd"] - finals["allreduce"]) < 0.15, finals


def test_zero_checkpoint_resumes_at_another_world_size(tiny_pretrain_run_args, tmp_path):
    """2 ranks x batch 2 with ZeRO-1 saved at step 3, resumed on 1 process x batch 4 (same global batch):
    the sharded optimizer state is re-sharded and the run continues close to the 2-rank reference; a
    different global batch is refused with a clear message."""
    base = [*tiny_pretrain_run_args, "--use_distributed_optimizer=true", "--max_iters=6", "--bucket_size=20000"]
    ref, moved = tmp_path / "ref", tmp_path / "moved"
    run_cmd(train_cmd([*base, "--batch_size=2", f"--out_dir={ref}"], nproc=2), env=_env())
    proc = run_trainer(train_cmd([*base, "--batch_size=2", f"--out_dir={moved}"], nproc=2),
                       env=_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(tmp_path / "fired")))
    assert proc.returncode != 0
    bad = run_trainer(train_cmd([*base, "--batch_size=2", f"--out_dir={moved}", "--init_from=resume"]), env=_env())
    assert bad.returncode == EXIT_BAD_CONFIG and "global batch" in bad.stderr
    run_cmd(train_cmd([*base, "--batch_size=4", f"--out_dir={moved}", "--init_from=resume"]), env=_env())
    a, b = losses(ref), losses(moved)
    assert a.keys() == b.keys() and all(a[s] == b[s] for s in (1, 2, 3))
    # steps 4-6 ran on one process: same samples and optimizer state, only the summation order differs
    assert all(abs(a[s] - b[s]) < 1e-4 for s in (4, 5, 6)), (a, b)
