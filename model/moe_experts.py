"""The experts of a mixture-of-experts layer (model/moe.py): E SwiGLU experts as two stacked weights
(`GroupedExperts`), the shared experts (`SharedExperts`), and the functions that compute the routed ones on their
dispatched rows, chosen per call by `choose_expert_backend`:
  grouped_mm  torch's grouped matmul (two launches, no host read) where it runs;
  fused_loop  the loop's matmuls with the backward written out (`_FusedLoop`: no cat or stack, the least saved for
              backward), reading the counts to the host; under torch.compile run outside the graph
              (`experts_eager_fused_loop`);
  loop        the reference: one SwiGLU per expert on its slice of the rows.
Must never: read a tensor's value to the host on the grouped path (the loops do, by design), or give an expert
with no rows a None gradient (it takes part with an empty matmul: a zero one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from model import kernels
from model.lora_experts import ExpertLoRA, adapted_weights, adapters_of

EXPERT_BACKENDS = ("auto", "grouped_mm", "fused_loop", "loop")

# torch >= 2.10 names it torch.nn.functional.grouped_mm (and runs it on compute capability 8 too)
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether the grouped matmul runs here: the CPU in bf16 (and in fp32 / fp16 when not traced), CUDA in bf16
    on compute capability >= 9 (>= 8 where torch has the public F.grouped_mm)."""
    if _GROUPED_MM is None:
        return False
    if x.device.type == "cpu":  # (traced, torch's shape function of it takes bf16 only)
        return x.dtype == torch.bfloat16 or (x.dtype in (torch.float32, torch.float16)
                                             and not torch.compiler.is_compiling())
    if x.device.type == "cuda":
        need = 8 if hasattr(F, "grouped_mm") else 9
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= need
    return False


@dataclass(frozen=True)
class ExpertAct:
    """The experts' activation of (gate, up): SwiGLU's silu(g) u, or gpt-oss's clamped form
    min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, -limit, limit) + 1)."""
    kind: str = "silu"
    limit: float = 7.0
    alpha: float = 1.702

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.kind == "silu":
            return F.silu(gate) * up
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up + 1)


SWIGLU = ExpertAct()


def experts_grouped(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, act: ExpertAct = SWIGLU, b_gate_up: Optional[torch.Tensor] = None,
                    b_down: Optional[torch.Tensor] = None, lora: Optional[ExpertLoRA] = None) -> torch.Tensor:
    """SwiGLU (or `act`) of each expert's rows by the grouped matmul (two launches: gate and up together, then down;
    no host read).
    w_gate_up [E, 2I, D] (gate rows, then up rows), w_down [E, D, I] (nn.Linear's [out, in] per expert); biases
    (gpt-oss's) b_gate_up [E, 2I] and b_down [E, D], each row taking its expert's (found from the offsets on the
    device); `lora`: LoRA adapters on the experts, added to each projection's output as s (x A_e^T) B_e^T by two
    more grouped matmuls each (model/lora_experts.py)."""
    offs = torch.cumsum(counts, dim=0).to(torch.int32)

    def mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _GROUPED_MM(x, w.transpose(-2, -1), offs=offs)
    gate_up = mm(rows, w_gate_up)
    if lora is not None:
        gate_up = lora.add("gate_up_proj", rows, gate_up, mm)
    if b_gate_up is not None or b_down is not None:
        row = torch.arange(rows.shape[0], device=rows.device, dtype=torch.int32)
        expert = torch.searchsorted(offs, row, right=True).clamp(max=counts.numel() - 1)
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[expert].to(gate_up.dtype)
    hidden = act(*gate_up.chunk(2, dim=-1))
    out = mm(hidden, w_down)
    if lora is not None:
        out = lora.add("down_proj", hidden, out, mm)
    return out if b_down is None else out + b_down[expert].to(out.dtype)


