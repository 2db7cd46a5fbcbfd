"""train_my_ddp.py, day-to-day use: a resume restores its own run's configuration, W&B continues its
run, LoRA checkpoints hold only the adapters (and resume exactly), MFU is labelled honestly, and
--parallel=fsdp trains like ddp and resumes exactly."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from tests.conftest import PY, ROOT, run_cmd, run_python, run_trainer
from tests.trainer.test_end_to_end import _env, final_weights, losses, train_cmd
from checkpoint.verify import find_latest_valid, list_checkpoints
from utils.constants import EXIT_BAD_CHECKPOINT
from utils.metrics import dedupe_by_step, read_metrics


def _records(out_dir) -> dict[int, dict]:
    return dedupe_by_step(read_metrics(os.path.join(out_dir, "metrics.jsonl")))


def test_resume_restores_the_runs_configuration(tiny_pretrain_run_args, tmp_path):
    """The crashed run is resumed with only --out_dir and --init_from=resume: same schedule, same
    losses as the uninterrupted run (the defaults would give another lr and a StaleIndexError)."""
    args = [*tiny_pretrain_run_args, "--max_iters=6", "--learning_rate=3e-3", "--min_lr=3e-4", "--warmup_iters=1"]
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"]), env=_env())
    once = tmp_path / "fired"
    proc = run_trainer(train_cmd([*args, f"--out_dir={crashed}"]),
                       env=_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists()
    out = run_cmd(train_cmd([f"--out_dir={crashed}", "--init_from=resume", "--log_interval=2"]), env=_env()).stdout
    assert "[resume] configuration from" in out and "log_interval 1 -> 2" in out
    assert losses(crashed) == losses(ref)
    a, b = _records(ref), _records(crashed)
    assert [a[s]["lr"] for s in (5, 6)] == [b[s]["lr"] for s in (5, 6)]
    # a change that breaks exactness is refused, naming the flag
    bad = run_trainer(train_cmd([f"--out_dir={crashed}", "--init_from=resume", "--max_seq_len=64"]), env=_env())
    assert bad.returncode == 2 and "--max_seq_len=64" in bad.stderr and "Traceback" not in bad.stderr


def test_metrics_label_mfu_and_smooth_throughput(tiny_pretrain_run_args, tmp_path):
    out = tmp_path / "run"
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--peak_flops")]
    log = run_cmd(train_cmd([*args, f"--out_dir={out}", "--max_iters=3"]), env=_env(PEAK_FLOPS="")).stdout
    recs = _records(out)
    rec = recs[3]
    # the first two steps of a process (compiling, first allocations) are not counted in the rate or MFU
    assert all("mfu" not in recs[s] and "tokens_per_sec_avg" not in recs[s] for s in (1, 2)), recs
    assert recs[1]["tokens_per_sec"] > 0  # the raw per-step rate is still logged
    assert rec["mfu_is_estimate"] is True and 0 < rec["mfu"] <= 1.0
    assert rec["tokens_per_sec_avg"] > 0 and "mfu~" in log and "an estimate" in log
    assert json.loads((out / "peak_flops.json").read_text())  # the measured peak is cached for the resume


def test_wandb_offline_run_is_continued_on_resume(tiny_pretrain_run_args, tmp_path):
    pytest.importorskip("wandb")
    out = tmp_path / "run"
    env = _env(WANDB_MODE="offline", WANDB_SILENT="true")
    args = [*tiny_pretrain_run_args, "--wandb=true", "--wandb_project=test", "--wandb_run_name=tiny"]
    run_cmd(train_cmd([*args, f"--out_dir={out}", "--max_iters=3"]), env=env)
    first = json.loads((out / "wandb_run.json").read_text())
    assert first["last_step"] == 3
    run_cmd(train_cmd([f"--out_dir={out}", "--init_from=resume", "--max_iters=5"]), env=env)
    second = json.loads((out / "wandb_run.json").read_text())
    assert second == {"id": first["id"], "last_step": 5}
    runs = [d for d in os.listdir(out / "wandb") if d.startswith("offline-run-")]
    assert len(runs) == 2 and all(first["id"] in d for d in runs)


def test_lora_checkpoints_hold_only_the_adapters_and_resume_exactly(tiny_pretrain_run_args, tmp_path):
    base = tmp_path / "base"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={base}", "--max_iters=3"]), env=_env())
    args = [*tiny_pretrain_run_args, f"--init_from={base}", "--max_iters=6", "--lora_rank=2", "--lora_targets=all"]
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"]), env=_env())
    w = final_weights(ref)
    assert w and all("lora_" in k for k in w), sorted(w)[:5]  # no frozen base tensor in the checkpoint
    full = os.path.getsize(os.path.join(find_latest_valid(str(base)), "model.safetensors"))
    light = os.path.getsize(os.path.join(find_latest_valid(str(ref)), "model.safetensors"))
    assert light < full / 4, (light, full)
    once = tmp_path / "fired"
    proc = run_trainer(train_cmd([*args, f"--out_dir={crashed}"]),
                       env=_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0
    run_cmd(train_cmd([f"--out_dir={crashed}", "--init_from=resume"]), env=_env())
    assert losses(crashed) == losses(ref)
    a, b = final_weights(ref), final_weights(crashed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # the base under the adapters changed: loading refuses it (exit 5) instead of a silently other model
    for _, p in list_checkpoints(str(base)):
        st = os.path.join(p, "model.safetensors")
        from safetensors.torch import load_file, save_file
        sd = load_file(st)
        sd["norm.weight"] = sd["norm.weight"] + 1
        save_file(sd, st)
        m = json.loads(open(os.path.join(p, "manifest.json")).read())
        import hashlib
        m["model.safetensors"] = {"bytes": os.path.getsize(st), "sha256": hashlib.sha256(open(st, "rb").read()).hexdigest()}
        open(os.path.join(p, "manifest.json"), "w").write(json.dumps(m))
    proc = run_trainer(train_cmd([f"--out_dir={crashed}", "--init_from=resume", "--max_iters=7"]), env=_env())
    assert proc.returncode == EXIT_BAD_CHECKPOINT and "fingerprint changed" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("nproc", [1, 2])
def test_fsdp_trains_like_ddp_and_resumes_exactly(tiny_pretrain_run_args, tmp_path, nproc):
    """fp32: --parallel=fsdp follows --parallel=ddp step for step (both average over the same global
    batch; only the summation order differs), and a crash + resume under fsdp is bit-exact."""
    args = [*tiny_pretrain_run_args, "--max_iters=5", "--gradient_accumulation_steps=2"]
    if nproc == 2:
        args = [a if not a.startswith("--batch_size") else "--batch_size=2" for a in args]
    ddp, fsdp, crashed = tmp_path / "ddp", tmp_path / "fsdp", tmp_path / "crashed"
    run_cmd(train_cmd([*args, f"--out_dir={ddp}"], nproc), env=_env())
    run_cmd(train_cmd([*args, f"--out_dir={fsdp}", "--parallel=fsdp"], nproc), env=_env())
    ld, lf = losses(ddp), losses(fsdp)
    assert sorted(ld) == sorted(lf) == [1, 2, 3, 4, 5]
    for s in ld:
        assert abs(ld[s] - lf[s]) <= 1e-4 * abs(ld[s]), (s, ld[s], lf[s])
    once = tmp_path / "fired"
    # at 2 processes the crashed run keeps gathered parameters until backward and evaluates when it
    # saves (step 3): the layout that once published a checkpoint written by each rank as a world of one
    variant = ["--reshard_after_forward=false", "--eval_interval=3"] if nproc == 2 else []
    proc = run_trainer(train_cmd([*args, f"--out_dir={crashed}", "--parallel=fsdp", *variant], nproc),
                       env=_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists(), proc.stderr[-2000:]
    run_cmd(train_cmd([f"--out_dir={crashed}", "--init_from=resume"], nproc), env=_env())
    assert losses(crashed) == lf
    from checkpoint.verify import list_checkpoints, verify_checkpoint
    for step, path in list_checkpoints(str(crashed)):  # steps 3 (after an evaluation) and 5 (final)
        assert verify_checkpoint(path) is None, path
        assert {f"__{r}_0.distcp" for r in range(nproc)} <= set(os.listdir(path)), os.listdir(path)


@pytest.mark.parametrize("first, then", [
    ((1, ["--batch_size=4", "--use_distributed_optimizer=true"]), (2, ["--batch_size=2", "--use_distributed_optimizer=true"])),
    ((2, ["--batch_size=2"]), (2, ["--batch_size=2", "--use_distributed_optimizer=true"])),
], ids=["zero-world1-to-zero-world2", "unsharded-world2-to-zero-world2"])
def test_optimizer_state_resumes_across_layouts(tiny_pretrain_run_args, tmp_path, first, then):
    """Saved at one layout, resumed at another: the Adam state carries over (the next losses follow
    the uninterrupted run to summation-order noise, not a restart of the moments)."""
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--batch_size")] + ["--max_iters=5"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    run_cmd(train_cmd([*args, *first[1], f"--out_dir={ref}"], first[0]), env=_env())
    run_cmd(train_cmd([*args, *first[1], f"--out_dir={run}", "--max_iters=3"], first[0]), env=_env())
    run_cmd(train_cmd([f"--out_dir={run}", "--init_from=resume", "--max_iters=5", *then[1]], then[0]), env=_env())
    a, b = losses(ref), losses(run)
    for s in (4, 5):
        assert abs(a[s] - b[s]) <= 1e-4 * abs(a[s]), (s, a[s], b[s])


def test_fsdp_with_compile_follows_eager_fsdp(tiny_pretrain_run_args, tmp_path):
    """--parallel=fsdp --compile=true: torch.compile over the FSDP2-wrapped model (its hooks traced into the graph)
    trains like the eager FSDP run. Traced with --compile_backend=aot_eager (Dynamo + AOTAutograd: the FSDP2 part;
    Inductor's code generation of the same model is tests/model/test_hf_interop_and_lora.py's, and cost this test
    ~70 s of a cold compile); the bound is Inductor's summation-order noise."""
    args = [*tiny_pretrain_run_args, "--max_iters=3", "--parallel=fsdp"]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    run_cmd(train_cmd([*args, f"--out_dir={eager}"]), env=_env())
    log = run_cmd(train_cmd([*args, f"--out_dir={compiled}", "--compile=true", "--compile_backend=aot_eager"]),
                  env=_env()).stdout
    assert "compile on (whole model, aot_eager)" in log, log[-2000:]
    le, lc = losses(eager), losses(compiled)
    assert sorted(le) == sorted(lc) == [1, 2, 3]
    for s in le:
        assert abs(le[s] - lc[s]) <= 1e-4 * abs(le[s]), (s, le[s], lc[s])


