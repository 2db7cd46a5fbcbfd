"""Pipeline stages as the trainer's engine: `PipelineParallelEngine`, this rank's stage (parallel/pipeline.py's
split and schedule) on the run's one mesh (parallel/mesh.py: "pp" x "dp_replicate" x "dp_shard" x "tp"; replicas of
sharded stages, HSDP, under FSDP2 only),
our DDP (engine_ddp.ddp_with_optimizer; ZeRO-1/2) or FSDP2 (engine_fsdp.fsdp_with_optimizer) per stage over the dp dimension (tensor parallel inside a
stage over FSDP2), and an optimizer whose global-norm clip and fp16 overflow decision span ALL stages (the
squared norm is all-reduced over the pp group too). Checkpoints: per-stage files (stage{s}_model.safetensors,
stage{s}_optimizer_dp{r}.pt, pipeline.json) in the same step_N/ layout with the same manifest / COMPLETE /
atomic rename; resumable at any dp size, and under our DDP at another split of the stages or without them
(checkpoint/pipeline.py); merge_stage_checkpoints() gives the full model.

    engine = build_parallel_engine(model, parallel_config, opt_cfg, device=device)   # parallel/build.py
    engine.optimizer.zero_grad()
    sums = engine.forward_backward(micro_batches, loss_fn, global_units)   # len == gradient_accumulation_steps
    engine.optimizer.step()

The task's loss runs on the last stage: its loss_fn(model, batch) gets, as `model`, the micro-batch's per-token
losses (parallel/pipeline.py LastStageOutput); DPO's chosen and rejected rows run through the stages as one
micro-batch of 2B rows padded to one length, the frozen reference (a full copy on every rank) inside loss_fn.

Owns: this engine's mesh use, stage wrapping, step, evaluation, and its state as full tensors.
Must never: normalise the loss other than by the global target units (sum over micro-batches and dp
replicas; ranks of one pp group hold the same data and are counted once), clip with a norm that misses
another stage's parameters, hold the stage split or build the schedule (parallel/pipeline.py's).
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from optimizer import OptimizerConfig
from parallel.config import CAPABILITIES, ParallelConfig
from parallel.engine import Engine, LossFn, StateSpec, stat_row, step_fields
from parallel.engine_ddp import ddp_with_optimizer
from parallel.engine_fsdp import fsdp_with_optimizer
from parallel.fsdp import reshard
from parallel.mesh import counts_in_sums, expert_dp_mesh, dp_coordinates, dp_mesh
from parallel.distributed_data_parallel import SHARD_OF_ATTR
from parallel.expert_state import ExpertShardedState
from parallel.pipeline import (SEGMENTS, LastStageOutput, PipelineStageModule, build_schedule, pipeline_stage_module,
                               split_layers, validate_pipeline_options)
from model.moe import in_backward
from utils.constants import IGNORE_INDEX


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


class JoinGradient(torch.autograd.Function):
    """`out` unchanged; its backward also gives the scalar `side` a gradient of 1, as if `side` were added to the
    loss: how a stage that does not compute the loss backpropagates its own layers' losses (Megatron-LM's
    MoEAuxLossAutoScaler does the same for MoE balancing losses)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        ctx.side = (side.shape, side.dtype, side.device)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        shape, dtype, device = ctx.side
        return grad, torch.ones(shape, dtype=dtype, device=device)


