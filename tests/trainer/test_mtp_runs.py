"""Multi-token prediction through the trainer (trainer/mtp.py, trainer/side_losses.py): the MTP term joins the
gradient and not the logged loss (beside MoE's balancing terms, written out by hand), real runs (a weight of 0 trains
the trunk as a run without MTP; MTP changes the trunk's training; an exact resume), context parallelism and FSDP at 2
ranks against one process, the export without the depths, and the refusals as one line, exit 2."""
from __future__ import annotations

import math
import os

import pytest
import torch

from model import ModelConfig, Transformer
from model.moe import moe_layers
from tests.conftest import run_cmd, run_trainer, train_cmd
from tests.trainer.test_end_to_end import _env, final_weights, losses
from tests.trainer.test_errors import assert_one_error_line, run_main
from trainer.side_losses import SideLosses
from utils.constants import EXIT_BAD_CONFIG
from utils.metrics import dedupe_by_step, read_metrics


def _rows(out) -> dict:
    return dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))


def test_mtp_and_balancing_join_the_gradient_not_the_logged_loss():
    """Engine.forward_backward with the side losses of an MoE model with 2 MTP depths: the gradient is that of the
    loss + weight / 2 x the depths' summed losses + the balancing terms x units, written out; the row holds the
    task's loss alone."""
    from parallel.engine import Engine
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_seq_len=16,
                                    moe_num_experts=4, moe_top_k=2, mtp_num_layers=2))
    x = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": x, "labels": torch.roll(x, -1, 1)}
    units = lambda b: int(b["labels"].numel())  # noqa: E731
    base = lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {})  # noqa: E731
    knobs = dict(moe_aux_loss_coef=0.1, moe_z_loss_coef=0.0, moe_bias_update_rate=0.0, mtp_loss_weight=0.3)
    engine = Engine(model, type("Unscaled", (), {"scale_loss": staticmethod(lambda t: t)})(), model)
    engine.side_loss = SideLosses.of(type("Cfg", (), knobs)(), model, units)
    model.zero_grad()
    row = engine.forward_backward([batch], base, global_units=1.0)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}

    model.zero_grad()
    lm = model(x, labels=batch["labels"], reduction="sum")
    mtp, _ = model.mtp.take()
    aux = sum(layer.take_aux()[0] for layer in moe_layers(model))
    (lm + 0.3 / 2 * mtp + 0.1 * aux * units(batch)).backward()
    assert float(row[0]) == pytest.approx(float(lm), rel=1e-6)  # the logged value is the task's loss alone
    for n, p in model.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-5, atol=1e-7), n
    assert got["mtp.depths.1.eh_proj.weight"].abs().sum() > 0


@pytest.fixture(scope="module")
def mtp_runs(tiny_pretrain_run_args, tmp_path_factory):
    """4 pretraining steps without MTP, with 2 depths at weight 0, and at weight 0.3 (checkpoints at 2 and 4)."""
    base = tmp_path_factory.mktemp("mtp")
    args = [*tiny_pretrain_run_args, "--max_iters=4", "--checkpoint_interval=2", "--grad_clip=0"]
    outs = {}
    for name, extra in (("plain", []), ("w0", ["--mtp_num_layers=2", "--mtp_loss_weight=0"]),
                        ("w3", ["--mtp_num_layers=2", "--mtp_loss_weight=0.3"])):
        outs[name] = base / name
        run_cmd(train_cmd([*args, f"--out_dir={outs[name]}", *extra]), env=_env())
    outs["args"] = args
    return outs


def test_weight_zero_trains_the_trunk_as_without_mtp(mtp_runs):
    """Same seed: the trunk starts from the same weights with or without MTP (model/mtp.py is built after it),
    so step 1's loss is the same in all three runs; at weight 0 the trunk trains as without MTP (its logged losses
    follow the plain run's), at 0.3 it trains otherwise. mtp_loss is logged per depth, the mean of the two."""
    plain, w0, w3 = (losses(mtp_runs[k]) for k in ("plain", "w0", "w3"))
    assert plain[1] == w0[1] == w3[1]
    for s in (2, 3, 4):
        assert abs(w0[s] - plain[s]) <= 1e-6 * abs(plain[s]), (s, w0[s], plain[s])
    assert max(abs(w3[s] - plain[s]) for s in (2, 3, 4)) > 1e-3
    r0, r3 = _rows(mtp_runs["w0"]), _rows(mtp_runs["w3"])
    assert r0[1]["mtp_loss"] == pytest.approx(r3[1]["mtp_loss"], rel=1e-6)  # the same weights at step 1
    for r in (r0, r3):
        assert r[1]["mtp_loss"] == pytest.approx((r[1]["mtp_loss_1"] + r[1]["mtp_loss_2"]) / 2, rel=1e-12)
        assert abs(r[1]["mtp_loss"] - math.log(384)) < 1.0  # about uniform over the tiny vocabulary at the start
    assert r3[4]["mtp_loss"] < r0[4]["mtp_loss"] - 0.01  # the depths learn at weight 0.3 (at 0 they do not)
    assert "mtp_loss" not in _rows(mtp_runs["plain"])[1]


