"""Pipeline stages as the trainer's engine: `PipelineParallelEngine` over parallel/pipeline.py's stages and
schedule (our DDP or FSDP2 per stage over the dp dimension of the one mesh; tensor parallel inside a stage
over FSDP2). Checkpoints: per-stage files (stage{s}_model.safetensors, stage{s}_optimizer_dp{r}.pt,
pipeline.json) in the same step_N/ layout with the same manifest / COMPLETE / atomic rename; resumable with
the same stages at any dp size.

Owns: this engine's step, evaluation and checkpoint format.
Must never: hold the schedule or the stage split (parallel/pipeline.py's).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
from safetensors import SafetensorError

from parallel.checkpoint_io import (damaged_file_hint, is_pipeline_checkpoint, load_extra_state,
                                    read_pipeline_meta_safe, refuse_nonfinite_weights)
from optimizer import OptimizerConfig
from parallel.config import CAPABILITIES, ParallelConfig
from parallel.engine_ddp import ddp_config
from parallel.pipeline import build_pipeline_engine
from parallel.engine import Engine, LossFn
from utils import checkpoint as ckpt
from utils.publish import fsync_file, make_temp_dir, temp_dir_for


class PipelineParallelEngine(Engine):
    """The trainer's view of a parallel.pipeline.PipelineEngine (this rank's stage on the pp x dp mesh)."""
    kind: ClassVar[str] = "pipeline"
    capabilities: ClassVar[frozenset] = CAPABILITIES["pipeline"]

    def __init__(self, pipe: Any) -> None:
        # the P ranks of a pipeline (and the T ranks of a stage's tensor group) hold the same batch and the
        # same broadcast loss: only stage 0's tensor rank 0 counts
        super().__init__(pipe.model, pipe.optimizer, pipe.module, dp_rank=pipe.dp_rank,
                         dp_size=pipe.dp_size, fixed_batch_shape=True, micro_batches_per_call=pipe.n_microbatches,
                         counts_in_sums=pipe.stage_index == 0 and pipe.tp_rank == 0, mesh=pipe.mesh)
        self.pipe = pipe

    def forward_backward(self, batches: Sequence[dict], loss_fn: LossFn, global_units: float,
                         poison: bool = False) -> torch.Tensor:
        out = self.pipe.forward_backward(batches, global_units, poison=poison)
        return torch.tensor([float(out.loss_sum), 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)

    def evaluate(self, batches: Sequence[dict], loss_fn: LossFn, count_units: Callable[[dict], int]) -> torch.Tensor:
        total, units = self.pipe.eval_loss_sum(batches)
        return torch.tensor([total, 0.0, 0.0, 0.0, float(units)], dtype=torch.float64)

    def resume_problem(self, ckpt_dir: str, saved_world: int, world_size: int) -> Optional[str]:
        if not is_pipeline_checkpoint(ckpt_dir):
            return (f"{ckpt_dir} was written without pipeline parallelism; resume it with --pipeline_parallel_size=1 "
                    "(or start a new pipeline run from its weights with --init_from=<that checkpoint>)")
        meta = read_pipeline_meta_safe(ckpt_dir)
        saved = (meta.get("pp_size"), meta.get("dp_size"), meta.get("dp_engine", "ddp"))
        here = (self.pipe.pp_size, self.pipe.dp_size, self.pipe.dp_engine)
        if (saved[0], saved[2]) != (here[0], here[2]):
            return (f"{ckpt_dir} was written on a pipeline mesh of pp={saved[0]} x dp={saved[1]} ({saved[2]}), this "
                    f"run is pp={here[0]} x dp={here[1]} ({here[2]}): a pipeline checkpoint resumes with the same "
                    "number of stages and dp engine, at any dp size (to change the stages, start a new run with "
                    "--init_from=<that checkpoint>)")
        return None

    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print) -> str:
        """Collective. The stages' files + per-rank RNG into step_N.tmp/, then rank 0 publishes it
        (manifest, COMPLETE, fsync, atomic rename: utils/checkpoint.publish_checkpoint_dir) and prunes."""
        root = ckpt.checkpoint_root(out_dir)
        final = os.path.join(root, ckpt.step_dir_name(step))
        tmp = temp_dir_for(final)
        # a write that does not fit (disk full, a file-size limit): the partial step_N.tmp removed, exit 7
        with ckpt.save_guard(root, step, check_space=rank == 0):
            if rank == 0:
                make_temp_dir(final)  # one left by a crash was never complete: dropped
            barrier()
            self.pipe.write_stage_files(tmp)  # collective over the mesh (FSDP gathers the stage's tensors)
            path = os.path.join(tmp, f"extra_rank{rank}.pt")
            torch.save(extra_state, path)
            fsync_file(path)
            if rank == 0:
                ckpt.write_json(os.path.join(tmp, "model_config.json"), model_config)
                ckpt.write_json(os.path.join(tmp, "config.json"), run_config)
                if fault_hook is not None:
                    fault_hook()  # test hook: die with a half-written checkpoint
            barrier()  # every rank has written and fsynced its files
            if rank == 0:
                ckpt.write_json(os.path.join(tmp, "trainer_state.json"),
                                dict(trainer_state, step=step, world_size=world_size, saved_at=time.time()))
                ckpt.publish_checkpoint_dir(tmp, final, step)
                ckpt.prune_checkpoints(out_dir, keep_last=keep_last, keep_best=True, log=log)
        barrier()
        return final

    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
             log: Callable[[str], None] = print) -> Optional[dict]:
        problem = self.resume_problem(ckpt_dir, saved_world, world_size)
        if problem:
            raise ckpt.CheckpointError(problem)
        try:
            self.pipe.load(ckpt_dir)
        except (ValueError, KeyError, TypeError, OSError, EOFError, RuntimeError, SafetensorError) as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: {damaged_file_hint(ckpt_dir, e)}") from e
        refuse_nonfinite_weights(self.module, ckpt_dir)
        return load_extra_state(ckpt_dir, rank, saved_world, world_size, log)




def build_pipeline_parallel_engine(model: torch.nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *,
                                   device: torch.device, group: Any = None,
                                   param_dtype: torch.dtype = torch.float32) -> PipelineParallelEngine:
    """This rank's stage of `model` on the pp x dp (x tp) mesh, our DDP or FSDP2 over dp; only the stage is
    moved to `device`."""
    pipe = build_pipeline_engine(
        model, opt_cfg, pp_size=pc.pp, n_microbatches=pc.gradient_accumulation_steps, schedule=pc.pipeline_schedule,
        dp_engine=pc.parallel, ddp_config=ddp_config(pc), device=device, param_dtype=param_dtype,
        reshard_after_forward=pc.reshard_after_forward, cpu_offload=pc.cpu_offload, tp_size=pc.tp)
    return PipelineParallelEngine(pipe)
