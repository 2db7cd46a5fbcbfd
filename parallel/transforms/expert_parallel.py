"""Expert parallelism (--expert_parallel_size > 1): the routed experts of every MoE block sharded over mesh["ep"],
tokens sent to the ranks that hold their experts and back by all-to-all (torchtitan's expert_parallel shape).

    apply(model, mesh, config)     # after the first rank's weights are broadcast, before the data-parallel wrap

What it does to each MoE layer (model/moe.py MoEFeedForward):
  weights  experts.gate_up_proj [E, 2I, D] and experts.down_proj [E, D, I]: this rank keeps experts
           [r E/ep, (r+1) E/ep) of mesh["ep"].
           --parallel=fsdp: DTensors Shard(0) on mesh["ep"]; FSDP2 then shards them again over mesh["efsdp"] (the
           dp ranks that hold the same experts, parallel/fsdp.py), and torch DCP reshards them at load, so a
           checkpoint resumes at any ep.
           --parallel=ddp: plain parameters [E/ep, ...] (the same names), each marked with its place in the full
           tensor (SHARD_OF_ATTR: our DDP keeps them in buffers of their own, reduced over mesh["efsdp"]; the
           optimizer's state and parallel/expert_state.py's checkpoints name the full tensor's elements, so a
           checkpoint loads at any ep).
  forward  a pre-hook on `experts` takes the dispatch's rows (sorted by expert) and counts [E], exchanges the
           counts (all-to-all), sends each rank the rows of its experts (differentiable all-to-all), reorders the
           received rows from (source rank, expert) to (expert, source rank) so that the local experts see their
           rows contiguous, and hands them their counts [E/ep]; a forward hook undoes the reorder and sends the
           outputs back by the reverse all-to-all, so `combine` gets its rows in dispatch order as without EP.
  gradient the all-to-all's backward brings each expert the gradients of its rows from every ep rank (a sum
           over those ranks' tokens); FSDP2's reduction over "efsdp" adds the other groups' sums, and its divide
           factor is the whole data-parallel size (`GRAD_DIVIDE_ATTR`, read by parallel/fsdp.py), the factor the
           engine's loss scale assumes for every weight (parallel/engine.py: loss x dp / global units).

Routing, the balancing losses and the loads stay per rank on its own tokens (each rank routes over all E experts).
The counts are read to the host for the all-to-all's split sizes (one sync per MoE layer and forward, as in
torchtitan).

Must never: change a parameter's name (checkpoints and the HF export key on them), or run without a mesh.
Under our DDP the ranks must hold the same full weights before the split: rank 0's are broadcast here.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from model.lora_experts import adapter_names
from model.moe import moe_layers
from parallel.distributed_data_parallel import SHARD_OF_ATTR

# set on a module by a transform, read by parallel/fsdp.py's wrap: fully_shard it on its own mesh first, dividing
# its reduced gradients by this factor
SHARD_MESH_ATTR = "fsdp_own_mesh"
GRAD_DIVIDE_ATTR = "fsdp_grad_divide_factor"


def apply(model: nn.Module, mesh: Any, config: Any) -> None:
    ep = int(getattr(config, "expert_parallel_size", 1))
    if ep == 1:
        return
    if mesh is None:
        raise ValueError(f"--expert_parallel_size={ep} runs on the device mesh (parallel/build.py builds it)")
    layers = moe_layers(model)
    if not layers:
        raise ValueError(f"--expert_parallel_size={ep} needs an MoE model (--moe_num_experts > 0)")
    from parallel.mesh import dp_mesh, expert_dp_mesh
    ep_mesh = mesh["ep"]
    # the gradients' divisor: every rank the engine's loss scale averages over (data parallel x context parallel)
    dp_size = mesh["dp_replicate"].size() * mesh["dp_shard"].size() * mesh["cp"].size()
    for layer in layers:
        if layer.num_experts % ep:
            raise ValueError(f"--moe_num_experts={layer.num_experts} is not divisible by --expert_parallel_size={ep}")
        if getattr(config, "parallel", "fsdp") == "ddp":
            # rank 0 of the data-parallel group (the world, or this pipeline stage's dp (x cp) ranks) broadcasts
            shard_experts_local(layer.experts, ep_mesh, dp_mesh(mesh).get_group())
            continue
        shard_experts(layer.experts, ep_mesh)
        # FSDP of the experts over the dp (x cp) ranks that hold the same ones (HSDP: across the replicas too)
        setattr(layer.experts, SHARD_MESH_ATTR, expert_dp_mesh(mesh))
        setattr(layer.experts, GRAD_DIVIDE_ATTR, float(dp_size))


def shard_experts(experts: nn.Module, ep_mesh: Any) -> None:
    """The stacked expert weights as DTensors Shard(0) on `ep_mesh` (this rank's E/ep experts, no communication:
    every rank holds the same full weights here), and the all-to-all hooks around the module's forward."""
    from torch.distributed.tensor import DTensor, Shard
    rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    for name in _expert_tensors(experts):
        full = getattr(experts, name)
        local = full.detach().chunk(ep, dim=0)[rank].clone()
        setattr(experts, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False),
                                            requires_grad=full.requires_grad))
    experts.weights_on_ep_mesh = True  # (model/moe.py GroupedExperts: its forward takes the local shards)
    _exchange_around(experts, ep_mesh)