def toy_dpo_args(tiny_pretrain_data, tmp_path, init_from, batch_size: int) -> list[str]:
    """Flags of a 3-step DPO run on 16 of the bundled preference pairs, from the checkpoint `init_from`."""
    toy = tmp_path / "toy_prefs.jsonl"
    with open(os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl"), encoding="utf-8") as f:
        toy.write_text("".join(line for _, line in zip(range(16), f)), encoding="utf-8")
    return [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--seed=3",
            "--val_ratio=0.1", "--task_type=dpo", f"--data_dir={toy}", f"--init_from={init_from}",
            "--max_iters=3", f"--batch_size={batch_size}", "--learning_rate=3e-3", "--dpo_beta=0.5",
            "--checkpoint_interval=3"]


def test_dpo_under_fsdp_shards_the_reference_and_follows_ddp(pretrained, tiny_pretrain_data, tmp_path):
    """DPO on 2 processes with --parallel=fsdp (policy and frozen reference both sharded by FSDP2) gives
    the losses and rewards of --parallel=ddp (a full reference copy per rank) to fp32 summation noise."""
    common = toy_dpo_args(tiny_pretrain_data, tmp_path, pretrained["out"], batch_size=2)
    recs = {}
    for engine in ("ddp", "fsdp"):
        out = tmp_path / engine
        log = run_cmd(train_cmd([*common, f"--out_dir={out}", f"--parallel={engine}"], 2), env=_env()).stdout
        recs[engine] = _records(out)
        assert ("[dpo] reference model: sharded" in log) == (engine == "fsdp"), log[-2000:]
        # the policy's and the reference's loads are told apart (the same checkpoint, two lines)
        loads = [ln for ln in log.splitlines() if "[init] loaded weights from" in ln]
        assert len(loads) == 2 and loads[1].endswith("(reference model)") and "(" not in loads[0], loads
    assert sorted(recs["ddp"]) == sorted(recs["fsdp"]) == [1, 2, 3]
    for s in (1, 2, 3):
        for key in ("loss", "chosen_reward", "rejected_reward"):
            a, b = recs["ddp"][s][key], recs["fsdp"][s][key]
            assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (s, key, a, b)


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_checkpoint_exports_to_hf_streaming(tiny_pretrain_run_args, tmp_path, tied):
    """export_hf.py on an fsdp (DCP) checkpoint streams it into HF's sharded layout, a few tensors per
    safetensors file: transformers loads it, with exactly the checkpoint's weights."""
    from transformers import LlamaForCausalLM

    from checkpoint.dcp import load_full_model_state_dict
    run = tmp_path / "run"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=2", "--parallel=fsdp",
                       f"--tie_embeddings={str(tied).lower()}"]), env=_env())
    found = find_latest_valid(str(run))
    hf_dir = tmp_path / "hf"
    out = run_cmd([sys.executable, os.path.join(ROOT, "export_hf.py"), f"--ckpt={run}", f"--out_dir={hf_dir}",
                   "--max_shard_gb=0.00002"], env=_env()).stdout  # ~21 KB shards: several files
    assert "streamed from the sharded checkpoint" in out
    shards = sorted(p.name for p in hf_dir.glob("model-*.safetensors"))
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (hf_dir / "model.safetensors").exists()
    want = load_full_model_state_dict(found)
    hf = LlamaForCausalLM.from_pretrained(str(hf_dir))
    got = hf.state_dict()
    for k, v in want.items():
        hf_key = k if k == "lm_head.weight" else "model." + k
        assert torch.equal(got[hf_key], v), k
    if tied:
        assert "lm_head.weight" not in index["weight_map"] and torch.equal(got["lm_head.weight"],
                                                                             want["embed_tokens.weight"])


