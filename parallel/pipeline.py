"""Pipeline parallelism (pp x dp) on `torch.distributed.pipelining`; our DDP (or ZeRO) or FSDP2 on dp.

Owns: splitting the Transformer's layers into P stages (`split_layers`, `pipeline_stage_module`: a
stage is the Transformer pruned as torchtitan does, run by Transformer.forward itself; the first stage
holds `embed_tokens`, the last `norm` + `lm_head` and computes the model's own loss), the
`PipelineStage` + schedule (`ScheduleGPipe` / `Schedule1F1B`, by name) of this rank, the 2-D
DeviceMesh ("pp", "dp"), wrapping each stage in our DistributedDataParallel over the dp
sub-group (or fully_shard over the dp sub-mesh), an optimizer whose global-norm clip and overflow decision span ALL stages (the squared
norm is all-reduced over the pp group too), per-stage checkpoints, and merging them into one full
state dict with the model's own key names (for export).

    engine = build_pipeline_engine(model, opt_cfg, pp_size=2, n_microbatches=gas, schedule="1f1b")
    engine.optimizer.set_lr(lr); engine.optimizer.zero_grad()
    out = engine.forward_backward(micro_batches)   # list of {"input_ids", "labels", ...}, len == gas
    stepped, grad_norm = engine.optimizer.step()
    engine.save(ckpt_dir); engine.load(ckpt_dir); full_sd = merge_stage_checkpoints(ckpt_dir)

Must never: normalise the loss other than by the global target-token count (sum over micro-batches
and dp replicas; ranks of one pp group hold the same data and are counted once), clip with a norm
that misses another stage's parameters (trap 8), or silently accept a layout it cannot run (tied
embeddings across stages, a layer count that does not split, fewer micro-batches than 1F1B needs,
micro-batch shapes that change, DPO batches).
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from model.llama import Transformer
from optimizer.optimizer_config import OptimizerConfig
from utils.constants import IGNORE_INDEX

SCHEDULES = ("gpipe", "1f1b")
FORMAT = 1
META_FILE = "pipeline.json"


# ---------------------------------------------------------------------------- splitting

def split_layers(n_layers: int, num_stages: int, allow_uneven: bool = False) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges per stage. A count that does not divide is a ValueError unless
    `allow_uneven`, then the first `n_layers % num_stages` stages get one layer more."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if n_layers < num_stages:
        raise ValueError(f"cannot split {n_layers} layer(s) into {num_stages} pipeline stages: every stage needs "
                         f"at least one transformer layer")
    if n_layers % num_stages and not allow_uneven:
        raise ValueError(f"n_layers={n_layers} does not divide into pipeline_parallel_size={num_stages} equal "
                         f"stages; choose a divisor of {n_layers} (or pass allow_uneven_split=True to give the "
                         f"first {n_layers % num_stages} stage(s) one layer more)")
    base, extra = divmod(n_layers, num_stages)
    out, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class PipelineStageModule(Transformer):
    """One stage: the Transformer pruned (`Transformer.pruned`) to the model's own submodules of this
    stage (`layers` a ModuleDict keyed by the global layer index, the embedding on the first stage, norm
    + LM head on the last), so its state_dict keys are exactly the full model's and merging the stages'
    state dicts is a plain union. Its forward IS Transformer.forward, with the schedule's signature:

    forward(x, labels=None, attention_mask=None, position_ids=None): x is token ids on the first stage
    and the hidden state [B, T, D] elsewhere. Non-last stages return the hidden state; the last returns
    the micro-batch's SUM of per-token losses as a shape-[1] fp32 tensor (Transformer.forward(...,
    reduction="sum"): the model's loss choice per its cfg), which the schedule merges along dim 0."""

    stage_index: int
    num_stages: int

    @property
    def is_first(self) -> bool:
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    @property
    def layer_range(self) -> tuple[int, int]:
        ids = [int(k) for k in self.layers]
        return ids[0], ids[-1] + 1

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.lm_head is None:
            return super().forward(x, attention_mask=attention_mask, position_ids=position_ids)
        if labels is None:
            raise ValueError("the last pipeline stage computes the loss: it needs labels")
        loss = super().forward(x, labels, "sum", attention_mask, position_ids)
        # [1] (and not a view of the 0-d loss): the schedule merges the micro-batches' sums along dim 0
        return torch.stack([loss.float()])


