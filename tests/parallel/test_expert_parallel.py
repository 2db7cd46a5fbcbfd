"""Expert parallelism (parallel/transforms/expert_parallel.py) at ep=2 under FSDP2 on gloo (2 ranks; 4 ranks with FSDP
over the experts' efsdp=2 and with HSDP replicas) and under our DDP, ZeRO-1 and ZeRO-2 (2 ranks; 4 ranks with the
experts reduced over the 2 ranks holding the same ones) follows one process: the first step's every gradient (expert
gradients gathered from their ep shards), each step's loss and gradient norm, the parameters after 3 steps, within
10x the one-process reference's own fp32 rounding (its fp32 run against its fp64 run), the selection biases exactly.
A second model whose selection bias sends every token to rank 0's experts: rank 1's experts receive no rows (zero
gradients, never None) and the run still follows one process. LoRA on the routed experts (FSDP2 and our DDP): the
adapters are cut by expert with the frozen weights, only they train, and the frozen weights end as they began. Our
DDP's plain checkpoints resume across ep sizes (and cross to FSDP2 and back). Bad flags: parallel/config.py's lines
(checked at 8 ranks without a process group) and the trainer's one line, exit 2."""
from __future__ import annotations

import dataclasses
import functools
import json
import os

import pytest
import torch

from tests.dist_helpers import computed_once, spawn, traced_with_aot_eager
from tests.parallel.test_moe_engines import (MOE, OPT, STEPS, moe_loss, new_model, one_process_reference,
                                             rank_batches)


def _full(t) -> list:
    from torch.distributed.tensor import DTensor
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().reshape(-1).tolist()


def _ddp_full(engine, p: torch.Tensor, t=None) -> list:
    """Our DDP's tensor `t` (default: the parameter `p`) of a parameter, gathered over the ep ranks where `p` is an
    expert-parallel shard."""
    from parallel.distributed_data_parallel import DistributedDataParallel
    t = p if t is None else t
    if DistributedDataParallel.shard_of(p) is None:
        return t.detach().double().reshape(-1).tolist()
    group = engine.model.expert_parallel_group
    out = t.new_empty((torch.distributed.get_world_size(group) * t.shape[0], *t.shape[1:]))
    torch.distributed.all_gather_into_tensor(out, t.detach().contiguous(), group=group)
    return out.double().reshape(-1).tolist()


def _ddp_grads(engine) -> dict:
    """Step 1's reduced gradients of our DDP, every one whole: the buckets' shards all-gathered where ZeRO-1
    reduce-scattered them (over each buffer's own group), the expert shards over the ep ranks."""
    from utils import comm
    ddp, opt = engine.model, engine.optimizer
    ddp.finish_grad_sync()  # (the step's own call then reduces nothing again)
    if opt.sharded:
        for b in ddp.buckets:
            lo, hi = opt.owned_range(b)
            comm.all_gather(b.grad_data, b.grad_data[lo:hi].clone(), b.buffer.group, b.buffer.world_size,
                            async_op=False)
    return {n: _ddp_full(engine, p, p.main_grad) for n, p in engine.module.named_parameters() if p.requires_grad}


