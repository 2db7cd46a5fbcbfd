"""train_my_ddp.py with --pipeline_parallel_size (pipeline stages x data parallel), end to end on tiny
real data, in real trainer subprocesses (torch.distributed.run, gloo, CPU):

- pp=2 (GPipe and 1F1B) with 4 micro-batches follows one process on the same global batch: losses,
  validation loss, and the weights of the saved (merged) stage checkpoints within 1e-5;
- a crash mid-run + --init_from=resume is bit-exact (losses and weights);
- pp=2 x dp=2 (4 processes; our DDP, and FSDP on dp) follows one process;
- SFT, LoRA and DPO under pp=2 follow one process (DPO's later steps and weights with AdamW's amplification
  of rounding allowed for; the tight DPO comparison is tests/parallel/test_pipeline_dpo.py);
- LoRA, --trainable=embeddings and DPO are accepted at pp=2 (no light checkpoints);
- --compile=true (per block) with activation checkpointing follows the eager pp=2 run; --float8 runs in the stages;
  fp16 follows one process in fp16, an overflow skipped at every stage;
- bad combinations exit 2 with one clear line; our DDP's checkpoints resume across the pipeline layout (pp=2 <->
  one process), a pipeline of FSDP stages only at its own split;
- export_hf.py of a pipeline checkpoint writes the merged weights.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.conftest import ROOT, run_cmd, run_trainer, toy_dpo_pairs
from tests.trainer.test_end_to_end import _env, train_cmd
from checkpoint.verify import find_latest_valid
from utils.constants import EXIT_BAD_CONFIG
from utils.metrics import dedupe_by_step, read_metrics

TOL = 1e-5


def records(out_dir) -> dict[int, dict]:
    return dedupe_by_step(read_metrics(os.path.join(out_dir, "metrics.jsonl")))


def losses(out_dir) -> dict[int, float]:
    return {s: r["loss"] for s, r in records(out_dir).items()}


def final_weights(out_dir) -> dict[str, torch.Tensor]:
    from checkpoint.weights import checkpoint_model_state
    return checkpoint_model_state(find_latest_valid(str(out_dir)))


def assert_weights_close(a: dict, b: dict, tol: float = TOL) -> float:
    assert a.keys() == b.keys()
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst <= tol, worst
    return worst


@pytest.fixture(scope="module")
def base_args(tiny_pretrain_run_args) -> list[str]:
    """n_layers=2 -> one layer per stage; 4 micro-batches of 2 samples per step; validation at steps 3 and 6
    over 4 batches (a multiple of the micro-batches, so the pipeline reads the same validation batches)."""
    drop = ("--batch_size", "--eval_interval", "--eval_iters")
    return [a for a in tiny_pretrain_run_args if not a.startswith(drop)] + [
        "--batch_size=2", "--gradient_accumulation_steps=4", "--max_iters=6", "--eval_interval=3",
        "--eval_iters=4", "--grad_clip=0.5"]


@pytest.fixture(scope="module")
def runs(base_args, tmp_path_factory) -> dict:
    """The one-process reference and the pp=2 runs (GPipe, 1F1B), shared by the tests below."""
    root = tmp_path_factory.mktemp("pp_runs")
    out = {"root": root, "ref": root / "ref", "gpipe": root / "gpipe", "1f1b": root / "1f1b"}
    run_cmd(train_cmd([*base_args, f"--out_dir={out['ref']}"]), env=_env())
    for sched in ("gpipe", "1f1b"):
        run_cmd(train_cmd([*base_args, f"--out_dir={out[sched]}", "--pipeline_parallel_size=2",
                           f"--pipeline_schedule={sched}"], nproc=2), env=_env())
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_matches_one_process(runs, schedule):
    ref, pp = records(runs["ref"]), records(runs[schedule])
    assert sorted(ref) == sorted(pp) == [1, 2, 3, 4, 5, 6]
    for s in ref:
        assert abs(ref[s]["loss"] - pp[s]["loss"]) <= TOL, (s, ref[s]["loss"], pp[s]["loss"])
        assert abs(ref[s]["grad_norm"] - pp[s]["grad_norm"]) <= 1e-4 * ref[s]["grad_norm"]
        assert ref[s]["tokens_seen"] == pp[s]["tokens_seen"]  # ranks of one pipeline counted once
    for s in (3, 6):  # evaluation runs through the pipeline too
        assert abs(ref[s]["val_loss"] - pp[s]["val_loss"]) <= TOL, (s, ref[s]["val_loss"], pp[s]["val_loss"])
    assert ref[6]["loss"] < ref[1]["loss"] - 0.1  # it learns (so the comparison is not of two idle runs)
    assert_weights_close(final_weights(runs["ref"]), final_weights(runs[schedule]))


def test_pp2_with_compile_follows_eager_pp2(runs, base_args, tmp_path):
    """--compile=true under pp=2 compiles each block of a stage (torchtitan's per-block compile; the stage's
    embedding, norm, head and loss and the schedule's sends run eagerly), here around activation-checkpointed
    blocks: it trains like the eager 1F1B run. Traced with --compile_backend=aot_eager (Dynamo + AOTAutograd, the
    stages' subject; Inductor's code generation of a block is one process's, tests/model/test_compile_cold.py and
    test_hf_interop_and_lora.py, and cost both ranks ~35 s of a cold compile here); the bound is Inductor's
    (summation-order noise, 1e-7 on the losses and 7e-6 on the weights after 6 steps when it was measured)."""
    out = tmp_path / "compiled"
    proc = run_trainer(train_cmd([*base_args, f"--out_dir={out}", "--pipeline_parallel_size=2",
                                  "--pipeline_schedule=1f1b", "--compile=true", "--compile_backend=aot_eager",
                                  "--gradient_checkpointing=true"], nproc=2), env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compile on (per block, aot_eager)" in proc.stdout, proc.stdout[-3000:]
    ref, got = records(runs["1f1b"]), records(out)
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4, 5, 6]
    for s in ref:
        assert abs(ref[s]["loss"] - got[s]["loss"]) <= 1e-4 * abs(ref[s]["loss"]), (s, ref[s]["loss"], got[s]["loss"])
    for s in (3, 6):  # evaluation through the compiled blocks (no_grad) too
        assert abs(ref[s]["val_loss"] - got[s]["val_loss"]) <= 1e-4 * abs(ref[s]["val_loss"])
    assert_weights_close(final_weights(runs["1f1b"]), final_weights(out), tol=1e-4)


def test_pp2_with_fp8_follows_one_process_with_fp8(runs, base_args, tmp_path):
    """--float8 under pp=2: each stage's block linears are converted (before the wrap, as without stages). Step
    1 (the same weights and batch, the same FP8 casts per micro-batch) equals the one-process FP8 run to the
    pipeline's summation-order tolerance, and differs from the pp=2 run without FP8 (FP8 ran). Later steps are
    not compared tightly: a 1e-7 weight difference flips some e4m3 roundings (steps of 2^-3 relative), so two
    FP8 runs that differ only in summation order drift apart by ~5e-4 relative by step 3 (measured); they are held
    to the coarse 2^-3 of tests/parallel/test_float8.py."""
    fp8 = ["--float8=tensorwise", "--float8_layers=all"]
    one, pp = tmp_path / "one", tmp_path / "pp"
    run_cmd(train_cmd([*base_args, f"--out_dir={one}", *fp8]), env=_env())
    proc = run_trainer(train_cmd([*base_args, f"--out_dir={pp}", "--pipeline_parallel_size=2", *fp8], nproc=2),
                       env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FP8 block matmuls (tensorwise, every layer)" in proc.stdout, proc.stdout[-3000:]
    ref, got, eager = losses(one), losses(pp), losses(runs["1f1b"])
    assert sorted(ref) == sorted(got) == [1, 2, 3, 4, 5, 6]
    assert abs(ref[1] - got[1]) <= TOL, (ref[1], got[1])
    assert got[1] != eager[1]  # the FP8 casts changed the forward
    assert all(abs(ref[s] - got[s]) < 2 ** -3 * abs(ref[s]) for s in ref), (ref, got)


def test_fp16_pp2_follows_one_process_and_skips_an_overflow_at_every_stage(base_args, tmp_path):
    """--dtype=fp16 (loss scaling) under pp=2 against one process in fp16, with a NaN loss injected at step 2:
    both skip step 2 (the overflow is found in the norm over every stage, so no stage steps alone) and go on
    alike. Bounds: fp16's own rounding (2^-10 relative) on the losses; on the weights the relative L2 difference
    per tensor, 2^-8: AdamW turns the fp16 rounding of a near-zero gradient (the layouts sum in another order)
    into up to ~lr on that element (measured: 4.7e-4 on one of 4096; 6.3e-4 relative L2 at worst), while a step
    taken or skipped differently moves every element by ~lr, ~0.2 relative here."""
    env = dict(_env(), MYLLM_FAULT="nan_loss@2")
    one, pp = tmp_path / "one", tmp_path / "pp"
    run_cmd(train_cmd([*base_args, f"--out_dir={one}", "--dtype=fp16"]), env=env)
    run_cmd(train_cmd([*base_args, f"--out_dir={pp}", "--dtype=fp16", "--pipeline_parallel_size=2"], nproc=2), env=env)
    ref, got = records(one), records(pp)
    assert [ref[s]["stepped"] for s in sorted(ref)] == [got[s]["stepped"] for s in sorted(got)] == \
        [True, False, True, True, True, True]
    for s in (1, 3, 4, 5, 6):
        assert abs(ref[s]["loss"] - got[s]["loss"]) <= 2 ** -10 * ref[s]["loss"], (s, ref[s]["loss"], got[s]["loss"])
    a, b = final_weights(one), final_weights(pp)
    assert a.keys() == b.keys()
    for k in a:
        rel = float((b[k].float() - a[k].float()).norm() / a[k].float().norm())
        assert rel <= 2 ** -8, (k, rel)


def test_pipeline_checkpoint_layout(runs):
    """step_N/ holds one weights file per stage + one optimizer file per stage, the usual manifest,
    COMPLETE, RNG per rank; keep_last pruning applies; the run config records the pipeline."""
    import json
    from checkpoint.verify import list_checkpoints, verify_checkpoint
    found = find_latest_valid(str(runs["1f1b"]))
    names = set(os.listdir(found))
    assert {"stage0_model.safetensors", "stage1_model.safetensors", "stage0_optimizer_dp0.pt",
            "stage1_optimizer_dp0.pt", "pipeline.json", "extra_rank0.pt", "extra_rank1.pt", "manifest.json",
            "COMPLETE", "trainer_state.json", "config.json", "model_config.json"} <= names
    assert "model.safetensors" not in names and verify_checkpoint(found) is None
    assert [s for s, _ in list_checkpoints(str(runs["1f1b"]))] == [6, 3]
    cfg = json.loads(open(os.path.join(found, "config.json")).read())
    assert cfg["pipeline_parallel_size"] == 2 and cfg["pipeline_schedule"] == "1f1b"
    meta = json.loads(open(os.path.join(found, "pipeline.json")).read())
    assert meta["pp_size"] == 2 and meta["layer_ranges"] == [[0, 1], [1, 2]]


def test_crash_and_resume_is_bit_exact(runs, base_args, tmp_path):
    """Crash at the start of step 5 (checkpoint at 3), resume: the same losses and weights as the
    uninterrupted 1F1B run, bit for bit."""
    crashed, once = tmp_path / "crashed", tmp_path / "fired"
    args = [*base_args, f"--out_dir={crashed}", "--pipeline_parallel_size=2", "--pipeline_schedule=1f1b"]
    proc = run_trainer(train_cmd(args, nproc=2),
                       env=_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists()
    assert max(losses(crashed)) == 4
    run_cmd(train_cmd([f"--out_dir={crashed}", "--init_from=resume"], nproc=2), env=_env())
    assert losses(crashed) == losses(runs["1f1b"])
    a, b = final_weights(runs["1f1b"]), final_weights(crashed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("source, flags, nproc", [("1f1b", ["--pipeline_parallel_size=1"], 1),
                                                  ("ref", ["--pipeline_parallel_size=2"], 2)],
                         ids=["pp2_to_one_process", "one_process_to_pp2"])
def test_resume_at_another_pipeline_layout_continues_the_run(runs, tmp_path, source, flags, nproc):
    """Our DDP's checkpoints resume across the pipeline layout: a pp=2 run's step 3 resumed by one process
    without stages (the stages' weights as one model, every stage's optimizer file assembled per parameter name),
    and a one-process run's step 3 resumed at pp=2 (each stage takes its tensors). Steps 4-6 and the final
    weights follow the uninterrupted one-process run to the pipeline's tolerance."""
    import shutil
    moved = tmp_path / "moved"
    shutil.copytree(runs[source], moved)
    shutil.rmtree(moved / "checkpoints" / "step_00000006")
    proc = run_trainer(train_cmd([f"--out_dir={moved}", "--init_from=resume", *flags], nproc=nproc), env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was written with another layout" in proc.stdout, proc.stdout[-3000:]
    ref, got = losses(runs["ref"]), losses(moved)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for s in (4, 5, 6):
        assert abs(ref[s] - got[s]) <= TOL, (s, ref[s], got[s])
    assert_weights_close(final_weights(runs["ref"]), final_weights(moved))


def test_a_zero_pipeline_resumes_without_stages_at_two_zero_ranks(runs, base_args, tmp_path):
    """ZeRO on both sides: a pp=2 run with --use_distributed_optimizer (its stage files are ZeRO shards) resumed
    from step 3 by 2 data-parallel ZeRO ranks without stages (the same global batch: half the accumulation), whose
    shards cut the parameters elsewhere: each rank assembles its pieces from every stage's file. Steps 4-6 and the
    final weights follow the one-process run."""
    import shutil
    run = tmp_path / "zero_pp"
    zero = ["--use_distributed_optimizer=true"]
    run_cmd(train_cmd([*base_args, f"--out_dir={run}", "--pipeline_parallel_size=2", *zero], nproc=2), env=_env())
    shutil.rmtree(run / "checkpoints" / "step_00000006")
    proc = run_trainer(train_cmd([f"--out_dir={run}", "--init_from=resume", "--pipeline_parallel_size=1",
                                  "--gradient_accumulation_steps=2", *zero], nproc=2), env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "was written with another layout (pp=2 x dp=1, ddp stages)" in proc.stdout, proc.stdout[-3000:]
    ref, got = losses(runs["ref"]), losses(run)
    for s in (4, 5, 6):
        assert abs(ref[s] - got[s]) <= TOL, (s, ref[s], got[s])
    assert_weights_close(final_weights(runs["ref"]), final_weights(run))


def test_a_pipeline_of_fsdp_stages_resumes_only_its_own_split(tiny_pretrain_run_args, tmp_path):
    """FSDP stages keep FSDP's optimizer state, which is not kept per whole tensor range: another layout is refused
    in one line (exit 2, a layout this checkpoint cannot resume at, named) rather than loaded wrongly."""
    args = [*tiny_pretrain_run_args, "--max_iters=1", "--checkpoint_interval=1", "--batch_size=2",
            "--gradient_accumulation_steps=2"]
    run = tmp_path / "fsdp_pp"
    proc = run_trainer(train_cmd([*args, f"--out_dir={run}", "--pipeline_parallel_size=2", "--parallel=fsdp"],
                                 nproc=2), env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_trainer(train_cmd([*args, f"--out_dir={run}", "--init_from=resume", "--max_iters=2",
                                  "--pipeline_parallel_size=1", "--parallel=ddp"]), env=_env())
    assert proc.returncode == EXIT_BAD_CONFIG, (proc.returncode, proc.stderr[-3000:])
    line = [x for x in proc.stderr.splitlines() if "error" in x]
    assert line and "a pipeline checkpoint (pp=2, fsdp stages)" in line[-1], proc.stderr[-3000:]


def test_export_hf_of_a_pipeline_checkpoint(runs, tmp_path):
    from safetensors.torch import load_file
    from model.hf_interop import export_hf  # noqa: F401  (the exporter export_hf.py uses)
    from checkpoint.pipeline import merge_stage_checkpoints
    hf = tmp_path / "hf"
    run_cmd([sys.executable, os.path.join(ROOT, "export_hf.py"), f"--ckpt={runs['1f1b']}", f"--out_dir={hf}"],
            env=_env())
    merged = merge_stage_checkpoints(find_latest_valid(str(runs["1f1b"])))
    exported = load_file(str(hf / "model.safetensors"))
    # HF names: model.embed_tokens.weight, model.layers.N..., lm_head.weight; q/k are permuted for HF's RoPE
    assert torch.equal(exported["model.embed_tokens.weight"], merged["embed_tokens.weight"])
    assert torch.equal(exported["lm_head.weight"], merged["lm_head.weight"])
    assert torch.equal(exported["model.layers.1.mlp.down_proj.weight"], merged["layers.1.mlp.down_proj.weight"])
    from model.hf_interop import import_hf
    back = import_hf(str(hf)).state_dict()
    assert back.keys() == merged.keys() and all(torch.equal(back[k], merged[k]) for k in back)


def test_sft_pp2_matches_one_process(runs, tiny_pretrain_data, tmp_path):
    """SFT (padded rows, attention mask, masked labels) through the pipeline follows one process; both
    start from the pipeline run's checkpoint (--init_from merges its stages)."""
    common = [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=64", "--device=cpu",
              "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--eval_iters=2",
              "--warmup_iters=1", "--seed=3", "--val_ratio=0.05", "--task_type=sft",
              f"--data_dir={os.path.join(ROOT, 'data', 'sft')}", f"--init_from={runs['1f1b']}", "--max_iters=2",
              "--batch_size=2", "--gradient_accumulation_steps=2", "--learning_rate=3e-3", "--checkpoint_interval=2"]
    ref, pp = tmp_path / "sft_ref", tmp_path / "sft_pp"
    run_cmd(train_cmd([*common, f"--out_dir={ref}"]), env=_env())
    run_cmd(train_cmd([*common, f"--out_dir={pp}", "--pipeline_parallel_size=2"], nproc=2), env=_env())
    lr, lp = losses(ref), losses(pp)
    assert sorted(lr) == sorted(lp) == [1, 2]
    assert all(abs(lr[s] - lp[s]) <= TOL for s in lr), (lr, lp)
    assert_weights_close(final_weights(ref), final_weights(pp))


@pytest.mark.slow
@pytest.mark.parametrize("dp_engine", ["ddp", "fsdp"])
def test_pp2_x_dp2_matches_one_process(runs, base_args, tmp_path, dp_engine):
    """4 processes: 2 stages x 2 data-parallel replicas of 1 sample x 4 micro-batches = the reference's
    global batch of 8 samples per step."""
    out = tmp_path / dp_engine
    args = [a if not a.startswith("--batch_size") else "--batch_size=1" for a in base_args]
    run_cmd(train_cmd([*args, f"--out_dir={out}", "--pipeline_parallel_size=2", f"--parallel={dp_engine}"],
                      nproc=4), env=_env())
    ref, pp = records(runs["ref"]), records(out)
    assert sorted(ref) == sorted(pp)
    for s in ref:
        assert abs(ref[s]["loss"] - pp[s]["loss"]) <= TOL, (s, ref[s]["loss"], pp[s]["loss"])
    assert_weights_close(final_weights(runs["ref"]), final_weights(out))


@pytest.mark.parametrize("flags, world, expect", [
    ({}, 1, "world size 1 is not a multiple of pipeline 2"),
    ({"n_layers": 3}, 2, "--n_layers=3 does not split into 2 equal stages"),
    ({"tie_embeddings": True}, 2, "--tie_embeddings=true cannot be combined with --pipeline_parallel_size=2"),
    ({"comm_hook": "powersgd"}, 2, "--comm_hook=powersgd cannot be combined with --pipeline_parallel_size=2"),
    ({"overlap_optim_step": True}, 2, "--overlap_optim_step=true cannot be combined with --pipeline_parallel_size=2"),
    ({"gradient_accumulation_steps": 1}, 2, "the 1F1B schedule needs at least as many micro-batches as stages"),
    ({"dp_replicate_size": 2}, 4, "--dp_replicate_size=2 cannot be combined with --parallel=ddp"),
    ({"pipeline_schedule": "zigzag"}, 2, "--pipeline_schedule='zigzag' (gpipe | 1f1b)"),
    ({"pipeline_parallel_size": 0}, 2, "--pipeline_parallel_size=0: must be an integer >= 1"),
])
def test_bad_combinations_are_named(flags, world, expect):
    from trainer import config as T
    from trainer.validation import validate_config
    cfg = T.TrainConfig(data_dir="d", tokenizer_dir="t", n_layers=4, gradient_accumulation_steps=2,
                        pipeline_parallel_size=2)
    for k, v in flags.items():
        setattr(cfg, k, v)
    with pytest.raises(T.TrainingError) as e:
        validate_config(cfg, world_size=world)
    assert e.value.code == EXIT_BAD_CONFIG and expect in str(e.value), str(e.value)
    validate_config(T.TrainConfig(data_dir="d", tokenizer_dir="t", n_layers=4, gradient_accumulation_steps=2,
                                  pipeline_parallel_size=2), world_size=4)  # and the good layout passes


@pytest.mark.parametrize("flags", [{"lora_rank": 4}, {"trainable": "embeddings"},
                                   {"lora_rank": 4, "parallel": "fsdp"}, {"task_type": "dpo", "init_from": "somewhere"},
                                   {"task_type": "dpo", "init_from": "somewhere", "lora_rank": 4}])
def test_frozen_parameters_and_dpo_are_accepted_without_light_checkpoints(flags):
    """LoRA, --trainable=embeddings and DPO run under the pipeline (tests/parallel/test_pipeline_frozen.py,
    test_pipeline_dpo.py); its checkpoints stay full stage files: it declares no light checkpoints."""
    from parallel.config import ParallelConfig
    from trainer import config as T
    from trainer.validation import validate_config
    cfg = T.TrainConfig(data_dir="d", tokenizer_dir="t", n_layers=4, gradient_accumulation_steps=2,
                        pipeline_parallel_size=2, **flags)
    validate_config(cfg, world_size=2)
    assert not ParallelConfig.from_flags(cfg).saves_light_checkpoints()


def test_lora_pp2_matches_one_process(runs, base_args, tmp_path):
    """LoRA adapters trained through the pipeline (full stage checkpoints) follow one process (a light
    checkpoint: the trainable tensors only); both start from the pipeline run's checkpoint."""
    args = [a for a in base_args if not a.startswith(("--max_iters", "--eval_interval"))] + [
        f"--init_from={runs['1f1b']}", "--max_iters=2", "--eval_interval=0", "--checkpoint_interval=2",
        "--lora_rank=2", "--lora_targets=q_proj,v_proj", "--learning_rate=3e-3"]
    ref, pp = tmp_path / "lora_ref", tmp_path / "lora_pp"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"]), env=_env())
    run_cmd(train_cmd([*args, f"--out_dir={pp}", "--pipeline_parallel_size=2"], nproc=2), env=_env())
    lr, lp = losses(ref), losses(pp)
    assert sorted(lr) == sorted(lp) == [1, 2]
    assert all(abs(lr[s] - lp[s]) <= TOL for s in lr), (lr, lp)
    light, full = final_weights(ref), final_weights(pp)
    assert light and set(light) < set(full) and all("lora_" in k for k in light)  # pp: full stage files
    assert_weights_close(light, {k: full[k] for k in light})
    base = final_weights(runs["1f1b"])
    assert all(torch.equal(full[k], base[k]) for k in base)  # the frozen base did not move


def test_dpo_pp2_matches_one_process(runs, tiny_pretrain_data, tmp_path):
    """DPO (chosen and rejected rows through the stages, the frozen reference on every rank) follows one
    process: losses, rewards, reward accuracy and the final weights; both start from the pipeline run."""
    toy = toy_dpo_pairs(tmp_path / "toy_prefs.jsonl")
    common = [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=64", "--device=cpu",
              "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--eval_iters=2",
              "--warmup_iters=1", "--seed=3", "--val_ratio=0.1", "--task_type=dpo", f"--data_dir={toy}",
              f"--init_from={runs['1f1b']}", "--max_iters=3", "--batch_size=2", "--gradient_accumulation_steps=2",
              "--learning_rate=3e-3", "--dpo_beta=0.5", "--checkpoint_interval=3"]
    ref, pp = tmp_path / "dpo_ref", tmp_path / "dpo_pp"
    run_cmd(train_cmd([*common, f"--out_dir={ref}"]), env=_env())
    run_cmd(train_cmd([*common, f"--out_dir={pp}", "--pipeline_parallel_size=2"], nproc=2), env=_env())
    rr, rp = records(ref), records(pp)
    assert sorted(rr) == sorted(rp) == [1, 2, 3]
    # step 1 (the same weights): loss, accuracy and grad norm within 1e-5; a reward is beta x (a sum of ~60 fp32
    # token log-probs of the policy minus the reference's), which the pipeline's padded rows round differently
    # by ~1e-5 (1e-4 allowed). Later steps follow weights that AdamW moved apart (see below): 2e-4.
    assert abs(rr[1]["grad_norm"] - rp[1]["grad_norm"]) <= TOL * rr[1]["grad_norm"]
    for s in rr:
        for k in ("loss", "chosen_reward", "rejected_reward", "reward_acc"):
            if s > 1 and k == "reward_acc":
                continue
            tol = 2e-4 if s > 1 else 1e-4 if k.endswith("reward") else TOL
            assert abs(rr[s][k] - rp[s][k]) <= tol, (s, k, rr[s][k], rp[s][k])
    assert any(abs(rr[s]["chosen_reward"]) > 1e-4 for s in rr)  # the rewards move
    # weights: the pipeline pads the pairs to another length than the collate (other rounding: step 1's grad norm
    # agrees to ~1e-7 relative), and AdamW turns
    # a rounding-level gradient of a rare token's embedding into an update of up to lr per step; so 98% of
    # the elements within 1e-5 and every one within 2 x lr x steps (the tight comparison, with the same
    # tolerance as every pipeline test, is tests/parallel/test_pipeline_dpo.py)
    a, b = final_weights(ref), final_weights(pp)
    assert a.keys() == b.keys()
    diffs = torch.cat([(a[k].float() - b[k].float()).abs().flatten() for k in a])
    assert float((diffs > TOL).float().mean()) < 0.02 and float(diffs.max()) <= 2 * 3e-3 * 3, diffs.max()


def test_bad_combination_exits_2_with_one_line(tiny_pretrain_run_args, tmp_path):
    """The trainer: exit 2, one "[rank 0] error: ..." line naming every problem, nothing written."""
    proc = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'bad'}",
                                     "--pipeline_parallel_size=2", "--gradient_accumulation_steps=2",
                                     "--tie_embeddings=true"]), env=_env())
    assert proc.returncode == EXIT_BAD_CONFIG, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("[rank 0] error: bad configuration:"), proc.stderr[-2000:]
    assert "world size 1 is not a multiple of pipeline 2" in lines[0]
    assert "--tie_embeddings=true" in lines[0]
    assert not os.path.isdir(tmp_path / "bad" / "checkpoints")
