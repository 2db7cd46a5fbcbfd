"""MoE through the trainer: the balancing losses reach the gradient and not the logged loss (trainer/moe.py), the
bias update of a real run against DeepSeek-V3's rule from the run's own logged loads, the metrics row, and bad MoE
flags as one line, exit 2."""
from __future__ import annotations

import math
import os

import pytest
import torch

from model import ModelConfig, Transformer
from model.moe import moe_layers
from tests.conftest import ROOT, run_cmd, train_cmd
from tests.trainer.test_errors import assert_one_error_line, run_main
from trainer.moe import MoETraining
from checkpoint.files import load_model_state
from checkpoint.verify import find_latest_valid
from utils.constants import EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG
from utils.metrics import dedupe_by_step, read_metrics

MOE = ["--moe_num_experts=4", "--moe_top_k=2", "--moe_hidden_dim=16", "--moe_first_dense_layers=1"]


def _cfg(**kw):
    return type("Cfg", (), {**dict(moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0, moe_bias_update_rate=0.0), **kw})()


def test_aux_losses_join_the_gradient_not_the_logged_loss():
    """Through Engine.forward_backward with MoETraining as its side loss: the gradient is that of the loss plus
    the balancing terms times the units, written out by hand; the row it returns holds the task's loss alone."""
    from parallel.engine import Engine
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_seq_len=16,
                                    moe_num_experts=4, moe_top_k=2, moe_shared_experts=1))
    x = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": x, "labels": x}
    units = lambda b: int(b["labels"].numel())  # noqa: E731
    base = lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {})  # noqa: E731

    def grads(loss_fn):
        model.zero_grad()
        loss, _ = loss_fn(model, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    engine = Engine(model, type("Unscaled", (), {"scale_loss": staticmethod(lambda t: t)})(), model)
    engine.side_loss = MoETraining.of(_cfg(moe_aux_loss_coef=0.1, moe_z_loss_coef=0.01), model, units)
    model.zero_grad()
    row = engine.forward_backward([batch], base, global_units=1.0)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    def by_hand(m, b):  # the loss plus the formula's terms, in the open
        lm = m(b["input_ids"], labels=b["labels"], reduction="sum")
        extra = 0.0
        for layer in moe_layers(m):
            aux = layer.take_aux()
            extra = extra + 0.1 * aux[0] + 0.01 * aux[1]
        return lm + extra * units(b), {}
    _, want = grads(by_hand)
    plain_loss, plain = grads(base)
    assert float(row[0]) == pytest.approx(float(plain_loss), rel=1e-6)  # the logged value is the task's loss alone
    router = "layers.0.mlp.router.weight"
    assert not torch.allclose(got[router], plain[router])  # the balancing terms moved the router's gradient
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=1e-5, atol=1e-7), n


RATE = 0.01


@pytest.fixture(scope="module")
def moe_run(tiny_pretrain_run_args, tmp_path_factory):
    """3 pretraining steps of a 3-block MoE (the first dense) with every balancing option on."""
    out = tmp_path_factory.mktemp("moe") / "run"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=3", "--n_layers=3", *MOE,
                       "--moe_aux_loss_coef=0.01", "--moe_z_loss_coef=0.001", f"--moe_bias_update_rate={RATE}"]))
    return out


def test_run_bias_update_and_metrics(moe_run):
    """Each layer's saved bias is rate x the sum over steps of sign(mean - load) of the loads the run logged;
    every token counted top_k times."""
    out, rate = moe_run, RATE
    rows = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    want = torch.zeros(2, 4)
    for step in (1, 2, 3):
        r = rows[step]
        loads = torch.tensor(r["moe_tokens_per_expert"], dtype=torch.float64)
        assert loads.shape == (2, 4) and (loads.sum(dim=1) == 4 * 32 * 2).all()  # batch x seq x top_k
        assert r["moe_load_max_mean"] == pytest.approx(float((loads.max(1).values / loads.mean(1)).max()))
        assert set(r) >= {"moe_aux_loss", "moe_z_loss", "moe_load_max_mean_l1", "moe_load_max_mean_l2"}
        assert 0.5 < r["moe_aux_loss"] <= 2  # 1 when balanced, at most E / top_k = 2
        want += rate * torch.sign(loads.mean(1, keepdim=True) - loads).float()
    state = load_model_state(find_latest_valid(str(out)))
    got = torch.stack([state["layers.1.mlp.expert_bias"], state["layers.2.mlp.expert_bias"]])
    assert torch.allclose(got, want, atol=1e-7), (got, want)
    assert "layers.0.mlp.gate_proj.weight" in state  # the first block stayed dense


