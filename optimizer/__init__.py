"""optimizer: every optimizer of the project, AdamW (and Muon beside it) with fp32 masters, loss scaling and
global-norm clipping, on one step skeleton (base.py) and one AdamW factory (adamw.py):

- mixed_precision_optimizer.py: MixedPrecisionOptimizer, over our DDP's gradient buffers, its state dict in
  ddp_state.py, its step path (one class each: step_paths.py, one_launch_step.py) chosen once when it is built;
- distributed_optimizer.py: DistributedOptimizer, ZeRO-1/2 over the same buffers;
- its updates: AdamW (adamw.py BucketAdamW, batched by fused_step.py; one launch per buffer: flat_adamw.py) and,
  with --optimizer=muon, Muon beside it (muon.py);
- fsdp_optimizer.py: FSDPOptimizer, over FSDP2's sharded DTensor parameters (imported from there: it
  loads torch's FSDP).

`build_optimizer(ddp_model, config)` is the only constructor the trainer needs for our DDP; it returns the
sharded ZeRO optimizer when `config.use_distributed_optimizer` is set (trap 7: the flag really shards
the optimizer state), the unsharded one otherwise. This package never imports parallel/ (it sits below
it): it steps over the DDP object it is given by duck typing. See docs/parallel.md.
"""
import dataclasses
import importlib
import os
from typing import Optional, Sequence

from optimizer.optimizer_config import OptimizerConfig

# resolved from their modules on first use: importing the package (and optimizer_config.py, which the trainer's
# torch-free pre-check reads) loads no torch, as parallel/ does
_EXPORTS = {
    "DistributedOptimizer": "optimizer.distributed_optimizer", "MixedPrecisionOptimizer":
    "optimizer.mixed_precision_optimizer", "DynamicGradScaler": "optimizer.grad_scaler",
    "ConstantScaler": "optimizer.grad_scaler",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'optimizer' has no attribute {name!r}")


def build_optimizer(ddp_model, config: OptimizerConfig, norm_groups: Sequence = (), *, path: Optional[str] = None):
    """norm_groups: process groups of ranks holding other parameters of the model (pipeline stages),
    over which the gradient norm and the skip decision are global too. path: the step path by name
    (optimizer/step_paths.py PATHS: tests), None: the run's, chosen once here. MYLLM_FLAT_ADAMW=auto|on|off, where
    `config.one_launch` is "auto", stands for it (a run started as a command: scripts/kill_trials.py).
    Returns a MixedPrecisionOptimizer (a DistributedOptimizer with `config.use_distributed_optimizer`)."""
    env = os.environ.get("MYLLM_FLAT_ADAMW")
    if env is not None and config.one_launch == "auto":
        if env not in ("auto", "on", "off"):
            raise ValueError(f"MYLLM_FLAT_ADAMW={env!r}: auto | on | off")
        config = dataclasses.replace(config, one_launch=env)
    if config.use_distributed_optimizer:
        from optimizer.distributed_optimizer import DistributedOptimizer
        return DistributedOptimizer(ddp_model, config, norm_groups, path=path)
    from optimizer.mixed_precision_optimizer import MixedPrecisionOptimizer
    return MixedPrecisionOptimizer(ddp_model, config, norm_groups, path=path)


__all__ = ["build_optimizer", "OptimizerConfig", "MixedPrecisionOptimizer", "DistributedOptimizer",
           "DynamicGradScaler", "ConstantScaler"]
