"""LoRA on the routed experts of an MoE layer (model/moe_experts.py `GroupedExperts`): per expert e, a rank-r update
of its gate/up weight and of its down weight, W_e + (alpha / r) B_e A_e, as PEFT's `target_parameters` adapters hold
them on transformers 5's stacked experts (its `lora.ParamWrapper`).

Owns: the target names (`EXPERT_TARGETS`, `expert_targets`), `add_expert_adapters` (the adapters of one
GroupedExperts), what its forward uses (`adapters_of` -> `ExpertLoRA`, whose `add` updates a grouped matmul's
outputs; `adapted_weights`, the weight-space update), `merge_expert_adapters`, and the PEFT layout both ways
(`peft_expert_tensors`, `expert_tensors_from_peft`).

Ours, beside the frozen `gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I]: `gate_up_proj_lora_A` [E, r, D],
`gate_up_proj_lora_B` [E, 2I, r], `down_proj_lora_A` [E, r, I], `down_proj_lora_B` [E, D, r] (whole experts along
the first dimension, as the weights: expert parallelism cuts them alike). PEFT's, per stacked parameter: `lora_A`
[E r, in] (expert-major) and `lora_B` [out, r E] (expert-minor), under `mlp.experts` when one parameter is adapted;
when both are, PEFT nests its wrappers in the parameters' order, so gate/up's sit under `mlp.experts.base_layer`.

Where the grouped matmul runs (CUDA in bf16, the CPU outside torch.compile: `auto` takes it for adapted experts), the
update is added to each projection's output, s (x A_e^T) B_e^T by two more grouped matmuls (`ExpertLoRA.add`): nothing
the size of the weights is formed. Under the loops (the CPU under compile, or asked for), and with a rank whose rows
are not 16-byte aligned, it is formed in weight space, W + s B A per expert (one batched matmul per projection, as
PEFT does), and the loop runs on the adapted weights: each MoE layer then keeps one more copy of its experts' weights
for the backward (activation checkpointing recomputes it instead). Expert parallelism and torch.compile run unchanged
either way. No dropout (PEFT's ParamWrapper has none either: the update is the same whichever side of the matmul it is
applied on).
Must never: let a frozen expert weight take a gradient, or write gate/up rows in another order than the family's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn

EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")
_PROJECTIONS = ("gate_up_proj", "down_proj")


def expert_targets(targets: Iterable[str]) -> tuple[str, ...]:
    """The routed experts' projections named among `targets` ("experts" = both), in the parameters' order."""
    targets = set(targets)
    if "experts" in targets:
        return _PROJECTIONS
    return tuple(p for p in _PROJECTIONS if f"experts.{p}" in targets)


def is_expert_target(name: str) -> bool:
    return name == "experts" or name in EXPERT_TARGETS


def grouped_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module holding stacked routed experts (model/moe_experts.py GroupedExperts)."""
    return [(n, m) for n, m in model.named_modules()
            if isinstance(getattr(m, "gate_up_proj", None), nn.Parameter) and m.gate_up_proj.dim() == 3]


def add_expert_adapters(experts: nn.Module, projections: tuple[str, ...], r: int, alpha: float) -> None:
    """Rank-`r` adapters on `projections` of one GroupedExperts: A drawn as PEFT draws it (uniform within
    1/sqrt(in), kaiming_uniform(a=sqrt 5) of each expert's [r, in]), B zero, so the model is unchanged."""
    for proj in projections:
        w = getattr(experts, proj)
        n, out_f, in_f = w.shape
        a = torch.empty(n, r, in_f, device=w.device, dtype=w.dtype)
        nn.init.uniform_(a, -1 / math.sqrt(in_f), 1 / math.sqrt(in_f))
        setattr(experts, f"{proj}_lora_A", nn.Parameter(a))
        setattr(experts, f"{proj}_lora_B", nn.Parameter(torch.zeros(n, out_f, r, device=w.device, dtype=w.dtype)))
    experts.lora_scaling = alpha / r


def adapter_names(experts: nn.Module) -> tuple[str, ...]:
    """The adapter parameters of one GroupedExperts (none without adapters)."""
    return tuple(f"{p}_lora_{x}" for p in _PROJECTIONS for x in "AB" if getattr(experts, f"{p}_lora_{x}", None)
                 is not None)


@dataclass(frozen=True)
class ExpertLoRA:
    """One GroupedExperts' adapters as its forward uses them: {projection: (A [E, r, in], B [E, out, r])} (this
    rank's experts' under expert parallelism) and the scaling alpha / r."""
    pairs: dict
    scaling: float

    def grouped_ok(self, x: torch.Tensor) -> bool:
        """Whether the grouped matmul can take the rank-r operands: it needs 16-byte aligned rows (r a multiple of 8
        in bf16, of 4 in fp32)."""
        r = next(iter(self.pairs.values()))[0].shape[1]
        return (r * x.element_size()) % 16 == 0

    def add(self, proj: str, x: torch.Tensor, y: torch.Tensor, mm: Callable) -> torch.Tensor:
        """y + s (x A_e^T) B_e^T for each row's expert e (`mm`: the per-expert matmul of the rows), or y."""
        pair = self.pairs.get(proj)
        if pair is None:
            return y
        a, b = (t.to(x.dtype) for t in pair)
        return y + self.scaling * mm(mm(x, a), b)