def pipeline_stage_module(model: Transformer, stage_index: int, num_stages: int,
                          allow_uneven_split: bool = False) -> PipelineStageModule:
    """Stage `stage_index` of `num_stages` of `model` (sharing its parameters, not copying them)."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is not in [0, {num_stages})")
    if num_stages > 1 and model.cfg.tie_embeddings:
        raise ValueError("tie_embeddings=True cannot be pipelined: the embedding (first stage) and the LM head "
                         "(last stage) would be one weight on two ranks; train untied or without pipeline "
                         "parallelism")
    lo, hi = split_layers(model.cfg.n_layers, num_stages, allow_uneven_split)[stage_index]
    stage = PipelineStageModule.pruned(model, range(lo, hi), embedding=stage_index == 0,
                                       head=stage_index == num_stages - 1)
    stage.stage_index, stage.num_stages = stage_index, num_stages
    return stage


# ---------------------------------------------------------------------------- optimizer across stages

def _pipeline_optimizer(ddp, config: OptimizerConfig, pp_group, pp_size: int):
    """Our (ZeRO or not) optimizer whose global norm and fp16 skip also span the other stages."""
    from optimizer import build_optimizer
    return build_optimizer(ddp, config, norm_groups=[pp_group] if pp_size > 1 else [])


def _pipeline_fsdp_optimizer(stage_module: nn.Module, config: OptimizerConfig, pp_group, pp_size: int):
    """FSDPOptimizer whose global norm also sums over the pp group (every stage's shards)."""
    from optimizer.fsdp_optimizer import FSDPOptimizer
    return FSDPOptimizer(stage_module, config, norm_groups=[pp_group] if pp_size > 1 else [])


def _full(t: Any) -> Any:
    """A DTensor gathered to a plain tensor (collective over its mesh); anything else unchanged.
    torch logs a warning per tensor when a dp x tp DTensor (FSDP's _StridedShard over Shard) needs two
    all-gathers; at checkpoint time that is expected, so it is not printed for every tensor of every save."""
    import logging

    from torch.distributed.tensor import DTensor
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
    from torch.distributed.tensor import DTensor, distribute_tensor
    if isinstance(template, DTensor):
        return distribute_tensor(full.to(template.device, template.dtype), template.device_mesh,
                                 template.placements, src_data_rank=None)
    if torch.is_tensor(template) and torch.is_tensor(full):
        return full.to(template.device)
    return full


# ---------------------------------------------------------------------------- validation + mesh

def validate_pipeline_options(*, pp_size: int, n_microbatches: int, schedule: str, dp_engine: str = "ddp",
                              world_size: Optional[int] = None, overlap_optim_step: bool = False,
                              comm_hook: str = "allreduce", task_type: str = "pretrain") -> None:
    """Raise ValueError for a pipeline configuration that cannot run (all problems at once)."""
    problems = []
    if pp_size < 1:
        problems.append(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if schedule.lower() not in SCHEDULES:
        problems.append(f"pipeline_schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if n_microbatches < 1:
        problems.append(f"the number of micro-batches (gradient_accumulation_steps) must be >= 1, got {n_microbatches}")
    elif schedule.lower() == "1f1b" and n_microbatches < pp_size:
        problems.append(f"the 1F1B schedule needs at least as many micro-batches as stages: "
                        f"gradient_accumulation_steps={n_microbatches} < pipeline_parallel_size={pp_size} "
                        f"(raise gradient_accumulation_steps or use --pipeline_schedule=gpipe)")
    if world_size is not None and pp_size >= 1 and world_size % pp_size:
        problems.append(f"world size {world_size} is not a multiple of pipeline_parallel_size={pp_size} "
                        f"(the mesh is pp x dp)")
    if dp_engine not in ("ddp", "fsdp"):
        problems.append(f"unknown dp engine {dp_engine!r}: ddp or fsdp")
    if overlap_optim_step:
        problems.append("overlap_optim_step=true is not supported with pipeline parallelism (its per-bucket "
                        "collectives differ between stages, and clipping must see every stage's gradients)")
    if comm_hook not in ("allreduce", None, ""):
        problems.append(f"comm_hook={comm_hook}: only the default all-reduce is tested with pipeline parallelism")
    if task_type == "dpo":
        problems.append("DPO is not supported with pipeline parallelism (its loss needs whole-sequence "
                        "log-probs of two models on every stage); use --pipeline_parallel_size=1")
    if problems:
        raise ValueError("bad options for pipeline parallelism: " + "; ".join(problems))


def build_pp_dp_mesh(pp_size: int, device_type: str = "cpu", tp_size: int = 1):
    """The 2-D mesh ("pp", "dp") over the whole world: rank = pp_index * dp + dp_index, so the
    ranks of one stage are contiguous (the dp all-reduce stays inside a node when dp <= gpus/node);
    with tp_size > 1 the 3-D ("pp", "dp", "tp"), tensor ranks innermost (parallel/mesh.py's order)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.mesh import layout_problem
    world = dist.get_world_size()
    problem = layout_problem(world, pp=pp_size, tp=tp_size)
    if problem:
        raise ValueError(problem)
    if tp_size == 1:
        return init_device_mesh(device_type, (pp_size, world // pp_size), mesh_dim_names=("pp", "dp"))
    return init_device_mesh(device_type, (pp_size, world // (pp_size * tp_size), tp_size),
                            mesh_dim_names=("pp", "dp", "tp"))


# ---------------------------------------------------------------------------- engine

@dataclass
class PipelineStepOutput:
    loss_sum: float        # sum of per-token losses of this dp replica's micro-batches (same on its pp ranks)
    units: int             # target tokens of this dp replica's micro-batches
    global_units: float    # target tokens over all micro-batches and dp replicas (the normaliser)


class PipelineEngine:
    """This rank's stage (DDP-wrapped over the dp group), its schedule and its optimizer."""

    def __init__(self, stage_module: PipelineStageModule, ddp, optimizer, schedule, stage, *, mesh,
                 schedule_name: str, n_microbatches: int, layer_ranges: list[tuple[int, int]],
                 n_layers: int, dp_engine: str = "ddp"):
        self.dp_engine = dp_engine
        self.module, self.model, self.optimizer = stage_module, ddp, optimizer
        self.schedule, self.stage, self.mesh = schedule, stage, mesh
        self.schedule_name, self.n_microbatches = schedule_name, n_microbatches
        self.layer_ranges, self.n_layers = layer_ranges, n_layers
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.pp_size, self.dp_size = mesh.size(0), mesh.size(1)
        self.tp_size = mesh.size(2) if mesh.ndim == 3 else 1
        self.tp_rank = mesh.get_local_rank("tp") if mesh.ndim == 3 else 0
        self.stage_index = dist.get_rank(self.pp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        self.is_first, self.is_last = stage_module.is_first, stage_module.is_last
        self._loss_mult = 1.0
        self._mb_shape: Optional[tuple] = None

    # ------------------------------------------------------------------ per step
    def _loss_fn(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        # output: this micro-batch's loss sum ([1]); the backward sees sum * dp / global_units (our DDP
        # averages over dp, so gradients are those of (all replicas' loss sums) / global_units), with
        # the fp16 loss scale on top.
        return self.optimizer.scale_loss(output.sum() * self._loss_mult)

    def forward_backward(self, micro_batches: Sequence[dict], global_units: Optional[float] = None,
                         poison: bool = False) -> PipelineStepOutput:
        """Run the schedule over this dp replica's micro-batches (every rank of a pp group passes the
        same ones; the first stage reads input_ids, the last labels, all of them attention_mask /
        position_ids). Gradients accumulate (DDP no_sync) and are reduced over dp in optimizer.step().
        `global_units`: target tokens over all micro-batches and dp replicas; computed here (one
        all-reduce over dp) when None. poison (a test hook): the step's loss and gradients become NaN.
        Collective over the whole mesh."""
        mbs = list(micro_batches)
        if len(mbs) != self.n_microbatches:
            raise ValueError(f"the pipeline schedule was built for {self.n_microbatches} micro-batches "
                             f"(gradient_accumulation_steps), got {len(mbs)}")
        self._check_shapes(mbs)
        units = int(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in mbs))
        if global_units is None:
            t = torch.tensor([float(units)], dtype=torch.float64, device=self.stage.device)  # nccl: on the device
            if self.dp_size > 1:
                dist.all_reduce(t, group=self.dp_group)
            global_units = float(t.item())
        global_units = max(1.0, float(global_units))
        self._loss_mult = self.dp_size / global_units * (float("nan") if poison else 1.0)

        args, target, kwargs = self._inputs(mbs)
        self.module.train()
        # one dp reduction per step: our DDP's in optimizer.step(); FSDP's reduce-scatter is run by the
        # schedule after the last backward (PipelineStage turns FSDP's per-backward sync off itself)
        sync_ctx = self.model.no_sync() if self.dp_engine == "ddp" else contextlib.nullcontext()
        with sync_ctx:
            out = self.schedule.step(*args, target=target, **kwargs)
        loss_sum = self._broadcast_loss(out)
        return PipelineStepOutput(loss_sum * float("nan") if poison else loss_sum, units, global_units)

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches: Sequence[dict]) -> tuple[float, int]:
        """(sum of per-token losses, target tokens) of this dp replica's batches, forward only
        (validation). len(micro_batches) must be a multiple of n_microbatches, each batch of the
        training shape. Switching the schedule between eval and train re-runs its shape inference
        (one extra forward; no effect on the numbers)."""
        mbs = list(micro_batches)
        if not mbs or len(mbs) % self.n_microbatches:
            raise ValueError(f"eval needs a multiple of {self.n_microbatches} micro-batches, got {len(mbs)}")
        self._check_shapes(mbs)
        self.module.eval()
        total, units = 0.0, 0
        try:
            for i in range(0, len(mbs), self.n_microbatches):
                group = mbs[i:i + self.n_microbatches]
                units += int(sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in group))
                args, target, kwargs = self._inputs(group)
                out = self.schedule.eval(*args, target=target, **kwargs)
                total += self._broadcast_loss(out)
        finally:
            self.module.train()
            if self.dp_engine == "fsdp":  # forward-only: free the gathered parameters (no backward will)
                from parallel.fsdp import reshard
                reshard(self.module)
        return total, units

    # ------------------------------------------------------------------ helpers
    def _check_shapes(self, mbs: list) -> None:
        for mb in mbs:
            if "input_ids" not in mb or "labels" not in mb:
                raise ValueError("pipeline micro-batches need input_ids and labels (DPO batches are not supported; "
                                 f"got keys {sorted(mb)})")
        shapes = {tuple(mb["input_ids"].shape) for mb in mbs}
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
        return args, (cat["labels"] if self.is_last else None), kwargs

    def _broadcast_loss(self, out: Optional[torch.Tensor]) -> float:
        """The last stage's merged per-micro-batch loss sums, summed, on every stage of the pp group."""
        loss = torch.zeros(1, dtype=torch.float64, device=self.stage.device)
        if self.is_last:
            loss[0] = float(out.detach().double().sum())
        if self.pp_size > 1:
            dist.broadcast(loss, src=dist.get_global_rank(self.pp_group, self.pp_size - 1), group=self.pp_group)
        return float(loss.item())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """{"model": this stage's weights (full-model key names), "optimizer": its optimizer state}.
        Under FSDP both are gathered to full tensors (collective over dp), so the files have one
        layout whatever the dp engine's sharding."""
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

    def _meta(self) -> dict:
        return {"format": FORMAT, "pp_size": self.pp_size, "dp_size": self.dp_size, "tp_size": self.tp_size,
                "n_layers": self.n_layers,
                "layer_ranges": [list(r) for r in self.layer_ranges], "schedule": self.schedule_name,
                "n_microbatches": self.n_microbatches,
                "dp_engine": self.dp_engine, "sharded_optimizer": self._sharded_files()}

    def _sharded_files(self) -> bool:
        """One optimizer file per dp rank (ZeRO's flat shards); FSDP state is gathered to one file."""
        return self.dp_engine == "ddp" and bool(getattr(self.optimizer, "sharded", False))

    def write_stage_files(self, dir_path: str) -> None:
        """Collective over the mesh: this stage's files into the existing directory `dir_path` (dp rank 0
        writes the stage's weights `stage{s}_model.safetensors` and, unless ZeRO shards it,
        `stage{s}_optimizer_dp0.pt`; ZeRO: every dp rank its own), fsynced; global rank 0 also writes
        `pipeline.json`. Returns after every rank has written (a barrier). Publishing the directory
        (COMPLETE, rename) is the caller's: `save` below, or the trainer's step_N checkpoints."""
        from safetensors.torch import save_file
        from utils.checkpoint import write_json
        from utils.publish import fsync_file
        sd = self.state_dict()
        s = self.stage_index
        first = self.dp_rank == 0 and self.tp_rank == 0  # one writer per stage (the tensors are gathered)
        if first:
            path = os.path.join(dir_path, f"stage{s}_model.safetensors")
            save_file({k: v.to("cpu").contiguous().clone() for k, v in sd["model"].items()}, path,
                      metadata={"format": "pt", "stage": str(s)})
            fsync_file(path)
        if first or self._sharded_files():
            path = os.path.join(dir_path, f"stage{s}_optimizer_dp{self.dp_rank}.pt")
            torch.save(sd["optimizer"], path)
            fsync_file(path)
        if dist.get_rank() == 0:
            write_json(os.path.join(dir_path, META_FILE), self._meta())
        dist.barrier()

    def save(self, ckpt_dir: str) -> str:
        """Collective over the mesh. Writes `ckpt_dir` atomically (utils/publish.py): `<ckpt_dir>.tmp`
        filled by every stage (`write_stage_files`), then `COMPLETE` and the publish by global rank 0
        (fsync, an older `ckpt_dir` set aside until the rename is done). A shared filesystem is assumed."""
        from utils.publish import make_temp_dir, publish_dir, temp_dir_for
        tmp = temp_dir_for(ckpt_dir)
        rank = dist.get_rank()
        if rank == 0:
            make_temp_dir(ckpt_dir)  # a crash's leftover is dropped, the directory made fresh
        dist.barrier()
        self.write_stage_files(tmp)
        if rank == 0:
            open(os.path.join(tmp, "COMPLETE"), "w").close()
            publish_dir(tmp, ckpt_dir, replace=True)
        dist.barrier()
        return ckpt_dir

    def load(self, ckpt_dir: str) -> None:
        """This stage's weights and optimizer state from a checkpoint of the same pipeline split (pp size,
        layer ranges) and dp engine, at any dp size (ZeRO shards are re-sharded)."""
        from safetensors.torch import load_file
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
            return torch.load(os.path.join(ckpt_dir, f"stage{s}_optimizer_dp{r}.pt"), map_location="cpu",
                              weights_only=True)
        if not sharded:  # one file per stage whatever the dp size (FSDP's state is gathered to it)
            opt = opt_file(0)
        elif int(meta["dp_size"]) == self.dp_size:
            opt = opt_file(self.dp_rank)
        else:  # ZeRO shards of another dp size: every saved shard, re-sharded by the optimizer
            opt = [opt_file(r) for r in range(int(meta["dp_size"]))]
        self.load_state_dict({"model": load_file(os.path.join(ckpt_dir, f"stage{s}_model.safetensors")),
                              "optimizer": opt})


def read_pipeline_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, META_FILE)
    if not os.path.isfile(os.path.join(ckpt_dir, "COMPLETE")) or not os.path.isfile(path):
        raise ValueError(f"{ckpt_dir} is not a complete pipeline checkpoint (no COMPLETE / {META_FILE})")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown pipeline checkpoint format {meta.get('format')}")
    return meta


def merge_stage_state_dicts(stage_states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The stages' state dicts (keys are already the full model's) as one dict; a key held by two
    stages is an error (it would mean a weight shared across stages)."""
    full: dict[str, torch.Tensor] = {}
    for s, sd in enumerate(stage_states):
        for k, v in sd.items():
            if k in full:
                raise ValueError(f"tensor {k} is held by two pipeline stages (stage {s} and an earlier one)")
            full[k] = v
    return full


def merge_stage_checkpoints(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """One process, no process group: the full model state dict of a pipeline checkpoint, with the
    Transformer's key names (load it with Transformer.load_state_dict, or export it to HF)."""
    from safetensors.torch import load_file
    meta = read_pipeline_meta(ckpt_dir)
    full = merge_stage_state_dicts([load_file(os.path.join(ckpt_dir, f"stage{s}_model.safetensors"))
                                    for s in range(meta["pp_size"])])
    layers = {int(k.split(".")[1]) for k in full if k.startswith("layers.")}
    if layers != set(range(meta["n_layers"])):
        raise ValueError(f"{ckpt_dir}: the stages hold layers {sorted(layers)}, expected 0..{meta['n_layers'] - 1}")
    return full


# ---------------------------------------------------------------------------- build

def build_pipeline_engine(model: Transformer, config: OptimizerConfig, *, pp_size: int, n_microbatches: int,
                          schedule: str = "1f1b", mesh=None, dp_engine: str = "ddp",
                          allow_uneven_split: bool = False, ddp_config=None,
                          device: Optional[torch.device] = None, param_dtype: torch.dtype = torch.float32,
                          reshard_after_forward: bool = True, cpu_offload: bool = False,
                          tp_size: int = 1) -> PipelineEngine:
    """This rank's pipeline engine. Collective over the world (mesh + broadcast of dp rank 0's weights).

    model: the full Transformer, built identically on every rank (same seed) or loaded; only this
      rank's stage is kept (the other layers can be freed by the caller: nothing references them).
    mesh: a 2-D DeviceMesh with dims ("pp", "dp") (3-D ("pp", "dp", "tp") with tp_size > 1), or None to build it.
    n_microbatches: the trainer's gradient_accumulation_steps (one micro-batch per accumulation step).
    schedule: "gpipe" (all forwards, then all backwards) or "1f1b" (less activation memory; needs
      n_microbatches >= pp_size).
    dp_engine: "ddp" (our DDP per stage over the dp group; ZeRO-1/2 with config.use_distributed_optimizer;
      ddp_config for buckets) or "fsdp" (fully_shard per block + the stage over the dp sub-mesh;
      param_dtype / reshard_after_forward / cpu_offload as in parallel/fsdp.py).
    tp_size: tensor-parallel ranks per stage (parallel/tensor_parallel.py; needs dp_engine="fsdp"): the
      world is pp x dp x tp, tp innermost (parallel/mesh.py's order).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from parallel import DDPConfig, DistributedDataParallel
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("pipeline parallelism needs an initialised process group")
    validate_pipeline_options(pp_size=pp_size, n_microbatches=n_microbatches, schedule=schedule,
                              dp_engine=dp_engine, world_size=dist.get_world_size(),
                              overlap_optim_step=config.overlap_optim_step)
    if device is None:
        device = next(model.parameters()).device
    device = torch.device(device)
    if tp_size > 1 and dp_engine != "fsdp":
        raise ValueError("tensor parallelism under pipeline stages runs on FSDP2 per stage: dp_engine='fsdp'")
    if mesh is None:
        mesh = build_pp_dp_mesh(pp_size, device.type, tp_size)
    names = ("pp", "dp") if tp_size == 1 else ("pp", "dp", "tp")
    if tuple(mesh.mesh_dim_names or ()) != names or mesh.size(0) != pp_size or (tp_size > 1 and mesh.size(2) != tp_size):
        raise ValueError(f"expected a DeviceMesh with dims {names}, pp={pp_size}, tp={tp_size}, got {mesh}")
    ranges = split_layers(model.cfg.n_layers, pp_size, allow_uneven_split)
    pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
    stage_index = dist.get_rank(pp_group)
    stage_module = pipeline_stage_module(model, stage_index, pp_size, allow_uneven_split)
    stage_module.to(device)  # only this stage: the full model may be built (or loaded) on the CPU
    if dp_engine == "fsdp":
        from parallel.fsdp import validate_fsdp_options
        validate_fsdp_options(use_distributed_optimizer=config.use_distributed_optimizer,
                              overlap_param_gather=config.overlap_param_gather, zero_stage=config.zero_stage)
        from parallel.fsdp import broadcast_from_first, wrap_fsdp
        if tp_size > 1:  # dp rank 0's (tp rank 0's) weights everywhere, then the stage split over the tensor ranks
            from parallel.tensor_parallel import apply_tensor_parallel
            broadcast_from_first(list(stage_module.parameters()) + list(stage_module.buffers()), mesh["dp", "tp"])
            apply_tensor_parallel(stage_module, mesh["tp"])
        # torch's PipelineStage recognises the FSDPModule: no gradient sync per micro-batch, one
        # reduce-scatter after the last backward
        ddp = wrap_fsdp(stage_module, mesh_or_group=mesh["dp"], param_dtype=param_dtype,
                        reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
                        sync_module_states=tp_size == 1, gloo_collectives=False)
        opt = _pipeline_fsdp_optimizer(stage_module, config, pp_group, pp_size)
    else:
        dcfg = ddp_config or DDPConfig(use_distributed_optimizer=config.use_distributed_optimizer)
        if dcfg.use_distributed_optimizer != config.use_distributed_optimizer:
            raise ValueError("DDPConfig.use_distributed_optimizer must equal OptimizerConfig.use_distributed_optimizer")
        ddp = DistributedDataParallel(stage_module, dcfg, process_group=dp_group)
        ddp.broadcast_params()  # the dp replicas of a stage start from dp rank 0's weights
        opt = _pipeline_optimizer(ddp, config, pp_group, pp_size)
    name = schedule.lower()
    engine_box: list[PipelineEngine] = []

    def loss_fn(output, target):
        return engine_box[0]._loss_fn(output, target)

    stage = PipelineStage(ddp, stage_index, pp_size, device, group=pp_group)
    sched_cls = ScheduleGPipe if name == "gpipe" else Schedule1F1B
    # scale_grads=False: the loss is already normalised by the global token count
    sched = sched_cls(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    engine = PipelineEngine(stage_module, ddp, opt, sched, stage, mesh=mesh, schedule_name=name,
                            n_microbatches=n_microbatches, layer_ranges=ranges, n_layers=model.cfg.n_layers,
                            dp_engine=dp_engine)
    engine_box.append(engine)
    return engine