def test_mtp_run_resumes_exactly(mtp_runs, tmp_path, capsys):
    """A crash after step 3 (step 2's checkpoint holds the depths and their optimizer state): the resumed run
    logs the uninterrupted run's losses and MTP losses and ends on its weights, bit for bit. Resuming it with
    another number of depths is refused (the model's shape is its checkpoint's)."""
    out = tmp_path / "crashed"
    args = [*mtp_runs["args"], f"--out_dir={out}", "--mtp_num_layers=2", "--mtp_loss_weight=0.3"]
    proc = run_trainer(train_cmd(args), env=_env(MYLLM_FAULT="crash@3"))
    assert proc.returncode != 0, proc.stdout[-2000:]
    run_cmd(train_cmd([f"--out_dir={out}", "--init_from=resume"]), env=_env())
    assert losses(out) == losses(mtp_runs["w3"])
    assert [_rows(out)[s]["mtp_loss"] for s in (1, 2, 3, 4)] == [_rows(mtp_runs["w3"])[s]["mtp_loss"]
                                                                  for s in (1, 2, 3, 4)]
    a, b = final_weights(mtp_runs["w3"]), final_weights(out)
    assert any(k.startswith("mtp.depths.1.") for k in a)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    code, err = run_main([f"--out_dir={out}", "--init_from=resume", "--max_iters=6", "--mtp_num_layers=1"], capsys)
    assert code == EXIT_BAD_CONFIG, err
    assert_one_error_line(err, "--mtp_num_layers=1 (the run used 2): the model's shape is fixed by its checkpoint")


def test_export_leaves_the_depths_out(mtp_runs, tmp_path, capsys):
    import export_hf
    from safetensors import safe_open
    out = tmp_path / "hf"
    assert export_hf.main([f"--ckpt={mtp_runs['w3']}", f"--out_dir={out}"]) == 0
    said = capsys.readouterr().out
    assert "the 2 multi-token prediction depth(s) (mtp.*)" in said, said
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert "model.layers.1.mlp.down_proj.weight" in keys and not any("mtp" in k for k in keys)


def test_sample_drafts_with_the_depth(mtp_runs, capsys):
    """sample.py on an MTP run: greedy text with the depth drafting (`--speculative=mtp`) is the text without it
    (the default, which says the depths are there), with a line saying how many drafts stood, with the repetition
    penalty too; `--speculative=mtp` on a run without depths is one line, exit 2."""
    import sample
    args = [f"--ckpt={mtp_runs['w3']}", "--prompt=the", "--temperature=0", "--max_new_tokens=12", "--device=cpu"]
    assert sample.main([*args, "--speculative=mtp"]) == 0
    spec_out, spec_err = capsys.readouterr()
    assert sample.main(args) == 0
    plain_out, plain_err = capsys.readouterr()
    assert spec_out == plain_out and len(spec_out) > len("---\nthe\n"), (spec_out, plain_out)
    assert "speculative decoding (multi-token prediction depth 1):" in spec_err
    assert "the model has 2 multi-token prediction depth(s): --speculative=mtp drafts" in plain_err
    outs = []
    for extra in (["--speculative=mtp"], []):  # with the repetition penalty: the same text, other than without it
        assert sample.main([*args, "--repetition_penalty=1.5", *extra]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] != plain_out, (outs, plain_out)
    code = sample.main([f"--ckpt={mtp_runs['plain']}", "--prompt=the", "--speculative=mtp", "--device=cpu"])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_CONFIG and "Traceback" not in err, err
    assert "sample.py: --speculative=mtp: the model has no multi-token prediction depth" in err.splitlines()[-1]