def adapters_of(experts: nn.Module, local: Callable[[torch.Tensor], torch.Tensor]) -> ExpertLoRA:
    """The adapters of one GroupedExperts with adapters (`local`: this rank's shard of a parameter under expert
    parallelism, else the parameter)."""
    pairs = {p: (local(getattr(experts, f"{p}_lora_A")), local(getattr(experts, f"{p}_lora_B")))
             for p in _PROJECTIONS if getattr(experts, f"{p}_lora_A", None) is not None}
    return ExpertLoRA(pairs, experts.lora_scaling)


def adapted_weights(lora: ExpertLoRA, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(gate/up, down) with each adapted projection's update added in weight space: W + s B A per expert."""
    out = []
    for proj, w in zip(_PROJECTIONS, (w_gate_up, w_down)):
        if proj in lora.pairs:
            a, b = lora.pairs[proj]
            w = torch.baddbmm(w, b.to(w.dtype), a.to(w.dtype), alpha=lora.scaling)
        out.append(w)
    return out[0], out[1]


def merge_expert_adapters(experts: nn.Module) -> None:
    """Fold the adapters into the weights (in fp32 at least, as model/lora.py merges a linear's) and remove them."""
    if getattr(experts, "lora_scaling", None) is None:
        return
    with torch.no_grad():
        for proj in _PROJECTIONS:
            a = getattr(experts, f"{proj}_lora_A", None)
            if a is None:
                continue
            w, b = getattr(experts, proj), getattr(experts, f"{proj}_lora_B")
            ct = torch.promote_types(w.dtype, torch.float32)
            w.copy_(w.to(ct) + experts.lora_scaling * torch.bmm(b.to(ct), a.to(ct)))
            delattr(experts, f"{proj}_lora_A")
            delattr(experts, f"{proj}_lora_B")
    experts.lora_scaling = None


def _peft_key(module: str, proj: str, both: bool, which: str) -> str:
    nested = ".base_layer" if both and proj == "gate_up_proj" else ""  # (PEFT's inner wrapper: the first parameter)
    return f"{module}{nested}.lora_{which}.weight"


def peft_expert_tensors(experts: nn.Module, module: str,
                        gate_up_rows: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> dict:
    """One GroupedExperts' adapters under PEFT's names (`module`: the experts' PEFT module name) and layouts;
    `gate_up_rows`: the family's order of gate/up's output rows from ours (gate rows, then up), e.g. gpt-oss's
    interleaving, applied to B's rows."""
    names = adapter_names(experts)
    both = len(names) == 4
    out = {}
    for proj in _PROJECTIONS:
        if f"{proj}_lora_A" not in names:
            continue
        a, b = getattr(experts, f"{proj}_lora_A").detach(), getattr(experts, f"{proj}_lora_B").detach()
        if proj == "gate_up_proj" and gate_up_rows is not None:
            b = gate_up_rows(b.transpose(1, 2)).transpose(1, 2)  # [E, 2I, r]: the row order along 2I
        n, r, in_f = a.shape
        out[_peft_key(module, proj, both, "A")] = a.reshape(n * r, in_f)
        out[_peft_key(module, proj, both, "B")] = b.permute(1, 2, 0).reshape(b.shape[1], r * n)
    return out


def expert_tensors_from_peft(sd: dict, module: str, ours: str, projections: tuple[str, ...], n_experts: int,
                             gate_up_rows: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> dict:
    """The inverse of `peft_expert_tensors` for one experts module: PEFT's tensors under `module` (taken out of `sd`)
    -> ours under `ours` (the module's name in our model); `gate_up_rows`: the family's rows back to ours."""
    both = len(projections) == 2
    out = {}
    for proj in projections:
        keys = [_peft_key(module, proj, both, x) for x in "AB"]
        if any(k not in sd for k in keys):
            raise ValueError(f"the adapters name {proj} of the routed experts as a target, but the file has no "
                             f"{' / '.join(k for k in keys if k not in sd)}")
        a, b = (sd.pop(k) for k in keys)
        r = a.shape[0] // n_experts
        a = a.reshape(n_experts, r, a.shape[1])
        b = b.reshape(b.shape[0], r, n_experts).permute(2, 0, 1)
        if proj == "gate_up_proj" and gate_up_rows is not None:
            b = gate_up_rows(b.transpose(1, 2)).transpose(1, 2)
        out[f"{ours}.{proj}_lora_A"], out[f"{ours}.{proj}_lora_B"] = a.contiguous(), b.contiguous()
    return out
