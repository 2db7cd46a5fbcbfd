"""FSDP2 engine: parameters, gradients and optimizer state sharded across ranks (ZeRO-3).

Owns: wrapping the Transformer with `torch.distributed.fsdp.fully_shard` (one unit per block, the
root unit holding embedding, final norm, LM head and so a tied embedding/head weight), the
mixed-precision and CPU-offload policies, a thin model wrapper with the interface the trainer
already uses for our DDP (`no_sync()`, comm-hook state), and `FSDPOptimizer`, which has the
`MixedPrecisionOptimizer` API (zero_grad, scale_loss, set_lr, step -> (stepped, grad_norm),
finish_param_sync, loss_scale, state_dict/load_state_dict) over torch AdamW on the sharded
DTensor parameters.

Must never: change the model's dtype (the sharded parameters stay fp32: they ARE the masters;
bf16/fp16 exist only as FSDP's compute copies), clip with a norm that is not global over all
shards of all ranks (trap 8), decide "skip this step" differently on different ranks, or accept
options that only our DDP implements (comm hooks, ZeRO flags, overlap_optim_step) silently.
Sharded checkpoints live in parallel/dcp_checkpoint.py.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from model.llama import blocks_of
from optimizer.grad_scaler import ConstantScaler, DynamicGradScaler
from optimizer.optimizer_config import OptimizerConfig

STATE_FORMAT = 1
_CONFIG_ATTR = "_fsdp_engine_config"  # set on the wrapped root: what wrap_fsdp was asked for
_MESH_ATTR = "_fsdp_engine_mesh"  # set on the wrapped root: the mesh its parameters are sharded over
_GROUP_ATTR = "_fsdp_engine_state_group"  # set on the wrapped root: every rank holding a part of its state
_TP_PARTIAL_ATTR = "_tp_partial_grads"  # set by shard_on_mesh: (parameter names, tensor group) to all-reduce


# ---------------------------------------------------------------------------- gloo collectives
try:  # FSDP2's pluggable collectives (torch >= 2.8)
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather as _AllGatherAPI
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatterAPI
except ImportError:  # pragma: no cover - older torch: FSDP's own gloo collectives are used
    _AllGatherAPI = _ReduceScatterAPI = object


class _AllocMixin:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class GlooAllReduceAllGather(_AllocMixin, _AllGatherAPI):
    """FSDP's all-gather as one all-reduce, for gloo only.

    gloo's all_gather_into_tensor measured ~2x slower than its all_reduce of the same total bytes
    (128 MB fp32, 2 processes: 0.38 s vs 0.14-0.20 s; docs/parallel.md). FSDP copies this rank's
    shard into its slot of the output buffer before the collective, so zeroing the other slots and
    summing gives every rank the gathered tensor exactly (x + 0 == x)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        slots = output_tensor.view(world, -1)
        if input_tensor.data_ptr() != slots[rank].data_ptr():  # FSDP normally copies in place already
            slots[rank].copy_(input_tensor.reshape(-1))
        for r in range(world):
            if r != rank:
                slots[r].zero_()
        return dist.all_reduce(output_tensor, group=group, async_op=async_op)


class GlooAllReduceReduceScatter(_AllocMixin, _ReduceScatterAPI):
    """FSDP's reduce-scatter as an all-reduce followed by keeping this rank's slot, for gloo only
    (gloo's reduce_scatter_tensor measured 0.47 s against 0.14-0.20 s for all_reduce, same bytes).
    The sum is the same sum; every rank keeps its own shard of it."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any = dist.ReduceOp.SUM, async_op: bool = False):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        dist.all_reduce(input_tensor, op=op, group=group)
        output_tensor.copy_(input_tensor.view(world, -1)[rank].view_as(output_tensor))
        return None


def _use_gloo_collectives(units: list, mesh: DeviceMesh) -> bool:
    """Route FSDP's collectives through all-reduce on a gloo mesh (see the classes above)."""
    if _AllGatherAPI is object or mesh.ndim != 1 or mesh.size() < 2 or dist.get_backend(mesh.get_group()) != "gloo":
        return False
    for unit in units:
        unit.set_custom_all_gather(GlooAllReduceAllGather())
        unit.set_custom_reduce_scatter(GlooAllReduceReduceScatter())
    return True


# ---------------------------------------------------------------------------- validation