def train(starve: bool, **layout) -> dict:
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    moe = dict(MOE, moe_bias_update_rate=0.0) if starve else MOE
    gpt_oss, lora = layout.pop("gpt_oss", False), layout.pop("lora", 0)
    cfg = dataclasses.replace(TrainConfig(), **{**dict(parallel="fsdp", expert_parallel_size=2, dtype="fp32",
                                                       device="cpu", gradient_accumulation_steps=2, bucket_size=500),
                                                **OPT, **moe, **layout})
    engine = build_engine(new_model(starve, gpt_oss=gpt_oss, lora=lora), cfg, device=torch.device("cpu"))
    ddp = cfg.parallel == "ddp"
    training, loss_fn = moe_loss(cfg, engine)
    rec = {"losses": [], "norms": [], "local_experts": []}
    for layer in training.layers:
        w = layer.experts.gate_up_proj
        rec["local_experts"].append((w if ddp else w.to_local()).shape[0])
        b = layer.experts.gate_up_proj_bias  # (gpt-oss's flat biases: this rank's experts' part)
        if b is not None:
            rec.setdefault("local_bias", []).append((b if ddp else b.to_local()).numel())
        a = getattr(layer.experts, "down_proj_lora_A", None)  # (LoRA on the experts: this rank's experts' adapters)
        if a is not None:
            rec.setdefault("local_adapters", []).append(list((a if ddp else a.to_local()).shape))
    for step in range(1, STEPS + 1):
        mine, units = rank_batches(engine, step)
        engine.optimizer.zero_grad()
        total = engine.sum_over_data(engine.forward_backward(mine, loss_fn, units), torch.device("cpu"))
        if step == 1 and not (ddp and cfg.zero_stage == 2):  # (ZeRO-2 frees what it does not own)
            rec["grads"] = _ddp_grads(engine) if ddp else \
                {n: _full(p.grad) for n, p in engine.module.named_parameters() if p.requires_grad}
        stepped, norm = engine.optimizer.step()
        training.after_step(engine, torch.device("cpu"))
        rec["losses"].append(float(total[0]) / units)
        rec["norms"].append(float(norm))
    if ddp:  # the buckets in launch order: which hold experts, and the first parameter of each in backward order
        order = {n: i for i, n in enumerate(reversed([n for n, _ in engine.module.named_parameters()]))}
        rec["buckets"] = [(b.buffer.expert, min(order[s.name] for s in b.slots)) for b in engine.model.buckets]
    # --overlap_param_gather leaves the last step's parameter all-gathers in flight (the next forward's pre-hooks
    # wait for them): wait here, as a save does, before reading the parameters (a read raced them: stale values)
    engine.optimizer.finish_param_sync()
    rec["params"] = {n: _ddp_full(engine, p) if ddp else _full(p) for n, p in engine.module.named_parameters()}
    rec["bias"] = [layer.expert_bias.tolist() for layer in training.layers]
    return rec


# the layouts each world runs: 2 ranks: ep=2 (experts left to the ep sharding; also with activation checkpointing,
# whose recompute runs the all-to-alls again in the backward, whole blocks or selective per op, and with FSDP2's CPU
# offload); 4 ranks: ep=2 with FSDP over the 2
# ranks that hold the same experts (efsdp=2), and ep=2 under HSDP (2 replicas of dp_shard=2, efsdp=1)
# Our DDP (2 ranks: ep=2, the experts' group of one rank; ZeRO-1 and ZeRO-2 shard the experts' state over it; 4 ranks:
# the experts reduced, and ZeRO-1-sharded, over the 2 ranks that hold the same ones; the ZeRO-1 one all-gathers
# the updated parameters during the next forward)
DDP, ZERO1 = dict(parallel="ddp"), dict(parallel="ddp", use_distributed_optimizer=True)
CASES = {2: {"plain": (False, {}), "starved": (True, {}), "recompute": (False, {"gradient_checkpointing": True}),
             "recompute_op": (False, {"activation_checkpoint": "selective"}),
             "offload": (False, {"cpu_offload": True}), "ddp": (False, DDP), "ddp_starved": (True, DDP),
             "zero1": (False, ZERO1), "zero2": (False, dict(ZERO1, zero_stage=2)),
             # gpt-oss's block: its flat expert biases cut by expert with the weights (FSDP2's DTensors, our DDP's)
             "gpt_oss": (False, {"gpt_oss": True}), "ddp_gpt_oss": (False, dict(DDP, gpt_oss=True)),
             # LoRA on the routed experts: the adapters cut by expert with the frozen weights they update
             # (rank 4: the grouped matmul with the update on its outputs; rank 2: the weight-space update)
             "lora": (False, {"lora": 4}), "ddp_lora": (False, dict(DDP, lora=2))},
         4: {"efsdp2": (False, {}), "hsdp": (False, {"dp_replicate_size": 2}), "ddp_edp2": (False, DDP),
             "zero1_edp2": (False, dict(ZERO1, overlap_param_gather=True))}}


