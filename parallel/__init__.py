"""parallel: how a model is spread over processes, behind one interface (engine.py: `build_engine` ->
DDPEngine | FSDPEngine | PipelineParallelEngine, the `TrainingEngine` protocol the trainer uses).

- distributed_data_parallel/: our DDP (contiguous parameter/gradient buffers, buckets, comm hooks);
  comm_hooks.py and powersgd.py its hooks (their collectives: utils/comm.py). The optimizers over those
  buffers, ZeRO-1/2 included, live in optimizer/, which never imports this package.
- fsdp.py + dcp_checkpoint.py: torch FSDP2 (`fully_shard`) with its optimizer (optimizer/fsdp_optimizer.py),
  sharded DCP checkpoints.
- pipeline.py: pipeline stages (the Transformer pruned) on torch.distributed.pipelining, x data parallel.
This module re-exports the DDP pieces. See docs/parallel.md."""
from parallel.distributed_data_parallel import DDPConfig, DistributedDataParallel, GradBucket
from parallel.comm_hooks import (CommHookState, allreduce_hook, bf16_compress_wrapper,
                                 fp16_compress_wrapper, reduce_scatter_hook)
from parallel.powersgd import PowerSGDState, powersgd_hook
from utils.comm import CommHandle

__all__ = ["DDPConfig", "DistributedDataParallel", "GradBucket", "CommHandle", "CommHookState",
           "allreduce_hook", "reduce_scatter_hook", "fp16_compress_wrapper", "bf16_compress_wrapper",
           "PowerSGDState", "powersgd_hook"]
