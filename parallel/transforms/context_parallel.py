"""Context parallelism as a transform: every sequence split over the mesh's "cp" ranks, attention run as a
ring over them (model/ring_attention.py). It sets the model's `context_parallel` switch (a plain attribute:
parameter names and checkpoints never change); the model then keeps its rank's two chunks of each whole
sequence it is given (input ids, labels, RoPE positions) and returns the loss summed over the cp group.

What the engines do around it: the cp ranks of one data-parallel replica read the same batch
(parallel/mesh.py SAME_BATCH_DIMS), parameters are the same on the cp ranks, and gradients are reduced over
dp x cp (our DDP over the whole world, parallel/engine_ddp.py; FSDP2 sharded over dp_shard x cp,
parallel/mesh.py dp_mesh), normalised by the global target count (Engine.grad_ranks).

Owns: turning the switch on for --context_parallel_size > 1, and giving the MoE blocks the group of the ranks
that split each sequence's tokens (cp, or cp x tp: their balancing losses are the whole sequences', model/moe.py
balancing_losses).
Must never: split the data itself (the model does, from the whole batch) or build process groups (the mesh does).
"""
from __future__ import annotations

from typing import Any

from torch import nn


def apply(model: nn.Module, mesh: Any, config: Any) -> None:
    if int(getattr(config, "context_parallel_size", 1)) <= 1:
        return
    from model.ring_attention import ContextParallel
    if not hasattr(model, "context_parallel"):
        raise ValueError("--context_parallel_size > 1 needs the project's Transformer (model/llama.py)")
    if getattr(model.cfg, "sliding_window", None):
        raise ValueError(f"--context_parallel_size > 1: the model's sliding-window attention (sliding_window="
                         f"{model.cfg.sliding_window}) is not in the ring attention (model/ring_attention.py)")
    if getattr(model.cfg, "attn_sinks", False):
        raise ValueError("--context_parallel_size > 1: the model's attention sinks (gpt-oss's) are not in the ring "
                         "attention (model/ring_attention.py)")
    if getattr(model.cfg, "attn_softcap", None) is not None:
        raise ValueError("--context_parallel_size > 1: the model's soft-capped attention scores (Gemma 2's "
                         "attn_softcap) are not in the ring attention (model/ring_attention.py)")
    model.context_parallel = ContextParallel(mesh["cp"].get_group())
    from model.moe import moe_layers
    from parallel.mesh import token_group
    for layer in moe_layers(model):  # the balancing losses are the whole sequences' (model/moe.py), whose tokens
        layer.sequence_group = token_group(mesh)  # are split over the cp ranks (and the tensor ranks, tp > 1)
