"""Pipeline parallelism (parallel/pipeline.py's stages, parallel/engine_pipeline.py's engine) on CPU + gloo: torch.distributed.pipelining stages
+ our DDP on the dp dimension, against one process training the same model on the same global batch.

Two spawns write what they measured to files that the tests below check:
  - 2 processes, pp=2 x dp=1: GPipe and 1F1B (with activation checkpointing), 3 steps each
    (accumulation 2 = 2 micro-batches, clipping active); GPipe then runs a forward-only pass and a
    4th step; 1F1B saves (the engine's trainer-facing save) after step 2 and a freshly built engine
    (another init) loads it and redoes step 3, which must be bit-identical;
  - 4 processes, pp=2 x dp=2: our DDP + GPipe, ZeRO-1 + 1F1B, FSDP + 1F1B (with the same
    save -> fresh engine -> load -> step 3 resume check): 3 steps.
Parameters are compared with one process (torch AdamW + clip_grad_norm_, loss = sum / target
tokens) within 10x the reference's own rounding (its fp32 run against its fp64 run) plus a floor, and so
are the per-step losses and global gradient norms (the norm must include BOTH stages' parameters).
In one process (no process group): the stages (the Transformer pruned) run one after the other give
the full model's loss sum and gradients (2/3 stages, uneven, packed, padded, checkpointing), and share
the model's parameters under its own key names.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from model import ModelConfig, Transformer
from optimizer import OptimizerConfig
from tests.dist_helpers import computed_once, one_process_step, spawn

VOCAB, SEQ, GLOBAL_B, GAS, STEPS = 64, 8, 4, 2, 3
OPT = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, grad_clip=0.3)


def _cfg(n_layers: int = 4, tied: bool = False, ckpt: bool = False) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, dim=16, n_layers=n_layers, n_heads=2, multiple_of=16, max_seq_len=16,
                       tie_embeddings=tied, gradient_checkpointing=ckpt)


def _new_model(seed: int = 0, ckpt: bool = False) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(_cfg(ckpt=ckpt))


def _global_batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for _ in range(GAS):
        x = torch.randint(0, VOCAB, (GLOBAL_B, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (GLOBAL_B, SEQ), generator=g)
        y[torch.rand(GLOBAL_B, SEQ, generator=g) < 0.25] = -100
        out.append((x, y))
    return out


def _rows(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = GLOBAL_B // world
    return t[rank * n:(rank + 1) * n]


# ------------------------------------------------------------------------------ reference (1 process)

def _reference(steps: int, dtype: torch.dtype = torch.float32
               ) -> tuple[list[dict[str, torch.Tensor]], list[float], list[float], dict]:
    """(params after each step, loss per step (before its update), grad norm per step, state dict after step 2),
    trained in `dtype`, returned as fp64."""
    model = _new_model(0).to(dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPT["weight_decay"]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"], foreach=False)
    losses, norms, at2, per_step = [], [], {}, []
    for step in range(1, steps + 1):
        batches = _global_batches(step)
        units = float(sum(int((y != -100).sum()) for _, y in batches))
        loss, norm = one_process_step(model, opt, params, batches, units, OPT["grad_clip"])
        losses.append(loss)
        norms.append(norm)
        if step == 2:
            at2 = {n: p.detach().double().clone() for n, p in model.state_dict().items()}
        per_step.append({n: p.detach().double().clone() for n, p in model.named_parameters()})
    return per_step, losses, norms, at2


@pytest.fixture(scope="module")
def reference():
    """The fp32 reference and, as reference[4], tolerances from its own rounding (its fp64 run): a parallel
    run (another summation order) may differ from it by 10x |fp32 - fp64| plus a floor (a fixed 1e-5
    bound failed on another machine in the FSDP tests, which compare the same way)."""
    torch.manual_seed(0)
    r32 = _reference(STEPS + 1, torch.float32)
    r64 = _reference(STEPS + 1, torch.float64)
    noise = [max(float((a[n] - b[n]).abs().max()) for n in a) for a, b in zip(r32[0], r64[0])]
    at2 = max(float((r32[3][n] - r64[3][n]).abs().max()) for n in r32[3])

    def scalar_tol(i):  # a mean of ~100 fp32 token losses, or a norm of fp32 gradients: ~1e-6 relative
        return 10 * max(abs(a - b) for a, b in zip(r32[i], r64[i])) + 1e-6 * max(abs(a) for a in r32[i])
    tol = {"params": [10 * n + 1e-7 for n in noise], "at2": 10 * at2 + 1e-7, "loss": scalar_tol(1),
           "norm": scalar_tol(2)}
    return (*r32, tol)


# ------------------------------------------------------------------------------ workers

def _pc(schedule: str, zero: bool = False, dp_engine: str = "ddp", gas: int = GAS):
    from parallel.config import ParallelConfig
    return ParallelConfig(parallel=dp_engine, pipeline_parallel_size=2, pipeline_schedule=schedule,
                          gradient_accumulation_steps=gas, use_distributed_optimizer=zero)


def _build(schedule: str, seed: int = 0, zero: bool = False, dp_engine: str = "ddp", ckpt: bool = False, **kw):
    from parallel.build import build_parallel_engine
    return build_parallel_engine(_new_model(seed, ckpt), _pc(schedule, zero, dp_engine),
                                 OptimizerConfig(**OPT, use_distributed_optimizer=zero), **kw)


def _token_loss(model, batch: dict):
    """The task's loss_fn for pretraining (trainer/task.py micro_batch_loss): the token CE sum, no statistics."""
    return model(batch["input_ids"], labels=batch["labels"], reduction="sum"), {}


