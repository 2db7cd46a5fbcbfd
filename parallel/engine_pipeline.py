"""Pipeline stages as the trainer's engine: `PipelineParallelEngine`, this rank's stage (parallel/pipeline.py's
split and schedule) on the run's one mesh (parallel/mesh.py: "pp" x "dp_shard" x "tp"; dp_replicate is 1),
our DDP (engine_ddp.ddp_with_optimizer; ZeRO-1/2) or FSDP2 (engine_fsdp.fsdp_with_optimizer) per stage over the dp dimension (tensor parallel inside a
stage over FSDP2), and an optimizer whose global-norm clip and fp16 overflow decision span ALL stages (the
squared norm is all-reduced over the pp group too). Checkpoints: per-stage files (stage{s}_model.safetensors,
stage{s}_optimizer_dp{r}.pt, pipeline.json) in the same step_N/ layout with the same manifest / COMPLETE /
atomic rename; resumable with the same stages at any dp size; merge_stage_checkpoints() gives the full model.

    engine = build_parallel_engine(model, parallel_config, opt_cfg, device=device)   # parallel/build.py
    engine.optimizer.zero_grad()
    sums = engine.forward_backward(micro_batches, loss_fn, global_units)   # len == gradient_accumulation_steps
    engine.optimizer.step()

The task's loss runs on the last stage: its loss_fn(model, batch) gets, as `model`, the micro-batch's per-token
losses (parallel/pipeline.py LastStageOutput); DPO's chosen and rejected rows run through the stages as one
micro-batch of 2B rows padded to one length, the frozen reference (a full copy on every rank) inside loss_fn.

Owns: this engine's mesh use, stage wrapping, step, evaluation and checkpoint format.
Must never: normalise the loss other than by the global target units (sum over micro-batches and dp
replicas; ranks of one pp group hold the same data and are counted once), clip with a norm that misses
another stage's parameters, hold the stage split or build the schedule (parallel/pipeline.py's).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor, distribute_tensor

from optimizer import OptimizerConfig
from parallel.checkpoint_io import (damaged_file_hint, is_pipeline_checkpoint, load_extra_state,
                                    read_pipeline_meta_safe, refuse_nonfinite_weights)
from parallel.config import CAPABILITIES, ParallelConfig
from parallel.engine import Engine, LossFn, stat_row, step_fields
from parallel.engine_ddp import ddp_with_optimizer
from parallel.engine_fsdp import fsdp_with_optimizer
from parallel.fsdp import reshard
from parallel.mesh import counts_in_sums
from parallel.pipeline import (FORMAT, META_FILE, SEGMENTS, LastStageOutput, PipelineStageModule, build_schedule,
                               pipeline_stage_module, read_pipeline_meta, split_layers, validate_pipeline_options)
from utils import checkpoint as ckpt
from utils.checkpoint_layout import TRAINER_STATE, stage_model_file, stage_optimizer_file
from utils.constants import IGNORE_INDEX
from utils.publish import fsync_file, make_temp_dir


def _full(t: Any) -> Any:
    """A DTensor gathered to a plain tensor (collective over its mesh); anything else unchanged.
    torch logs a warning per tensor when a dp x tp DTensor (FSDP's _StridedShard over Shard) needs two
    all-gathers; at checkpoint time that is expected, so it is not printed for every tensor of every save."""
    if not isinstance(t, DTensor):
        return t
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return t.full_tensor()
    finally:
        logger.setLevel(level)


def _like(full: Any, template: Any) -> Any:
    """`full` sharded like the DTensor `template` (every rank holds `full`: no communication)."""
    if isinstance(template, DTensor):
        return distribute_tensor(full.to(template.device, template.dtype), template.device_mesh,
                                 template.placements, src_data_rank=None)
    if torch.is_tensor(template) and torch.is_tensor(full):
        return full.to(template.device)
    return full


class PipelineParallelEngine(Engine):
    """This rank's stage (wrapped over the dp group), its schedule and its optimizer."""
    kind: ClassVar[str] = "pipeline"
    capabilities: ClassVar[frozenset] = CAPABILITIES["pipeline"]

    def __init__(self, stage_module: PipelineStageModule, wrapped: Any, optimizer: Any, *, mesh: Any,
                 device: torch.device, schedule: str, n_microbatches: int, layer_ranges: list[tuple[int, int]],
                 dp_engine: str = "ddp") -> None:
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp_shard")
        self.pp_size, self.dp_size, self.tp_size = (mesh[d].size() for d in ("pp", "dp_shard", "tp"))
        self.stage_index, self.dp_rank = mesh.get_local_rank("pp"), mesh.get_local_rank("dp_shard")
        self.tp_rank = mesh.get_local_rank("tp")
        self.dp_engine, self.schedule_name, self.n_microbatches = dp_engine, schedule.lower(), n_microbatches
        self.layer_ranges, self.n_layers = layer_ranges, stage_module.cfg.n_layers
        # the P ranks of a pipeline (and the T ranks of a stage's tensor group) hold the same batch and the
        # same broadcast loss: only the first of them counts (parallel/mesh.py SAME_BATCH_DIMS)
        super().__init__(wrapped, optimizer, stage_module, dp_rank=self.dp_rank, dp_size=self.dp_size,
                         fixed_batch_shape=True, micro_batches_per_call=n_microbatches,
                         counts_in_sums=counts_in_sums(mesh), mesh=mesh,
                         sharded_optimizer=self._sharded_files(optimizer))
        self.is_first, self.is_last = stage_module.is_first, stage_module.is_last
        self._loss_mult, self._poison = 1.0, False
        self._mb_shape: Optional[tuple] = None
        self._pad_len = stage_module.cfg.max_seq_len
        # this call's micro-batches (host batch, row groups), the task's loss_fn and counter, the summed row
        self._pending: list = []
        self._task_loss: Optional[LossFn] = None
        self._count_units: Optional[Callable[[dict], int]] = None
        self._rows: dict[int, torch.Tensor] = {}
        self.stage, self.schedule = build_schedule(wrapped, self.stage_index, self.pp_size, device, self.pp_group,
                                                   n_microbatches, self.schedule_name, self._schedule_loss)

    # ------------------------------------------------------------------ one step
    def _schedule_loss(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """The schedule's loss on the last stage, per micro-batch in order: the task's loss_fn over this
        micro-batch's per-token losses (`output`, [rows, T]); its step_fields(stat_keys) row is summed. The backward
        sees loss_sum * dp / global_units (our DDP averages over dp, so gradients are those of (all
        replicas' loss sums) / global_units), with the fp16 loss scale on top."""
        i = int(target.reshape(-1)[0])  # the micro-batch's index (a host tensor: no device read)
        mb, segments = self._pending[i]
        loss_sum, stats = self._task_loss(LastStageOutput(output, segments), mb)
        if self._poison:
            loss_sum = loss_sum * float("nan")
        units = self._count_units(mb) if self._count_units is not None else 0.0
        # by index: the schedule's shape inference (first step, eval <-> train) calls this once more, for
        # micro-batch 0 before its real forward, which overwrites it
        self._rows[i] = stat_row(loss_sum, stats, self.stat_keys, units=units)
        return self.optimizer.scale_loss(loss_sum * self._loss_mult)

    def _start(self, mbs: list, loss_fn: LossFn, count_units: Optional[Callable[[dict], int]]) -> tuple:
        """The micro-batches as the stages' inputs (row groups stacked, checked to be of one shape), and the
        state _schedule_loss reads."""
        grouped = [mb for mb in mbs if "input_ids" not in mb]  # DPO: padded to the longest pair seen so far
        if grouped:
            self._pad_len = max([self._pad_len] + [mb[k].shape[1] for mb in grouped for k in mb
                                                   if k.endswith("input_ids")])
        assembled = [self._assemble(mb) for mb in mbs]
        self._check_shapes([a for a, _ in assembled], regrow=bool(grouped))
        self.module.reduction = "none" if grouped else "sum"  # per-token losses only where row groups need them
        self._pending = [(mb, seg) for mb, (_, seg) in zip(mbs, assembled)]
        self._task_loss, self._count_units, self._rows = loss_fn, count_units, {}
        return self._inputs([a for a, _ in assembled])

    def forward_backward(self, batches: Sequence[dict], loss_fn: LossFn, global_units: float,
                         poison: bool = False) -> torch.Tensor:
        """Run the schedule over this dp replica's micro-batches (every rank of a pp group passes the same
        ones; the first stage reads input_ids, the last labels, all of them attention_mask / position_ids).
        Gradients accumulate (DDP no_sync) and are reduced over dp in optimizer.step(). Returns the float64
        step_fields(stat_keys) row (the last stage's loss sum, broadcast over the pp group). Collective over the mesh."""
        mbs = list(batches)
        if len(mbs) != self.n_microbatches:
            raise ValueError(f"the pipeline schedule was built for {self.n_microbatches} micro-batches "
                             f"(gradient_accumulation_steps), got {len(mbs)}")
        args, target, kwargs = self._start(mbs, loss_fn, None)
        self._loss_mult, self._poison = self.dp_size / max(1.0, float(global_units)), poison
        self.module.train()
        # one dp reduction per step: our DDP's in optimizer.step(); FSDP's reduce-scatter is run by the
        # schedule after the last backward (PipelineStage turns FSDP's per-backward sync off itself)
        sync_ctx = self.model.no_sync() if self.dp_engine == "ddp" else contextlib.nullcontext()
        with sync_ctx:
            self.schedule.step(*args, target=target, return_outputs=False, **kwargs)
        self._poison = False
        return self._broadcast_row()

    @torch.no_grad()
    def evaluate(self, batches: Sequence[dict], loss_fn: LossFn, count_units: Callable[[dict], int]) -> torch.Tensor:
        """float64 step_fields(stat_keys) sums of this dp replica's batches, forward only (validation).
        len(batches) must be a multiple of n_microbatches, each batch of the training shape. Switching the
        schedule between eval and train re-runs its shape inference (one extra forward; no effect on the
        numbers)."""
        mbs = list(batches)
        if not mbs or len(mbs) % self.n_microbatches:
            raise ValueError(f"eval needs a multiple of {self.n_microbatches} micro-batches, got {len(mbs)}")
        self.module.eval()
        self._loss_mult, total = 1.0, None
        try:
            for i in range(0, len(mbs), self.n_microbatches):
                args, target, kwargs = self._start(mbs[i:i + self.n_microbatches], loss_fn, count_units)
                self.schedule.eval(*args, target=target, return_outputs=False, **kwargs)
                row = self._broadcast_row()
                total = row if total is None else total + row
        finally:
            self.module.train()
            if self.dp_engine == "fsdp":  # forward-only: free the gathered parameters (no backward will)
                reshard(self.module)
        return total

    def _assemble(self, mb: dict) -> tuple[dict, list[tuple[int, int, int]]]:
        """A micro-batch as the stages' inputs + its row groups [(first row, end row, length)]: input_ids /
        labels as they are, or DPO's chosen and rejected rows stacked into one batch of 2B rows padded to the
        longest pair seen so far, at least the model's max_seq_len (labels ignored, attention mask 0 where
        padded), so the micro-batches keep one shape (it grows only when a longer pair comes)."""
        groups = [p for p in SEGMENTS if f"{p}input_ids" in mb and f"{p}labels" in mb]
        if not groups:
            raise ValueError("pipeline micro-batches need input_ids and labels (or DPO's chosen_ / rejected_ "
                             f"ones); got keys {sorted(mb)}")
        if groups == [""]:
            return ({k: mb[k] for k in ("input_ids", "labels", "attention_mask", "position_ids") if k in mb},
                    [(0, mb["input_ids"].shape[0], mb["input_ids"].shape[1])])
        T, lo = self._pad_len, 0
        masked = any(f"{p}attention_mask" in mb for p in groups)
        parts: dict[str, list] = {"input_ids": [], "labels": [], "attention_mask": []}
        segments = []
        for p in groups:
            x = mb[f"{p}input_ids"]
            b, t = x.shape

            def pad(v: torch.Tensor, fill: int) -> torch.Tensor:
                return torch.nn.functional.pad(v, (0, T - t), value=fill)
            parts["input_ids"].append(pad(x, 0))
            parts["labels"].append(pad(mb[f"{p}labels"], IGNORE_INDEX))
            if masked:
                parts["attention_mask"].append(pad(mb.get(f"{p}attention_mask", torch.ones_like(x)), 0))
            segments.append((lo, lo + b, t))
            lo += b
        return {k: torch.cat(v) for k, v in parts.items() if v}, segments

    def _check_shapes(self, mbs: list, regrow: bool = False) -> None:
        """One [rows, seq] shape for every micro-batch of every call; regrow (DPO's padded pairs, whose
        length grew): the schedule re-runs its shape inference for the new shape (every rank of the pp group
        sees the same batches, so they do it together)."""
        shapes = {tuple(mb["input_ids"].shape) for mb in mbs}
        if regrow and len(shapes) == 1 and self._mb_shape is not None and shapes != {self._mb_shape}:
            self.schedule._stage_forward_initialized = self.schedule._stage_backward_initialized = False
            self._mb_shape = None
        if len(shapes) != 1 or (self._mb_shape is not None and shapes != {self._mb_shape}):
            want = self._mb_shape or "one shape"
            raise ValueError(f"pipeline stages exchange fixed-shape activations: every micro-batch must be "
                             f"[batch, seq] = {want}, got {sorted(shapes)} (pad SFT batches to max_seq_len)")
        self._mb_shape = shapes.pop()

    def _inputs(self, mbs: list) -> tuple[tuple, Any, dict]:
        device = self.stage.device
        cat = {k: torch.cat([mb[k] for mb in mbs]).to(device) for k in mbs[0]
               if k in ("input_ids", "labels", "attention_mask", "position_ids")}
        kwargs = {k: cat[k] for k in ("attention_mask", "position_ids") if k in cat}
        if self.is_last:
            kwargs["labels"] = cat["labels"]
        args = (cat["input_ids"],) if self.is_first else ()
        # the schedule's target: each micro-batch's index, on the host (split into one row per micro-batch)
        return args, (torch.arange(len(mbs)).reshape(-1, 1) if self.is_last else None), kwargs

    def _broadcast_row(self) -> torch.Tensor:
        """The last stage's step_fields(stat_keys) sums of this call's micro-batches, on every stage of the pp group."""
        row = torch.zeros(len(step_fields(self.stat_keys)), dtype=torch.float64, device=self.stage.device)
        if self.is_last:
            if sorted(self._rows) != list(range(len(self._pending))):
                raise RuntimeError(f"the schedule computed the losses of micro-batches {sorted(self._rows)} of "
                                   f"{len(self._pending)}")
            for i in range(len(self._pending)):
                row = row + self._rows[i].to(row.device)
        if self.pp_size > 1:
            dist.broadcast(row, src=dist.get_global_rank(self.pp_group, self.pp_size - 1), group=self.pp_group)
        return row

    # ------------------------------------------------------------------ stage state and files
    def _sharded_files(self, optimizer: Any = None) -> bool:
        """One optimizer file per dp rank (ZeRO's flat shards); FSDP state is gathered to one file."""
        return self.dp_engine == "ddp" and bool(getattr(optimizer or self.optimizer, "sharded", False))

    def state_dict(self) -> dict:
        """{"model": this stage's weights (full-model key names), "optimizer": its optimizer state}. Under FSDP
        both are gathered to full tensors (collective over dp), so the files have one layout whatever the
        dp engine's sharding."""
        self.optimizer.finish_param_sync()
        model = {k: _full(v).detach() for k, v in self.module.state_dict().items()}
        opt = self.optimizer.state_dict()
        if self.dp_engine == "fsdp":
            opt = dict(opt, adamw={k: _full(v) for k, v in opt["adamw"].items()})
        return {"model": model, "optimizer": opt}

    def load_state_dict(self, sd: dict) -> None:
        """The inverse of state_dict() (full tensors; re-sharded here under FSDP)."""
        if self.dp_engine == "fsdp":
            current = self.module.state_dict()
            self.module.load_state_dict({k: _like(v, current[k]) for k, v in sd["model"].items()})
            template = self.optimizer.state_dict()["adamw"]
            opt = dict(sd["optimizer"])
            opt["adamw"] = {k: _like(v, template.get(k)) for k, v in opt["adamw"].items()}
            self.optimizer.load_state_dict(opt)
            return
        self.module.load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])

    def write_stage_files(self, dir_path: str) -> None:
        """Collective over the mesh: this stage's files into the existing directory `dir_path` (dp rank 0
        writes the stage's weights `stage{s}_model.safetensors` and, unless ZeRO shards it,
        `stage{s}_optimizer_dp0.pt`; ZeRO: every dp rank its own), fsynced; global rank 0 also writes
        `pipeline.json`. Returns after every rank has written (a barrier). Publishing the directory is `save`'s."""
        self.write_stage_state(dir_path, self.state_dict(), dist.get_rank())
        dist.barrier()

    def write_stage_state(self, dir_path: str, sd: dict, global_rank: int, copy: bool = True) -> None:
        """The files of write_stage_files from a state_dict() (no collective: the background writer of
        --async_checkpoint calls it with host snapshots, copy=False)."""
        s = self.stage_index
        first = self.dp_rank == 0 and self.tp_rank == 0  # one writer per stage (the tensors are gathered)
        if first:
            path = os.path.join(dir_path, stage_model_file(s))
            tensors = {k: v.to("cpu").contiguous().clone() for k, v in sd["model"].items()} if copy else sd["model"]
            save_file(tensors, path, metadata={"format": "pt", "stage": str(s)})
            fsync_file(path)
        if first or self._sharded_files():
            path = os.path.join(dir_path, stage_optimizer_file(s, self.dp_rank))
            torch.save(sd["optimizer"], path)
            fsync_file(path)
        if global_rank == 0:
            ckpt.write_json(os.path.join(dir_path, META_FILE), {
                "format": FORMAT, "pp_size": self.pp_size, "dp_size": self.dp_size, "tp_size": self.tp_size,
                "n_layers": self.n_layers, "layer_ranges": [list(r) for r in self.layer_ranges],
                "schedule": self.schedule_name, "n_microbatches": self.n_microbatches,
                "dp_engine": self.dp_engine, "sharded_optimizer": self._sharded_files()})

    def load_stage_files(self, ckpt_dir: str) -> None:
        """This stage's weights and optimizer state from a checkpoint of the same pipeline split (pp size,
        layer ranges) and dp engine, at any dp size (ZeRO shards are re-sharded)."""
        meta = read_pipeline_meta(ckpt_dir)
        if meta["pp_size"] != self.pp_size or [tuple(r) for r in meta["layer_ranges"]] != list(self.layer_ranges):
            raise ValueError(f"checkpoint {ckpt_dir} has {meta['pp_size']} stage(s) with layers "
                             f"{meta['layer_ranges']}; this run has {self.pp_size} with {self.layer_ranges}: resume "
                             f"at the same pipeline_parallel_size (or merge_stage_checkpoints() it to one model "
                             f"and start from that)")
        if meta.get("dp_engine", "ddp") != self.dp_engine:
            raise ValueError(f"checkpoint {ckpt_dir} was written with dp engine {meta.get('dp_engine')!r}; this run "
                             f"uses {self.dp_engine!r} (the optimizer states differ; the weights can be taken with "
                             f"merge_stage_checkpoints())")
        sharded = self._sharded_files()
        if sharded != bool(meta["sharded_optimizer"]):
            raise ValueError(f"checkpoint {ckpt_dir}: optimizer layout (sharded={meta['sharded_optimizer']}) differs "
                             f"from this run's (sharded={sharded}): resume with the same --use_distributed_optimizer")
        s = self.stage_index

        def opt_file(r: int) -> dict:
            return torch.load(os.path.join(ckpt_dir, stage_optimizer_file(s, r)), map_location="cpu",
                              weights_only=True)
        if not sharded:  # one file per stage whatever the dp size (FSDP's state is gathered to it)
            opt = opt_file(0)
        elif int(meta["dp_size"]) == self.dp_size:
            opt = opt_file(self.dp_rank)
        else:  # ZeRO shards of another dp size: every saved shard, re-sharded by the optimizer
            opt = [opt_file(r) for r in range(int(meta["dp_size"]))]
        self.load_state_dict({"model": load_file(os.path.join(ckpt_dir, stage_model_file(s))),
                              "optimizer": opt})

    # ------------------------------------------------------------------ the trainer's checkpoints
    def resume_problem(self, ckpt_dir: str, saved_world: int, world_size: int) -> Optional[str]:
        if not is_pipeline_checkpoint(ckpt_dir):
            return (f"{ckpt_dir} was written without pipeline parallelism; resume it with --pipeline_parallel_size=1 "
                    "(or start a new pipeline run from its weights with --init_from=<that checkpoint>)")
        meta = read_pipeline_meta_safe(ckpt_dir)
        saved = (meta.get("pp_size"), meta.get("dp_size"), meta.get("dp_engine", "ddp"))
        if (saved[0], saved[2]) != (self.pp_size, self.dp_engine):
            return (f"{ckpt_dir} was written on a pipeline mesh of pp={saved[0]} x dp={saved[1]} ({saved[2]}), this "
                    f"run is pp={self.pp_size} x dp={self.dp_size} ({self.dp_engine}): a pipeline checkpoint resumes "
                    "with the same number of stages and dp engine, at any dp size (to change the stages, start a "
                    "new run with --init_from=<that checkpoint>)")
        return None

    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print, writer: Any = None) -> str:
        """Collective. The stages' files + per-rank RNG into step_N.tmp/, then rank 0 publishes it
        (manifest, COMPLETE, fsync, atomic rename: utils/checkpoint.publish_checkpoint_dir) and prunes.
        Always full stage files (no light LoRA checkpoints)."""
        if writer is not None:
            from parallel.async_saves import save_pipeline_async
            return save_pipeline_async(self, out_dir, step, rank, world_size, model_config, trainer_state, run_config,
                                       extra_state, keep_last, barrier, fault_hook, log, writer)
        root = ckpt.checkpoint_root(out_dir)
        final, tmp = ckpt.step_dir_paths(root, step)
        # a write that does not fit (disk full, a file-size limit): the partial step_N.tmp removed, exit 7
        with ckpt.save_guard(root, step, check_space=rank == 0):
            if rank == 0:
                make_temp_dir(final)  # one left by a crash was never complete: dropped
            barrier()
            self.write_stage_files(tmp)  # collective over the mesh (FSDP gathers the stage's tensors)
            ckpt.write_extra_and_configs(tmp, rank, extra_state, model_config, run_config, fault_hook)
            barrier()  # every rank has written and fsynced its files
            if rank == 0:
                ckpt.write_json(os.path.join(tmp, TRAINER_STATE),
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
            self.load_stage_files(ckpt_dir)
        except (ValueError, KeyError, TypeError, OSError, EOFError, RuntimeError, SafetensorError) as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: {damaged_file_hint(ckpt_dir, e)}") from e
        refuse_nonfinite_weights(self.module, ckpt_dir)
        return load_extra_state(ckpt_dir, rank, saved_world, world_size, log)


def pipeline_stage_of(model: torch.nn.Module, pc: ParallelConfig, opt_cfg: OptimizerConfig, mesh: Any,
                      allow_uneven_split: bool = False) -> PipelineStageModule:
    """This rank's stage of `model` (the full Transformer, built identically on every rank or loaded; the stage
    shares its parameters) on the run's mesh (pp x dp x tp), with the layout's refusals. The caller moves only
    the stage to the device (the other layers can be freed: nothing references them) and applies the transforms
    to it (parallel/build.py)."""
    if mesh is None:
        raise ValueError("pipeline parallelism needs an initialised process group")
    validate_pipeline_options(pp_size=pc.pp, n_microbatches=pc.gradient_accumulation_steps,
                              schedule=pc.pipeline_schedule, dp_engine=pc.parallel, world_size=mesh.size(),
                              overlap_optim_step=opt_cfg.overlap_optim_step)
    if pc.tp > 1 and pc.parallel != "fsdp":
        raise ValueError("tensor parallelism under pipeline stages runs on FSDP2 per stage: --parallel=fsdp")
    if mesh["dp_replicate"].size() != 1:
        raise ValueError("pipeline stages replicate over the dp_shard dimension only: --dp_replicate_size=1")
    stage = pipeline_stage_module(model, mesh.get_local_rank("pp"), pc.pp, allow_uneven_split)
    stage.layer_ranges = split_layers(model.cfg.n_layers, pc.pp, allow_uneven_split)
    return stage


def wrap_pipeline_engine(stage: PipelineStageModule, pc: ParallelConfig, opt_cfg: OptimizerConfig, *, mesh: Any,
                         group: Any = None, device: Optional[torch.device] = None,
                         param_dtype: torch.dtype = torch.float32) -> PipelineParallelEngine:
    """The pipeline engine around this rank's stage (pipeline_stage_of, on its device, transforms applied): the
    stage in the data-parallel wrap of --parallel (our DDP / ZeRO, or FSDP2: the same wraps as the
    one-stage engines) over the mesh's "dp_shard" ranks, its optimizer's norm spanning every stage, and the
    schedule."""
    norm_groups = [mesh.get_group("pp")] if pc.pp > 1 else []  # the global norm and fp16 skip span the stages
    if pc.parallel == "fsdp":
        wrapped, opt = fsdp_with_optimizer(stage, pc, opt_cfg, dp_mesh=mesh["dp_shard"], param_dtype=param_dtype,
                                           gloo_collectives=False, norm_groups=norm_groups)
    else:  # dp rank 0's weights everywhere (our DDP broadcasts them)
        wrapped, opt = ddp_with_optimizer(stage, pc, opt_cfg, group=mesh.get_group("dp_shard"),
                                          norm_groups=norm_groups)
    device = torch.device(device if device is not None else next(stage.parameters()).device)
    return PipelineParallelEngine(stage, wrapped, opt, mesh=mesh, device=device, schedule=pc.pipeline_schedule,
                                  n_microbatches=pc.gradient_accumulation_steps, dp_engine=pc.parallel,
                                  layer_ranges=stage.layer_ranges)
