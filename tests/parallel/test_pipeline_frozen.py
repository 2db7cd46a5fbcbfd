"""Pipeline stages with frozen parameters (parallel/engine_pipeline.py over model/lora.py): LoRA adapters
(every stage trains its layers' adapters over a frozen base) and --trainable=embeddings (the first stage
trains only the embedding, the last only the LM head; the frozen layers between still pass gradients
back) at pp=2 x dp=1 (2 processes, gloo, CPU) follow one process on the same global batch and seed: the
per-step losses and global gradient norms, the final trainable weights, and the frozen weights unchanged
bit for bit; LoRA also with FSDP2 on the stages' dp dimension. Tolerances as in tests/parallel/test_pipeline.py: 10x the reference's own rounding (its fp32
run against its fp64 run) plus a floor. A save -> fresh engine -> load of a LoRA pipeline writes full stage
files (no light checkpoints) that merge into the whole model with its adapters.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from optimizer import OptimizerConfig
from tests.dist_helpers import computed_once, one_process_step, spawn
from tests.parallel.test_pipeline import OPT, _global_batches, _manager, _new_model, _pc, _rows, _save, _token_loss, _units

STEPS = 3
MODES = {"lora": dict(lora_rank=2, lora_targets="q_proj,v_proj,down_proj"), "embeddings": dict(train_embeddings=True)}


def _model(mode: str, dtype: torch.dtype = torch.float32):
    from model.lora import select_trainable
    model = _new_model(0).to(dtype)
    torch.manual_seed(5)  # LoRA's A init
    select_trainable(model, **MODES[mode])
    if mode == "lora":  # B starts at zero: make the adapters matter from the first step
        with torch.no_grad():
            for i, (n, p) in enumerate(model.named_parameters()):
                if n.endswith("lora_B.weight"):
                    p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(i))
    return model


def _reference(mode: str, dtype: torch.dtype) -> tuple[dict, list[float], list[float]]:
    """(every parameter after STEPS steps, loss per step, grad norm per step) of one process, as fp64."""
    model = _model(mode, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPT["weight_decay"]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"], foreach=False)
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        batches = _global_batches(step)
        loss, norm = one_process_step(model, opt, params, batches, _units(batches), OPT["grad_clip"])
        losses.append(loss)
        norms.append(norm)
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}, losses, norms


def _worker(rank: int, world: int, tmp: str) -> None:
    from checkpoint.verify import find_latest_valid
    from parallel.build import build_parallel_engine
    from parallel.engine_pipeline import _full
    runs = [(m, s, "ddp") for m in MODES for s in ("gpipe", "1f1b")] + [("lora", "1f1b", "fsdp")]
    for mode, schedule, dp_engine in runs:
        eng = build_parallel_engine(_model(mode), _pc(schedule, dp_engine=dp_engine),
                                    OptimizerConfig(**OPT))
        losses, norms = [], []
        for step in range(1, STEPS + 1):
            batches = _global_batches(step)
            mbs = [{"input_ids": _rows(x, 0, 1), "labels": _rows(y, 0, 1)} for x, y in batches]
            eng.optimizer.zero_grad()
            row = eng.forward_backward(mbs, _token_loss, _units(batches))
            stepped, norm = eng.optimizer.step()
            assert stepped
            losses.append(float(row[0]) / _units(batches))
            norms.append(float(norm))
        name = f"{mode}_{schedule}{'_fsdp' if dp_engine == 'fsdp' else ''}_stage{eng.stage_index}"
        params = {n: _full(p).detach().clone() for n, p in eng.module.named_parameters()}
        trainable = sorted(n for n, p in eng.module.named_parameters() if p.requires_grad)
        torch.save(params, os.path.join(tmp, f"{name}.pt"))
        with open(os.path.join(tmp, f"{name}.json"), "w") as f:
            json.dump({"losses": losses, "norms": norms, "trainable": trainable}, f)
        if mode == "lora" and schedule == "1f1b" and dp_engine == "ddp":
            out = os.path.join(tmp, "ckpt_lora")
            _save(eng, out, STEPS)
            fresh = build_parallel_engine(_model(mode), _pc(schedule), OptimizerConfig(**OPT))
            _manager(fresh, out).load(find_latest_valid(out), world)
            same = all(torch.equal(p, params[n]) for n, p in fresh.module.named_parameters())
            with open(os.path.join(tmp, f"reload_stage{fresh.stage_index}.json"), "w") as f:
                json.dump({"same": same}, f)
        dist.barrier()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> str:
    return computed_once(tmp_path_factory, "pp_frozen", lambda d: spawn(_worker, 2, str(d)) or str(d))


@pytest.mark.parametrize("mode,schedule", [("lora", "gpipe"), ("lora", "1f1b"), ("embeddings", "gpipe"),
                                           ("embeddings", "1f1b"), ("lora", "1f1b_fsdp")])
def test_frozen_stages_match_one_process(runs, mode, schedule):
    p32, l32, n32 = _reference(mode, torch.float32)
    p64, l64, n64 = _reference(mode, torch.float64)
    noise = max(float((p32[n] - p64[n]).abs().max()) for n in p32)
    tol_p = 10 * noise + 1e-7
    tol_l = 10 * max(abs(a - b) for a, b in zip(l32, l64)) + 1e-6 * max(l32)
    tol_n = 10 * max(abs(a - b) for a, b in zip(n32, n64)) + 1e-6 * max(n32)
    start = {n: p.detach().double() for n, p in _model(mode).named_parameters()}
    params, trainable = {}, []
    for s in range(2):
        params.update(torch.load(os.path.join(runs, f"{mode}_{schedule}_stage{s}.pt"), weights_only=True))
        info = json.load(open(os.path.join(runs, f"{mode}_{schedule}_stage{s}.json")))
        trainable += info["trainable"]
        assert all(abs(a - b) <= tol_l for a, b in zip(info["losses"], l32)), (info["losses"], l32, tol_l)
        assert all(abs(a - b) <= tol_n for a, b in zip(info["norms"], n32)), (info["norms"], n32, tol_n)
    assert params.keys() == p32.keys()
    want_trainable = sorted(n for n, p in _model(mode).named_parameters() if p.requires_grad)
    assert sorted(trainable) == want_trainable
    for n, p in params.items():
        if n in want_trainable:
            assert float((p.double() - p32[n]).abs().max()) <= tol_p, (n, tol_p)
            assert not torch.equal(p.double(), start[n]), n  # it trained
        else:
            assert torch.equal(p.double(), start[n]), n  # frozen: bit for bit
    assert max(n32) > OPT["grad_clip"]  # clipping was active


def test_lora_pipeline_checkpoint_is_full_and_reloads(runs):
    from checkpoint.pipeline import merge_stage_checkpoints
    from checkpoint.verify import find_latest_valid
    for s in range(2):
        assert json.load(open(os.path.join(runs, f"reload_stage{s}.json")))["same"]
    full = merge_stage_checkpoints(find_latest_valid(os.path.join(runs, "ckpt_lora")))
    assert set(full) == set(_model("lora").state_dict())  # base weights and adapters: full stage files
