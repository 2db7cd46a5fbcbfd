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

Owns: which layers are converted, the recipe, the device check.
Must never: convert a layer whose dimensions the FP8 kernels cannot take (multiples of 16), or change a
parameter's name or dtype.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from utils.device import fp8_matmul_problem, is_accelerator

RECIPES = ("tensorwise", "rowwise")
BLOCK_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def converts(fqn: str, module: nn.Module) -> bool:
    """Whether the transform converts this module: a block's linear layer (not the LM head, not a LoRA
    adapter) with both dimensions multiples of 16."""
    leaf = fqn.rsplit(".", 1)[-1]
    return (type(module) is nn.Linear and leaf in BLOCK_LINEARS and ".layers." in f".{fqn}"
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


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
    chosen = {fqn for fqn, m in model.named_modules() if converts(fqn, m)}
    convert_to_float8_training(model, config=fp8_config, module_filter_fn=lambda m, fqn: fqn in chosen)
    return len(chosen)
