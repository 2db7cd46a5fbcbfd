"""FSDP2 engine: parameters, gradients and optimizer state sharded across ranks (ZeRO-3).

Owns: wrapping the Transformer with `torch.distributed.fsdp.fully_shard` (one unit per block, the
root unit holding embedding, final norm, LM head and so a tied embedding/head weight), the
mixed-precision and CPU-offload policies, a thin model wrapper with the interface the trainer
already uses for our DDP (`no_sync()`, comm-hook state), what the wrapped model records for its
optimizer (optimizer/fsdp_optimizer.py's FSDPOptimizer: the mesh and the wrap options; tensor parallelism records
its partial gradients itself), `shard_on_mesh` (a whole model laid out on the run's mesh in one call: DPO's frozen
reference), and `build_fsdp_engine`, which pairs the wrapped model with that optimizer (library callers; the
trainer's engine is built by parallel/build.py).

Must never: change the model's dtype (the sharded parameters stay fp32: they ARE the optimizer's
masters; bf16/fp16 exist only as FSDP's compute copies), or accept options that only our DDP
implements (comm hooks, ZeRO flags, overlap_optim_step) silently.
Sharded checkpoints of it are checkpoint/dcp.py's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from model.llama import blocks_of
from optimizer.fsdp_optimizer import MESH_ATTR, WRAP_CONFIG_ATTR, FSDPOptimizer, raise_fsdp_problems
from optimizer.optimizer_config import OptimizerConfig
from parallel.config import ParallelConfig
from parallel.mesh import MESH_DIMS, dp_mesh
from parallel.transforms.expert_parallel import GRAD_DIVIDE_ATTR, SHARD_MESH_ATTR
from parallel.transforms.tensor_parallel import apply_tensor_parallel

_GROUP_ATTR = "_fsdp_engine_state_group"  # set on the wrapped root: every rank holding a part of its state


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
    FSDP: the trainer's refusals (parallel/config.py, from FSDP's declared capabilities) for a library
    caller. `comm_hook="allreduce"` is the trainer's default and means "the engine's own reduction"."""
    section = ParallelConfig(parallel="fsdp", comm_hook=comm_hook or "allreduce", zero_stage=zero_stage,
                             use_distributed_optimizer=use_distributed_optimizer,
                             overlap_optim_step=overlap_optim_step, overlap_param_gather=overlap_param_gather)
    problems = section.problems()
    if grad_reduce_in_fp32:
        problems.append("--grad_reduce_in_fp32 is a ddp option; FSDP always reduces gradients in fp32")
    raise_fsdp_problems(problems)


def _resolve_mesh(mesh_or_group: Union[DeviceMesh, dist.ProcessGroup, None], device_type: str) -> DeviceMesh:
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim not in (1, 2):
            raise ValueError("wrap_fsdp shards over a 1-D data-parallel mesh, or a 2-D (replicate, shard) one for "
                             "HSDP (parallel/mesh.py's dp_mesh)")
        return mesh_or_group
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("FSDP needs an initialised process group, also at world size 1 (e.g. "
                         "dist.init_process_group(backend, rank=0, world_size=1))")
    if mesh_or_group is None:  # the world as data-parallel shards: its own group, no new one
        return DeviceMesh.from_group(dist.group.WORLD, device_type)
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
    DTensors, parallel/transforms/tensor_parallel.py, gain the data-parallel dimension).

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
    # modules a transform laid out on a mesh of their own (expert parallel's experts: FSDP over "efsdp"), first,
    # so that their blocks leave them out; their gradients divided by the factor the transform gives
    own = [m for m in model.modules() if getattr(m, SHARD_MESH_ATTR, None) is not None]
    for unit in own:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **{**kw, "mesh": getattr(unit, SHARD_MESH_ATTR)})
        unit.set_gradient_divide_factor(getattr(unit, GRAD_DIVIDE_ATTR))
        shard_mesh = getattr(unit, SHARD_MESH_ATTR)
        if shard_mesh.size(shard_mesh.ndim - 1) > 1 and dist.get_backend(shard_mesh.get_group(0)) == "gloo":
            # gloo has no PREMUL_SUM: sum, then divide (a 1-rank shard dimension divides in FSDP's copy already)
            unit.set_force_sum_reduction_for_comms(True)
        if gloo_collectives:
            _use_gloo_collectives([unit], getattr(unit, SHARD_MESH_ATTR))
    blocks = blocks + list(getattr(getattr(model, "mtp", None), "depths", []))  # multi-token prediction's depths
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
    setattr(model, WRAP_CONFIG_ATTR, {"param_dtype": param_dtype, "reduce_dtype": reduce_dtype,
                                  "reshard_after_forward": reshard_after_forward, "cpu_offload": cpu_offload})
    setattr(model, MESH_ATTR, mesh)
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
    parallel/engine_fsdp.py's FSDPEngine holds (gradient accumulation: `no_sync(model)`)."""
    validate_fsdp_options(comm_hook=comm_hook, use_distributed_optimizer=config.use_distributed_optimizer,
                          overlap_optim_step=config.overlap_optim_step,
                          overlap_param_gather=config.overlap_param_gather, zero_stage=config.zero_stage,
                          grad_reduce_in_fp32=grad_reduce_in_fp32)
    if param_dtype == torch.float16 and config.precision != "fp16":
        raise ValueError("param_dtype=float16 needs precision='fp16' (loss scaling)")
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
    (parallel/transforms/tensor_parallel.py), then FSDP2 over the data-parallel dims (HSDP when there are replicas).
    A checkpoint of the result is collective over the world."""
    if mesh["pp"].size() != 1:
        raise ValueError("shard_on_mesh lays out one model without pipeline stages (mesh['pp'] must be 1)")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("the model is already sharded")
    if mesh.size() > 1:
        broadcast_from_first(list(model.parameters()) + list(model.buffers()), mesh)
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=sequence_parallel)
    elif sequence_parallel:
        raise ValueError("sequence parallelism needs tensor parallelism (mesh['tp'] > 1)")
    return wrap_fsdp(model, mesh_or_group=dp_mesh(mesh), param_dtype=param_dtype,
                     reshard_after_forward=reshard_after_forward, cpu_offload=cpu_offload,
                     sync_module_states=False, state_group=dist.group.WORLD)