def validate_fsdp_options(*, comm_hook: str = "allreduce", use_distributed_optimizer: bool = False,
                          overlap_optim_step: bool = False, overlap_param_gather: bool = False,
                          grad_reduce_in_fp32: bool = False, zero_stage: int = 1) -> None:
    """Raise ValueError for options of our DDP engine that have no meaning (or a different one) under
    FSDP. `comm_hook="allreduce"` is the trainer's default and means "the engine's own reduction"."""
    problems = []
    if comm_hook not in ("allreduce", None, ""):
        problems.append(f"--comm_hook={comm_hook}: FSDP reduce-scatters gradients itself (in fp32); comm hooks "
                        "(powersgd, fp16/bf16 compression, reduce_scatter) exist only for --parallel=ddp")
    if use_distributed_optimizer:
        problems.append("--use_distributed_optimizer=true is ZeRO-1/2 of --parallel=ddp; FSDP already shards "
                        "parameters, gradients and optimizer state (drop the flag)")
    if zero_stage != 1:
        problems.append(f"--zero_stage={zero_stage} belongs to --parallel=ddp with ZeRO; FSDP's stage is chosen "
                        "by --reshard_after_forward (true: ZeRO-3, false: ZeRO-2-like)")
    if overlap_optim_step:
        problems.append("--overlap_optim_step=true is not supported with FSDP (its per-bucket step needs our DDP "
                        "buckets; FSDP overlaps communication with compute by itself)")
    if overlap_param_gather:
        problems.append("--overlap_param_gather=true belongs to ZeRO under --parallel=ddp; FSDP prefetches "
                        "parameter all-gathers itself")
    if grad_reduce_in_fp32:
        problems.append("--grad_reduce_in_fp32 is a ddp option; FSDP always reduces gradients in fp32")
    if problems:
        raise ValueError("bad options for --parallel=fsdp: " + "; ".join(problems))


def _resolve_mesh(mesh_or_group: Union[DeviceMesh, dist.ProcessGroup, None], device_type: str) -> DeviceMesh:
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim not in (1, 2):
            raise ValueError("wrap_fsdp shards over a 1-D data-parallel mesh, or a 2-D (replicate, shard) one for "
                             "HSDP (parallel/mesh.py's dp_mesh)")
        return mesh_or_group
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("FSDP needs an initialised process group, also at world size 1 (e.g. "
                         "dist.init_process_group(backend, rank=0, world_size=1))")
    if mesh_or_group is None:
        return init_device_mesh(device_type, (dist.get_world_size(),))
    return DeviceMesh.from_group(mesh_or_group, device_type)


# ---------------------------------------------------------------------------- wrapping