def _chat_args(tiny_pretrain_data, init, out, *extra):
    return [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--eval_iters=2",
            "--warmup_iters=1", "--seed=3", "--val_ratio=0.05", f"--init_from={init}", f"--out_dir={out}",
            "--batch_size=4", "--learning_rate=3e-3", *extra]


def test_sft_lora_and_dpo_on_an_moe_model(moe_run, tiny_pretrain_data, tmp_path):
    """SFT (full, bias update on) trains the experts; LoRA (targets all,experts: the attention projections, the dense
    block's MLP and the routed experts get adapters, the stacked expert weights and the router stay frozen) saves
    only adapters, and the merged model's experts are W + s B A of the base's; DPO starts at reward accuracy 0
    (policy = reference) and logs the loads of chosen and rejected forwards."""
    sft_data = os.path.join(ROOT, "data", "sft")
    base = load_model_state(find_latest_valid(str(moe_run)))
    sft = tmp_path / "sft"
    run_cmd(train_cmd(_chat_args(tiny_pretrain_data, moe_run, sft, "--task_type=sft", f"--data_dir={sft_data}",
                                 "--max_iters=3", "--checkpoint_interval=3", "--moe_bias_update_rate=0.01",
                                 "--moe_aux_loss_coef=0.01")))
    after = load_model_state(find_latest_valid(str(sft)))
    assert not torch.equal(after["layers.1.mlp.experts.gate_up_proj"], base["layers.1.mlp.experts.gate_up_proj"])
    assert not torch.equal(after["layers.1.mlp.expert_bias"], base["layers.1.mlp.expert_bias"])
    rows = dedupe_by_step(read_metrics(os.path.join(sft, "metrics.jsonl")))
    assert all(math.isfinite(rows[s]["loss"]) and rows[s]["moe_load_max_mean"] >= 1 for s in (1, 2, 3))

    lora = tmp_path / "lora"
    run_cmd(train_cmd(_chat_args(tiny_pretrain_data, moe_run, lora, "--task_type=sft", f"--data_dir={sft_data}",
                                 "--max_iters=2", "--checkpoint_interval=2", "--lora_rank=2", "--lora_alpha=4",
                                 "--lora_targets=all,experts")))
    saved = load_model_state(find_latest_valid(str(lora)))
    assert any("self_attn.q_proj.lora_A" in k for k in saved) and any("layers.0.mlp.gate_proj.lora_A" in k
                                                                       for k in saved)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) or ".router." in k for k in saved)
    from trainer.weights import load_weights_from
    merged, _ = load_weights_from(str(lora), lambda m: None)  # the base rebuilt, the adapters merged
    for proj in ("gate_up_proj", "down_proj"):
        a, b = (saved[f"layers.2.mlp.experts.{proj}_lora_{x}"] for x in "AB")
        assert b.abs().max() > 0  # trained away from zero
        want = base[f"layers.2.mlp.experts.{proj}"] + 4 / 2 * torch.bmm(b, a)
        got = merged.state_dict()[f"layers.2.mlp.experts.{proj}"]
        assert torch.allclose(got, want, rtol=0, atol=8 * torch.finfo(torch.float32).eps * float(want.abs().max()))

    dpo, toy = tmp_path / "dpo", tmp_path / "toy_prefs.jsonl"
    with open(os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl"), encoding="utf-8") as f:
        toy.write_text("".join(line for _, line in zip(range(16), f)), encoding="utf-8")
    run_cmd(train_cmd(_chat_args(tiny_pretrain_data, sft, dpo, "--task_type=dpo", f"--data_dir={toy}",
                                 "--max_iters=2", "--checkpoint_interval=2", "--moe_aux_loss_coef=0.01")))
    rows = dedupe_by_step(read_metrics(os.path.join(dpo, "metrics.jsonl")))
    assert rows[1]["reward_acc"] == 0.0 and math.isfinite(rows[2]["loss"])
    assert sum(rows[1]["moe_tokens_per_expert"][0]) % 2 == 0 and sum(rows[1]["moe_tokens_per_expert"][0]) > 0


@pytest.mark.parametrize("extra, needle", [
    (["--moe_num_experts=4", "--moe_top_k=5"], "--moe_top_k=5: must be in [1, --moe_num_experts=4]"),
    (["--moe_num_experts=4", "--moe_score=relu"], "--moe_score='relu' (softmax | sigmoid)"),
    (["--moe_num_experts=4", "--moe_first_dense_layers=2"], "--moe_first_dense_layers=2: leaves no MoE block"),
    (["--moe_num_experts=-1"], "--moe_num_experts=-1: must be >= 0"),
    (["--moe_bias_update_rate=-0.1"], "--moe_bias_update_rate=-0.1: must be a finite number >= 0"),
    (["--moe_num_experts=4", "--moe_bias_update_rate=0.1", "--lora_rank=2"],
     "--moe_bias_update_rate=0.1 cannot be combined with --lora_rank=2"),
    (["--moe_num_experts=6", "--moe_n_groups=4"], "--moe_n_groups=4: must be >= 1 and divide --moe_num_experts=6"),
    (["--moe_num_experts=8", "--moe_n_groups=4", "--moe_topk_groups=5"],
     "--moe_topk_groups=5: must be in [1, --moe_n_groups=4]"),
    (["--moe_num_experts=8", "--moe_n_groups=4", "--moe_topk_groups=1", "--moe_top_k=3"],
     "--moe_top_k=3: more than the 1 x 2 experts of --moe_topk_groups=1 groups"),
    (["--moe_num_experts=4", "--moe_routed_scaling=0"], "--moe_routed_scaling=0.0: must be a finite number > 0"),
    (["--moe_num_experts=4", "--moe_aux_loss_type=token"], "--moe_aux_loss_type='token' (batch | sequence)"),
    (["--moe_num_experts=4", "--moe_capacity_factor=-1"],
     "--moe_capacity_factor=-1.0: must be a finite number >= 0 (0 = dropless)"),
    (["--moe_num_experts=4", "--moe_token_drop_policy=random"], "--moe_token_drop_policy='random' (probs | position)"),
], ids=["top_k", "score", "all_dense", "negative", "rate", "lora_bias", "groups", "topk_groups", "group_top_k",
        "scaling", "aux_type", "capacity", "drop_policy"])
def test_bad_moe_flags_one_line_exit_2(tiny_pretrain_run_args, tmp_path, capsys, extra, needle):
    code, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=1", *extra], capsys)
    assert code == EXIT_BAD_CONFIG, err
    assert_one_error_line(err, needle)


def test_export_refuses_what_mixtral_cannot_hold_and_a_mixtral_trains(moe_run, tiny_pretrain_run_args, tmp_path,
                                                                     capsys):
    """export_hf.py on the run with a dense first block: exit 2, one line naming it. A Mixtral directory written
    by export_hf starts a run (--init_from) as an MoE model of that shape."""
    import export_hf
    from model.hf_interop import export_hf as write_hf
    code = export_hf.main([f"--ckpt={moe_run}", f"--out_dir={tmp_path / 'hf'}"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_CONFIG and "moe_first_dense_layers=1 (every Mixtral block is MoE)" in err, err
    assert len(err.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "hf")

    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=384, dim=32, n_layers=2, n_heads=4, hidden_dim=48, max_seq_len=32,
                                    moe_num_experts=4, moe_top_k=2, moe_hidden_dim=16))
    write_hf(model, str(tmp_path / "mixtral"))
    out = tmp_path / "from_hf"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=1", "--checkpoint_interval=1",
                       f"--init_from={tmp_path / 'mixtral'}"]))
    row = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))[1]
    assert row["moe_tokens_per_expert"] and len(row["moe_tokens_per_expert"]) == 2
    state = load_model_state(find_latest_valid(str(out)))
    assert state["layers.1.mlp.experts.down_proj"].shape == (4, 32, 16)