def _ddp_run(ep: int, zero: bool, parallel: str = "ddp"):
    """Our DDP engine at `ep` (ZeRO-1 with `zero`; or FSDP2), its MoE training and loss: (engine, one step's
    function)."""
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    cfg = dataclasses.replace(TrainConfig(), parallel=parallel, expert_parallel_size=ep, use_distributed_optimizer=zero,
                              dtype="fp32", device="cpu", gradient_accumulation_steps=2, bucket_size=500, **OPT, **MOE)
    engine = build_engine(new_model(), cfg, device=torch.device("cpu"))
    training, loss_fn = moe_loss(cfg, engine)

    def step(n: int) -> float:
        mine, units = rank_batches(engine, n)
        engine.optimizer.zero_grad()
        total = engine.sum_over_data(engine.forward_backward(mine, loss_fn, units), torch.device("cpu"))
        engine.optimizer.step()
        training.after_step(engine, torch.device("cpu"))
        return float(total[0]) / units
    return engine, step


def resume_across_ep(rank: int, world: int, out_dir: str) -> dict:
    """Uninterrupted ep=2 and ep=1 runs of 10 steps under our DDP; then ep=2 DDP for steps 1-2 -> its plain checkpoint
    resumed at ep=1 ZeRO-1 for 3-4 -> resumed at ep=2 ZeRO-1 for 5-6, which goes on to 7-8; its step-6 checkpoint
    resumed at ep=2 ZeRO-1 again (each rank its own optimizer file) for 7-8, and under FSDP2 at ep=2 for 7-8, whose
    DCP checkpoint our DDP at ep=2 resumes for 9-10."""
    import torch.distributed as dist

    from checkpoint.manager import CheckpointManager

    def manager(engine):
        return CheckpointManager(engine, out_dir, rank=rank, world_size=world, barrier=dist.barrier, keep_last=10)

    def save(engine, n: int) -> str:
        return manager(engine).save(n, trainer_state={}, model_config={}, run_config={})

    rec = {}
    for name, ep in (("ep2", 2), ("ep1", 1)):
        _, step = _ddp_run(ep, False)
        rec[name] = [step(n) for n in range(1, 11)]
    engine, step = _ddp_run(2, False)
    got = [step(n) for n in (1, 2)]
    ckpt = save(engine, 2)
    for ep, steps in ((1, (3, 4)), (2, (5, 6))):
        engine, step = _ddp_run(ep, True)
        manager(engine).load(ckpt, world)
        got += [step(n) for n in steps]
        ckpt = save(engine, steps[-1])
    rec["moved"], rec["continued"] = got, [step(n) for n in (7, 8)]
    engine, step = _ddp_run(2, True)
    manager(engine).load(ckpt, world)
    rec["resumed"] = [step(n) for n in (7, 8)]
    engine, step = _ddp_run(2, False, "fsdp")
    manager(engine).load(ckpt, world)
    rec["fsdp"] = [step(n) for n in (7, 8)]
    dcp = save(engine, 8)
    engine, step = _ddp_run(2, False)
    manager(engine).load(dcp, world)
    rec["back"] = [step(n) for n in (9, 10)]
    with open(f"{ckpt}/optimizer_rank1.pt", "rb") as f:  # what rank 1 saved: its experts' ranges of the full tensors
        state = torch.load(f, weights_only=True)
    rec["rank1_expert_range"] = [state["params"]["layers.1.mlp.experts.down_proj"][k] for k in ("lo", "hi", "numel")]
    return rec