def wrap_fsdp(model: nn.Module, *, mesh_or_group: Union[DeviceMesh, dist.ProcessGroup, None] = None,
              param_dtype: torch.dtype, reduce_dtype: torch.dtype = torch.float32,
              reshard_after_forward: bool = True, cpu_offload: bool = False,
              sync_module_states: bool = True, state_group: Optional[dist.ProcessGroup] = None,
              gloo_collectives: bool = True) -> nn.Module:
    """fully_shard every block of `model.layers` (a ModuleList, or a pipeline stage's ModuleDict), then
    the root; returns `model` (same object, its class now also an FSDPModule). Parameters become fp32
    DTensors sharded on dim 0 over the mesh (2-D with tensor parallelism: already tensor-parallel
    DTensors, parallel/tensor_parallel.py, gain the data-parallel dimension).

    mesh_or_group: a 1-D data-parallel DeviceMesh or process group (None: the world), or a 2-D
      (replicate, shard) mesh: HSDP, sharded within a replica and all-reduced across replicas.
    state_group: every rank holding a part of the model's state, what a checkpoint is collective over
      (default: the mesh's group; tensor parallel runs pass the world).
    gloo_collectives: route FSDP's all-gather / reduce-scatter through all-reduce on gloo (faster
      there; see GlooAllReduceAllGather).

    param_dtype: compute dtype of the all-gathered parameters (torch.float32 / bfloat16 / float16).
    reduce_dtype: dtype of the gradient reduce-scatter (fp32 unless you know why not).
    reshard_after_forward: True frees each block's gathered parameters after its forward (ZeRO-3,
      gathered again in backward); False keeps them until backward (ZeRO-2-like: more memory, one
      all-gather per step instead of two). The root is not resharded after forward (its
      parameters, embedding and LM head, are the first needed by backward), except in a model
      without trainable parameters (a DPO reference model).
    cpu_offload: shards, gradients and hence the optimizer step live in CPU memory (CPUOffloadPolicy).
    sync_module_states: broadcast rank 0's parameters and buffers before sharding (like our DDP's
      broadcast_params), so the ranks need not have initialised identically.
    """
    if isinstance(model, FSDPModule):
        raise ValueError("model is already wrapped with fully_shard")
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        raise ValueError("wrap_fsdp expects a model with a `layers` ModuleList (or ModuleDict) of transformer blocks")
    blocks = blocks_of(layers)
    if param_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"param_dtype must be float32, bfloat16 or float16, got {param_dtype}")
    bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if bad:
        raise ValueError(f"FSDP keeps the sharded parameters in fp32 (they are the optimizer's masters); the model "
                         f"has {', '.join(bad)} parameters: build it in fp32 and choose the compute precision with "
                         f"param_dtype")
    devices = {p.device for p in model.parameters()}
    if len(devices) != 1:
        raise ValueError(f"model parameters are on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    mesh = _resolve_mesh(mesh_or_group, device.type)
    if sync_module_states and mesh.size() > 1:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            raise ValueError("sync_module_states broadcasts plain tensors: broadcast before applying tensor "
                             "parallelism and pass sync_module_states=False")
        broadcast_from_first(list(model.parameters()) + list(model.buffers()), mesh)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=device.type != "cpu") if cpu_offload else None
    kw: dict[str, Any] = dict(mesh=mesh, mp_policy=mp)
    if offload is not None:
        kw["offload_policy"] = offload
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, **kw)
    # The root unit holds everything outside the blocks: embedding, final norm, LM head; a tied
    # embedding/head weight is one Parameter there, so it is sharded and reduced exactly once.
    # A model with nothing to train (DPO's reference model) never runs a backward that would free
    # the root's gathered parameters, so its root reshards after forward like the blocks.
    frozen = not any(p.requires_grad for p in model.parameters())
    fully_shard(model, reshard_after_forward=frozen, **kw)
    if gloo_collectives:
        _use_gloo_collectives([*blocks, model], mesh)
    setattr(model, _CONFIG_ATTR, {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
                                  "reshard_after_forward": reshard_after_forward, "cpu_offload": cpu_offload})
    setattr(model, _MESH_ATTR, mesh)
    setattr(model, _GROUP_ATTR, state_group if state_group is not None else _mesh_process_group(mesh))
    return model


