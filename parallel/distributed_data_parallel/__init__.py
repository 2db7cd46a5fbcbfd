"""Data parallelism with contiguous buffers and buckets (see docs/parallel.md)."""
from parallel.distributed_data_parallel.ddp_config import DDPConfig
from parallel.distributed_data_parallel.distributed_data_parallel import SHARD_OF_ATTR, DistributedDataParallel
from parallel.distributed_data_parallel.param_and_grad_buffer import (Bucket, GradBucket,
                                                                      ParamAndGradBuffer, ParamSlot)

__all__ = ["DDPConfig", "DistributedDataParallel", "Bucket", "GradBucket", "ParamAndGradBuffer",
           "ParamSlot", "SHARD_OF_ATTR"]