@pytest.mark.parametrize("nproc, extra", [
    (2, ["--context_parallel_size=2"]),
    (2, ["--parallel=fsdp", "--batch_size=2"]),
    (2, ["--batch_size=2", "--use_distributed_optimizer=true", "--zero_stage=1"]),
    (2, ["--parallel=fsdp", "--tensor_parallel_size=2"]),
    (2, ["--parallel=fsdp", "--tensor_parallel_size=2", "--sequence_parallel=true"]),
    (2, ["--pipeline_parallel_size=2", "--batch_size=2", "--gradient_accumulation_steps=2"]),
    (2, ["--pipeline_parallel_size=2", "--batch_size=2", "--gradient_accumulation_steps=2", "--parallel=fsdp",
         "--pipeline_schedule=gpipe"]),
], ids=["cp2", "fsdp2", "zero1", "tp2", "tp2_sp", "pp2", "pp2_fsdp"])
def test_two_ranks_follow_one_process(mtp_runs, tmp_path, nproc, extra):
    """fp32, the run at weight 0.3 over 2 gloo ranks: sequences split over 2 context-parallel ranks (the shifted
    targets built from whole rows first), FSDP over 2 data-parallel ranks (the depths their own units) or our DDP
    with ZeRO-1 (the depths' optimizer state sharded with the rest) with the same global batch, or the depths' blocks split over 2 tensor-parallel ranks like the model's (with sequence
    parallelism: their projections and norms on each rank's positions, the norm's output gathered for the
    vocabulary-parallel loss), or 2 pipeline stages (our DDP with 1F1B, FSDP2 with GPipe; the first stage sends the
    depths' embedded inputs on beside the hidden state: fails when their gradient does not reach the embedding);
    every step's loss and MTP loss follow the one-process run (summation order only), and the stages' checkpoint
    its weights, the depths' included."""
    args = [a for a in mtp_runs["args"] if not a.startswith("--max_iters")]
    out = tmp_path / "run"
    run_cmd(train_cmd([*args, "--max_iters=3", "--lr_decay_iters=4", f"--out_dir={out}", "--mtp_num_layers=2",
                       "--mtp_loss_weight=0.3", *extra], nproc), env=_env())
    ref, got = _rows(mtp_runs["w3"]), _rows(out)
    for s in (1, 2, 3):
        for key in ("loss", "mtp_loss", "mtp_loss_1", "mtp_loss_2"):
            assert abs(got[s][key] - ref[s][key]) <= 1e-4 * abs(ref[s][key]), (s, key, got[s][key], ref[s][key])
    if "--pipeline_parallel_size=2" in extra:  # the stages' files hold the depths (the last stage's) at step 2
        from checkpoint.weights import checkpoint_model_state
        a, b = (checkpoint_model_state(str(d / "checkpoints" / "step_00000002")) for d in (mtp_runs["w3"], out))
        assert a.keys() == b.keys() and any(k.startswith("mtp.depths.1.") for k in b)
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-3, atol=1e-5, msg=k)


@pytest.mark.parametrize("extra, needle", [
    (["--mtp_num_layers=-1"], "--mtp_num_layers=-1: must be in [0, 16]"),
    (["--mtp_num_layers=1", "--mtp_loss_weight=-1"], "--mtp_loss_weight=-1.0: must be a finite number >= 0"),
    (["--mtp_num_layers=1", "--lora_rank=2"], "--mtp_num_layers=1 cannot be combined with --lora_rank=2"),
    (["--mtp_num_layers=1", "--pipeline_parallel_size=2", "--context_parallel_size=2",
      "--gradient_accumulation_steps=2"],
     "--mtp_num_layers=1 cannot be combined with --pipeline_parallel_size=2 with --context_parallel_size=2"),
], ids=["negative", "weight", "lora", "pp_cp"])
def test_bad_mtp_flags_one_line_exit_2(tiny_pretrain_run_args, tmp_path, capsys, extra, needle):
    code, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=1", *extra], capsys)
    assert code == EXIT_BAD_CONFIG, err
    assert_one_error_line(err, needle)


def test_dpo_with_mtp_is_refused(pretrained, tmp_path, capsys):
    code, err = run_main([*pretrained["args"], f"--out_dir={tmp_path / 'run'}", "--max_iters=1", "--task_type=dpo",
                          f"--init_from={pretrained['out']}", "--mtp_num_layers=1"], capsys)
    assert code == EXIT_BAD_CONFIG, err
    assert_one_error_line(err, "--mtp_num_layers=1 trains beside a language-model loss: --task_type=pretrain or sft")