def _mesh_process_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of all ranks of `mesh` (1-D: its own; 2-D: the world's, which it spans in the
    trainer's layouts)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    return dist.group.WORLD


def broadcast_from_first(tensors: list, mesh: DeviceMesh) -> None:
    """Every rank of `mesh` gets the tensors of its first rank (coordinates 0, ..., 0): a broadcast
    along each dimension, the innermost first."""
    with torch.no_grad():
        for dim in reversed(range(mesh.ndim)):
            if mesh.size(dim) < 2:
                continue
            group = mesh.get_group(dim)
            src = dist.get_global_rank(group, 0)
            for t in tensors:
                dist.broadcast(t.data, src=src, group=group)


def fsdp_state_group(model: nn.Module) -> Optional[dist.ProcessGroup]:
    """The group a checkpoint of `model` is collective over, as recorded by wrap_fsdp (None if unwrapped)."""
    return getattr(model, _GROUP_ATTR, None)


def fsdp_mesh(model: nn.Module) -> Optional[DeviceMesh]:
    """The mesh `model` was sharded over, as recorded by wrap_fsdp (None for a model it did not wrap).

    Never inferred from the parameters: between a forward-only pass and the next backward, units
    built with reshard_after_forward=False hold plain (unsharded) tensors, not DTensors."""
    return getattr(model, _MESH_ATTR, None)


def reshard(model: nn.Module) -> int:
    """Free the gathered (unsharded) parameters of every FSDP unit in `model`; returns the number of
    units. Needed after a forward-only pass (evaluation): FSDP frees a unit's gathered parameters
    after its backward, or after its forward only when reshard_after_forward=True (and never for
    the root), so without this every rank keeps the whole model until the next backward."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.reshard()
    return len(units)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient accumulation: backward inside this context accumulates unsharded gradients locally,
    without the reduce-scatter; the first backward outside it reduces everything accumulated."""
    if not isinstance(model, FSDPModule):
        raise ValueError("no_sync(model) expects a model wrapped by wrap_fsdp")
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


# ---------------------------------------------------------------------------- optimizer

class FSDPOptimizer:
    """AdamW over the sharded fp32 DTensor parameters, with the MixedPrecisionOptimizer API.

    Only parameters with requires_grad are optimized (frozen LoRA bases are left out); weight decay
    applies to ndim >= 2 only; clipping uses the global norm over every shard of every rank; with
    precision='fp16' a DynamicGradScaler scales the loss and a non-finite global norm (the same
    all-reduced value on every rank) skips the step everywhere.
    """
    sharded = True

    def __init__(self, model: nn.Module, config: OptimizerConfig, norm_groups: Sequence = ()):
        validate_fsdp_options(use_distributed_optimizer=config.use_distributed_optimizer,
                              overlap_optim_step=config.overlap_optim_step,
                              overlap_param_gather=config.overlap_param_gather, zero_stage=config.zero_stage)
        if not isinstance(model, FSDPModule):
            raise ValueError("FSDPOptimizer needs a model wrapped by wrap_fsdp")
        self.model, self.config = model, config
        wcfg = getattr(model, _CONFIG_ATTR, {})
        if wcfg.get("param_dtype") == torch.float16 and config.precision != "fp16":
            raise ValueError("param_dtype=float16 needs precision='fp16' (loss scaling)")
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise ValueError("the model has no trainable parameters")
        for n, p in self.named_params:
            if not isinstance(p, DTensor):
                raise ValueError(f"parameter {n} is not sharded (a DTensor): wrap every module with wrap_fsdp")
            if p.dtype != torch.float32:
                raise ValueError(f"parameter {n} is {p.dtype}; FSDP masters must be fp32")
        self.params = [p for _, p in self.named_params]
        # sequence parallelism: the norms' gradients are partial sums over the tensor ranks
        names, self.tp_group = getattr(model, _TP_PARTIAL_ATTR, ((), None))
        self.tp_partial = [p for n, p in self.named_params if n in set(names)]
        self.mesh: DeviceMesh = fsdp_mesh(model) or self.params[0].device_mesh
        self.norm_groups = list(norm_groups)  # more groups the squared norm is summed over (pipeline stages)
        # the data-parallel shard dimension: what "world_size" in the optimizer state means
        self.world_size = self.mesh.size(self.mesh.ndim - 1)
        self.scaler = (DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                                         config.loss_scale_growth_interval, config.hysteresis)
                       if config.precision == "fp16" else ConstantScaler())
        self.lr = float(config.lr)
        self.prev_grad_norm: Optional[float] = None
        groups = [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": config.weight_decay},
                  {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        kw: dict[str, Any] = dict(lr=self.lr, betas=config.betas, eps=config.eps)
        self.adamw: torch.optim.AdamW
        if self.params[0].device.type == "cpu":  # CPU (or offloaded) shards: plain single-tensor loop
            self.adamw = torch.optim.AdamW(groups, foreach=False, fused=False, **kw)
        else:
            try:
                self.adamw = torch.optim.AdamW(groups, fused=bool(config.fused), foreach=not config.fused, **kw)
            except (RuntimeError, ValueError):
                self.adamw = torch.optim.AdamW(groups, foreach=True, **kw)
        # The all-reduce of the norm runs on the mesh's device (gloo: cpu; nccl: the rank's accelerator),
        # which is not where offloaded gradients live.
        self._comm_device = (torch.device("cpu") if self.mesh.device_type == "cpu" else
                             torch.device(self.mesh.device_type,
                                          torch.get_device_module(self.mesh.device_type).current_device()))

    # ------------------------------------------------------------------ per step API
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if isinstance(self.scaler, DynamicGradScaler) else loss

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.scale)

    def set_lr(self, lr: float) -> None:
        self.lr = float(lr)
        for g in self.adamw.param_groups:
            g["lr"] = self.lr

    def finish_param_sync(self) -> None:
        """No-op: FSDP gathers parameters in its own forward hooks."""

    def _sum_tp_partial_grads(self) -> None:
        """One all-reduce over the tensor group of the gradients that are partial sums there."""
        grads = [p.grad.to_local() for p in self.tp_partial if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.tp_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _local_grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.params if p.grad is not None]

    def global_grad_norm(self) -> float:
        """sqrt(sum of grad^2 over every element of every parameter, each counted once), identical on all
        ranks. A local shard's sum of squares is summed over the mesh dimensions its gradient is sharded
        on, never over those it is replicated on (HSDP replicas; norms under tensor parallelism): the
        parameters are grouped by (mesh, sharded dimensions), one all-reduce of a scalar per group and
        dimension (one in all for plain FSDP)."""
        buckets: dict[tuple, list] = {}
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad
            # sharded = not replicated (FSDP's _StridedShard on a 2-D mesh is not a Shard subclass)
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate() and g.device_mesh.size(i) > 1)
            buckets.setdefault((id(g.device_mesh), dims), [g.device_mesh, dims, []])[2].append(g.to_local())
        sumsq = torch.zeros((), dtype=torch.float32, device=self._comm_device)
        for mesh, dims, grads in buckets.values():
            part = torch.stack([n.float() ** 2 for n in torch._foreach_norm(grads, 2)]).sum().to(self._comm_device)
            for dim in dims:
                dist.all_reduce(part, group=mesh.get_group(dim))
            sumsq = sumsq + part
        for group in self.norm_groups:  # e.g. the pipeline group: the norm spans every stage
            dist.all_reduce(sumsq, group=group)
        return math.sqrt(float(sumsq.item()))

    @torch.no_grad()
    def step(self) -> tuple[bool, float]:
        """Unscale, skip on inf/nan (decided from the all-reduced norm, so every rank agrees), clip by
        the global norm, AdamW on the shards. Returns (stepped, grad_norm); (False, inf) when skipped."""
        self._sum_tp_partial_grads()
        grads = self._local_grads()
        if isinstance(self.scaler, DynamicGradScaler) and grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        norm = self.global_grad_norm()
        found_inf = not math.isfinite(norm)
        self.scaler.update(found_inf)
        if found_inf:
            self.zero_grad()
            return False, float("inf")
        if self.config.grad_clip > 0:
            coef = min(1.0, self.config.grad_clip / (norm + 1e-6))
            if coef < 1.0 and grads:
                torch._foreach_mul_(grads, coef)
        self.adamw.step()
        self.prev_grad_norm = norm
        self.zero_grad()
        return True, norm

    # ------------------------------------------------------------------ memory accounting
    def state_bytes(self) -> int:
        """Bytes of this rank's Adam moments (the local shards; `step` counters excluded)."""
        total = 0
        for st in self.adamw.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    loc = v.to_local() if isinstance(v, DTensor) else v
                    total += loc.numel() * loc.element_size()
        return total

    # ------------------------------------------------------------------ state
    def _sd_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict:
        """Sharded, DCP-ready: {"adamw": flat {"state.<fqn>.exp_avg": DTensor, ..., "param_groups.<fqn>.lr":
        float, ...}, "scaler": {...}, "lr", "prev_grad_norm", "format", "world_size"}. For a never-stepped
        optimizer the dict holds zero moments with step=1 (torch's get_optimizer_state_dict makes them
        with an lr=0 step), so a template built before loading has every tensor DCP must fill; the
        optimizer itself stays fresh (a save before the first step would resume with step=1)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        fresh = not self.adamw.state
        adamw = get_optimizer_state_dict(self.model, self.adamw, options=self._sd_options())
        if fresh:  # the zero moments (with step=1) were only made for the returned template: stay fresh
            self.adamw.state.clear()
        return {"format": STATE_FORMAT, "engine": "fsdp", "world_size": self.world_size, "lr": self.lr,
                "scaler": self.scaler.state_dict(),
                "prev_grad_norm": -1.0 if self.prev_grad_norm is None else float(self.prev_grad_norm),
                "adamw": adamw}

    def sharded_state_dict(self) -> dict:
        return self.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        """Load a dict shaped like state_dict() (its DTensors may come from any world size via DCP).
        Hyper-parameters other than lr (betas, eps, weight decay) stay those of this run's config."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        if sd.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown FSDP optimizer state format {sd.get('format')!r}")
        adamw = dict(sd["adamw"])
        current = {k: v for k, v in self.adamw.param_groups[0].items() if k != "params"}
        for k in list(adamw):
            if k.startswith("param_groups."):
                hp = k.rsplit(".", 1)[1]
                if hp in current and hp != "lr":
                    adamw[k] = self._group_of(k)[hp]
        set_optimizer_state_dict(self.model, self.adamw, adamw, options=self._sd_options())
        self.scaler.load_state_dict(sd["scaler"])
        self.set_lr(float(sd["lr"]))
        pg = float(sd["prev_grad_norm"])
        self.prev_grad_norm = None if pg < 0 else pg

    def _group_of(self, flat_key: str) -> dict:
        fqn = flat_key[len("param_groups."):].rsplit(".", 1)[0]
        p = dict(self.named_params).get(fqn)
        for g in self.adamw.param_groups:
            if any(q is p for q in g["params"]):
                return g
        return self.adamw.param_groups[0]