def _count_units(batch: dict) -> int:
    return int((batch["labels"] != -100).sum())


def _units(batches) -> float:
    return float(sum(int((y != -100).sum()) for _, y in batches))


def _step(eng, step: int) -> tuple[float, float]:
    """One optimizer step on this dp replica's rows of the global batch: (global loss, grad norm)."""
    batches = _global_batches(step)
    mbs = [{"input_ids": _rows(x, eng.dp_rank, eng.dp_size), "labels": _rows(y, eng.dp_rank, eng.dp_size)}
           for x, y in batches]
    eng.optimizer.zero_grad()
    row = eng.forward_backward(mbs, _token_loss, _units(batches))
    stepped, norm = eng.optimizer.step()
    assert stepped
    loss = eng.sum_over_data(row[:1].clone(), torch.device("cpu"))  # the replicas' sums (each pipeline once)
    return float(loss[0]) / _units(batches), norm


def _manager(eng, out: str):
    from checkpoint.manager import CheckpointManager
    return CheckpointManager(eng, out, rank=dist.get_rank(), world_size=dist.get_world_size(), keep_last=2,
                             barrier=dist.barrier)


def _save(eng, out: str, step: int) -> str:
    """The trainer-facing save (step_N/ under out/checkpoints, published atomically)."""
    return _manager(eng, out).save(step, model_config={}, trainer_state={}, run_config={},
                                   rank_state={"rank": dist.get_rank()})


def _load_ckpt(eng, out: str) -> None:
    from checkpoint.verify import find_latest_valid
    extra = _manager(eng, out).load(find_latest_valid(out), dist.get_world_size())
    assert extra["rank"] == dist.get_rank()


def _stage_params(eng) -> dict[str, torch.Tensor]:
    from parallel.engine_pipeline import _full
    return {n: _full(p).detach().clone() for n, p in eng.module.named_parameters()}  # FSDP: gathered over dp


def _record(tmp: str, name: str, eng, losses, norms) -> None:
    torch.save(_stage_params(eng), os.path.join(tmp, f"{name}_stage{eng.stage_index}_dp{eng.dp_rank}.pt"))
    with open(os.path.join(tmp, f"{name}_stage{eng.stage_index}_dp{eng.dp_rank}.json"), "w") as f:
        json.dump({"losses": losses, "norms": norms, "layers": list(eng.module.layer_range)}, f)