def _compiled(**layout) -> dict:
    """train() with --compile, traced with the aot_eager backend; the number of graphs it compiled."""
    rec, graphs = traced_with_aot_eager(train, False, compile=True, **layout)
    return dict(rec, graphs=graphs)


def _world(rank: int, world: int, out_path: str) -> None:
    out = {name: train(starve, **layout) for name, (starve, layout) in CASES[world].items()}
    if world == 2:
        out["resume"] = resume_across_ep(rank, world, os.path.join(os.path.dirname(out_path), "resume"))
        out["compiled"], out["ddp_compiled"] = _compiled(), _compiled(**DDP)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def _results(d) -> dict:
    out = {}
    for world in CASES:
        spawn(_world, world, str(d / f"ep_w{world}.json"))
        out.update(json.loads((d / f"ep_w{world}.json").read_text()))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return computed_once(tmp_path_factory, "expert_parallel", _results)


def _close(got: dict, r32: dict, r64: dict, key: str) -> None:
    noise = max(float((r32[key][n] - r64[key][n]).abs().max()) for n in r32[key])
    assert sorted(got[key]) == sorted(r32[key])
    for n, want in r32[key].items():
        diff = float((torch.tensor(got[key][n], dtype=torch.float64) - want.reshape(-1)).abs().max())
        assert diff <= 10 * noise + 1e-7, (key, n, diff, noise)


@functools.lru_cache(maxsize=None)
def _reference(dtype: torch.dtype, starve: bool, gpt_oss: bool, lora: int) -> dict:
    """one_process_reference, computed once per worker for the cases that share it (13 of the 19 share another's)."""
    return one_process_reference(dtype, starve, gpt_oss=gpt_oss, lora=lora)


@pytest.mark.parametrize("case", ["plain", "starved", "recompute", "recompute_op", "offload", "efsdp2", "hsdp", "ddp",
                                  "ddp_starved", "zero1", "zero2", "ddp_edp2", "zero1_edp2", "compiled", "ddp_compiled",
                                  "gpt_oss", "ddp_gpt_oss", "lora", "ddp_lora"])
def test_ep2_follows_one_process(results, case):
    """(compiled: --compile with ep=2 under FSDP2 and our DDP; the all-to-all's host-read split sizes break the
    graph, which compiles in pieces around them; gpt_oss: gpt-oss's block, whose expert biases ep cuts by expert)"""
    starve, gpt_oss = case.endswith("starved"), case.endswith("gpt_oss")
    lora = {"lora": 4, "ddp_lora": 2}.get(case, 0)
    r32, r64 = (_reference(dt, starve, gpt_oss, lora) for dt in (torch.float32, torch.float64))
    rec = results[case]
    if case.endswith("compiled"):
        assert rec["graphs"] >= 1  # compiled, not silently eager
    # E/ep = 2 experts on each rank, FSDP-sharded again over efsdp=2 (one expert's rows per rank)
    assert rec["local_experts"] == ([1, 1] if case == "efsdp2" else [2, 2])
    if gpt_oss:  # 2 of the 4 experts' gate and up biases (8 wide each)
        assert rec["local_bias"] == [2 * 2 * 8] * 2
    if lora:  # 2 of the 4 experts' down adapters A [2, r, I=8]; only the adapters (and q's) train
        assert rec["local_adapters"] == [[2, lora, 8]] * 2
        assert all("lora_" in n for n in rec["grads"]) and any("experts.gate_up_proj_lora_A" in n for n in rec["grads"])
    # the clip matters: every step's norm is above --grad_clip, so a norm that missed the other ranks' experts
    # (or counted them twice) would scale every update differently
    if lora:  # (the adapters' norm moves more from step to step: at least one step clipped)
        assert max(r32["norms"]) > 1.5 * OPT["grad_clip"]
    else:
        assert min(r32["norms"]) > 1.5 * OPT["grad_clip"]
    for key in ("losses", "norms"):
        tol = 10 * max(abs(a - b) for a, b in zip(r32[key], r64[key])) + 1e-6
        assert max(abs(a - b) for a, b in zip(rec[key], r32[key])) <= tol, (key, rec[key], r32[key])
    if "buckets" in rec:  # our DDP launches the experts' buckets in backward order with the others, not after them
        firsts = [first for _, first in rec["buckets"]]
        assert firsts == sorted(firsts) and rec["buckets"][-1][0] is False and any(e for e, _ in rec["buckets"])
    if case != "zero2":  # (ZeRO-2 keeps no whole gradient to compare: its norm and parameters follow them)
        _close(rec, r32, r64, "grads")
    _close(rec, r32, r64, "params")
    for got, want in zip(rec["bias"], r32["bias"]):
        assert torch.equal(torch.tensor(got), want), (got, want)
    if starve:  # rank 1's experts (2, 3) of the first MoE layer saw no token: their gradient is zero, not None
        g = torch.tensor(rec["grads"]["layers.1.mlp.experts.gate_up_proj"]).view(4, -1)
        assert g[2:].abs().max() == 0 and g[:2].abs().max() > 0
    else:
        assert any(torch.count_nonzero(b) for b in r32["bias"])  # the rule moved them


