"""Activation checkpointing of the Transformer blocks: what each block keeps for its backward when
ModelConfig.gradient_checkpointing is on, by `ModelConfig.checkpoint_policy`:

  full  every block is recomputed whole in the backward: it keeps its input only (torch.utils.checkpoint).
  op    selective per operation (torchtitan's op-level selective AC): inside every block the outputs of the
        attention, of the reduce-scatters of sequence parallelism and of every other matmul are kept; the rest
        (norms, RoPE, SwiGLU, casts, the other matmuls) is recomputed in the backward. Roughly half a block's
        matmul FLOPs are recomputed instead of all of them, for more memory than `full` and less than none.
  N     (an integer) every N-th block, counted by its global index (the N-th, 2N-th, ...: the same blocks
        whatever the pipeline stages), is recomputed whole; the others keep everything (torchtitan's
        layer-level selective AC). 1 is `full`.

Owns: `run_block` (one block's forward under the policy), `checkpointed` (a forward under it, which the per-block
compile traces) and `saved_ops` (what `op` keeps).
Must never: change what a block computes: every policy gives the gradients of no checkpointing, bit for bit on
the CPU (tests/model/test_checkpointing.py), and the random draws of dropout are replayed (checkpoint's RNG state).
"""
from __future__ import annotations

from collections import defaultdict
from functools import lru_cache, partial
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _ops(*names: str) -> set:
    """The default overloads of the named ops that this torch build has (a CPU build lacks some CUDA ones)."""
    found = set()
    for name in names:
        ns, op = name.split(".")
        packet = getattr(getattr(torch.ops, ns, None), op, None)
        if packet is not None and hasattr(packet, "default"):
            found.add(packet.default)
    return found


# the matmuls counted for "every other": a linear's is mm (addmm with a bias)
_MATMULS = _ops("aten.mm", "aten.addmm")
# kept whenever they run: the attention kernels (SDPA's every backend, the varlen / FlashAttention-4 entries, the
# flash-attn package's ops), the grouped matmul of the routed experts, and the functional collectives' reduce-scatters
# (sequence parallelism's) and all-to-alls (a communication not repeated in the backward; our expert parallelism's
# all-to-alls are c10d's, not these: they run again in the recompute, as under full checkpointing)
_SAVED_NAMES = (
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
    "aten._scaled_dot_product_fused_attention_overrideable", "aten._flash_attention_forward",
    "aten._efficient_attention_forward", "aten._grouped_mm", "_c10d_functional.reduce_scatter_tensor",
    "_c10d_functional.all_to_all_single", "flash_attn._flash_attn_forward", "flash_attn._flash_attn_varlen_forward")


@lru_cache(maxsize=None)
def saved_ops() -> frozenset:
    """What `op` keeps, resolved at its first use: the flash-attn package registers its ops when it is imported (on a
    GPU, by the model's first attention), after this module."""
    return frozenset(_MATMULS | _ops(*_SAVED_NAMES))


def _keep_every_other_matmul(counts: dict, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The `op` policy for one call of a block: the forward and its recomputation count the matmuls apart, so
    both keep the same ones (the 1st, 3rd, ...)."""
    if func in _MATMULS:
        key = "recompute" if ctx.is_recompute else "forward"
        counts[key] += 1
        if counts[key] % 2 == 0:
            return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _op_contexts():
    return create_selective_checkpoint_contexts(partial(_keep_every_other_matmul, defaultdict(int)))


# set on a block whose (compiled) forward runs the checkpoint itself
CHECKPOINTS_ITSELF = "checkpoints_itself"


def block_index(block: nn.Module) -> int:
    """A block's global index (its attention's layer_idx): the same under pipeline stages."""
    return int(block.self_attn.layer_idx)


def checkpoints(block: nn.Module, policy: str) -> bool:
    """Whether the policy recomputes anything of this block (full, op: every block; N: every N-th)."""
    return policy in ("full", "op") or (block_index(block) + 1) % int(policy) == 0


def checkpointed(forward: Callable, policy: str) -> Callable:
    """forward(*args, **kwargs) under the policy's checkpoint (full or N: the whole call; op: selective per op)."""
    context = {"context_fn": _op_contexts} if policy == "op" else {}
    return lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, **context, **kwargs)


def run_block(block: nn.Module, policy: str, *args: Any) -> Any:
    """block(*args) under the checkpoint policy (`full`, `op` or an integer N, as the module's docstring says). A
    block whose compiled forward holds its checkpoint already (parallel/transforms/compile.py compile_blocks: the
    policy traced into each block's graph, so that Inductor's partitioner keeps what `op` keeps) is called as is."""
    if getattr(block, CHECKPOINTS_ITSELF, False) or not checkpoints(block, policy):
        return block(*args)
    return checkpointed(block, policy)(*args)