def shard_experts_local(experts: nn.Module, ep_mesh: Any, dp_group: Any = None) -> None:
    """Our DDP's layout: this rank's E/ep experts as plain parameters of the same names, cut from the full weights
    of the first rank of `dp_group` (the world when None; broadcast here: the ranks may have initialised
    differently), each marked with (the full shape, the first element of its slice in the full tensor's flat view:
    Shard(0) of a contiguous tensor is one flat range); the all-to-all hooks around the module's forward."""
    rank, ep = ep_mesh.get_local_rank(), ep_mesh.size()
    for name in _expert_tensors(experts):
        full = getattr(experts, name)
        data = full.detach().clone()
        if dist.is_initialized() and dist.get_world_size(dp_group) > 1:
            src = dist.get_global_rank(dp_group, 0) if dp_group is not None else 0
            dist.broadcast(data, src=src, group=dp_group)
        local = data.chunk(ep, dim=0)[rank].clone()
        param = nn.Parameter(local, requires_grad=full.requires_grad)
        setattr(param, SHARD_OF_ATTR, (tuple(full.shape), rank * local.numel()))
        setattr(experts, name, param)
    _exchange_around(experts, ep_mesh)


def _expert_tensors(experts: nn.Module) -> tuple[str, ...]:
    """The experts' parameters cut by expert: the stacked weights, gpt-oss's flat biases (whole experts per
    chunk: [E * n] in expert order, model/moe_experts.py), and LoRA adapters on them (model/lora_experts.py)."""
    return ("gate_up_proj", "down_proj") + tuple(n for n in ("gate_up_proj_bias", "down_proj_bias")
                                                 if getattr(experts, n, None) is not None) + adapter_names(experts)


def _exchange_around(experts: nn.Module, ep_mesh: Any) -> None:
    group, ep = ep_mesh.get_group(), ep_mesh.size()
    experts.register_forward_pre_hook(lambda m, args: _to_expert_ranks(m, args, group, ep))
    experts.register_forward_hook(lambda m, args, out: _from_expert_ranks(m, out, group))


def _to_expert_ranks(module: nn.Module, args: tuple, group: Any, ep: int) -> tuple:
    """(rows sorted by expert [N, D], counts [E]) of this rank -> (the rows of this rank's experts from every ep
    rank, grouped by expert [M, D], their counts [E/ep])."""
    from torch.distributed.nn.functional import all_to_all_single
    rows, counts = args
    local_e = counts.numel() // ep
    received = torch.empty_like(counts)  # [ep, E/ep]: from each source rank, its rows for each of my experts
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(ep, local_e)
    send = counts.view(ep, local_e).sum(dim=1).tolist()
    recv = received.sum(dim=1).tolist()
    out = rows.new_empty(sum(recv), rows.shape[-1])
    got = all_to_all_single(out, rows, output_split_sizes=recv, input_split_sizes=send, group=group)
    # (source, expert) order -> (expert, source): the start of each segment in the received buffer, segments
    # taken expert-major
    flat = received.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view(ep, local_e).t().reshape(-1)
    lengths = received.t().reshape(-1)
    out_starts = torch.cumsum(lengths, 0) - lengths
    perm = torch.repeat_interleave(starts - out_starts, lengths) + torch.arange(got.shape[0], device=got.device)
    module._ep_exchange = (perm, send, recv)
    return got.index_select(0, perm), received.sum(dim=0)


def _from_expert_ranks(module: nn.Module, out: torch.Tensor, group: Any) -> torch.Tensor:
    """The local experts' output rows back to the ranks (and the order) they came from."""
    from torch.distributed.nn.functional import all_to_all_single
    perm, send, recv = module._ep_exchange
    module._ep_exchange = None
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    back = out.new_empty(sum(send), out.shape[-1])
    return all_to_all_single(back, out.index_select(0, inverse), output_split_sizes=send, input_split_sizes=recv,
                             group=group)