# ---------------------------------------------------------------------------- accounting + builder

def sharded_bytes(model: nn.Module, optimizer: Optional[FSDPOptimizer] = None) -> dict[str, int]:
    """This rank's bytes of parameter shards, gradient shards (present between backward and step) and
    Adam moments: the '16 B/param / world' accounting of docs/parallel.md (fp32 params + grads +
    exp_avg + exp_avg_sq). Frozen parameters count as params only."""
    out = {"params": 0, "grads": 0, "optimizer": 0}
    for p in model.parameters():
        loc = p.to_local() if isinstance(p, DTensor) else p
        out["params"] += loc.numel() * loc.element_size()
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            out["grads"] += g.numel() * g.element_size()
    if optimizer is not None:
        out["optimizer"] = optimizer.state_bytes()
    return out


def build_fsdp_engine(model: nn.Module, config: OptimizerConfig, *,
                      mesh_or_group: Union[DeviceMesh, dist.ProcessGroup, None] = None,
                      param_dtype: torch.dtype = torch.float32, reshard_after_forward: bool = True,
                      cpu_offload: bool = False, comm_hook: str = "allreduce",
                      grad_reduce_in_fp32: bool = False, sequence_parallel: bool = False) -> tuple[nn.Module, FSDPOptimizer]:
    """(the model, fully_shard-ed in place by wrap_fsdp, and its optimizer), validated together: what
    parallel/engine.py's FSDPEngine holds (gradient accumulation: `no_sync(model)`)."""
    validate_fsdp_options(comm_hook=comm_hook, use_distributed_optimizer=config.use_distributed_optimizer,
                          overlap_optim_step=config.overlap_optim_step,
                          overlap_param_gather=config.overlap_param_gather, zero_stage=config.zero_stage,
                          grad_reduce_in_fp32=grad_reduce_in_fp32)
    if param_dtype == torch.float16 and config.precision != "fp16":
        raise ValueError("param_dtype=float16 needs precision='fp16' (loss scaling)")
    from parallel.mesh import MESH_DIMS
    if isinstance(mesh_or_group, DeviceMesh) and tuple(mesh_or_group.mesh_dim_names or ()) == MESH_DIMS:
        wrapped = shard_on_mesh(model, mesh_or_group, param_dtype=param_dtype,
                                reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
                                sequence_parallel=sequence_parallel)
    else:
        wrapped = wrap_fsdp(model, mesh_or_group=mesh_or_group, param_dtype=param_dtype,
                            reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload)
    return wrapped, FSDPOptimizer(wrapped, config)


