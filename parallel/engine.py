"""The trainer's one interface to the parallel engines: a wrapped model, an optimizer, and a
checkpoint adapter, whatever engine runs underneath.

    engine = build_engine(model, cfg)          # cfg.parallel: "ddp" (default) or "fsdp"
    out = engine.model(x, ...)                 # forward; `with engine.model.no_sync():` to accumulate
    engine.optimizer.scale_loss(loss).backward(); engine.optimizer.step()
    engine.save(out_dir, step, ...)            # collective: every rank calls it
    extra = engine.load(ckpt_dir, saved_world) # collective: weights, optimizer, comm-hook state

- ddp: our DistributedDataParallel (buckets, comm hooks, PowerSGD) + MixedPrecisionOptimizer, or the
  ZeRO-1/2 DistributedOptimizer with --use_distributed_optimizer. Checkpoints: utils/checkpoint.py
  (full weights in model.safetensors from rank 0, optimizer state per rank when sharded; it re-shards
  to another world size). LoRA runs store only the trainable tensors (see `trainable_state`).
- fsdp: torch FSDP2 (`fully_shard` per block + root) + FSDPOptimizer (parallel/fsdp.py). Checkpoints:
  torch.distributed.checkpoint, sharded, no gather, loadable at any world size
  (parallel/dcp_checkpoint.py), in the same step_N/ layout, so listing, verification and pruning are shared.

Owns: engine choice and wrapping, and how each engine saves and loads its state.
Must never: run the training loop, or decide what the trainer's state holds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from utils import checkpoint as ckpt


@dataclass
class Engine:
    kind: str                       # "ddp" | "fsdp"
    model: nn.Module                # DistributedDataParallel or FSDPDataParallel: forward, no_sync()
    optimizer: Any                  # MixedPrecisionOptimizer / DistributedOptimizer / FSDPOptimizer API
    module: nn.Module               # the unwrapped model (state-dict keys without a prefix)
    sharded_optimizer: bool = False
    # LoRA runs whose frozen base is a file: {"source", "fingerprint"}; then only trainable tensors are saved
    lora_base: Optional[dict] = field(default=None)

    # ------------------------------------------------------------------ save
    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print) -> str:
        self.optimizer.finish_param_sync()  # ZeRO + overlapped gather: parameters complete before reading them
        hook_state = self.model.comm_hook_state_dict()
        if hook_state:
            extra_state = dict(extra_state, comm_hook=hook_state)
        if self.kind == "fsdp":
            from parallel.dcp_checkpoint import save_dcp_checkpoint
            state = dict(trainer_state, step=step, world_size=world_size)
            path = save_dcp_checkpoint(ckpt.checkpoint_root(out_dir), step, self.model, self.optimizer,
                                       json_files={"trainer_state.json": state, "model_config.json": model_config,
                                                   "config.json": run_config},
                                       rank_state=extra_state, fault_hook=fault_hook)
            if rank == 0:
                ckpt.prune_checkpoints(out_dir, keep_last=keep_last, keep_best=True, log=log)
            barrier()
            return path
        if self.lora_base is not None:
            trainer_state = dict(trainer_state, lora_base=self.lora_base)
        model_state = None
        if rank == 0:
            model_state = trainable_state(self.module) if self.lora_base is not None else self.module.state_dict()
        req = ckpt.SaveRequest(step=step, rank=rank, world_size=world_size, model_state=model_state,
                               model_config=model_config,
                               optimizer_state=self.optimizer.state_dict() if self.sharded_optimizer or rank == 0 else None,
                               extra_state=extra_state, trainer_state=trainer_state, run_config=run_config)
        return ckpt.save_checkpoint(out_dir, req, barrier=barrier, keep_last=keep_last, fault_hook=fault_hook, log=log)

    # ------------------------------------------------------------------ load
    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int) -> Optional[dict]:
        """Weights, optimizer and comm-hook state of `ckpt_dir` into this engine; returns this rank's
        extra state (RNG) or None. The model must already hold the LoRA base when the checkpoint is light."""
        if is_sharded_checkpoint(ckpt_dir):
            if self.kind != "fsdp":
                raise ckpt.CheckpointError(f"checkpoint {ckpt_dir} was written by --parallel=fsdp (sharded, DCP); "
                                           "resume it with --parallel=fsdp")
            from parallel.dcp_checkpoint import load_dcp_checkpoint
            load_dcp_checkpoint(ckpt_dir, self.model, self.optimizer)
            return ckpt.load_rank_file(ckpt_dir, "extra", rank) if saved_world == world_size else None
        if self.kind == "fsdp":
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir} was written by --parallel=ddp; resume it with "
                                       "--parallel=ddp (or start a new fsdp run with --init_from=<that checkpoint>)")
        load_weights(self.module, ckpt.load_model_state(ckpt_dir), partial=self.lora_base is not None, source=ckpt_dir)
        load_optimizer_state(self.optimizer, ckpt_dir, self.sharded_optimizer, rank, world_size, saved_world)
        extra = ckpt.load_rank_file(ckpt_dir, "extra", rank)
        if extra is not None and extra.get("comm_hook"):
            self.model.load_comm_hook_state_dict(extra["comm_hook"])
        return extra if saved_world == world_size else None


def is_sharded_checkpoint(ckpt_dir: str) -> bool:
    from parallel.dcp_checkpoint import is_dcp_checkpoint
    return is_dcp_checkpoint(ckpt_dir)


def load_optimizer_state(opt, ckpt_dir: str, sharded: bool, rank: int, world_size: int, saved_world: int) -> None:
    """Any saved layout into this optimizer: a ZeRO rank at the same world size reads its own shard;
    otherwise rank 0's file when it holds everything (an unsharded run, or a ZeRO run of one rank),
    else every saved rank's file, which the optimizer re-shards to this world size."""
    def read(r: int) -> dict:
        sd = ckpt.load_rank_file(ckpt_dir, "optimizer", r)
        if sd is None:
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: optimizer_rank{r}.pt is missing "
                                       f"(the run saved {saved_world} rank(s))")
        return sd
    try:
        if sharded and saved_world == world_size and os.path.isfile(os.path.join(ckpt_dir, f"optimizer_rank{rank}.pt")):
            own = read(rank)
            if own.get("sharded"):
                opt.load_state_dict(own)
                return
        first = read(0)
        if not first.get("sharded") or int(first.get("world_size", 1)) == 1:
            opt.load_state_dict(first)
        else:
            opt.load_state_dict([first] + [read(r) for r in range(1, int(first["world_size"]))])
    except (ValueError, KeyError) as e:
        raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: optimizer state does not load ({e})") from e