@pytest.mark.parametrize("family, flags", [
    ("Glm4MoeForCausalLM", ["--moe_score=sigmoid", "--moe_shared_experts=1", "--moe_first_dense_layers=1",
                            "--moe_bias_update_rate=0.01"]),
    ("MixtralForCausalLM", []),
], ids=["glm4_moe", "mixtral"])
def test_sharded_moe_checkpoint_exports_to_hf_streaming(tiny_pretrain_run_args, tmp_path, family, flags):
    """An MoE run's DCP checkpoint streams into its Hugging Face family too (model/hf_interop.py moe_family), each
    stacked expert tensor split per expert as its group is read: transformers loads it as that family, with
    exactly the checkpoint's weights (the selection biases too, which the run moved, for GLM-4-MoE)."""
    import transformers

    from checkpoint.dcp import load_full_model_state_dict
    from model.config import ModelConfig
    from model.hf_interop import moe_family
    run = tmp_path / "run"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={run}", "--max_iters=2", "--parallel=fsdp",
                       "--n_layers=2", "--moe_num_experts=4", "--moe_top_k=2", "--moe_hidden_dim=16", *flags]),
            env=_env())
    found = find_latest_valid(str(run))
    hf_dir = tmp_path / "hf"
    out = run_cmd([sys.executable, os.path.join(ROOT, "export_hf.py"), f"--ckpt={run}", f"--out_dir={hf_dir}",
                   "--max_shard_gb=0.00002"], env=_env()).stdout
    assert f"({family}, streamed from the sharded checkpoint" in out, out
    shards = sorted(p.name for p in hf_dir.glob("model-*.safetensors"))
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    want = load_full_model_state_dict(found)
    biases = [v for k, v in want.items() if k.endswith("expert_bias")]
    assert any(bool(b.any()) for b in biases) == (family == "Glm4MoeForCausalLM")  # (the run moved them)
    cfg = json.loads((hf_dir / "config.json").read_text())
    hub = moe_family(ModelConfig(moe_num_experts=4, moe_score="sigmoid" if flags else "softmax"))[0].to_hub(
        {k: v for k, v in want.items() if not k.startswith("mtp.")})
    got = getattr(transformers, family).from_pretrained(str(hf_dir), experts_implementation="eager").state_dict()
    assert cfg["architectures"] == [family]
    for k, v in hub.items():
        hf_key = k if k == "lm_head.weight" else "model." + k
        mine = (got[hf_key.replace(".block_sparse_moe.", ".mlp.")] if ".experts." not in k
                else _expert_weight(got, hf_key))
        assert hf_key in index["weight_map"] and torch.equal(mine, v), k