@pytest.mark.parametrize("nproc, extra", [
    (1, ["--n_layers=3", "--moe_n_groups=2", "--moe_topk_groups=1", "--moe_routed_scaling=2.0"]),
    (2, ["--n_layers=3", "--batch_size=2", "--parallel=fsdp"]),
    (2, ["--n_layers=2", "--pipeline_parallel_size=2", "--gradient_accumulation_steps=2"]),
    (4, ["--n_layers=4", "--pipeline_parallel_size=2", "--gradient_accumulation_steps=2", "--parallel=fsdp",
         "--expert_parallel_size=2", "--batch_size=2"]),
    (4, ["--n_layers=4", "--pipeline_parallel_size=2", "--gradient_accumulation_steps=2",
         "--expert_parallel_size=2", "--batch_size=2"]),
    (4, ["--n_layers=4", "--pipeline_parallel_size=2", "--gradient_accumulation_steps=2",
         "--expert_parallel_size=2", "--batch_size=2", "--use_distributed_optimizer=true"]),
    (2, ["--n_layers=3", "--parallel=fsdp", "--tensor_parallel_size=2", "--sequence_parallel=true"]),
    (4, ["--n_layers=3", "--context_parallel_size=2", "--expert_parallel_size=2", "--batch_size=2",
         "--use_distributed_optimizer=true"]),
    (4, ["--n_layers=3", "--expert_parallel_size=2", "--batch_size=1", "--use_distributed_optimizer=true",
         "--optimizer=muon"]),
], ids=["1proc", "fsdp2", "pp2", "pp2_ep2", "pp2_ep2_ddp", "pp2_ep2_zero1", "tp2_sp", "cp2_ep2_zero1",
        "ep2_zero1_muon"])