def experts_loop(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, act: ExpertAct = SWIGLU, b_gate_up: Optional[torch.Tensor] = None,
                 b_down: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The reference: one SwiGLU (or `act`, with the biases where given) per expert on its slice of the rows (reads
    the counts to the host). An expert with no rows still takes part (an empty matmul), so its weights get a zero
    gradient, never None."""
    outs = []
    # unbind: one backward that stacks the E gradients (w[e] would zero-fill a whole [E, ...] gradient per expert)
    n = counts.numel()
    experts = zip(w_gate_up.unbind(0), w_down.unbind(0), (b_gate_up.unbind(0) if b_gate_up is not None else [None] * n),
                  (b_down.unbind(0) if b_down is not None else [None] * n))
    for rows_e, (gu, d, bgu, bd) in zip(torch.split(rows, counts.tolist()), experts):
        gate, up = F.linear(rows_e, gu, bgu).chunk(2, dim=-1)
        outs.append(F.linear(act(gate, up), d, bd))
    return torch.cat(outs)


class _FusedLoop(torch.autograd.Function):
    """The loop's computation with its backward written out: each expert's matmuls write straight into slices of
    one output (no cat; the weight gradients into one [E, ...] tensor, no stack), and each expert's SwiGLU, forward
    and backward, runs on its own rows right after their matmul, while they are in cache. Saved for backward: the
    rows and the gate/up pre-activations (the activation is recomputed per expert), where the loop's graph also keeps
    each expert's silu and activation. The same matmuls as the loop's autograd graph, in the same layouts (on the
    CPU the values and gradients compare equal bit for bit; the tests allow rounding)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                sizes: list[int]) -> torch.Tensor:
        if sum(sizes) != rows.shape[0]:
            raise ValueError(f"the experts' counts sum to {sum(sizes)}, but {rows.shape[0]} rows were dispatched")
        hidden = w_down.shape[-1]
        gate_up = rows.new_empty(rows.shape[0], 2 * hidden)
        out = rows.new_empty(rows.shape[0], w_down.shape[1])
        act = rows.new_empty(max(sizes, default=0), hidden)  # one expert's at a time
        s = 0
        for e, n in enumerate(sizes):
            if n:
                h = torch.mm(rows[s:s + n], w_gate_up[e].t(), out=gate_up[s:s + n])
                a = torch.mul(F.silu(h[:, :hidden]), h[:, hidden:], out=act[:n])
                torch.mm(a, w_down[e].t(), out=out[s:s + n])
            s += n
        ctx.save_for_backward(rows, w_gate_up, w_down, gate_up)
        ctx.sizes = sizes
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        rows, w_gate_up, w_down, gate_up = ctx.saved_tensors
        need_rows, need_gate_up, need_down = ctx.needs_input_grad[:3]
        hidden, grad = w_down.shape[-1], grad.contiguous()
        g_rows = torch.empty_like(rows) if need_rows else None
        g_gate_up = torch.empty_like(w_gate_up) if need_gate_up else None
        g_down = torch.empty_like(w_down) if need_down else None
        most = max(ctx.sizes, default=0)
        g_act, g_h = rows.new_empty(most, hidden), rows.new_empty(most, 2 * hidden)  # one expert's at a time
        s = 0
        for e, n in enumerate(ctx.sizes):
            if n == 0:  # no rows: a zero gradient, as the loop's empty matmul gives
                for g in (g_gate_up, g_down):
                    if g is not None:
                        g[e].zero_()
                continue
            g_e, gate, up = grad[s:s + n], gate_up[s:s + n, :hidden], gate_up[s:s + n, hidden:]
            silu = F.silu(gate)
            if need_down:  # autograd's layout: (act^T grad) written transposed into [D, I]
                torch.mm((silu * up).t(), g_e, out=g_down[e].t())
            if need_rows or need_gate_up:
                ga = torch.mm(g_e, w_down[e], out=g_act[:n])
                gh = g_h[:n]
                torch.mul(ga, silu, out=gh[:, hidden:])
                torch.ops.aten.silu_backward.grad_input(ga * up, gate, grad_input=gh[:, :hidden])
                if need_gate_up:
                    torch.mm(rows[s:s + n].t(), gh, out=g_gate_up[e].t())
                if need_rows:
                    torch.mm(gh, w_gate_up[e], out=g_rows[s:s + n])
            s += n
        return g_rows, g_gate_up, g_down, None


def experts_fused_loop(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                       w_down: torch.Tensor) -> torch.Tensor:
    """The loop with its backward written out (`_FusedLoop`); reads the counts to the host, like the loop. Under
    autocast it computes in the autocast dtype, as the loop's F.linear does (matmuls with out= are not autocast)."""
    device = rows.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return _FusedLoop.apply(rows.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), counts.tolist())
    return _FusedLoop.apply(rows, w_gate_up, w_down, counts.tolist())


def choose_expert_backend(x: torch.Tensor, backend: str, plain: bool = True) -> str:
    """auto: grouped_mm on an accelerator that runs it; elsewhere the fused loop (on the CPU the three measured the
    same speed, bench/bench_moe.py, and it saves the least for backward), under torch.compile run outside the graph
    (`experts_eager_fused_loop`: traced, every new split of the tokens over the experts recompiled it).
    "loop" under compile is traced as the graph it is. Not `plain` (gpt-oss's experts: biases, another activation):
    the grouped matmul where it runs, else the loop (the fused loop's backward is SwiGLU's without biases)."""
    if not plain:
        if backend in ("auto", "fused_loop"):
            return "grouped_mm" if grouped_mm_supported(x) else "loop"
    elif backend == "auto":
        if x.device.type != "cpu" and grouped_mm_supported(x):
            return "grouped_mm"
        return "eager_fused_loop" if torch.compiler.is_compiling() else "fused_loop"
    if backend not in EXPERT_BACKENDS:
        raise ValueError(f"expert backend must be one of {EXPERT_BACKENDS}, got {backend!r}")
    if backend == "grouped_mm" and not grouped_mm_supported(x):
        raise ValueError(f"the grouped matmul does not run on {x.device} in {x.dtype}; use the loop")
    return backend


