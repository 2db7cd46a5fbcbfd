"""The experts' fused loop run outside torch.compile's graph (model/moe.py `choose_expert_backend` picks it under
compile where the grouped matmul does not run: the CPU, fp32, older GPUs).

Why: the loop reads each expert's row count to the host, which breaks the graph whatever runs after it; traced, the
code after the break is specialised on those counts, so every new split of the tokens over the experts recompiled
it until torch's recompile limit (8) left it eager anyway. Run eagerly from the start, the break is the same one,
nothing recompiles, and the loop keeps its written-out backward (`_FusedLoop`: the least saved for backward).
Imported only under compile (a module-level torch.compiler.disable imports torch._dynamo, ~2 s, which sample.py
and export_hf.py should not pay for).
Must never: compute anything but `experts_fused_loop` (the same values and gradients as eager).
"""
from __future__ import annotations

import torch

from model.moe import experts_fused_loop


@torch.compiler.disable
def experts_outside_graph(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                          w_down: torch.Tensor) -> torch.Tensor:
    return experts_fused_loop(rows, counts, w_gate_up, w_down)