def test_resume_is_exact_with_the_biases(tiny_pretrain_run_args, tmp_path, nproc, extra):
    """A crash at the start of step 4 (checkpoint at 2), resumed: the same losses and final weights, selection
    biases included, as the uninterrupted run (the biases moved every step: a resume that lost them diverges).
    Under 2 pipeline stages the metrics row holds every stage's MoE layers, each token counted top_k times (`pp2`:
    the first stage's one block is dense, and it still joins the statistics' sum, a collective)."""
    from tests.conftest import run_trainer
    args = [*tiny_pretrain_run_args, *MOE, "--moe_bias_update_rate=0.01", "--moe_aux_loss_coef=0.01",
            "--max_iters=5", "--checkpoint_interval=2", *extra]
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    # one thread in every run: a CPU matmul's rounding may depend on the thread count
    plain = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    run_cmd(train_cmd([*args, f"--out_dir={ref}"], nproc), env=plain)
    once = tmp_path / "fired"
    env = dict(plain, MYLLM_FAULT="crash@4", MYLLM_FAULT_ONCE_FILE=str(once))
    proc = run_trainer(train_cmd([*args, f"--out_dir={crashed}"], nproc), env=env)
    assert proc.returncode != 0 and once.exists()
    run_cmd(train_cmd([*args, f"--out_dir={crashed}", "--init_from=resume"], nproc), env=plain)
    def losses(d):
        return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))).items()}
    assert losses(crashed) == losses(ref) and sorted(losses(ref)) == [1, 2, 3, 4, 5]
    from checkpoint.weights import checkpoint_model_state  # any engine's checkpoint (DCP for fsdp)
    a, b = (checkpoint_model_state(find_latest_valid(str(d))) for d in (ref, crashed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.count_nonzero(a["layers.1.mlp.expert_bias"]) > 0
    if "--moe_n_groups=2" in extra:  # the routing's shape is the model's: saved with it, resumed with it
        import json
        saved = json.loads((crashed / "checkpoints" / "step_00000004" / "model_config.json").read_text())
        assert (saved["moe_n_groups"], saved["moe_topk_groups"], saved["moe_routed_scaling"]) == (2, 1, 2.0)
    rows = dedupe_by_step(read_metrics(os.path.join(crashed, "metrics.jsonl")))
    n_moe = int(next(a for a in extra if a.startswith("--n_layers="))[len("--n_layers="):]) - 1
    for r in rows.values():
        loads = torch.tensor(r["moe_tokens_per_expert"])
        assert loads.shape == (n_moe, 4) and len(set(loads.sum(dim=1).tolist())) == 1, loads
        assert 0.5 < r["moe_aux_loss"] <= 2 and f"moe_load_max_mean_l{n_moe}" in r


def test_pipeline_stages_resume_at_another_ep_and_zero(tiny_pretrain_run_args, tmp_path):
    """Our DDP's pipeline stages with experts over 2 ep ranks and ZeRO-1 (each rank's optimizer file holds its
    experts' and its shard's state, by parameter name): the step-2 checkpoint resumes at ep=1 without ZeRO, and
    steps 3-4 follow the uninterrupted run (the stage files hold every expert, gathered)."""
    import shutil
    plain = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = [*tiny_pretrain_run_args, *MOE, "--moe_bias_update_rate=0.01", "--moe_aux_loss_coef=0.01",
            "--max_iters=4", "--checkpoint_interval=2", "--n_layers=4", "--pipeline_parallel_size=2",
            "--gradient_accumulation_steps=2", "--batch_size=2"]
    ref, moved = tmp_path / "ref", tmp_path / "moved"
    run_cmd(train_cmd([*args, f"--out_dir={ref}", "--expert_parallel_size=2", "--use_distributed_optimizer=true"],
                      4), env=plain)
    shutil.copytree(ref, moved)
    shutil.rmtree(moved / "checkpoints" / "step_00000004")
    run_cmd(train_cmd([*args, f"--out_dir={moved}", "--init_from=resume", "--expert_parallel_size=1",
                       "--use_distributed_optimizer=false"], 4), env=plain)

    def losses(d):
        return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))).items()}
    a, b = losses(ref), losses(moved)
    assert sorted(b) == [1, 2, 3, 4]
    for s in (3, 4):  # another reduction order of the experts' gradients: rounding only
        assert abs(a[s] - b[s]) <= 1e-5 * abs(a[s]), (s, a[s], b[s])