def test_a_checkpoints_depths_are_refused_where_they_would_be_lost(mtp_runs, tmp_path, capsys):
    """Depths that come with the weights (--init_from a run with MTP, the flag left at 0): LoRA would leave them
    out of its checkpoints, so the run stops before its first step with one line naming the checkpoint."""
    code, err = run_main([*mtp_runs["args"], f"--out_dir={tmp_path / 'run'}", "--max_iters=1",
                          f"--init_from={mtp_runs['w3']}", "--lora_rank=2"], capsys)
    assert code == EXIT_BAD_CONFIG, err
    assert_one_error_line(err, "with 2 multi-token prediction depth(s) (mtp_num_layers) cannot be combined with "
                                "--lora_rank=2")


def test_moe_depths_under_expert_parallelism_follow_one_process(mtp_runs, tmp_path):
    """An MoE model (its MTP depth an MoE block, logged as layer n_layers) with its experts split over 2
    expert-parallel ranks of our DDP, 2 rows each: the losses, the MTP loss and every layer's expert loads (the
    depth's included) follow the one-process run of the same 4 rows."""
    args = [*[a for a in mtp_runs["args"] if not a.startswith("--max_iters")], "--max_iters=3", "--lr_decay_iters=4",
            "--mtp_num_layers=1", "--mtp_loss_weight=0.3", "--moe_num_experts=4", "--moe_top_k=2",
            "--moe_hidden_dim=16"]  # (no balancing loss: of 2 rows per rank it is not that of the 4 rows)
    one, ep = tmp_path / "one", tmp_path / "ep"
    run_cmd(train_cmd([*args, f"--out_dir={one}"]), env=_env())
    run_cmd(train_cmd([*args, f"--out_dir={ep}", "--expert_parallel_size=2", "--batch_size=2"], 2), env=_env())
    a, b = _rows(one), _rows(ep)
    for s in (1, 2, 3):
        for key in ("loss", "mtp_loss"):
            assert abs(a[s][key] - b[s][key]) <= 1e-4 * abs(a[s][key]), (s, key, a[s][key], b[s][key])
        assert len(a[s]["moe_tokens_per_expert"]) == 3 and "moe_load_max_mean_l2" in a[s]  # blocks 0, 1 + depth 2
    assert a[1]["moe_tokens_per_expert"] == b[1]["moe_tokens_per_expert"]  # the same routing before any update


def test_layouts_that_cannot_hold_a_checkpoints_depths_are_named():
    """loaded_mtp_problems asks the engines' declarations (parallel/config.py): pipeline stages beside tensor or
    context parallelism cannot hold the depths; our DDP, FSDP, pipeline stages, tensor, context and expert
    parallelism can."""
    from trainer.config import TrainConfig
    from trainer.validation import loaded_mtp_problems
    asked = "the model of ckpt with 1 multi-token prediction depth(s) (mtp_num_layers) cannot be combined with"
    got = loaded_mtp_problems(TrainConfig(pipeline_parallel_size=2, gradient_accumulation_steps=2, parallel="fsdp",
                                          tensor_parallel_size=2), 1, "ckpt")
    assert len(got) == 1 and got[0].startswith(f"{asked} --pipeline_parallel_size=2 with --tensor_parallel_size=2 ("), \
        got
    for kw in ({}, {"parallel": "fsdp"}, {"parallel": "fsdp", "tensor_parallel_size": 2},
               {"context_parallel_size": 2}, {"expert_parallel_size": 2},
               {"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2}):
        assert loaded_mtp_problems(TrainConfig(**kw), 1, "ckpt") == [], kw


def _tp_layout(rank: int, world: int, out_path: str) -> None:
    """The tensor-parallel transform on a model with 2 depths, on 2 gloo ranks: how each depth is laid out."""
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from parallel.transforms.tensor_parallel import apply_tensor_parallel
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, hidden_dim=48, max_seq_len=16,
                                    mtp_num_layers=2))
    partial = apply_tensor_parallel(model, init_device_mesh("cpu", (world,)), sequence_parallel=True)
    depth = model.mtp.depths[1]
    got = {"q": [str(p) for p in depth.block.self_attn.q_proj.weight.placements],
           "q_local": list(depth.block.self_attn.q_proj.weight.to_local().shape),
           "down": [str(p) for p in depth.block.mlp.down_proj.weight.placements],
           "eh_proj_plain": not isinstance(depth.eh_proj.weight, DTensor),
           "partial": sorted(n for n in partial if n.startswith("mtp.depths.1."))}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(got, f)