def shard_on_mesh(model: nn.Module, mesh: DeviceMesh, *, param_dtype: torch.dtype,
                  reshard_after_forward: bool = True, cpu_offload: bool = False,
                  sequence_parallel: bool = False) -> nn.Module:
    """The whole layout of parallel/mesh.py's mesh (pp = 1) on `model`, in place: the first rank's weights
    broadcast to every rank, tensor parallelism over mesh["tp"] when it has > 1 rank
    (parallel/tensor_parallel.py), then FSDP2 over the data-parallel dims (HSDP when there are replicas).
    A checkpoint of the result is collective over the world."""
    from parallel.mesh import dp_mesh
    from parallel.tensor_parallel import apply_tensor_parallel
    if mesh["pp"].size() != 1:
        raise ValueError("shard_on_mesh lays out one model without pipeline stages (mesh['pp'] must be 1)")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("the model is already sharded")
    if mesh.size() > 1:
        broadcast_from_first(list(model.parameters()) + list(model.buffers()), mesh)
    partial: list[str] = []
    if mesh["tp"].size() > 1:
        partial = apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
    elif sequence_parallel:
        raise ValueError("sequence parallelism needs tensor parallelism (mesh['tp'] > 1)")
    wrapped = wrap_fsdp(model, mesh_or_group=dp_mesh(mesh), param_dtype=param_dtype,
                        reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
                        sync_module_states=False, state_group=dist.group.WORLD)
    setattr(wrapped, _TP_PARTIAL_ATTR, (tuple(partial), mesh["tp"].get_group()))
    return wrapped
