"""A synchronous save whose writes do not fit at ONE rank of two (its node's disk full, or a file-size limit): every
rank ends with the same DiskFullError line (exit 7), the partial step_N.tmp is removed and the previous checkpoint
is left intact, in each format: plain (our DDP), the pipeline stages, and DCP (FSDP). Before, the failing rank exited
7 and the other one waited in the save's barrier until that death broke the connection (a gloo traceback, exit 1).

The disk is made "full" for real in the failing rank's process only: RLIMIT_FSIZE lowered to 1 KiB (SIGXFSZ
ignored), so its next file write past it fails with EFBIG inside safetensors / torch.save / DCP, as ENOSPC would.
One spawn of 2 ranks runs every case in turn (a limit is lifted again before the next) and writes what each rank
raised; the tests read it.
"""
from __future__ import annotations

import json
import os
import resource
import signal

import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import computed_once, spawn

LIMIT = 1024  # bytes: every case's failing file is larger (the smallest, an RNG-state file, is ~6 KiB)
CASES = [("plain", 1), ("plain", 0), ("pipeline", 1), ("dcp", 1)]  # (format, the rank whose disk is full)


class _StageEngine:
    """The two methods save_stages reads of a pipeline engine: a 2-stage split, stage = rank, one dp rank each."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_spec(self):
        stages = dict(stage_index=self.rank, dp_rank=0, tp_rank=0, sharded_optimizer=False, pp_size=2, dp_size=1,
                      tp_size=1, n_layers=2, layer_ranges=[[0, 1], [1, 2]], schedule="gpipe", n_microbatches=2,
                      dp_engine="ddp")
        return type("Spec", (), {"stages": stages})()

    def state_dict(self) -> dict:
        return {"model": {f"layers.{self.rank}.w": torch.full((2048,), float(self.rank))},
                "optimizer": {"state": {}, "param_groups": []}}


def _save(fmt: str, rank: int, world: int, out_dir: str, step: int, fsdp_model) -> str:
    from checkpoint.protocol import SaveJob
    extra = {"rng": torch.get_rng_state()}
    if fmt == "plain":
        from checkpoint.plain import SaveRequest, save_checkpoint
        req = SaveRequest(step=step, rank=rank, world_size=world,
                          model_state={"w": torch.arange(2048.0)} if rank == 0 else None, model_config={"dim": 4},
                          optimizer_state=None, extra_state=extra, trainer_state={"val_loss": None}, run_config={})
        return save_checkpoint(out_dir, req, barrier=dist.barrier, keep_last=5, log=lambda s: None)
    if fmt == "pipeline":
        from checkpoint.pipeline import save_stages
        job = SaveJob(out_dir=out_dir, step=step, trainer_state={"val_loss": None}, model_config={"dim": 4},
                      run_config={}, extra_state=extra, rank=rank, world_size=world, keep_last=5,
                      barrier=dist.barrier, log=lambda s: None)
        return save_stages(_StageEngine(rank), job)
    from checkpoint.dcp import save_dcp_checkpoint
    from utils.checkpoint_layout import checkpoint_root
    return save_dcp_checkpoint(checkpoint_root(out_dir), step, fsdp_model, None,
                               json_files={"trainer_state.json": {"step": step}}, rank_state=extra)


def _every_case(rank: int, world: int, tmp: str, result_file: str) -> None:
    from tests.parallel.test_fsdp import _build
    from utils.errors import exit_code_for
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG (not a signal)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    fsdp_model, _ = _build(dist.group.WORLD)  # the FSDP tests' tiny model, sharded over both ranks
    got = {}
    for fmt, failing in CASES:
        out_dir = os.path.join(tmp, f"{fmt}-{failing}")
        _save(fmt, rank, world, out_dir, 1, fsdp_model)  # the checkpoint that must survive
        dist.barrier()
        if rank == failing:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
        try:
            _save(fmt, rank, world, out_dir, 2, fsdp_model)
            row = {"raised": None}
        except Exception as e:  # noqa: BLE001 - what the trainer would turn into its exit code and line
            named = exit_code_for(e)
            row = {"raised": type(e).__name__, "code": named[0] if named else 1, "line": str(e)}
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        dist.barrier()
        ckpts = os.path.join(out_dir, "checkpoints")
        row["left"] = sorted(os.listdir(ckpts))
        got[f"{fmt}-{failing}"] = row
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump(got, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    def run(d) -> dict:
        spawn(_every_case, 2, str(d), str(d / "result.json"))
        return {"ranks": [json.loads((d / f"result.json.{r}").read_text()) for r in (0, 1)], "dir": str(d)}
    out = computed_once(tmp_path_factory, "full_disk_at_one_rank", run)
    return {0: out["ranks"][0], 1: out["ranks"][1], "dir": out["dir"]}


@pytest.mark.parametrize("fmt,failing", CASES, ids=[f"{f}-rank{r}" for f, r in CASES])
def test_every_rank_exits_7_with_the_failing_ranks_line(results, fmt, failing):
    rows = [results[r][f"{fmt}-{failing}"] for r in (0, 1)]
    for rank, row in enumerate(rows):
        assert row["raised"] == "DiskFullError" and row["code"] == 7, (rank, row)
        # the partial step_00000002.tmp is gone at every rank; step 1 is still there and still complete
        assert row["left"] == ["step_00000001"], (rank, row)
    line = rows[failing]["line"]
    assert line.startswith("saving checkpoint ") and "step_00000002" in line and " did not fit " in line, line
    assert "the partial step_00000002.tmp was removed and the earlier checkpoints are intact" in line, line
    if fmt != "dcp":
        # the file named is the failing rank's own; the other rank says the same line
        own = {"plain": ("extra_rank1.pt" if failing else "model.safetensors"),
               "pipeline": f"stage{failing}_model.safetensors"}[fmt]
        assert f"step_00000002.tmp/{own} did not fit" in line, line
        assert rows[1 - failing]["line"] == line
    else:  # DCP's own collective write: both ranks learn it from DCP (each names its own shard) and say which
        for row in rows:  # rank's write failed, and how
            assert row["line"].startswith("saving checkpoint ") and f"rank {failing}: OSError" in row["line"], row


@pytest.mark.parametrize("case", [f"{f}-{r}" for f, r in CASES])
def test_the_earlier_checkpoint_still_verifies(results, case):
    """What the failed save left in place is whole: step 1 matches its manifest (every file, every hash)."""
    from checkpoint.verify import verify_checkpoint
    assert verify_checkpoint(os.path.join(results["dir"], case, "checkpoints", "step_00000001")) is None