def test_ddp_resume_across_ep_sizes(results):
    """Our DDP's plain checkpoints: ep=2 -> ep=1 (ZeRO-1) -> ep=2 (ZeRO-1) -> FSDP2 ep=2 -> our DDP ep=2 follows the
    uninterrupted ep=2 run within 10x its difference from the uninterrupted ep=1 run (the same sums, reduced in
    another order), steps 1-2 exactly; a resume at the same layout continues exactly as the run that saved it."""
    rec = results["resume"]
    want, other, got = rec["ep2"], rec["ep1"], rec["moved"]
    tol = 10 * max(abs(a - b) for a, b in zip(want, other)) + 1e-7
    assert got[:2] == want[:2]
    assert max(abs(a - b) for a, b in zip(got, want[:6])) <= tol, (got, want, tol)
    assert rec["resumed"] == rec["continued"]
    crossed = rec["resumed"] + rec["fsdp"] + rec["back"]  # (and through FSDP2's DCP format and back)
    assert max(abs(a - b) for a, b in zip(crossed, want[6:8] * 2 + want[8:])) <= tol, (crossed, want, tol)
    # down_proj [4 experts, D=16, I=8] of the first MoE layer: rank 1 holds experts 2-3 (ZeRO over its 1-rank group)
    assert rec["rank1_expert_range"] == [2 * 16 * 8, 4 * 16 * 8, 4 * 16 * 8]


@pytest.mark.parametrize("flags, model, needle", [
    (dict(parallel="fsdp"), dict(moe_num_experts=6), "--moe_num_experts=6 is not divisible by --expert_parallel_size=4"),
    (dict(parallel="fsdp"), dict(moe_num_experts=0), "--expert_parallel_size=4 needs an MoE model"),
    (dict(parallel="ddp", overlap_optim_step=True), dict(moe_num_experts=8),
     "--overlap_optim_step=true cannot be combined with --expert_parallel_size=4 under --parallel=ddp"),
    (dict(parallel="ddp", comm_hook="powersgd"), dict(moe_num_experts=8),
     "--comm_hook=powersgd cannot be combined with --expert_parallel_size=4"),
    (dict(parallel="fsdp", context_parallel_size=4), dict(moe_num_experts=8),
     "--expert_parallel_size=4 does not divide the data-parallel shard dimension 2"),
    (dict(parallel="fsdp", dp_replicate_size=4), dict(moe_num_experts=8),
     "--expert_parallel_size=4 does not divide the data-parallel shard dimension 2"),
], ids=["experts", "dense", "ddp_overlap_step", "ddp_powersgd", "cp_shard", "shard"])
def test_refusals_name_the_flags(flags, model, needle):
    """parallel/config.py's lines at 8 ranks (what the trainer prints, one line, exit 2)."""
    from parallel.config import ParallelConfig
    pc = ParallelConfig(expert_parallel_size=4, **flags)
    lines = pc.problems(8) + pc.model_problems(n_layers=2, n_heads=2, n_kv_heads=2, max_seq_len=16, dropout=0.0,
                                               **model)
    assert any(needle in line for line in lines), lines
    assert all("\n" not in line for line in lines)


