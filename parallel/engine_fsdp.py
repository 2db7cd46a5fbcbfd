"""torch FSDP2 (`fully_shard` per block + root) + FSDPOptimizer as the trainer's engine: `FSDPEngine` and its
builder, on the run's one device mesh (parallel/mesh.py): HSDP over ("dp_replicate", "dp_shard") with
replicas, tensor (+ sequence) parallel inside over "tp" (applied as a transform first).

Checkpoints: torch.distributed.checkpoint, sharded, no gather, loadable at any world size
(parallel/dcp_checkpoint.py), in the same step_N/ layout, so listing, verification and pruning are shared.
A --parallel=ddp checkpoint resumes here too: its weights and AdamW state converted per parameter name.

Owns: this engine's wrapping, DPO reference layout, and checkpoint format.
Must never: hold the micro-batch loop (parallel/engine.py's) or the optimizer's step (optimizer/).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from optimizer import OptimizerConfig
from optimizer.fsdp_optimizer import FSDPOptimizer
from parallel.checkpoint_io import agreed_reads, is_sharded_checkpoint, load_extra_state, refuse_nonfinite_weights
from parallel.config import CAPABILITIES, ParallelConfig
from parallel.dcp_checkpoint import load_dcp_checkpoint, save_dcp_checkpoint
from parallel.engine import Engine
from parallel.fsdp import no_sync, reshard, shard_on_mesh, validate_fsdp_options, wrap_fsdp
from parallel.mesh import dp_mesh
from parallel.resume_across_engines import load_full_state_into_fsdp, read_ddp_training_state
from utils import checkpoint as ckpt
from utils.checkpoint_layout import MODEL_CONFIG, RUN_CONFIG, TRAINER_STATE


@dataclass
class FSDPEngine(Engine):
    """torch FSDP2 (`fully_shard` per block + root) + FSDPOptimizer (parallel/fsdp.py). Checkpoints:
    torch.distributed.checkpoint, sharded, no gather, loadable at any world size (parallel/dcp_checkpoint.py)."""
    kind: ClassVar[str] = "fsdp"
    capabilities: ClassVar[frozenset] = CAPABILITIES["fsdp"]

    def place_reference(self, ref: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """DPO's reference laid out on the same mesh (tensor-parallel like the policy, fp32 shards, each
        block gathered in `dtype` for its forward and freed after it), so it costs 1/world of its bytes."""
        return shard_on_mesh(ref.to(device=device, dtype=torch.float32), self.mesh, param_dtype=dtype,
                             reshard_after_forward=True)

    def reference_layout(self) -> str:
        tp = self.mesh["tp"].size() if self.mesh is not None else 1
        return "sharded by FSDP2" + (f" and split over {tp} tensor-parallel ranks" if tp > 1 else "")

    def _no_sync(self) -> contextlib.AbstractContextManager:
        return no_sync(self.model)  # the model is the fully_shard-ed module itself: no wrapper

    def _after_forward_only(self) -> None:
        reshard(self.model)  # no backward follows to free what the forward gathered: free it now

    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print, writer: Any = None) -> str:
        state = dict(trainer_state, step=step, world_size=world_size)
        if writer is not None:  # --async_checkpoint: DCP's collectives here, the files in the background
            from parallel.async_saves import save_dcp_checkpoint_async
            return save_dcp_checkpoint_async(out_dir, ckpt.checkpoint_root(out_dir), step, self.model, self.optimizer,
                                             json_files={TRAINER_STATE: state, MODEL_CONFIG: model_config,
                                                         RUN_CONFIG: run_config},
                                             rank_state=extra_state, writer=writer, keep_last=keep_last,
                                             fault_hook=fault_hook, log=log)
        path = save_dcp_checkpoint(ckpt.checkpoint_root(out_dir), step, self.model, self.optimizer,
                                   json_files={TRAINER_STATE: state, MODEL_CONFIG: model_config,
                                               RUN_CONFIG: run_config},
                                   rank_state=extra_state, fault_hook=fault_hook)
        if rank == 0:
            ckpt.prune_checkpoints(out_dir, keep_last=keep_last, keep_best=True, log=log)
        barrier()
        return path

    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
             log: Callable[[str], None] = print) -> Optional[dict]:
        problem = self.resume_problem(ckpt_dir, saved_world, world_size)
        if problem:
            raise ckpt.CheckpointError(problem)
        if not is_sharded_checkpoint(ckpt_dir):
            return self._load_ddp_checkpoint(ckpt_dir, saved_world, rank, world_size, log)
        with agreed_reads(self.module):  # this rank's own file, before DCP's collective read
            extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log)
        load_dcp_checkpoint(ckpt_dir, self.model, self.optimizer)
        refuse_nonfinite_weights(self.module, ckpt_dir)
        return extra

    def _load_ddp_checkpoint(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
                             log: Callable[[str], None]) -> Optional[dict]:
        """A --parallel=ddp checkpoint resumed under FSDP2: every rank reads the full weights (the optimizer's
        fp32 masters) and the AdamW state assembled from every optimizer_rank{r}.pt (ZeRO shards included),
        and keeps its own shard of each (parallel/resume_across_engines.py)."""
        with agreed_reads(self.module):
            if ckpt.read_trainer_state(ckpt_dir).get("lora_base"):
                raise ckpt.CheckpointError(f"checkpoint {ckpt_dir} holds only a LoRA run's trainable tensors (its "
                                           "base is a file): resume it with --parallel=ddp")
            weights, state, scalars = read_ddp_training_state(ckpt_dir)
            extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log)
        if scalars is None:
            log(f"[resume] warning: {ckpt_dir} (--parallel=ddp) has no optimizer file: resuming its weights under "
                "--parallel=fsdp with FRESH AdamW moments (the next steps differ from the uninterrupted run's)")
        load_full_state_into_fsdp(self.model, self.optimizer, weights, state if scalars is not None else None, scalars,
                                  ckpt_dir)
        refuse_nonfinite_weights(self.module, ckpt_dir)
        if scalars is not None:
            log(f"[resume] {ckpt_dir} was written by --parallel=ddp: its weights and optimizer state (AdamW's "
                "exp_avg, exp_avg_sq and step, Muon's momentum, per parameter) converted to --parallel=fsdp")
        return extra




def fsdp_with_optimizer(part: nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *, dp_mesh: Any,
                        param_dtype: torch.dtype, state_group: Any = None, gloo_collectives: bool = True,
                        norm_groups: Sequence = ()) -> tuple[nn.Module, FSDPOptimizer]:
    """`part` (its weights already the same on every rank: parallel/build.py broadcasts them before tensor
    parallelism) fully_shard-ed over `dp_mesh`, and its optimizer: the data-parallel wrap of --parallel=fsdp,
    and of a pipeline stage (parallel/engine_pipeline.py), whose `norm_groups` the gradient norm spans too."""
    validate_fsdp_options(use_distributed_optimizer=opt_cfg.use_distributed_optimizer,
                          overlap_optim_step=opt_cfg.overlap_optim_step,
                          overlap_param_gather=opt_cfg.overlap_param_gather, zero_stage=opt_cfg.zero_stage)
    if param_dtype == torch.float16 and opt_cfg.precision != "fp16":
        raise ValueError("param_dtype=float16 needs precision='fp16' (loss scaling)")
    wrapped = wrap_fsdp(part, mesh_or_group=dp_mesh, param_dtype=param_dtype,
                        reshard_after_forward=pc.reshard_after_forward, cpu_offload=pc.cpu_offload,
                        sync_module_states=False, state_group=state_group, gloo_collectives=gloo_collectives)
    return wrapped, FSDPOptimizer(wrapped, opt_cfg, norm_groups=norm_groups)


def wrap_fsdp_engine(model: nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, *, mesh: Any,
                     group: Any = None, device: Optional[torch.device] = None,
                     param_dtype: torch.dtype = torch.float32) -> FSDPEngine:
    """The --parallel=fsdp engine: FSDP2 over the run's mesh's data-parallel dims (HSDP with replicas;
    tensor parallel already applied over "tp" by its transform). `group` is unused: the mesh is the world's."""
    wrapped, opt = fsdp_with_optimizer(model, pc, opt_cfg, dp_mesh=dp_mesh(mesh), param_dtype=param_dtype,
                                       state_group=dist.group.WORLD)
    layout = pc.layout(dist.get_world_size())
    rank, world = layout.dp_coordinates(dist.get_rank())
    # context parallel: FSDP2 averages the gradients over dp x cp ranks (parallel/mesh.py dp_mesh), the batch is
    # split over dp only
    return FSDPEngine(wrapped, opt, wrapped, sharded_optimizer=True, dp_rank=rank, dp_size=world, mesh=mesh,
                      counts_in_sums=layout.counts_in_sums(dist.get_rank()), grad_ranks=world * layout.cp)