def _worker_pp2(rank: int, world: int, tmp: str) -> None:
    assert world == 2
    # GPipe, 3 steps; then a validation pass (forward only) on step 4's batches and a 4th step after it
    eng = _build("gpipe")
    res = [_step(eng, s) for s in range(1, STEPS + 1)]
    _record(tmp, "gpipe", eng, [r[0] for r in res], [r[1] for r in res])
    mbs = [{"input_ids": x, "labels": y} for x, y in _global_batches(STEPS + 1)]
    row = eng.evaluate(mbs + mbs, _token_loss, _count_units)  # 2 rounds of the schedule
    eval_sum, eval_units = float(row[0]), float(row[-1])  # the units: the last field
    res = [_step(eng, STEPS + 1)]
    _record(tmp, "gpipe_after_eval", eng, [r[0] for r in res], [r[1] for r in res])
    with open(os.path.join(tmp, f"eval_rank{rank}.json"), "w") as f:
        json.dump({"loss": eval_sum / eval_units, "units": eval_units}, f)
    # bad calls on a built engine
    errors = {}
    mbs = [{"input_ids": x, "labels": y} for x, y in _global_batches(1)]
    for key, bad in (("count", mbs[:1]), ("shape", [{k: v[:, :4] for k, v in mb.items()} for mb in mbs])):
        try:
            eng.forward_backward(bad, _token_loss, _units(_global_batches(1)))
            errors[key] = None
        except ValueError as e:
            errors[key] = str(e)
    with open(os.path.join(tmp, f"errors_rank{rank}.json"), "w") as f:
        json.dump(errors, f)
    del eng

    # 1F1B with activation checkpointing: 2 steps, save per stage, 3rd step; then a fresh engine
    # (another init) loads and redoes step 3
    eng = _build("1f1b", ckpt=True)
    res = [_step(eng, s) for s in (1, 2)]
    _save(eng, os.path.join(tmp, "ckpt_1f1b"), 2)
    res.append(_step(eng, 3))
    _record(tmp, "1f1b", eng, [r[0] for r in res], [r[1] for r in res])
    del eng
    eng = _build("1f1b", seed=123, ckpt=True)
    _load_ckpt(eng, os.path.join(tmp, "ckpt_1f1b"))
    res = [_step(eng, 3)]
    _record(tmp, "1f1b_resumed", eng, [r[0] for r in res], [r[1] for r in res])


def _worker_pp2_dp2(rank: int, world: int, tmp: str) -> None:
    assert world == 4
    for name, schedule, zero, dp_engine in (("pp2dp2_gpipe", "gpipe", False, "ddp"),
                                            ("pp2dp2_1f1b_zero", "1f1b", True, "ddp"),
                                            ("pp2dp2_1f1b_fsdp", "1f1b", False, "fsdp")):
        eng = _build(schedule, zero=zero, dp_engine=dp_engine)
        assert (eng.pp_size, eng.dp_size) == (2, 2)
        res = [_step(eng, s) for s in (1, 2)]
        if dp_engine == "fsdp":
            _save(eng, os.path.join(tmp, "ckpt_fsdp"), 2)
        res.append(_step(eng, 3))
        eng.optimizer.finish_param_sync()
        _record(tmp, name, eng, [r[0] for r in res], [r[1] for r in res])
        del eng
    # FSDP resume: a fresh engine (another init) loads the per-stage checkpoint and redoes step 3
    eng = _build("1f1b", seed=123, dp_engine="fsdp")
    _load_ckpt(eng, os.path.join(tmp, "ckpt_fsdp"))
    res = [_step(eng, 3)]
    _record(tmp, "pp2dp2_1f1b_fsdp_resumed", eng, [r[0] for r in res], [r[1] for r in res])


@pytest.fixture(scope="module")
def pp2(tmp_path_factory) -> str:
    return computed_once(tmp_path_factory, "pipeline_pp2", lambda d: spawn(_worker_pp2, 2, str(d)) or str(d))


@pytest.fixture(scope="module")
def pp2dp2(tmp_path_factory) -> str:
    return computed_once(tmp_path_factory, "pipeline_pp2dp2", lambda d: spawn(_worker_pp2_dp2, 4, str(d)) or str(d))


def _load(tmp: str, name: str, dp: int = 0) -> tuple[dict, list[dict]]:
    params, infos = {}, []
    for s in range(2):
        params.update(torch.load(os.path.join(tmp, f"{name}_stage{s}_dp{dp}.pt"), weights_only=True))
        with open(os.path.join(tmp, f"{name}_stage{s}_dp{dp}.json")) as f:
            infos.append(json.load(f))
    return params, infos


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (sorted(set(a) ^ set(b)))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _check_against_reference(params, infos, reference, steps=STEPS, first=1):
    ref_params, ref_losses, ref_norms = reference[0][steps - 1], reference[1][first - 1:], reference[2][first - 1:]
    tol = reference[4]
    diff = _max_diff({k: v.double() for k, v in params.items()}, ref_params)
    print(f"max |param - reference| = {diff:.2e} (tolerance {tol['params'][steps - 1]:.2e})")
    assert diff <= tol["params"][steps - 1], (diff, tol)
    for info in infos:  # every stage reports the same global loss and global norm as one process
        for got, want in zip(info["losses"], ref_losses[:steps]):
            assert abs(got - want) <= tol["loss"], (info["losses"], ref_losses, tol)
        for got, want in zip(info["norms"], ref_norms[:steps]):
            assert abs(got - want) <= tol["norm"], (info["norms"], ref_norms, tol)
    assert max(ref_norms) > OPT["grad_clip"]  # clipping was active