def test_moe_and_expert_parallel_are_capabilities_of_every_engine():
    """The trainer asks for "moe" (trainer/config.py engine_needs): every engine declares it, pipeline stages
    included, and experts sharded over ep ranks run under pipeline stages of either dp engine."""
    from parallel.config import ParallelConfig
    needs = {"--moe_num_experts=4": "moe"}
    for pc in (ParallelConfig(pipeline_parallel_size=2, gradient_accumulation_steps=2),
               ParallelConfig(pipeline_parallel_size=2, gradient_accumulation_steps=2, parallel="fsdp"),
               ParallelConfig(parallel="fsdp"), ParallelConfig()):
        assert pc.problems(2, needs=needs) == []
    ep = dict(pipeline_parallel_size=2, gradient_accumulation_steps=2, expert_parallel_size=2)
    for dp in ("fsdp", "ddp"):
        assert ParallelConfig(parallel=dp, **ep).problems(4, needs=needs) == []
    assert ParallelConfig(use_distributed_optimizer=True, **ep).problems(4, needs=needs) == []


def test_good_layout_has_no_problem():
    from parallel.config import ParallelConfig
    from parallel.mesh import MeshLayout
    pc = ParallelConfig(parallel="fsdp", expert_parallel_size=2, dp_replicate_size=2)
    assert pc.problems(8) == [] and pc.model_problems(n_layers=2, n_heads=2, n_kv_heads=2, max_seq_len=16,
                                                      dropout=0.0, moe_num_experts=4) == []
    assert pc.layout(8) == MeshLayout(1, 2, 4, 1, 1, 2) and pc.data_parallel_size(8) == 8
    for zero in (dict(), dict(use_distributed_optimizer=True, zero_stage=1),
                 dict(use_distributed_optimizer=True, zero_stage=2, comm_hook="bf16")):
        pc = ParallelConfig(expert_parallel_size=2, **zero)
        assert pc.problems(8, needs={"--task_type=dpo": "sequence_logprobs"}) == []


def test_ddp_refuses_what_needs_the_whole_model_on_one_rank():
    from parallel.config import ParallelConfig
    lines = ParallelConfig(expert_parallel_size=2).problems(4, needs={"--sample_every=10": "whole_model_on_one_rank",
                                                                      "--lora_rank=8": "frozen_parameters"})
    assert [line.split(" (")[0] for line in lines] == [
        "--sample_every=10 cannot be combined with --expert_parallel_size=2 under --parallel=ddp"]


