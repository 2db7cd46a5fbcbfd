"""DPO through pipeline stages (parallel/engine_pipeline.py with the task's loss, trainer/task.py
micro_batch_loss): each micro-batch's chosen and rejected rows run through the stages as one batch of 2B
rows padded to the model's max_seq_len; the last stage hands their per-token losses to the task's loss_fn,
which also runs the frozen reference model (a full copy on every rank). At pp=2 x dp=1 (2 processes, gloo,
CPU), GPipe and 1F1B, the per-step loss, chosen / rejected rewards and reward accuracy (the step row),
a validation pass (evaluate) and the final weights follow one process within 10x the reference's own
rounding (its fp32 run against its fp64 run) plus a floor, as in tests/parallel/test_pipeline.py.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from trainer.tasks.dpo import DPOTask

from optimizer import OptimizerConfig
from tests.dist_helpers import computed_once, spawn
from tests.parallel.test_pipeline import GAS, OPT, VOCAB, _new_model, _pc

STEPS, PAIRS = 3, 4
CFG = SimpleNamespace(task_type="dpo", dpo_beta=0.5, dpo_loss="sigmoid", dpo_loss_weights="", dpo_label_smoothing=0.0,
                      discopop_tau=0.05, rpo_alpha=0.0, simpo_gamma=0.5)


def _pairs(step: int) -> list[dict]:
    """GAS micro-batches of PAIRS pairs; chosen and rejected of other lengths (<= max_seq_len 16), right-padded
    rows (attention mask 0, labels ignored) as the DPO collate makes them."""
    g = torch.Generator().manual_seed(2000 + step)
    out = []
    for _ in range(GAS):
        mb = {}
        for prefix, t in (("chosen_", 10), ("rejected_", 7)):
            x = torch.randint(0, VOCAB, (PAIRS, t), generator=g)
            y = torch.randint(0, VOCAB, (PAIRS, t), generator=g)
            y[:, :2] = -100  # the prompt
            mask = torch.ones(PAIRS, t, dtype=torch.long)
            mask[1, t - 3:] = 0
            mask[3, t - 1:] = 0
            y[mask == 0] = -100
            mb.update({f"{prefix}input_ids": x, f"{prefix}labels": y, f"{prefix}attention_mask": mask})
        out.append(mb)
    return out


def _loss_fn(ref):
    return lambda model, batch: DPOTask(CFG).micro_batch_loss(model, ref, batch, torch.device("cpu"))


def _ref_model(dtype: torch.dtype = torch.float32):
    return _new_model(1).to(dtype).eval().requires_grad_(False)


def _reference(dtype: torch.dtype) -> tuple[dict, list[list[float]], list[float]]:
    """(parameters after STEPS steps, per step [loss, chosen, rejected, acc] per pair, validation row) as fp64."""
    model, loss_fn = _new_model(0).to(dtype), _loss_fn(_ref_model(dtype))
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPT["weight_decay"]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=OPT["lr"], betas=OPT["betas"], eps=OPT["eps"], foreach=False)
    rows = []
    for step in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        sums = torch.zeros(4, dtype=torch.float64)
        for mb in _pairs(step):
            loss, stats = loss_fn(model, mb)
            (loss / (GAS * PAIRS)).backward()
            sums += torch.tensor([float(loss.detach()), *(float(stats[k]) for k in ("chosen_reward", "rejected_reward",
                                                                           "reward_acc"))], dtype=torch.float64)
        torch.nn.utils.clip_grad_norm_(params, OPT["grad_clip"])
        opt.step()
        rows.append((sums / (GAS * PAIRS)).tolist())
    with torch.no_grad():
        val = torch.zeros(4, dtype=torch.float64)
        for mb in _pairs(STEPS + 1):
            loss, stats = loss_fn(model, mb)
            val += torch.tensor([float(loss), *(float(stats[k]) for k in ("chosen_reward", "rejected_reward",
                                                                          "reward_acc"))], dtype=torch.float64)
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}, rows, val.tolist()


def _worker(rank: int, world: int, tmp: str) -> None:
    from parallel.build import build_parallel_engine
    loss_fn = _loss_fn(_ref_model())
    for schedule in ("gpipe", "1f1b"):
        eng = build_parallel_engine(_new_model(0), _pc(schedule), OptimizerConfig(**OPT))
        eng.stat_keys = DPOTask.stat_keys  # as the trainer sets them (trainer/start.py place_on_engine)
        rows = []
        for step in range(1, STEPS + 1):
            eng.optimizer.zero_grad()
            row = eng.forward_backward(_pairs(step), loss_fn, GAS * PAIRS)
            stepped, _ = eng.optimizer.step()
            assert stepped
            rows.append((row[:4] / (GAS * PAIRS)).tolist())
        val = eng.evaluate(_pairs(STEPS + 1), loss_fn, lambda b: int(b["chosen_input_ids"].shape[0]))
        params = {n: p.detach().clone() for n, p in eng.module.named_parameters()}
        torch.save(params, os.path.join(tmp, f"{schedule}_stage{eng.stage_index}.pt"))
        with open(os.path.join(tmp, f"{schedule}_stage{eng.stage_index}.json"), "w") as f:
            json.dump({"rows": rows, "val": val.tolist()}, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> str:
    return computed_once(tmp_path_factory, "pp_dpo", lambda d: spawn(_worker, 2, str(d)) or str(d))


@pytest.fixture(scope="module")
def reference():
    r32, r64 = _reference(torch.float32), _reference(torch.float64)
    tol_p = 10 * max(float((r32[0][n] - r64[0][n]).abs().max()) for n in r32[0]) + 1e-7
    tol_r = [10 * max(abs(a[j] - b[j]) for a, b in zip(r32[1], r64[1])) + 1e-6 * max(abs(a[j]) for a in r32[1]) + 1e-7
             for j in range(4)]
    return r32, tol_p, tol_r


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dpo_pp2_matches_one_process(runs, reference, schedule):
    (params_ref, rows_ref, val_ref), tol_p, tol_r = reference
    params = {}
    for s in range(2):
        params.update(torch.load(os.path.join(runs, f"{schedule}_stage{s}.pt"), weights_only=True))
        info = json.load(open(os.path.join(runs, f"{schedule}_stage{s}.json")))
        for got, want in zip(info["rows"], rows_ref):  # every stage returns the same row
            assert all(abs(got[j] - want[j]) <= tol_r[j] for j in range(4)), (got, want, tol_r)
        assert info["val"][4] == GAS * PAIRS  # units: pairs, counted by the task's count_units
        for j in range(4):
            assert abs(info["val"][j] - val_ref[j]) <= tol_r[j] * GAS * PAIRS, (info["val"], val_ref)
    assert params.keys() == params_ref.keys()
    diff = max(float((params[n].double() - params_ref[n]).abs().max()) for n in params)
    assert diff <= tol_p, (diff, tol_p)
    assert any(abs(r[1] - r[2]) > 1e-3 for r in rows_ref)  # the rewards are not idle
    start = {n: p.detach().double() for n, p in _new_model(0).named_parameters()}
    assert max(float((params_ref[n] - start[n]).abs().max()) for n in start) > 100 * tol_p  # it trained