def _expert_weight(state: dict, hub_key: str) -> torch.Tensor:
    """One expert's Hub-layout weight out of transformers 5's stacked parameters (`mlp.experts.gate_up_proj`
    [E, 2I, D], gate rows first; Mixtral's w1 / w3 / w2 named as GLM's gate / up / down, its block_sparse_moe
    as mlp)."""
    import re
    m = re.match(r"(.*\.experts)\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)\.weight$", hub_key)
    stem, e, w = m.group(1), int(m.group(2)), {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(
        m.group(3), m.group(3))
    stem = stem.replace("block_sparse_moe", "mlp")
    if w == "down_proj":
        return state[f"{stem}.down_proj"][e]
    gate, up = state[f"{stem}.gate_up_proj"][e].chunk(2, dim=0)
    return gate if w == "gate_proj" else up


def test_init_checkpoint_chooses_best_or_a_step_of_the_init_from_run(pretrained, tmp_path, capsys):
    """--init_from=<run> takes its newest checkpoint; --init_checkpoint=best the one with the lowest validation
    loss, step_N that one; the load line says which. A choice that names nothing is one line, exit 2."""
    import train_my_ddp as T
    from checkpoint.verify import list_checkpoints
    from utils.checkpoint_json import read_json
    from utils.constants import EXIT_BAD_CONFIG
    run = str(pretrained["out"])
    found = list_checkpoints(run)
    vals = {p: read_json(os.path.join(p, "trainer_state.json")).get("val_loss") for _, p in found}
    best = min((v, p) for p, v in vals.items() if v is not None)[1]
    other = next(p for _, p in found if p != best)
    base = [*pretrained["args"], f"--init_from={run}", "--max_iters=1", "--checkpoint_interval=1"]
    for which, want in (("best", best), (os.path.basename(other), other)):
        capsys.readouterr()
        assert T.main([*base, f"--out_dir={tmp_path / which}", f"--init_checkpoint={which}"]) == 0
        out = capsys.readouterr().out
        assert f"[init] loaded weights from {want} (--init_checkpoint={which})" in out, out[-2000:]
    pre = run_python([PY, "train_my_ddp.py", *base, f"--out_dir={tmp_path / 'none'}", "--init_checkpoint=step_99"])
    lines = [line for line in pre.stderr.splitlines() if line.strip()]
    assert pre.returncode == EXIT_BAD_CONFIG and len(lines) == 1 and "no checkpoint at step 99" in lines[0], pre.stderr
    assert "--init_checkpoint" in lines[0]


def test_a_new_task_is_one_module_and_one_registration_line(tiny_pretrain_run_args, tmp_path, monkeypatch, capsys):
    """tests/trainer/last_token_task.py (a loss on each row's last token, averaged over rows, one statistic of its
    own) becomes --task_type=last_token by one entry in trainer.tasks.TASKS: the pre-check accepts the name, the
    engines carry its statistic in the step row, the metrics rows and validation report it per unit."""
    import train_my_ddp as T
    from trainer import tasks
    monkeypatch.setitem(tasks.TASKS, "last_token", "tests.trainer.last_token_task:LastTokenTask")  # the one line
    out = tmp_path / "run"
    code = T.main([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=3", "--task_type=last_token",
                   "--eval_interval=3"])
    assert code == 0, capsys.readouterr().err[-2000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["rows_scored"] == 1.0 and 0 < r["loss"] < 20 for r in steps), steps
    assert any(r.get("val_rows_scored") == 1.0 for r in rows), rows
    # its units are rows: 4 rows a step, so tokens_seen (the units by default) grows by 4
    assert [r["tokens_seen"] for r in steps] == [4, 8, 12], steps
    monkeypatch.delitem(tasks.TASKS, "last_token")
    assert T.main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'x'}", "--task_type=last_token"]) == 2


