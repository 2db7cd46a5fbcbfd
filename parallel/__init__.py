"""parallel: how a model is spread over processes, behind one interface (engine.py: the `TrainingEngine`
protocol the trainer uses; build.py: `build_engine` -> DDPEngine | FSDPEngine | PipelineParallelEngine, one
module each; config.py: the typed `ParallelConfig`, the engines' capabilities and every refusal; mesh.py:
the one device mesh; transforms/: tensor parallel, activation checkpointing, compile, in their order).

- distributed_data_parallel/: our DDP (contiguous parameter/gradient buffers, buckets, comm hooks);
  comm_hooks.py and powersgd.py its hooks (their collectives: utils/comm.py). The optimizers over those
  buffers, ZeRO-1/2 included, live in optimizer/, which never imports this package.
- fsdp.py: torch FSDP2 (`fully_shard`) with its optimizer (optimizer/fsdp_optimizer.py); its sharded
  DCP checkpoints are checkpoint/dcp.py's.
- pipeline.py: pipeline stages (the Transformer pruned) on torch.distributed.pipelining, x data parallel.

Importing the package imports no torch (the trainer's pre-check reads parallel/config.py before torch
loads); the DDP names below are resolved from their modules on first use. See docs/parallel.md."""
import importlib

_EXPORTS = {
    "DDPConfig": "parallel.distributed_data_parallel", "DistributedDataParallel": "parallel.distributed_data_parallel",
    "GradBucket": "parallel.distributed_data_parallel", "CommHandle": "utils.comm",
    "CommHookState": "parallel.comm_hooks", "allreduce_hook": "parallel.comm_hooks",
    "reduce_scatter_hook": "parallel.comm_hooks", "fp16_compress_wrapper": "parallel.comm_hooks",
    "bf16_compress_wrapper": "parallel.comm_hooks", "PowerSGDState": "parallel.powersgd",
    "powersgd_hook": "parallel.powersgd",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'parallel' has no attribute {name!r}")
