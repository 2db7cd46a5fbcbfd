"""parallel: data-parallel engine (buffers, buckets, comm hooks, PowerSGD, ZeRO). See docs/parallel.md."""
from parallel.distributed_data_parallel import DDPConfig, DistributedDataParallel, GradBucket
from parallel.comm import CommHandle
from parallel.comm_hooks import (CommHookState, allreduce_hook, bf16_compress_wrapper,
                                 fp16_compress_wrapper, reduce_scatter_hook)
from parallel.powersgd import PowerSGDState, powersgd_hook

__all__ = ["DDPConfig", "DistributedDataParallel", "GradBucket", "CommHandle", "CommHookState",
           "allreduce_hook", "reduce_scatter_hook", "fp16_compress_wrapper", "bf16_compress_wrapper",
           "PowerSGDState", "powersgd_hook"]
