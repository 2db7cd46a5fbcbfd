"""A function call that torch.compile never traces: `outside_graph(fn, *args)` runs fn eagerly (a graph break),
its autograd graph joining the compiled ones around it. model/moe_experts.py runs the experts' loop so (its host
read of the counts breaks the graph anyway; traced after the break it recompiled for every new split of the tokens).
Imported only where a traced forward needs it: a module-level torch.compiler.disable imports torch._dynamo (~2 s),
which the commands that only load a checkpoint never need.
Must never: change what fn computes.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


@torch.compiler.disable
def outside_graph(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)