# ------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pp2_matches_one_process(pp2, reference, schedule):
    params, infos = _load(pp2, schedule)
    assert [i["layers"] for i in infos] == [[0, 2], [2, 4]]
    _check_against_reference(params, infos, reference)


def test_pp2_eval_then_train(pp2, reference):
    """A forward-only pass (the schedule switches to eval and back) gives the one-process loss and
    leaves training exact: the step after it still matches."""
    for rank in range(2):
        ev = json.load(open(os.path.join(pp2, f"eval_rank{rank}.json")))
        assert abs(ev["loss"] - reference[1][STEPS]) <= reference[4]["loss"], (ev, reference[1], reference[4])
    params, infos = _load(pp2, "gpipe_after_eval")
    _check_against_reference(params, infos, reference, steps=STEPS + 1, first=STEPS + 1)


def test_pp2_resume_is_bit_exact(pp2):
    a, _ = _load(pp2, "1f1b")
    b, _ = _load(pp2, "1f1b_resumed")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), _max_diff(a, b)


def test_merged_checkpoint_is_the_full_model(pp2, reference):
    from checkpoint.pipeline import merge_stage_checkpoints, read_pipeline_meta
    from checkpoint.verify import find_latest_valid
    ckpt = find_latest_valid(os.path.join(pp2, "ckpt_1f1b"))
    assert ckpt.endswith("step_00000002") and not os.path.exists(ckpt + ".tmp")
    meta = read_pipeline_meta(ckpt)
    assert meta["pp_size"] == 2 and meta["layer_ranges"] == [[0, 2], [2, 4]]
    full = merge_stage_checkpoints(ckpt)
    want = Transformer(_cfg()).state_dict()
    assert {k: tuple(v.shape) for k, v in full.items()} == {k: tuple(v.shape) for k, v in want.items()}
    # the weights after step 2 of one process
    assert _max_diff({k: v.double() for k, v in full.items()}, reference[3]) <= reference[4]["at2"]
    m = Transformer(_cfg())
    m.load_state_dict(full)  # strict


@pytest.mark.parametrize("name", ["pp2dp2_gpipe", "pp2dp2_1f1b_zero", "pp2dp2_1f1b_fsdp"])
def test_pp2_dp2_matches_one_process(pp2dp2, reference, name):
    params, infos = _load(pp2dp2, name, dp=0)
    _check_against_reference(params, infos, reference)
    replica, _ = _load(pp2dp2, name, dp=1)
    assert all(torch.equal(params[k], replica[k]) for k in params)  # dp replicas identical


def test_pp2_dp2_fsdp_resume_is_bit_exact(pp2dp2):
    from checkpoint.pipeline import merge_stage_checkpoints
    for dp in (0, 1):
        a, _ = _load(pp2dp2, "pp2dp2_1f1b_fsdp", dp)
        b, _ = _load(pp2dp2, "pp2dp2_1f1b_fsdp_resumed", dp)
        assert all(torch.equal(a[k], b[k]) for k in a), _max_diff(a, b)
    from checkpoint.verify import find_latest_valid
    full = merge_stage_checkpoints(find_latest_valid(os.path.join(pp2dp2, "ckpt_fsdp")))  # gathered over dp at save time
    assert set(full) == set(Transformer(_cfg()).state_dict())


def test_bad_calls_on_engine(pp2):
    for rank in range(2):
        errors = json.load(open(os.path.join(pp2, f"errors_rank{rank}.json")))
        assert errors["count"] and "2 micro-batches" in errors["count"]
        assert errors["shape"] and "fixed-shape" in errors["shape"]


