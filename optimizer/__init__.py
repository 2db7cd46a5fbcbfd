"""optimizer: AdamW with fp32 masters, loss scaling and global-norm clipping over DDP buffers.

`build_optimizer(ddp_model, config)` is the only constructor the trainer needs; it returns the
sharded ZeRO optimizer when `config.use_distributed_optimizer` is set (trap 7: the flag really
shards the optimizer state), the unsharded one otherwise. See docs/parallel.md.
"""
from optimizer.grad_scaler import ConstantScaler, DynamicGradScaler
from optimizer.mixed_precision_optimizer import MixedPrecisionOptimizer
from optimizer.optimizer_config import OptimizerConfig


def build_optimizer(ddp_model, config: OptimizerConfig, norm_groups=()) -> MixedPrecisionOptimizer:
    """norm_groups: process groups of ranks holding other parameters of the model (pipeline stages),
    over which the gradient norm and the skip decision are global too."""
    if config.use_distributed_optimizer:
        # Imported here: parallel.distributed_optimizer builds on this package.
        from parallel.distributed_optimizer import DistributedOptimizer
        return DistributedOptimizer(ddp_model, config, norm_groups)
    return MixedPrecisionOptimizer(ddp_model, config, norm_groups)


__all__ = ["build_optimizer", "OptimizerConfig", "MixedPrecisionOptimizer", "DynamicGradScaler",
           "ConstantScaler"]