def test_selective_activation_checkpointing_trains_like_none(tiny_pretrain_run_args, tmp_path):
    """--activation_checkpoint=selective, per op and every 2nd block: the losses and weights of a run that keeps
    every activation, bit for bit on the CPU (recomputation replays the same operations); the [layout] line names
    the policy. The policy is the command's, not the checkpoint's: a run saved under one continues under another
    (here op, then full from step 3) as the uninterrupted run without checkpointing."""
    args = [*tiny_pretrain_run_args, "--max_iters=5"]
    plain, op, nth = tmp_path / "plain", tmp_path / "op", tmp_path / "nth"
    run_cmd(train_cmd([*args, f"--out_dir={plain}"]), env=_env())
    log = run_cmd(train_cmd([*args, f"--out_dir={op}", "--activation_checkpoint=selective", "--max_iters=3"]),
                  env=_env()).stdout
    assert "activation checkpointing selective per op (attention and every other matmul kept)" in log, log[-2000:]
    log = run_cmd(train_cmd([*args, f"--out_dir={op}", "--activation_checkpoint=full"]), env=_env()).stdout
    assert "activation checkpointing full (each block)" in log and "[resume]" in log, log[-2000:]
    log = run_cmd(train_cmd([*args, f"--out_dir={nth}", "--activation_checkpoint=selective",
                             "--selective_ac_option=2"]), env=_env()).stdout
    assert "activation checkpointing every 2nd block" in log, log[-2000:]
    want = losses(plain)
    assert sorted(want) == [1, 2, 3, 4, 5]
    assert losses(op) == want and losses(nth) == want
    ref = final_weights(plain)
    for run in (op, nth):
        got = final_weights(run)
        assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref), run
