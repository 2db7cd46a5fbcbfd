"""torch.compile as a transform. In one process (and for FSDP2, and with CUDA-graph compile modes) the engine's
whole forward model is compiled (`engine.forward_model = torch.compile(engine.model)`: our DDP's wrapper and
the model in one graph, or FSDP2's root module); with tensor parallelism, and under our DDP across ranks,
each Transformer block is compiled in place (`compile_blocks`, torchtitan's per-block compile): the DTensor
hooks inside a block are traced while FSDP2's hooks, the embedding, the LM head and the vocabulary-parallel
loss run eagerly around it, and our DDP's bucket communication overlaps the blocks' backward (`per_block`).

Owns: what is compiled, and the one workaround it needs (an AsyncCollectiveTensor input materialised).
Must never: change parameter names or module structure (checkpoints and hooks stay the same).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch._functorch.config  # noqa: F401  (the activation memory budget: `within_budget`)
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from model.checkpointing import CHECKPOINTS_ITSELF, checkpointed, checkpoints
from model.llama import blocks_of


def compile_in_place(model: nn.Module, **kwargs: Any) -> nn.Module:
    """torch.compile a plain model's whole forward in place (nn.Module.compile): its state_dict keys stay
    the same (no `_orig_mod.` prefix). For a model outside an engine: the benches, the tests."""
    model.compile(**kwargs)
    return model


CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _mode(config: Any) -> str:
    return str(getattr(config, "compile_mode", "default") or "default")


def compile_kwargs(config: Any) -> dict:
    """torch.compile's keyword arguments for --compile_mode ("default": none), --compile_tuning and
    --compile_backend (another than Inductor: {"backend": name}, the mode and tuning refused with it by the flags'
    checks). torch.compile takes a mode or an options dict, not both: with tuning the mode's own options
    (torch._inductor's list_mode_options) are passed with coordinate_descent_tuning added; the max-autotune modes
    have it already."""
    backend = str(getattr(config, "compile_backend", "inductor") or "inductor")
    if backend != "inductor":
        return {"backend": backend}
    mode = _mode(config)
    if not bool(getattr(config, "compile_tuning", False)) or mode.startswith("max-autotune"):
        return {} if mode == "default" else {"mode": mode}
    from torch._inductor import list_mode_options
    return {"options": {**list_mode_options(mode), "coordinate_descent_tuning": True}}


class _StepMarked(nn.Module):
    """A compiled model replayed as CUDA graphs (Inductor's cudagraph trees). The engine calls
    `begin_micro_batch()` before each micro-batch's forward (parallel/engine.py), so a forward after the
    previous micro-batch's backward reuses the graphs' memory instead of extending one growing sequence; a
    micro-batch may call the model more than once (DPO: chosen, then rejected). The previous micro-batch's
    outputs must not be read afterwards: the engine turns each loss into its own stats row first."""

    def __init__(self, compiled: nn.Module) -> None:
        super().__init__()
        self.compiled = compiled

    @staticmethod
    def begin_micro_batch() -> None:
        torch.compiler.cudagraph_mark_step_begin()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.compiled(*args, **kwargs)


def memory_budget(config: Any) -> Optional[float]:
    """--activation_checkpoint=memory_budget's share of the activations to keep, else None."""
    if str(getattr(config, "activation_checkpoint", "none")) != "memory_budget":
        return None
    return float(getattr(config, "activation_memory_budget", 0.5))


def within_budget(fn: Callable, budget: Optional[float]) -> Callable:
    """fn called with AOTAutograd's activation memory budget set to `budget` for the call (the partitioner reads
    it at the first call and at each recompile: torchtitan's memory_budget mode) and restored after it, so no other
    compile in the process sees it. None: fn itself."""
    if budget is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._functorch.config.patch(activation_memory_budget=budget):
            return fn(*args, **kwargs)
    return run


class _WithinBudget(nn.Module):
    """A whole-model compile under --activation_checkpoint=memory_budget (`within_budget` as a module: the engine's
    forward model)."""

    def __init__(self, compiled: nn.Module, budget: float) -> None:
        super().__init__()
        self.compiled = compiled
        self.run = within_budget(compiled, budget)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def compile_blocks(model: nn.Module, budget: Optional[float] = None, **compile_kw: Any) -> None:
    """torch.compile each Transformer block's forward in place (the blocks stay the same modules: only
    their bound `forward` is replaced). Under activation checkpointing the block's checkpoint is compiled with it
    (model/checkpointing.py `checkpointed`, as torchtitan compiles its checkpoint-wrapped blocks): the policy's
    choices are the partitioner's, where a checkpoint around the compiled call would see Inductor's kernels as
    one and recompute the whole block whatever the policy. `budget`: --activation_checkpoint=memory_budget's share
    (`within_budget`).

    The first block's input is the vocabulary-parallel embedding's all-reduced output, which torch hands
    over as an AsyncCollectiveTensor (the all-reduce not yet waited on); a compiled graph given that
    wrapper returns no gradient to the embedding (measured: a zero embedding gradient with torch 2.13),
    so such an input is materialised eagerly first (one copy of the block's input, once per forward)."""
    def compiled(forward):
        graph = within_budget(torch.compile(forward, **compile_kw), budget)

        def run(h, *args, **kwargs):
            if isinstance(h, AsyncCollectiveTensor):
                h = h.clone()  # a dispatched op: waits for the collective, keeps the autograd edge
            return graph(h, *args, **kwargs)
        return run

    cfg = getattr(model, "cfg", None)
    policy = cfg.checkpoint_policy if cfg is not None and cfg.gradient_checkpointing else None
    for block in blocks_of(model.layers):
        if policy is not None and checkpoints(block, policy):  # the checkpoint inside the graph, as torchtitan's
            block.forward = compiled(checkpointed(block.forward, policy))
            setattr(block, CHECKPOINTS_ITSELF, True)
        else:
            block.forward = compiled(block.forward)
    for depth in getattr(getattr(model, "mtp", None), "depths", []):
        depth.block.forward = compiled(depth.block.forward)


def per_block(engine: Any, config: Any) -> bool:
    """Whether --compile compiles each block instead of the whole model: under tensor parallelism (the DTensor
    hooks), and under our DDP with gradients to communicate (more than one rank), unless CUDA graphs replay
    the step (--compile_mode reduce-overhead / max-autotune: one whole graph).
    Why DDP: a whole-model graph's backward is ONE autograd node, so every parameter's gradient (and with it
    our DDP's post-accumulate hooks, which launch each bucket's all-reduce) arrives only after the whole
    backward: the communication could not overlap any of it. Per block, a block's gradients arrive as its
    backward graph ends, and its bucket communicates while the blocks below it run theirs (torchtitan
    compiles per block for the same reason). One process has nothing to overlap: it keeps the one graph."""
    if int(getattr(config, "tensor_parallel_size", 1)) > 1 or getattr(engine, "kind", "") == "pipeline":
        return True
    if _mode(config) in CUDA_GRAPH_MODES:
        return False
    return getattr(engine, "kind", "") == "ddp" and int(getattr(engine.model, "world_size", 1)) > 1


def apply(engine: Any, mesh: Any, config: Any) -> None:
    """--compile=true on a built engine (the last transform: see parallel/transforms/__init__.py)."""
    if not bool(getattr(config, "compile", False)):
        return
    kw, budget = compile_kwargs(config), memory_budget(config)
    if per_block(engine, config):
        compile_blocks(engine.module, budget, **kw)  # the forward model stays the module: each block is compiled
    else:
        compiled = torch.compile(engine.model, **kw)
        if budget is not None:
            compiled = _WithinBudget(compiled, budget)
        if _mode(config) in CUDA_GRAPH_MODES:
            compiled = _StepMarked(compiled)
        engine.forward_model = compiled
