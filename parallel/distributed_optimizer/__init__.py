"""ZeRO-1/2 sharded optimizer (see distributed_optimizer.py and docs/parallel.md)."""
from parallel.distributed_optimizer.distributed_optimizer import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