def test_lora_on_the_experts_under_our_ddp_at_ep2_saves_whole_adapters_and_resumes_exactly(tiny_pretrain_run_args,
                                                                                              tmp_path):
    """LoRA on q_proj and the routed experts under --parallel=ddp --expert_parallel_size=2 (2 ranks): its light
    checkpoint holds each adapter whole (all 4 experts, gathered from the ep shards) and no base weight; crashed at
    step 3 and resumed, its losses equal the uninterrupted run's exactly (the same layout). Tensor parallel at 2
    (the MoE layers whole on each rank, each its share of the tokens) follows one process within 10x the ep run's
    own difference from it."""
    import os

    from checkpoint.files import load_model_state
    from checkpoint.verify import find_latest_valid
    from tests.conftest import run_cmd, run_trainer, train_cmd
    from utils.metrics import dedupe_by_step, read_metrics
    moe = ["--moe_num_experts=4", "--moe_top_k=2", "--moe_hidden_dim=16", "--moe_first_dense_layers=1", "--n_layers=3"]
    base = tmp_path / "base"
    run_cmd(train_cmd([*tiny_pretrain_run_args, *moe, f"--out_dir={base}", "--max_iters=2", "--checkpoint_interval=2"]))
    args = [*tiny_pretrain_run_args, *moe, f"--init_from={base}", "--lora_rank=2", "--lora_alpha=8",
            "--lora_targets=q_proj,experts", "--expert_parallel_size=2", "--batch_size=2", "--max_iters=4",
            "--checkpoint_interval=2"]

    def losses(d):
        return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))).items()}

    ref, moved = tmp_path / "ref", tmp_path / "moved"
    run_cmd(train_cmd([*args, f"--out_dir={ref}"], 2))
    saved = load_model_state(find_latest_valid(str(ref)))
    assert saved["layers.1.mlp.experts.gate_up_proj_lora_A"].shape == (4, 2, 32)
    assert saved["layers.2.mlp.experts.down_proj_lora_B"].shape == (4, 32, 2)
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in saved)
    once = tmp_path / "fired"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MYLLM_FAULT="crash@3",
               MYLLM_FAULT_ONCE_FILE=str(once))
    proc = run_trainer(train_cmd([*args, f"--out_dir={moved}"], 2), env=env)
    assert proc.returncode != 0 and once.exists(), proc.stderr[-2000:]
    run_cmd(train_cmd([*args, f"--out_dir={moved}", "--init_from=resume"], 2))
    want, got = losses(ref), losses(moved)
    assert sorted(want) == [1, 2, 3, 4] and got == want
    one, tp = tmp_path / "one", tmp_path / "tp2"
    single = [a for a in args if a not in ("--expert_parallel_size=2", "--batch_size=2")]
    run_cmd(train_cmd([*single, f"--out_dir={one}"]))
    run_cmd(train_cmd([*single, "--tensor_parallel_size=2", f"--out_dir={tp}"], 2))
    ref1, tp2 = losses(one), losses(tp)
    tol = 10 * max(abs(want[s] - ref1[s]) for s in want) + 1e-7
    assert sorted(tp2) == [1, 2, 3, 4] and max(abs(tp2[s] - ref1[s]) for s in ref1) <= tol, (tp2, ref1, tol)


def test_trainer_refuses_in_one_line_exit_2(tiny_pretrain_run_args, tmp_path, capsys):
    from tests.trainer.test_errors import assert_one_error_line, run_main
    from utils.constants import EXIT_BAD_CONFIG
    code, err = run_main([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=1",
                          "--moe_num_experts=3", "--parallel=fsdp", "--expert_parallel_size=2"], capsys)
    assert code == EXIT_BAD_CONFIG, err
    assert_one_error_line(err, "--moe_num_experts=3 is not divisible by --expert_parallel_size=2")


