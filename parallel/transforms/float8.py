"""FP8 training of the Transformer blocks' linear layers as a transform (--float8=tensorwise | rowwise), on
torchao's float8 training (`convert_to_float8_training`): each q/k/v/o and gate/up/down `nn.Linear` becomes a
`Float8Linear` whose forward casts its input and weight (and in the backward the output gradient) to FP8 with
dynamic scales (e4m3 forward, e5m2 gradients; one scale per tensor, or per row with `rowwise`) and multiplies
them on the FP8 tensor cores. The weights, the optimizer and the checkpoints stay as they were (the parameter
names do not change); the embedding and the LM head are not converted (torchtitan leaves the output layer out
too: its error reaches the loss directly).

On a CPU there are no FP8 matmuls: torchao's emulation runs the same casts and scales with higher-precision
matmuls, which is what the tests check against a hand-written FP8 reference. A GPU without FP8 tensor cores
(compute capability < 8.9) is refused with one line. torchao is an optional extra for training (imported only
when --float8 is on).

Which layers: by default (--float8_layers=auto) only those large enough for the FP8 matmul to pay for its
scaling casts (`worth_fp8`, torchao's H100 thresholds); --float8_layers=all converts every block linear.

Owns: which layers are converted, the recipe, the device check.
Must never: convert a layer whose dimensions the FP8 kernels cannot take (multiples of 16), or change a
parameter's name or dtype.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch
from torch import nn

from utils.device import fp8_matmul_problem, is_accelerator

log = logging.getLogger(__name__)
RECIPES = ("tensorwise", "rowwise")
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# multi-head latent attention's projections (model/mla.py), FP8 in DeepSeek-V3's own training as the rest
MLA_LINEARS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def worth_fp8(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether an FP8 matmul of this (N = out, K = in) weight is expected to beat bf16 once its scaling casts
    are paid (--float8_layers=auto). The thresholds are torchao 0.18's, from its H100 microbenchmarks of
    float8 linears (torchao/float8/float8_linear_utils.py `_auto_filter_for_tensorwise` / `_rowwise`):
    tensorwise skips K <= 4096 with N <= 1024; rowwise skips N <= 2048, K <= 1024, and N <= 4096 with K <= 2048.
    Measured on an H200 by bench/bench_model_gpu.py (`make gpu-report`) at 124M (16,384 tokens a step): every
    block linear in FP8 ran at 0.66x of bf16; with torchao's tensorwise filter only gate/up (N 2048, K 768)
    stayed, and the step still lost, 516,053 vs 551,106-571,668 tokens/s. So tensorwise also skips K <= 1024 with
    N <= 4096 (a 124M-size model converts nothing); at 1B (K 2048-5632) it gained 1.15x over the whole step."""
    n, k = out_features, in_features
    if recipe == "rowwise":
        return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))
    return not ((k <= 4096 and n <= 1024) or (k <= 1024 and n <= 4096))


def converts(fqn: str, module: nn.Module, recipe: str = "tensorwise", layers: str = "all") -> bool:
    """Whether the transform converts this module: a block's linear layer, the multi-token prediction depths'
    blocks included (not their eh_proj, not the LM head, not a LoRA adapter), with both dimensions multiples of 16,
    and with layers="auto" large enough (`worth_fp8`)."""
    leaf, path = fqn.rsplit(".", 1)[-1], f".{fqn}"
    return (type(module) is nn.Linear and leaf in BLOCK_LINEARS + MLA_LINEARS
            and (".layers." in path or ".mtp.depths." in path)
            and module.in_features % 16 == 0 and module.out_features % 16 == 0
            and (layers == "all" or worth_fp8(recipe, module.out_features, module.in_features)))


def apply(model: nn.Module, mesh: Any, config: Any, device: Optional[torch.device] = None) -> int:
    """Convert the block linears of `model` in place when config.float8 is a recipe; the number converted
    (0 when --float8=off). ValueError (one line) for a GPU without FP8 or a missing torchao."""
    recipe = str(getattr(config, "float8", "off"))
    if recipe == "off":
        return 0
    device = torch.device(device if device is not None else next(model.parameters()).device)
    problem = fp8_matmul_problem(device)
    if problem:
        raise ValueError(problem)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional extra
    except ImportError as e:
        raise ValueError(f"--float8={recipe} needs torchao (pip install torchao==0.18.0): {e}") from e
    fp8_config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=not is_accelerator(device))
    layers = str(getattr(config, "float8_layers", "auto"))
    candidates = [fqn for fqn, m in model.named_modules() if converts(fqn, m)]
    chosen = {fqn for fqn, m in model.named_modules() if converts(fqn, m, recipe, layers)}
    convert_to_float8_training(model, config=fp8_config, module_filter_fn=lambda m, fqn: fqn in chosen)
    kinds = sorted({f.rsplit(".", 1)[-1] for f in chosen})
    log.info("--float8=%s: %d of %d block linears in FP8 (%s)%s", recipe, len(chosen), len(candidates),
             ", ".join(kinds) or "none",
             "" if layers == "all" or len(chosen) == len(candidates) else
             "; the others are too small to gain (--float8_layers=all converts them too)")
    return len(chosen)