def test_bad_combinations_raise():
    from parallel.build import build_parallel_engine
    from parallel.pipeline import pipeline_stage_module, split_layers, validate_pipeline_options
    with pytest.raises(ValueError, match="does not divide"):
        split_layers(5, 2)
    assert split_layers(5, 2, allow_uneven=True) == [(0, 3), (3, 5)]
    with pytest.raises(ValueError, match="at least one transformer layer"):
        split_layers(2, 3, allow_uneven=True)
    with pytest.raises(ValueError, match="tie_embeddings"):
        torch.manual_seed(0)
        pipeline_stage_module(Transformer(_cfg(tied=True)), 0, 2)
    with pytest.raises(ValueError, match="1F1B schedule needs at least as many micro-batches"):
        validate_pipeline_options(pp_size=4, n_microbatches=2, schedule="1f1b")
    validate_pipeline_options(pp_size=4, n_microbatches=2, schedule="gpipe")  # GPipe has no such limit
    with pytest.raises(ValueError, match="pipeline_schedule='interleaved'"):
        validate_pipeline_options(pp_size=2, n_microbatches=2, schedule="interleaved")
    with pytest.raises(ValueError, match="unknown dp engine"):
        validate_pipeline_options(pp_size=2, n_microbatches=2, schedule="gpipe", dp_engine="zero3")
    with pytest.raises(ValueError, match="not a multiple"):
        validate_pipeline_options(pp_size=2, n_microbatches=2, schedule="gpipe", world_size=3)
    with pytest.raises(ValueError, match="overlap_optim_step"):
        validate_pipeline_options(pp_size=2, n_microbatches=2, schedule="gpipe", overlap_optim_step=True)
    with pytest.raises(ValueError, match="initialised process group"):
        build_parallel_engine(_new_model(), _pc("1f1b"), OptimizerConfig())


# ------------------------------------------------------------------------------ stages = pruned Transformer (1 process)

def _stage_cfg(n_layers: int, ckpt: bool = False, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, dim=16, n_layers=n_layers, n_heads=2, n_kv_heads=1, multiple_of=16,
                       max_seq_len=16, gradient_checkpointing=ckpt, loss_chunk_size=5, **kw)