def experts_eager_fused_loop(rows: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor,
                             w_down: torch.Tensor) -> torch.Tensor:
    """The fused loop run outside torch.compile's graph (`choose_expert_backend` picks it under compile). Traced,
    the code after the counts' host read (a graph break whatever follows) was specialised on the counts, so every
    new split of the tokens over the experts recompiled it until torch's recompile limit (8) left it eager anyway;
    run eagerly from the start, nothing recompiles, and the loop keeps its written-out backward."""
    # imported here, under compile only: its torch.compiler.disable imports torch._dynamo (~2 s), which sample.py
    # and export_hf.py should not pay for
    from model.eager_region import outside_graph
    return outside_graph(experts_fused_loop, rows, counts, w_gate_up, w_down)


_EXPERT_FUNCTIONS = {"grouped_mm": experts_grouped, "fused_loop": experts_fused_loop, "loop": experts_loop,
                     "eager_fused_loop": experts_eager_fused_loop}


class GroupedExperts(nn.Module):
    """E SwiGLU experts as two stacked parameters (EP shards their first dimension): gate and up in one
    [E, 2I, D] (one matmul for both, as transformers 5 and Megatron's fc1 hold them), down [E, D, I].
    gpt-oss's experts (`biases`, `act`): biases on both projections, stored flat, `gate_up_proj_bias` [E * 2I] (each
    expert's gate then up) and `down_proj_bias` [E * D]: one dimension, so that they are treated as every other bias
    (no weight decay, AdamW beside Muon) while expert parallelism cuts them by expert as the weights (Shard(0) of a
    flat [E * n] is whole experts); and their clamped activation (`ExpertAct`)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, biases: bool = False, act: ExpertAct = SWIGLU):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts * 2 * hidden)) if biases else None
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts * dim)) if biases else None
        self.act = act
        self.backend = "auto"  # a plain attribute (tests, benchmarks): never in the config or a checkpoint
        # expert parallelism under FSDP2 (parallel/transforms/expert_parallel.py shard_experts): the weights are
        # DTensors over the ep ranks and the forward computes this rank's experts, their local shards. A plain flag
        # (not a type test of the weights): torch.compile traces it, and sample.py never imports DTensor
        self.weights_on_ep_mesh = False
        self.lora_scaling: Optional[float] = None  # alpha / r with LoRA adapters (model/lora_experts.py), else None

    def _local(self, w: torch.Tensor) -> torch.Tensor:
        return w.to_local() if self.weights_on_ep_mesh else w

    def init_weights(self, std: float) -> None:
        """Drawn like the dense linears (normal, std = initializer_range); biases 0."""
        for p in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(p, mean=0.0, std=std)
        for p in self.biases():
            nn.init.zeros_(p)

    def biases(self) -> tuple[torch.Tensor, ...]:
        return tuple(b for b in (self.gate_up_proj_bias, self.down_proj_bias) if b is not None)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        plain = self.gate_up_proj_bias is None and self.act.kind == "silu"
        fn = _EXPERT_FUNCTIONS[choose_expert_backend(rows, self.backend, plain)]
        # under expert parallelism this rank computes its own experts (parallel/transforms/expert_parallel.py hands
        # it their rows and counts)
        weights = tuple(self._local(w) for w in (self.gate_up_proj, self.down_proj) + self.biases())
        lora = None
        if self.lora_scaling is not None:  # LoRA on the experts (model/lora_experts.py)
            lora = adapters_of(self, self._local)
            # the grouped matmul where it was asked for or (auto) runs: no adapted copy of the weights
            # (bench/bench_moe_lora.py); else the update in weight space, W + s B A
            grouped = fn is experts_grouped or (self.backend == "auto" and grouped_mm_supported(rows))
            if not (grouped and lora.grouped_ok(rows)):
                weights, lora = adapted_weights(lora, weights[0], weights[1]) + weights[2:], None
        if plain and lora is None:
            return fn(rows, counts, *weights)
        w_gate_up, w_down, *flat = weights
        n = w_gate_up.shape[0]  # (this rank's experts under expert parallelism)
        b_gate_up, b_down = (b.view(n, -1) for b in flat) if flat else (None, None)
        if lora is not None:  # (the grouped matmul: the update on the activations, s (x A^T) B^T)
            return experts_grouped(rows, counts, w_gate_up, w_down, self.act, b_gate_up, b_down, lora)
        return fn(rows, counts, w_gate_up, w_down, self.act, b_gate_up, b_down)


class SharedExperts(nn.Module):
    """The shared experts, always on, merged into one SwiGLU of n x the expert width (DeepSeek-V3)."""

    def __init__(self, dim: int, hidden: int, fused: bool, backend: str):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.fused, self.backend = fused, backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.swiglu(self.gate_proj(x), self.up_proj(x), fused=self.fused,
                                             backend=self.backend))