class PipelineParallelEngine(Engine):
    """This rank's stage (wrapped over the dp group), its schedule and its optimizer."""
    kind: ClassVar[str] = "pipeline"
    capabilities: ClassVar[frozenset] = CAPABILITIES["pipeline"]

    def __init__(self, stage_module: PipelineStageModule, wrapped: Any, optimizer: Any, *, mesh: Any,
                 device: torch.device, schedule: str, n_microbatches: int, layer_ranges: list[tuple[int, int]],
                 dp_engine: str = "ddp") -> None:
        self.pp_group = mesh.get_group("pp")
        self.pp_size, self.tp_size = mesh["pp"].size(), mesh["tp"].size()
        # over dp_replicate x dp_shard (HSDP under FSDP2 stages; replicate is 1 else)
        self.dp_rank, self.dp_size = dp_coordinates(mesh)
        self.stage_index = mesh.get_local_rank("pp")
        self.tp_rank, self.cp_rank, cp = mesh.get_local_rank("tp"), mesh.get_local_rank("cp"), mesh["cp"].size()
        self.dp_engine, self.schedule_name, self.n_microbatches = dp_engine, schedule.lower(), n_microbatches
        self.layer_ranges, self.n_layers = layer_ranges, stage_module.cfg.n_layers
        self._stage_module = stage_module  # (read by _sharded_files before Engine's fields are set)
        # this rank's place among the ranks its dp wrap reduces over (dp, or dp x cp): its sharded optimizer file
        group = dp_mesh(mesh).get_group() if dp_engine == "ddp" else None
        self.optimizer_rank, self.optimizer_files = (dist.get_rank(group), dist.get_world_size(group)) \
            if group is not None else (self.dp_rank, self.dp_size)
        # the P ranks of a pipeline (and the T ranks of a stage's tensor group) hold the same batch and the
        # same broadcast loss: only the first of them counts (parallel/mesh.py SAME_BATCH_DIMS)
        super().__init__(wrapped, optimizer, stage_module, dp_rank=self.dp_rank, dp_size=self.dp_size,
                         fixed_batch_shape=True, micro_batches_per_call=n_microbatches,
                         counts_in_sums=counts_in_sums(mesh),
                         mesh=mesh, grad_ranks=self.dp_size * cp,
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
        stage_module.after_forward = self._after_stage_forward
        self.stage, self.schedule = build_schedule(wrapped, self.stage_index, self.pp_size, device, self.pp_group,
                                                   n_microbatches, self.schedule_name, self._schedule_loss,
                                                   stage_module=stage_module)

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

    def _after_stage_forward(self, out: torch.Tensor) -> torch.Tensor:
        """A training forward's output of this stage, with the side loss of the stage's own layers (MoE balancing)
        joined to its backward: times the micro-batch's units and the loss's own scaling, as the one-stage engines
        add it to the loss. The schedule's shape-inference forward (no micro-batch) has its statistics dropped."""
        if self.side_loss is None or in_backward():
            return out
        i = self.module.micro_batch
        batch = self._pending[i][0] if i is not None and i < len(self._pending) else None
        extra = self.side_loss.take(i, batch)
        if extra is None:
            return out
        return JoinGradient.apply(out, self.optimizer.scale_loss(extra * self._loss_mult))

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
        # the gradients are averaged over the dp wrap's ranks: dp, or dp x cp (each cp rank backpropagates its part
        # of the cp group's summed loss, model/ring_attention.py)
        self._loss_mult, self._poison = (self.grad_ranks or self.dp_size) / max(1.0, float(global_units)), poison
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

    # ------------------------------------------------------------------ stage state (checkpoint/pipeline.py's files)
    def _sharded_files(self, optimizer: Any = None) -> bool:
        """One optimizer file per dp rank (ZeRO's flat shards; expert-parallel shards: each rank's experts' state);
        FSDP state is gathered to one file."""
        return self.dp_engine == "ddp" and (bool(getattr(optimizer or self.optimizer, "sharded", False))
                                            or self._expert_shards() != {})

    def _expert_shards(self) -> dict:
        """Our DDP's expert-parallel shards of this stage: {name: parameter} (transforms/expert_parallel.py)."""
        return {n: p for n, p in self._stage_module.named_parameters() if getattr(p, SHARD_OF_ATTR, None) is not None}

    def state_dict(self) -> dict:
        """{"model": this stage's weights (full-model key names), "optimizer": its optimizer state}. Under FSDP
        both are gathered to full tensors (collective over dp), so the files have one layout whatever the
        dp engine's sharding."""
        self.optimizer.finish_param_sync()
        model = {k: _full(v).detach() for k, v in self.module.state_dict().items()}
        if self._expert_shards():  # our DDP's expert-parallel shards whole (collective over ep): any ep loads them
            model.update(ExpertShardedState(self.module, self.mesh["ep"].get_group()).full_shards())
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
        # (our DDP's expert-parallel shards: this rank's slice of each whole expert tensor; else a plain load)
        ExpertShardedState(self.module, None).load_state_dict(sd["model"])
        self.optimizer.load_state_dict(sd["optimizer"])


    def state_spec(self) -> StateSpec:
        """The stage split (what pipeline.json records) and this rank's place in it; state_dict() gathers."""
        return StateSpec("stages", self.module, self.optimizer, sharded_optimizer=self._sharded_files(),
                         stages={"pp_size": self.pp_size, "dp_size": self.dp_size, "tp_size": self.tp_size,
                                 "n_layers": self.n_layers, "layer_ranges": [list(r) for r in self.layer_ranges],
                                 "schedule": self.schedule_name, "n_microbatches": self.n_microbatches,
                                 "dp_engine": self.dp_engine, "sharded_optimizer": self._sharded_files(),
                                 "stage_index": self.stage_index, "dp_rank": self.dp_rank, "tp_rank": self.tp_rank,
                                 "cp_rank": self.cp_rank, "optimizer_rank": self.optimizer_rank,
                                 "optimizer_files": self.optimizer_files})


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
    if mesh["dp_replicate"].size() != 1 and pc.parallel != "fsdp":
        raise ValueError("replicas of sharded pipeline stages (HSDP) run on FSDP2 per stage: --parallel=fsdp")
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
        # over dp_shard, or dp_replicate x dp_shard (HSDP: sharded within a replica, all-reduced between them)
        wrapped, opt = fsdp_with_optimizer(stage, pc, opt_cfg, dp_mesh=dp_mesh(mesh), param_dtype=param_dtype,
                                           gloo_collectives=False, norm_groups=norm_groups)
    else:  # dp rank 0's weights everywhere (our DDP broadcasts them); over dp_shard, or dp_shard x cp
        # expert parallelism: the experts' own buffers, reduced over the ranks holding the same ones
        experts = dict(expert_group=expert_dp_mesh(mesh).get_group(), expert_parallel_group=mesh["ep"].get_group()) \
            if pc.ep > 1 else {}
        wrapped, opt = ddp_with_optimizer(stage, pc, opt_cfg, group=dp_mesh(mesh).get_group(),
                                          norm_groups=norm_groups, **experts)
    device = torch.device(device if device is not None else next(stage.parameters()).device)
    return PipelineParallelEngine(stage, wrapped, opt, mesh=mesh, device=device, schedule=pc.pipeline_schedule,
                                  n_microbatches=pc.gradient_accumulation_steps, dp_engine=pc.parallel,
                                  layer_ranges=stage.layer_ranges)