# ---------------------------------------------------------------------------- light LoRA checkpoints

def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a LoRA run changes: its trainable parameters (adapters, and the embedding / LM head
    when they train). Everything else is the frozen base, which the checkpoint references instead."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if id(v) in trainable}


def load_weights(module: nn.Module, state: dict[str, torch.Tensor], partial: bool, source: str) -> None:
    """Full checkpoints must match the model exactly; a light (LoRA) one must cover exactly the
    trainable parameters, and the rest must be the base the checkpoint references (checked by the caller)."""
    if not partial:
        module.load_state_dict(state)
        return
    want = set(trainable_state(module))
    have = set(state)
    if want != have:
        raise ckpt.CheckpointError(f"checkpoint {source}: its tensors are not this run's trainable parameters "
                                   f"(missing {sorted(want - have)[:4]}, unexpected {sorted(have - want)[:4]}); "
                                   "were the --lora_* flags changed?")
    module.load_state_dict(state, strict=False)


def base_fingerprint(module: nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of the frozen (non-trainable) tensors."""
    import hashlib
    h = hashlib.sha256()
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    for k, v in sorted(module.state_dict(keep_vars=True).items()):
        if id(v) in trainable:
            continue
        t = v.detach().to("cpu").contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ---------------------------------------------------------------------------- build

def build_engine(model: nn.Module, cfg: Any, group: Any = None) -> Engine:
    """Wrap `model` for `cfg.parallel` and build its optimizer: the same objects for world size 1 and N."""
    from optimizer import OptimizerConfig
    from utils.device import parse_dtype
    zero = cfg.use_distributed_optimizer
    opt_cfg = OptimizerConfig(
        lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip, precision=cfg.dtype, use_distributed_optimizer=zero, zero_stage=cfg.zero_stage,
        overlap_param_gather=cfg.overlap_param_gather, overlap_optim_step=cfg.overlap_optim_step,
        fused=cfg.device != "cpu")
    if cfg.parallel == "fsdp":
        from parallel.fsdp import build_fsdp_engine, unwrap
        wrapped, opt = build_fsdp_engine(model, opt_cfg, mesh_or_group=group, param_dtype=parse_dtype(cfg.dtype),
                                         reshard_after_forward=cfg.reshard_after_forward,
                                         cpu_offload=cfg.cpu_offload)
        return Engine("fsdp", wrapped, opt, unwrap(wrapped), sharded_optimizer=True)
    from optimizer import build_optimizer
    from parallel import (DDPConfig, DistributedDataParallel, PowerSGDState, allreduce_hook,
                          bf16_compress_wrapper, fp16_compress_wrapper, powersgd_hook, reduce_scatter_hook)
    ddp = DistributedDataParallel(model, DDPConfig(bucket_size=cfg.bucket_size,
                                                   overlap_grad_reduce=cfg.overlap_grad_reduce,
                                                   grad_reduce_in_fp32=cfg.grad_reduce_in_fp32,
                                                   use_distributed_optimizer=zero), process_group=group)
    ddp.broadcast_params()
    if cfg.comm_hook == "powersgd":
        ddp.register_comm_hook(PowerSGDState(matrix_approximation_rank=cfg.powersgd_rank,
                                             start_powerSGD_iter=cfg.powersgd_start_iter,
                                             min_compression_rate=cfg.powersgd_min_compression_rate,
                                             warm_start=cfg.powersgd_warm_start, seed=cfg.seed), powersgd_hook)
    elif cfg.comm_hook in ("fp16", "bf16"):
        wrap = fp16_compress_wrapper if cfg.comm_hook == "fp16" else bf16_compress_wrapper
        ddp.register_comm_hook(None, wrap(reduce_scatter_hook if zero else allreduce_hook))
    # "reduce_scatter" is what the distributed optimizer registers itself (validate_config insists on it)
    return Engine("ddp", ddp, build_optimizer(ddp, opt_cfg), model, sharded_optimizer=zero)


def checkpoint_model_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The weights stored in a checkpoint of either engine, in one process (export, sampling, init)."""
    if is_sharded_checkpoint(ckpt_dir):
        from parallel.dcp_checkpoint import load_full_model_state_dict
        return load_full_model_state_dict(ckpt_dir)
    return ckpt.load_model_state(ckpt_dir)


def checkpoint_world_size(ckpt_dir: str) -> int:
    return int(ckpt.read_json(os.path.join(ckpt_dir, "trainer_state.json"))["world_size"])