def test_resume_across_ep_sizes(tiny_pretrain_run_args, tmp_path):
    """FSDP2 at 2 ranks, 6 steps, a checkpoint every 2: ep=2 crashes at step 3, resumes at ep=1 (torch DCP reshards
    the experts from their ep shards), crashes at step 5, resumes at ep=2. Its losses equal the uninterrupted ep=2
    run's within 10x the difference between the uninterrupted ep=1 and ep=2 runs (the same sums, reduced in
    another order), and steps 1-2 exactly."""
    import os

    from tests.conftest import run_cmd, run_trainer, train_cmd
    from utils.metrics import dedupe_by_step, read_metrics
    args = [*tiny_pretrain_run_args, "--moe_num_experts=4", "--moe_top_k=2", "--moe_hidden_dim=16",
            "--moe_first_dense_layers=1", "--n_layers=3", "--moe_bias_update_rate=0.01", "--moe_aux_loss_coef=0.01",
            "--parallel=fsdp", "--batch_size=2", "--max_iters=6", "--checkpoint_interval=2"]

    def losses(d):
        return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))).items()}

    ref2, ref1, moved = tmp_path / "ep2", tmp_path / "ep1", tmp_path / "moved"
    run_cmd(train_cmd([*args, f"--out_dir={ref2}", "--expert_parallel_size=2"], 2))
    run_cmd(train_cmd([*args, f"--out_dir={ref1}", "--expert_parallel_size=1"], 2))
    for ep, fault, resume in ((2, "crash@3", []), (1, "crash@5", ["--init_from=resume"])):
        once = tmp_path / f"fired{ep}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MYLLM_FAULT=fault,
                   MYLLM_FAULT_ONCE_FILE=str(once))
        proc = run_trainer(train_cmd([*args, f"--out_dir={moved}", f"--expert_parallel_size={ep}", *resume], 2),
                           env=env)
        assert proc.returncode != 0 and once.exists(), proc.stderr[-2000:]
    run_cmd(train_cmd([*args, f"--out_dir={moved}", "--expert_parallel_size=2", "--init_from=resume"], 2))
    want, other, got = losses(ref2), losses(ref1), losses(moved)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    tol = 10 * max(abs(want[s] - other[s]) for s in want) + 1e-7
    assert [got[1], got[2]] == [want[1], want[2]]
    assert max(abs(got[s] - want[s]) for s in want) <= tol, (got, want, tol)


def test_ep_checkpoints_cross_to_our_ddp_and_back(tiny_pretrain_run_args, tmp_path):
    """6 steps at 2 ranks, a checkpoint every 2: ep=2 under FSDP2 crashes at step 3; its DCP checkpoint (experts in
    ep shards) resumes under --parallel=ddp (checkpoint/convert.py reads each tensor whole by name), which crashes
    at step 5 after writing the plain format at step 4; that resumes at ep=2 again. The losses equal the
    uninterrupted ep=2 run's within 10x the difference of an uninterrupted ddp run from it (the same
    micro-batches, the same sums in another order)."""
    import os

    from tests.conftest import run_cmd, run_trainer, train_cmd
    from utils.metrics import dedupe_by_step, read_metrics
    args = [*tiny_pretrain_run_args, "--moe_num_experts=4", "--moe_top_k=2", "--moe_hidden_dim=16",
            "--moe_first_dense_layers=1", "--n_layers=3", "--moe_bias_update_rate=0.01", "--moe_aux_loss_coef=0.01",
            "--max_iters=6", "--checkpoint_interval=2", "--batch_size=2"]
    ep2, ddp = ["--parallel=fsdp", "--expert_parallel_size=2"], ["--parallel=ddp", "--expert_parallel_size=1"]

    def losses(d):
        return {s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))).items()}

    ref, other_run, moved = tmp_path / "ep2", tmp_path / "ddp2", tmp_path / "moved"
    run_cmd(train_cmd([*args, *ep2, f"--out_dir={ref}"], 2))
    run_cmd(train_cmd([*args, *ddp, f"--out_dir={other_run}"], 2))
    for layout, fault, resume in ((ep2, "crash@3", []), (ddp, "crash@5", ["--init_from=resume"])):
        once = tmp_path / f"fired_{fault}"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MYLLM_FAULT=fault,
                   MYLLM_FAULT_ONCE_FILE=str(once))
        proc = run_trainer(train_cmd([*args, *layout, f"--out_dir={moved}", *resume], 2), env=env)
        assert proc.returncode != 0 and once.exists(), proc.stderr[-2000:]
    run_cmd(train_cmd([*args, *ep2, f"--out_dir={moved}", "--init_from=resume"], 2))
    want, other, got = losses(ref), losses(other_run), losses(moved)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    tol = 10 * max(abs(want[s] - other[s]) for s in want) + 1e-7
    assert max(abs(got[s] - want[s]) for s in want) <= tol, (got, want, other, tol)