def test_tensor_parallelism_splits_the_depths_blocks(tmp_path):
    """Under tp 2 with sequence parallelism each depth's block is split as the model's are (q column-parallel,
    down row-parallel: half the rows / columns per rank); its projection and norms stay whole on every rank and
    their gradients are summed over the tensor group (each rank saw half the positions)."""
    import json

    from tests.dist_helpers import spawn
    out = tmp_path / "layout.json"
    spawn(_tp_layout, 2, str(out))
    got = json.loads(out.read_text())
    assert got["q"] == ["S(0)"] and got["q_local"] == [16, 32] and got["down"] == ["S(1)"]
    assert got["eh_proj_plain"]
    assert got["partial"] == ["mtp.depths.1.block.input_layernorm.weight", "mtp.depths.1.block.post_attention_layernorm"
                              ".weight", "mtp.depths.1.eh_proj.weight", "mtp.depths.1.enorm.weight",
                              "mtp.depths.1.hnorm.weight", "mtp.depths.1.norm.weight"]


def _run(argv, capsys) -> tuple[int, str]:
    import train_my_ddp
    code = train_my_ddp.main(argv)
    out, err = capsys.readouterr()
    return code, out + err


def test_a_hub_models_mtp_layer_is_kept_when_asked_and_depths_grow_to_the_flag(tiny_pretrain_run_args, tmp_path,
                                                                                capsys):
    """A DeepSeek-V3-shaped run (latent attention) with one depth, exported (the depth as the Hub's MTP layer,
    model/hf_mtp.py): --init_from=<the export> --mtp_num_layers=1 logs the first step of --init_from=<the run>
    exactly, loss and MTP loss (the depth came back as it was); without the flag the layer is left out (said; no MTP
    loss); --mtp_num_layers=2 adds one new depth after it; a model without depths grows the one asked for; fewer than
    the weights have is one line, exit 2. sample.py --speculative=mtp drafts with the export's MTP layer (greedy: the
    text without it)."""
    import export_hf
    base = [*tiny_pretrain_run_args, "--max_iters=1", "--kv_lora_rank=16", "--mtp_loss_weight=0.3"]
    src, hf = tmp_path / "src", tmp_path / "hf"
    assert _run([*base, f"--out_dir={src}", "--mtp_num_layers=1"], capsys)[0] == 0
    assert export_hf.main([f"--ckpt={src}", f"--out_dir={hf}"]) == 0
    capsys.readouterr()
    said = {}

    def run(name, init, *extra):
        code, said[name] = _run([*base, f"--out_dir={tmp_path / name}", f"--init_from={init}", *extra], capsys)
        assert code == 0, said[name][-3000:]
        return _rows(tmp_path / name)[1]

    ours, hub = run("ours", src), run("hub", hf, "--mtp_num_layers=1")
    assert "its 1 multi-token prediction layer(s): 1 kept as the model's MTP depths" in said["hub"]
    assert (hub["loss"], hub["mtp_loss"]) == (ours["loss"], ours["mtp_loss"])
    left = run("left", hf)
    assert "its 1 multi-token prediction layer(s): left out" in said["left"] and "mtp_loss" not in left
    assert left["loss"] == ours["loss"]
    more = run("more", hf, "--mtp_num_layers=2")
    assert "[init] 1 new multi-token prediction depth(s)" in said["more"] and "mtp_loss_2" in more
    assert more["mtp_loss_1"] == ours["mtp_loss"]  # the kept depth first, as it was
    grown = run("grown", tmp_path / "left", "--mtp_num_layers=1")
    assert "[init] 1 new multi-token prediction depth(s) (initialised as a new model's) after the 0" in said["grown"]
    assert "mtp_loss" in grown
    code, err = _run([*base, f"--out_dir={tmp_path / 'fewer'}", f"--init_from={tmp_path / 'more'}",
                      "--mtp_num_layers=1"], capsys)
    assert code == EXIT_BAD_CONFIG
    assert_one_error_line(err, "--mtp_num_layers=1: the model of")
    assert "has 2 multi-token prediction depths" in err
    import sample
    args = [f"--ckpt={hf}", "--prompt=the", "--temperature=0", "--max_new_tokens=10", "--device=cpu"]
    assert sample.main([*args, "--speculative=mtp"]) == 0
    spec_out, spec_err = capsys.readouterr()
    assert sample.main(args) == 0
    plain_out, plain_err = capsys.readouterr()
    assert spec_out == plain_out and "speculative decoding (multi-token prediction depth 1):" in spec_err
    assert "1 kept as the model's MTP depths" in spec_err and "sample.py's --speculative=mtp keeps them" in plain_err