def _stage_batch(inputs: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    y[0, :2] = -100
    kw: dict = {}
    if inputs == "packed":  # packed samples: positions restart at each sample (attention stays inside it)
        kw["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], list(range(SEQ)), [0, 1, 0, 1, 2, 3, 0, 1]])
    elif inputs == "padded":
        mask = torch.ones(3, SEQ, dtype=torch.long)
        mask[0, -3:] = 0
        mask[2, -1:] = 0
        y[mask == 0] = -100
        kw["attention_mask"] = mask
    return x, y, kw


@pytest.mark.parametrize("inputs", ["plain", "packed", "padded"])
@pytest.mark.parametrize("ckpt", [False, True], ids=["nockpt", "ckpt"])
@pytest.mark.parametrize("n_layers,n_stages,uneven", [(4, 2, False), (6, 3, False), (5, 2, True)])
def test_stages_in_sequence_equal_the_full_model(n_layers, n_stages, uneven, ckpt, inputs):
    """The stages run one after the other (the activations cut between stages as the schedule does, the
    backward fed stage by stage) give the full model's loss sum and gradients."""
    from parallel.pipeline import pipeline_stage_module
    torch.manual_seed(0)
    model = Transformer(_stage_cfg(n_layers, ckpt)).train()
    x, y, kw = _stage_batch(inputs)
    want = model(x, labels=y, reduction="sum", **kw)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    stages = [pipeline_stage_module(model, s, n_stages, allow_uneven_split=uneven) for s in range(n_stages)]
    calls = [0]
    hook = model.layers[n_layers - 1].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ins, outs, h = [], [], x
    for s, stage in enumerate(stages):
        if s:
            h = h.detach().requires_grad_(True)  # what the next rank receives
        ins.append(h)
        h = stage(h, labels=y if stage.is_last else None, **kw)
        outs.append(h)
        if not stage.is_last:
            assert h.shape == (3, SEQ, 16)
    assert h.shape == (1,) and h.dtype == torch.float32
    assert torch.allclose(h[0], want.detach(), rtol=1e-6, atol=1e-6), (float(h), float(want))
    h.sum().backward()
    for s in range(n_stages - 2, -1, -1):
        outs[s].backward(ins[s + 1].grad)
    hook.remove()
    assert calls[0] == (2 if ckpt else 1)  # checkpointing recomputes the block in the backward
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want_grads[n], rtol=1e-5, atol=1e-6), n

    # forward only (eval, no grad): the same loss sum
    model.eval()
    with torch.no_grad():
        h = x
        for stage in stages:
            h = stage(h, labels=y if stage.is_last else None, **kw)
        assert torch.allclose(h[0], model(x, labels=y, reduction="sum", **kw), rtol=1e-6, atol=1e-6)


def test_stages_are_the_model_pruned():
    """A stage is a Transformer sharing the model's own submodules (no copy), with the model's key names;
    the stages' keys are disjoint and together exactly the full model's."""
    from parallel.pipeline import merge_stage_state_dicts, pipeline_stage_module
    torch.manual_seed(0)
    model = Transformer(_stage_cfg(6))
    full = model.state_dict()
    full_params = dict(model.named_parameters())
    stages = [pipeline_stage_module(model, s, 3) for s in range(3)]
    for s, stage in enumerate(stages):
        assert isinstance(stage, Transformer) and stage.cfg is model.cfg
        assert (stage.stage_index, stage.num_stages) == (s, 3)
        assert stage.layer_range == (2 * s, 2 * s + 2)
        assert (stage.is_first, stage.is_last) == (s == 0, s == 2)
        assert (stage.embed_tokens is model.embed_tokens) if s == 0 else stage.embed_tokens is None
        assert (stage.lm_head is model.lm_head and stage.norm is model.norm) if s == 2 else \
            (stage.lm_head is None and stage.norm is None)
        assert all(stage.layers[str(i)] is model.layers[i] for i in range(*stage.layer_range))
        assert stage.rotary is model.rotary
        sd = stage.state_dict()
        assert set(sd) <= set(full)
        for n, p in stage.named_parameters():
            assert p is full_params[n] and p.data_ptr() == full_params[n].data_ptr()
        for k, v in sd.items():
            assert v.data_ptr() == full[k].data_ptr()
    assert {f"layers.{i}.mlp.up_proj.weight" for i in (2, 3)} <= set(stages[1].state_dict())
    assert "embed_tokens.weight" in stages[0].state_dict() and "lm_head.weight" in stages[2].state_dict()
    assert sum(len(st.state_dict()) for st in stages) == len(full)
    merged = merge_stage_state_dicts([st.state_dict() for st in stages])
    assert list(merged) == list(full) and all(merged[k] is not None for k in full)
    # loading a stage's weights goes into the model's own tensors
    with torch.no_grad():
        stages[1].load_state_dict({k: torch.zeros_like(v) for k, v in stages[1].state_dict().items()})
    assert float(model.layers[2].mlp.up_proj.weight.detach().abs().sum()) == 0.0
    # the full model stays a ModuleList model (generation, indexing)
    assert isinstance(model.layers, torch.nn.ModuleList) and model.layers[5] is stages[2].layers["5"]


@pytest.mark.parametrize("fused", [True, False])
def test_last_stage_uses_the_model_loss_and_needs_labels(monkeypatch, fused):
    """The last stage's loss is the model's cfg-chosen loss head (chunked linear+CE, or the full-logits
    reference with fused_cross_entropy=False), with reduction "sum" (per token with reduction="none", as DPO
    runs it); without labels it refuses."""
    import model.loss as loss_mod
    from parallel.pipeline import pipeline_stage_module
    torch.manual_seed(0)
    model = Transformer(_stage_cfg(2, fused_cross_entropy=fused))
    x, y, _ = _stage_batch("plain")
    first, last = pipeline_stage_module(model, 0, 2), pipeline_stage_module(model, 1, 2)
    seen = []
    name = "linear_cross_entropy" if fused else "linear_cross_entropy_ref"
    real = getattr(loss_mod, name)

    def spy(hidden, weight, labels, reduction, *rest, **kw):
        seen.append((name, reduction, weight is model.lm_head.weight))
        return real(hidden, weight, labels, reduction, *rest, **kw)
    monkeypatch.setattr(loss_mod, name, spy)
    out = last(first(x), labels=y)
    assert seen == [(name, "sum", True)] and out.shape == (1,)
    assert torch.equal(out[0], model(x, labels=y, reduction="sum"))
    last.reduction = "none"
    out = last(first(x), labels=y)
    assert seen[-1] == (name, "none", True) and out.shape == (3, SEQ)
    assert torch.equal(out, model(x, labels=y, reduction="none").float())
    with pytest.raises(ValueError, match="needs labels"):
        last(first(x))