def test_a_muon_run_saved_before_muon_stepped_experts_resumes_as_it_ran(tiny_pretrain_run_args, tmp_path, capsys):
    """A Muon run whose config.json predates --muon_experts (AdamW stepped its experts) resumes with
    --muon_experts=false (trainer/config.py BEFORE_THE_FLAG), logged; asked to switch the experts to Muon, the resume
    is one exit-5 line naming the flag, never a silently reset state."""
    import json
    out = tmp_path / "run"
    args = [*tiny_pretrain_run_args, *MOE, "--optimizer=muon", f"--out_dir={out}", "--checkpoint_interval=2"]
    run_cmd(train_cmd([*args, "--max_iters=2", "--muon_experts=false"]))
    from checkpoint.verify import sha256_file
    for path in (out / "config.json", out / "checkpoints" / "step_00000002" / "config.json"):  # as saved before
        saved = json.loads(path.read_text())
        saved.pop("muon_experts")
        path.write_text(json.dumps(saved))
    manifest = out / "checkpoints" / "step_00000002" / "manifest.json"  # (its record of the file, updated)
    entries = json.loads(manifest.read_text())
    entries["config.json"] = {"bytes": os.path.getsize(path), "sha256": sha256_file(str(path))}
    manifest.write_text(json.dumps(entries))
    code, err = run_main([*args, "--max_iters=3", "--init_from=resume", "--muon_experts=true"], capsys)
    assert code == EXIT_BAD_CHECKPOINT, err
    assert_one_error_line(err, "experts.down_proj: its saved entry has no momentum tensor (it was stepped by "
                               "AdamW there: see --muon_experts)")
    proc = run_cmd(train_cmd([*args, "--max_iters=3", "--init_from=resume"]))
    assert "predates --muon_experts: muon_experts=False, as that run ran" in proc.stdout, proc.stdout[-2000:]
    rows = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert sorted(rows) == [1, 2, 3]
    saved = torch.load(os.path.join(find_latest_valid(str(out)), "optimizer_rank0.pt"), weights_only=True)
    assert "exp_avg" in saved["params"]["layers.1.mlp.experts.down_proj"]
    assert "momentum" in saved["params"]["layers.1.mlp.router.weight"]


def test_capacity_drops_are_logged_and_expert_parallel_follows_data_parallel(tiny_pretrain_run_args, tmp_path):
    """--moe_capacity_factor=0.5 at 2 ranks, 2 rows each: every rank caps its own forward's pairs (before any
    exchange), so 2 expert-parallel ranks give the losses, the loads and the dropped share of 2 data-parallel ranks
    without expert parallelism; some pairs are dropped, not all."""
    args = [*tiny_pretrain_run_args, "--max_iters=3", "--checkpoint_interval=3", "--batch_size=2", *MOE,
            "--moe_capacity_factor=0.5"]
    dp, ep = tmp_path / "dp", tmp_path / "ep"
    run_cmd(train_cmd([*args, f"--out_dir={dp}"], 2))
    run_cmd(train_cmd([*args, f"--out_dir={ep}", "--expert_parallel_size=2"], 2))
    a, b = (dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))) for d in (dp, ep))
    for s in (1, 2, 3):
        assert abs(a[s]["loss"] - b[s]["loss"]) <= 1e-4 * abs(a[s]["loss"]), (s, a[s]["loss"], b[s]["loss"])
        assert 0 < a[s]["moe_dropped_frac"] < 1 and a[s]["moe_dropped_frac"] == b[s]["moe_dropped_frac"], s
    assert a[1]["moe_tokens_per_expert"] == b[1]["moe_tokens_per_expert"]
