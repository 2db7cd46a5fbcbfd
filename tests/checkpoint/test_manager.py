"""checkpoint/manager.py in one process: the trainer's one interface saves an engine's state (through its StateSpec)
and loads it into a fresh engine so that the next steps equal the uninterrupted run's bit for bit; each rank's RNG
and rank_state come back from load(); the layout chooses the format; a pipeline checkpoint is refused under our
DDP with a line that names the flag."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch
from torch import nn

from checkpoint.manager import CheckpointManager
from checkpoint.verify import find_latest_valid, verify_checkpoint
from optimizer import OptimizerConfig
from parallel.config import ParallelConfig
from parallel.engine import StateSpec
from parallel.build import build_parallel_engine
from utils.errors import CheckpointError


def _engine(seed: int, **opt):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))
    return build_parallel_engine(model, ParallelConfig(), OptimizerConfig(lr=1e-2, **opt), device=torch.device("cpu"))


def _step(engine, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    engine.optimizer.zero_grad()
    ((engine.model(x) - y) ** 2).sum().backward()
    engine.optimizer.step()


def _weights(engine) -> dict:
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


@pytest.mark.parametrize("opt", [{}, {"optimizer": "muon"}], ids=["adamw", "muon"])
def test_a_resumed_engine_continues_bit_for_bit(tmp_path, opt):
    """The reference is the same engine run without a save: 2 steps, save, 2 more steps. A fresh engine (another
    init) loaded from the save and stepped twice must hold exactly those weights (the optimizer's moments and
    step count came back; a lost moment changes the first step after the load)."""
    ref = _engine(0, **opt)
    manager = CheckpointManager(ref, str(tmp_path), keep_last=2, log=lambda m: None)
    for s in (1, 2):
        _step(ref, s)
    path = manager.save(2, trainer_state={"data_cursor": {"step": 2}}, model_config={"dim": 6}, run_config={})
    for s in (3, 4):
        _step(ref, s)
    fresh = _engine(1, **opt)
    assert not torch.equal(_weights(fresh)["0.weight"], _weights(ref)["0.weight"])
    extra = CheckpointManager(fresh, str(tmp_path), log=lambda m: None).load(path, saved_world=1)
    for s in (3, 4):
        _step(fresh, s)
    want, got = _weights(ref), _weights(fresh)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert extra is not None and set(extra["rng"]) >= {"torch_cpu", "python_state", "numpy_keys"}
    state = json.load(open(os.path.join(path, "trainer_state.json")))
    assert (state["step"], state["world_size"], state["data_cursor"]) == (2, 1, {"step": 2})


def test_rng_and_rank_state_come_back_from_load(tmp_path):
    engine = _engine(0)
    manager = CheckpointManager(engine, str(tmp_path), log=lambda m: None)
    _step(engine, 1)
    random.seed(5)
    torch.manual_seed(5)
    expected = (random.random(), float(torch.rand(1)))
    random.seed(5)
    torch.manual_seed(5)
    path = manager.save(1, trainer_state={}, model_config={}, run_config={}, rank_state={"mark": torch.tensor([7])})
    random.seed(99)
    torch.manual_seed(99)
    extra = manager.load(path, saved_world=1)
    assert torch.equal(extra["mark"], torch.tensor([7]))
    from checkpoint.rng import restore_rng_state
    restore_rng_state(extra["rng"], torch.device("cpu"))
    assert (random.random(), float(torch.rand(1))) == expected


def test_the_layout_chooses_the_format_and_a_pipeline_of_fsdp_stages_is_refused(tmp_path):
    engine = _engine(0)
    manager = CheckpointManager(engine, str(tmp_path), keep_last=1, log=lambda m: None)
    _step(engine, 1)
    path = manager.save(1, trainer_state={}, model_config={}, run_config={})
    assert verify_checkpoint(path) is None and find_latest_valid(str(tmp_path), log=lambda m: None) == path
    assert {"model.safetensors", "optimizer_rank0.pt", "extra_rank0.pt"} <= set(os.listdir(path))  # plain format
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "pipeline.json").write_text(json.dumps({"pp_size": 2, "dp_engine": "ddp"}))
    assert manager.resume_problem(str(tmp_path / "pp"), saved_world=2) is None  # our DDP's stages: per name
    (tmp_path / "pp" / "pipeline.json").write_text(json.dumps({"pp_size": 2, "dp_engine": "fsdp"}))
    problem = manager.resume_problem(str(tmp_path / "pp"), saved_world=2)
    assert problem is not None and "a pipeline checkpoint (pp=2, fsdp stages)" in problem
    with pytest.raises(CheckpointError, match="fsdp stages"):
        manager.load(str(tmp_path / "pp"), saved_world=2)

    class Odd:  # an engine whose state layout no format knows
        def state_spec(self):
            return StateSpec("tiles", engine.module, engine.optimizer)
    with pytest.raises(ValueError, match="'tiles'"):
        CheckpointManager(Odd(), str(tmp_path)).save(2, trainer_state={}, model_config={}, run_config={})
