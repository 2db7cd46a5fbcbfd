"""The trainer's one interface to the parallel engines (`TrainingEngine`): a wrapped model, an optimizer,
one training step's forward + backward, evaluation, and the engine's own checkpoint format, whatever engine
runs underneath. One class per engine: DDPEngine (our DDP / ZeRO), FSDPEngine (FSDP2),
PipelineParallelEngine (stages over either); `build_engine` picks it from the flags, and the trainer
never branches on which one it got.

    engine = build_engine(model, cfg)          # cfg.parallel: "ddp" (default) or "fsdp";
                                               # cfg.pipeline_parallel_size > 1: pipeline stages, dp over either
    engine.optimizer.zero_grad()
    sums = engine.forward_backward(batches, loss_fn, global_units)   # this replica's micro-batches
    engine.optimizer.step()
    sums = engine.evaluate(batches, loss_fn)   # no gradients
    totals = engine.sum_over_data(values, device)  # each data-parallel replica counted once
    engine.save(out_dir, step, ...)            # collective: every rank calls it
    extra = engine.load(ckpt_dir, saved_world) # collective: weights, optimizer, comm-hook state

loss_fn(model, batch) -> (sum of the micro-batch's per-unit losses, {stat: sum}) is the task's loss
(token CE, DPO); the engine decides how micro-batches run and how gradients are normalised (by
`global_units`, the target units of all micro-batches of all data-parallel replicas).
`engine.dp_rank` / `engine.dp_size` are the data-parallel coordinates the data loader must use.

- ddp (DDPEngine): our DistributedDataParallel (buckets, comm hooks, PowerSGD) + MixedPrecisionOptimizer, or the
  ZeRO-1/2 DistributedOptimizer with --use_distributed_optimizer. Checkpoints: utils/checkpoint.py
  (full weights in model.safetensors from rank 0, optimizer state per rank when sharded; it re-shards
  to another world size). LoRA runs store only the trainable tensors (see `trainable_state`).
- fsdp (FSDPEngine): torch FSDP2 (`fully_shard` per block + root) + FSDPOptimizer (parallel/fsdp.py), built on
  the run's device mesh (parallel/mesh.py): tensor (+ sequence) parallel over its "tp" dim with
  --tensor_parallel_size (parallel/tensor_parallel.py), HSDP over ("dp_replicate", "dp_shard") with
  --dp_replicate_size. Checkpoints:
  torch.distributed.checkpoint, sharded, no gather, loadable at any world size
  (parallel/dcp_checkpoint.py), in the same step_N/ layout, so listing, verification and pruning are shared.
- pipeline (`PipelineParallelEngine`, cfg.pipeline_parallel_size = P > 1): parallel/pipeline.py's
  stages + GPipe/1F1B schedule on a pp x dp mesh (pp x dp x tp with --tensor_parallel_size, FSDP only),
  our DDP or FSDP per stage over dp. The task's
  loss_fn is not used: the last stage computes the token loss (pretrain, SFT; no DPO). Checkpoints:
  per-stage files (stage{s}_model.safetensors, stage{s}_optimizer_dp{r}.pt, pipeline.json) in the same
  step_N/ layout with the same manifest / COMPLETE / atomic rename; resumable at the same mesh only;
  `checkpoint_model_state` merges the stages into one model (export, --init_from).

Owns: engine choice and wrapping, how each engine runs a step's micro-batches, and how it saves and loads its state.
Must never: run the training loop, or decide what the trainer's state holds.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

import torch
from torch import nn

from utils import checkpoint as ckpt
from utils.publish import fsync_file, make_temp_dir, temp_dir_for

# loss_fn(model, batch) -> (sum of the per-unit losses of the micro-batch, {"chosen_reward": sum, ...})
LossFn = Callable[[nn.Module, dict], tuple[torch.Tensor, dict]]
STAT_KEYS = ("chosen_reward", "rejected_reward", "reward_acc")
STEP_FIELDS = ("loss_sum", *STAT_KEYS, "units")  # the layout of every engine's step / evaluation sums


@dataclass
class StepStats:
    """Sums over micro-batches (and, once reduced, over data-parallel replicas) with names: what
    `forward_backward` and `evaluate` return as one float64 vector in STEP_FIELDS order (a vector so
    that one all-reduce carries it). `units`: target tokens (pretrain/SFT) or pairs (DPO); the
    forward_backward vector leaves it 0 (the trainer counted the step's units before the step)."""
    loss_sum: float = 0.0
    chosen_reward: float = 0.0
    rejected_reward: float = 0.0
    reward_acc: float = 0.0
    units: float = 0.0

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepStats":
        return cls(*(float(v) for v in t.detach().to("cpu", torch.float64).reshape(-1).tolist()))

    def per_unit(self, units: Optional[float] = None) -> dict[str, float]:
        """Each sum divided by `units` (default: its own count, at least 1)."""
        n = max(1.0, self.units if units is None else units)
        return {"loss": self.loss_sum / n, **{k: getattr(self, k) / n for k in STAT_KEYS}}


def _stat_row(loss_sum: torch.Tensor, stats: dict, units: float = 0.0) -> torch.Tensor:
    """float64 STEP_FIELDS of one micro-batch, on the loss's device, without a host read: tensor
    statistics are detached and cast there, host numbers enter by a fill (`new_full`)."""
    def one(v: Any) -> torch.Tensor:
        if isinstance(v, torch.Tensor):
            return v.detach().to(dtype=torch.float64).reshape(1)
        return loss_sum.new_full((1,), float(v), dtype=torch.float64)
    return torch.cat([one(loss_sum)] + [one(stats.get(k, 0.0)) for k in STAT_KEYS] + [one(units)])


def _zero_stats() -> torch.Tensor:
    return torch.zeros(len(STEP_FIELDS), dtype=torch.float64)


class TrainingEngine(Protocol):
    """What the trainer asks of an engine (one class per engine below; `build_engine` picks it)."""
    kind: str
    optimizer: Any
    module: nn.Module
    dp_rank: int
    dp_size: int
    fixed_batch_shape: bool
    micro_batches_per_call: int
    lora_base: Optional[dict]

    def place_reference(self, ref: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module: ...
    def reference_layout(self) -> str: ...
    def forward_backward(self, batches: Sequence[dict], loss_fn: LossFn, global_units: float,
                         poison: bool = False) -> torch.Tensor: ...
    def evaluate(self, batches: Sequence[dict], loss_fn: LossFn, count_units: Callable[[dict], int]) -> torch.Tensor: ...
    def sum_over_data(self, values: "list[float] | torch.Tensor", device: torch.device,
                      to_host: bool = True) -> torch.Tensor: ...
    def resume_problem(self, ckpt_dir: str, saved_world: int, world_size: int) -> Optional[str]: ...
    def save(self, out_dir: str, step: int, **kw: Any) -> str: ...
    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
             log: Callable[[str], None] = print) -> Optional[dict]: ...


@dataclass
class Engine:
    """What every engine shares: micro-batches with gradient accumulation through a DDP-like wrapper
    (`no_sync`), forward-only evaluation, sums over the data-parallel replicas. Subclasses own the
    reference-model layout and the checkpoint format: DDPEngine, FSDPEngine, PipelineParallelEngine."""
    kind: ClassVar[str] = "engine"
    model: nn.Module                # our DistributedDataParallel (forward, no_sync(), train()) or the fully_shard-ed model
                                    # (pipeline: this rank's stage, wrapped over the dp group)
    optimizer: Any                  # MixedPrecisionOptimizer / DistributedOptimizer / FSDPOptimizer API
    module: nn.Module               # the unwrapped model or stage (state-dict keys without a prefix)
    sharded_optimizer: bool = False
    # LoRA runs whose frozen base is a file: {"source", "fingerprint"}; then only trainable tensors are saved
    lora_base: Optional[dict] = field(default=None)
    dp_rank: int = 0                # data-parallel coordinates: which slice of the global batch this rank reads
    dp_size: int = 1
    forward_model: Optional[nn.Module] = None  # what runs the forward (torch.compile(model) with --compile)
    fixed_batch_shape: bool = False  # every micro-batch must have one [batch, seq] shape (pipeline stages)
    micro_batches_per_call: int = 1  # evaluate() takes a multiple of this many batches
    # False on ranks whose sums repeat another rank's (pipeline stages after the first, tensor-parallel
    # ranks after the first hold the same batch): they add zeros in sum_over_data
    counts_in_sums: bool = True
    mesh: Any = None                 # the run's DeviceMesh (parallel/mesh.py), where the engine built one

    def __post_init__(self) -> None:
        if self.forward_model is None:
            self.forward_model = self.model

    def _no_sync(self) -> contextlib.AbstractContextManager:
        """Backward inside it accumulates gradients without communicating (all but the last micro-batch)."""
        return self.model.no_sync()

    # ------------------------------------------------------------------ DPO's reference model
    def place_reference(self, ref: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """DPO's frozen reference model, laid out like the trained one: here a full copy in `dtype` on
        every rank (FSDPEngine shards it)."""
        return ref.to(device=device, dtype=dtype)

    def reference_layout(self) -> str:
        """How place_reference lays out DPO's reference model, for the start-up log."""
        return "a full copy"

    # ------------------------------------------------------------------ one step
    def forward_backward(self, batches: Sequence[dict], loss_fn: LossFn, global_units: float,
                         poison: bool = False) -> torch.Tensor:
        """Forward + backward of this rank's micro-batches; gradients accumulate (no_sync on all but
        the last) and are those of (all replicas' loss sums) / global_units. Returns the float64
        STEP_FIELDS sums of this rank's micro-batches (StepStats.from_tensor names them), on the
        device that computed them: nothing here reads a value back to the host (no sync per micro-batch;
        the trainer reads the step's sums once, after the optimizer step).
        poison (a test hook): the step's loss and gradients become NaN."""
        acc = None
        n = len(batches)
        for i, batch in enumerate(batches):
            sync = contextlib.nullcontext() if i == n - 1 else self._no_sync()
            with sync:
                loss_sum, stats = loss_fn(self.forward_model, batch)
                if poison:
                    loss_sum = loss_sum * float("nan")
                # our DDP averages gradients over ranks; * world / global_units makes the result the
                # gradient of (sum of all ranks' losses) / (all ranks' target units)
                self.optimizer.scale_loss(loss_sum * (self.dp_size / global_units)).backward()
            row = _stat_row(loss_sum, stats)
            acc = row if acc is None else acc + row
        return acc if acc is not None else _zero_stats()

    @torch.no_grad()
    def evaluate(self, batches: Sequence[dict], loss_fn: LossFn, count_units: Callable[[dict], int]) -> torch.Tensor:
        """float64 STEP_FIELDS sums over this rank's validation batches, units counted (forward only;
        the model is back in train mode afterwards)."""
        self.forward_model.eval()
        sums = None
        try:
            for batch in batches:
                loss_sum, stats = loss_fn(self.forward_model, batch)
                row = _stat_row(loss_sum, stats, units=count_units(batch))  # counted on the host batch
                sums = row if sums is None else sums + row
        finally:
            self.forward_model.train()
            self._after_forward_only()
        return sums if sums is not None else _zero_stats()

    def _after_forward_only(self) -> None:
        """Hook after a forward with no backward (FSDPEngine frees the gathered parameters)."""

    def sum_over_data(self, values: "list[float] | torch.Tensor", device: torch.device,
                      to_host: bool = True) -> torch.Tensor:
        """Sum a small float64 vector over the data-parallel replicas (every rank gets the result; ranks
        that repeat another's batch add zeros); to_host=False: left on the device for a later HostCopy
        (utils.dist.all_reduce_sum)."""
        from utils.dist import all_reduce_sum
        if not self.counts_in_sums:
            t = values.clone() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
            values = t.zero_()
        return all_reduce_sum(values, device, to_host=to_host)

    def resume_problem(self, ckpt_dir: str, saved_world: int, world_size: int) -> Optional[str]:
        """Why this engine cannot resume `ckpt_dir` (saved by `saved_world` processes), or None."""
        if is_pipeline_checkpoint(ckpt_dir):
            meta = read_pipeline_meta_safe(ckpt_dir)
            return (f"{ckpt_dir} was written with --pipeline_parallel_size={meta.get('pp_size')}; resume it with "
                    "that pipeline layout (or start a new run from it with --init_from=<that checkpoint>)")
        return None

    # ------------------------------------------------------------------ checkpoints (each engine's own format)
    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print) -> str:
        """Collective: this step's checkpoint under out_dir/checkpoints, published atomically; its path."""
        raise NotImplementedError

    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
             log: Callable[[str], None] = print) -> Optional[dict]:
        """Weights, optimizer and comm-hook state of `ckpt_dir` into this engine; returns this rank's
        extra state (RNG) or None. The model must already hold the LoRA base when the checkpoint is light.
        Raises CheckpointError naming the file when a file is damaged, CheckpointMismatchError when an
        intact checkpoint holds other tensor names or shapes than this model. A missing
        extra_rank{r}.pt at the same world size is logged (through `log`, on every rank) and returns None."""
        raise NotImplementedError


@dataclass
class DDPEngine(Engine):
    """Our DistributedDataParallel + MixedPrecisionOptimizer, or ZeRO-1/2 (DistributedOptimizer).
    Checkpoints: utils/checkpoint.py (full weights from rank 0, or only the trainable tensors of a LoRA
    run whose base is a file; optimizer state per rank when sharded, re-sharded at another world size)."""
    kind: ClassVar[str] = "ddp"

    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print) -> str:
        self.optimizer.finish_param_sync()  # ZeRO + overlapped gather: parameters complete before reading them
        hook_state = self.model.comm_hook_state_dict()
        if hook_state:
            extra_state = dict(extra_state, comm_hook=hook_state)
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

    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
             log: Callable[[str], None] = print) -> Optional[dict]:
        problem = self.resume_problem(ckpt_dir, saved_world, world_size)
        if problem:
            raise ckpt.CheckpointError(problem)
        if is_sharded_checkpoint(ckpt_dir):
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir} was written by --parallel=fsdp (sharded, DCP); "
                                       "resume it with --parallel=fsdp")
        # every file this rank reads, read and checked before any collective; then one collective of every
        # rank's verdict, so that a file damaged at one rank is the same line at all of them
        with agreed_reads(self.module):
            weights = ckpt.load_model_state(ckpt_dir)
            opt_state = read_optimizer_state(ckpt_dir, self.sharded_optimizer, rank, world_size, saved_world)
            extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log, same_world_only=False)
        load_weights(self.module, weights, partial=self.lora_base is not None, source=ckpt_dir,
                     mismatch=ckpt.CheckpointMismatchError)
        load_optimizer_state(self.optimizer, ckpt_dir, self.sharded_optimizer, rank, world_size, saved_world,
                             read=opt_state)
        if extra is not None and extra.get("comm_hook"):
            try:
                self.model.load_comm_hook_state_dict(extra["comm_hook"])
            except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
                if isinstance(e, torch.OutOfMemoryError):
                    raise
                raise ckpt.CheckpointError(f"{os.path.join(ckpt_dir, f'extra_rank{rank}.pt')}: its comm-hook "
                                           f"(PowerSGD) state does not load ({type(e).__name__}: "
                                           f"{ckpt.one_line(e)[:200]})") from e
        return extra if saved_world == world_size else None


@dataclass
class FSDPEngine(Engine):
    """torch FSDP2 (`fully_shard` per block + root) + FSDPOptimizer (parallel/fsdp.py). Checkpoints:
    torch.distributed.checkpoint, sharded, no gather, loadable at any world size (parallel/dcp_checkpoint.py)."""
    kind: ClassVar[str] = "fsdp"

    def place_reference(self, ref: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """DPO's reference laid out on the same mesh (tensor-parallel like the policy, fp32 shards, each
        block gathered in `dtype` for its forward and freed after it), so it costs 1/world of its bytes."""
        from parallel.fsdp import shard_on_mesh
        return shard_on_mesh(ref.to(device=device, dtype=torch.float32), self.mesh, param_dtype=dtype,
                             reshard_after_forward=True)

    def reference_layout(self) -> str:
        tp = self.mesh["tp"].size() if self.mesh is not None else 1
        return "sharded by FSDP2" + (f" and split over {tp} tensor-parallel ranks" if tp > 1 else "")

    def _no_sync(self) -> contextlib.AbstractContextManager:
        from parallel.fsdp import no_sync  # the model is the fully_shard-ed module itself: no wrapper
        return no_sync(self.model)

    def _after_forward_only(self) -> None:
        from parallel.fsdp import reshard  # no backward follows to free what the forward gathered: free it now
        reshard(self.model)

    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print) -> str:
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

    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
             log: Callable[[str], None] = print) -> Optional[dict]:
        problem = self.resume_problem(ckpt_dir, saved_world, world_size)
        if problem:
            raise ckpt.CheckpointError(problem)
        if not is_sharded_checkpoint(ckpt_dir):
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir} was written by --parallel=ddp; resume it with "
                                       "--parallel=ddp (or start a new fsdp run with --init_from=<that checkpoint>)")
        from parallel.dcp_checkpoint import load_dcp_checkpoint
        with agreed_reads(self.module):  # this rank's own file, before DCP's collective read
            extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log)
        load_dcp_checkpoint(ckpt_dir, self.model, self.optimizer)
        refuse_nonfinite_weights(self.module, ckpt_dir)
        return extra


@contextlib.contextmanager
def agreed_reads(module: nn.Module):
    """Reads of one rank's own checkpoint files, then ONE collective of every rank's verdict: when any rank
    raised a CheckpointError (a damaged file, named), every rank raises the same one (the lowest rank's),
    so each prints the same line and exits with the same code; no rank goes on into a collective that the
    failed rank never joins (which ended the others with gloo's "Connection closed by peer")."""
    from utils.constants import EXIT_BAD_CHECKPOINT
    from utils.dist import first_error_of_ranks
    verdict = None
    try:
        yield
    except ckpt.CheckpointError as e:
        verdict = (EXIT_BAD_CHECKPOINT, ckpt.one_line(e))
    device = next((p.device for p in module.parameters()), None)
    agreed = first_error_of_ranks(verdict, device)
    if agreed is not None:
        raise ckpt.CheckpointError(agreed[1])


def refuse_nonfinite_weights(module: nn.Module, ckpt_dir: str) -> None:
    """One pass over this rank's loaded weights (its shard of a sharded model, its stage of a pipeline) and
    one collective of every rank's verdict: CheckpointError (exit 5) with the same line on every rank,
    naming the first tensor that holds NaN or inf, when any rank found one."""
    from torch.distributed.tensor import DTensor

    from utils.constants import EXIT_BAD_CHECKPOINT
    from utils.dist import first_error_of_ranks
    params = [(n, p.to_local() if isinstance(p, DTensor) else p) for n, p in module.named_parameters()]
    bad = ckpt.first_nonfinite(params)
    device = params[0][1].device if params else None
    verdict = first_error_of_ranks(None if bad is None else (EXIT_BAD_CHECKPOINT, f"checkpoint {ckpt_dir}: {bad}"),
                                   device)
    if verdict is not None:
        raise ckpt.CheckpointError(verdict[1])


def load_extra_state(ckpt_dir: str, rank: int, saved_world: int, world_size: int,
                     log: Callable[[str], None] = print, same_world_only: bool = True) -> Optional[dict]:
    """This rank's extra_rank{r}.pt (RNG states, comm-hook state), checked: its RNG state must restore.
    None at another world size (same_world_only: not even read), or when the file is missing, which at
    the same world size is logged: the run goes on with this process's own RNG state (seeded by --seed),
    so dropout and sampling after the resume do not repeat the uninterrupted run's."""
    if same_world_only and saved_world != world_size:
        return None
    path = os.path.join(ckpt_dir, f"extra_rank{rank}.pt")
    extra = ckpt.load_rank_file(ckpt_dir, "extra", rank)
    if extra is None:
        if saved_world == world_size:
            log(f"[resume] warning: rank {rank}: {path} is missing: continuing with fresh RNG state (this process's "
                "own, seeded by --seed) and a fresh comm-hook state, so random draws after the resume (dropout, "
                "PowerSGD) differ from the uninterrupted run's")
        return None
    if "rng" in extra:
        problem = ckpt.rng_state_problem(extra["rng"])
        if problem:
            raise ckpt.CheckpointError(f"{path}: {problem}")
    elif saved_world == world_size:
        raise ckpt.CheckpointError(f"{path}: holds no RNG state (keys {sorted(map(str, extra))[:5]})")
    return extra


def is_sharded_checkpoint(ckpt_dir: str) -> bool:
    from parallel.dcp_checkpoint import is_dcp_checkpoint
    return is_dcp_checkpoint(ckpt_dir)


def read_optimizer_state(ckpt_dir: str, sharded: bool, rank: int, world_size: int,
                         saved_world: int) -> tuple[Any, str]:
    """The optimizer files this rank loads (no collective): (its state dict or the list of every saved rank's,
    the file name(s) for messages). CheckpointError naming a file that is missing or damaged."""
    def read(r: int) -> dict:
        sd = ckpt.load_rank_file(ckpt_dir, "optimizer", r)
        if sd is None:
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: optimizer_rank{r}.pt is missing "
                                       f"(the run saved {saved_world} rank(s))")
        return sd
    if sharded and saved_world == world_size and os.path.isfile(os.path.join(ckpt_dir, f"optimizer_rank{rank}.pt")):
        own = read(rank)
        if isinstance(own, dict) and own.get("sharded"):
            return own, f"optimizer_rank{rank}.pt"
    first = read(0)
    n = first.get("world_size", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: optimizer_rank0.pt does not load into this optimizer "
                                   f"(ValueError: world_size={n!r} is not an integer >= 1)")
    if not first.get("sharded") or n == 1:
        return first, "optimizer_rank0.pt"
    return [first] + [read(r) for r in range(1, n)], f"optimizer_rank0.pt .. optimizer_rank{n - 1}.pt"


def load_optimizer_state(opt, ckpt_dir: str, sharded: bool, rank: int, world_size: int, saved_world: int,
                         read: Optional[tuple[Any, str]] = None) -> None:
    """Any saved layout into this optimizer: a ZeRO rank at the same world size reads its own shard;
    otherwise rank 0's file when it holds everything (an unsharded run, or a ZeRO run of one rank),
    else every saved rank's file, which the optimizer re-shards to this world size.
    CheckpointError naming the file when one is missing, damaged, or does not load into this optimizer.
    `read`: what read_optimizer_state returned (the files already read)."""
    if read is not None:
        state, name = read
        with _naming_a_bad_optimizer_file(ckpt_dir, lambda: name):
            opt.load_state_dict(state)
        return
    reading = {"name": f"optimizer_rank{rank}.pt"}

    def read(r: int) -> dict:
        reading["name"] = f"optimizer_rank{r}.pt"
        sd = ckpt.load_rank_file(ckpt_dir, "optimizer", r)
        if sd is None:
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: optimizer_rank{r}.pt is missing "
                                       f"(the run saved {saved_world} rank(s))")
        return sd
    with _naming_a_bad_optimizer_file(ckpt_dir, lambda: reading["name"]):
        if sharded and saved_world == world_size and os.path.isfile(os.path.join(ckpt_dir, f"optimizer_rank{rank}.pt")):
            own = read(rank)
            if own.get("sharded"):
                opt.load_state_dict(own)
                return
        first = read(0)
        n = first.get("world_size", 1)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"world_size={n!r} is not an integer >= 1")
        if not first.get("sharded") or n == 1:
            opt.load_state_dict(first)
        else:
            states = [first] + [read(r) for r in range(1, n)]
            reading["name"] = f"optimizer_rank0.pt .. optimizer_rank{n - 1}.pt"
            opt.load_state_dict(states)


@contextlib.contextmanager
def _naming_a_bad_optimizer_file(ckpt_dir: str, name: Callable[[], str]):
    """An optimizer state that does not load (wrong shapes, keys, types) becomes a CheckpointError naming the
    file `name()` was reading; CheckpointErrors and out-of-memory pass through."""
    try:
        yield
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as e:
        if isinstance(e, (ckpt.CheckpointError, torch.OutOfMemoryError)):
            raise
        raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: {name()} does not load into this optimizer "
                                   f"({type(e).__name__}: {ckpt.one_line(e)[:200]})") from e


# ---------------------------------------------------------------------------- light LoRA checkpoints

def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a LoRA run changes: its trainable parameters (adapters, and the embedding / LM head
    when they train). Everything else is the frozen base, which the checkpoint references instead."""
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if id(v) in trainable}


def load_weights(module: nn.Module, state: dict[str, torch.Tensor], partial: bool, source: str,
                 mismatch: Optional[type] = None) -> None:
    """Full checkpoints must match the model exactly; a light (LoRA) one must cover exactly the
    trainable parameters, and the rest must be the base the checkpoint references (checked by the caller).
    Names or shapes that do not fit raise `mismatch` (default CheckpointError: the checkpoint's tensors
    disagree with the model its own model_config.json builds); the trainer's resume passes
    CheckpointMismatchError (a configuration that builds another model)."""
    mismatch = mismatch or ckpt.CheckpointError
    where = weights_file_name(source)
    if not partial:
        try:
            module.load_state_dict(state)
        except RuntimeError as e:  # missing / unexpected keys, size mismatch
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise mismatch(f"checkpoint {source}: {where} does not fit the model ({ckpt.one_line(e)[:300]})") from e
        return
    want = set(trainable_state(module))
    have = set(state)
    if want != have:
        raise mismatch(f"checkpoint {source}: its tensors are not this run's trainable parameters "
                       f"(missing {sorted(want - have)[:4]}, unexpected {sorted(have - want)[:4]}); "
                       "were the --lora_* flags changed?")
    try:
        module.load_state_dict(state, strict=False)
    except RuntimeError as e:
        if isinstance(e, torch.OutOfMemoryError):
            raise
        raise mismatch(f"checkpoint {source}: {where} does not fit the model ({ckpt.one_line(e)[:300]})") from e


def weights_file_name(ckpt_dir: str) -> str:
    """Which file(s) of a checkpoint hold its weights, for messages."""
    if is_pipeline_checkpoint(ckpt_dir):
        return "stage*_model.safetensors"
    if os.path.isfile(os.path.join(ckpt_dir, "dcp_manifest.json")):
        return ".metadata / __*.distcp"
    return "model.safetensors"


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

def build_engine(model: nn.Module, cfg: Any, group: Any = None, device: Optional[torch.device] = None) -> TrainingEngine:
    """Wrap `model` for `cfg.parallel` (and `cfg.pipeline_parallel_size`) and build its optimizer: the
    same objects for world size 1 and N. `device`: where to run (default: where the model is); only
    this rank's pipeline stage is moved there, so the full model may be built on the CPU.
    Raises ValueError for a layout that cannot run."""
    if device is None:
        device = next(model.parameters()).device
    engine = _build_engine(model, cfg, group, torch.device(device))
    if getattr(cfg, "compile", False):
        if getattr(cfg, "tensor_parallel_size", 1) > 1:
            compile_blocks(engine.module)  # the forward model stays the module: each block is compiled
        else:
            engine.forward_model = torch.compile(engine.model)
    return engine


def compile_blocks(model: nn.Module) -> None:
    """torch.compile each Transformer block's forward in place (torchtitan's per-block compile): the
    tensor-parallel hooks inside a block (DTensor from_local / redistribute) are traced into its graph,
    while FSDP2's hooks on the block itself, the embedding, the LM head and the vocabulary-parallel loss
    run eagerly around it. The blocks stay the same modules (parameter names, hooks, checkpoints unchanged):
    only their bound `forward` is replaced.

    The first block's input is the vocabulary-parallel embedding's all-reduced output, which torch hands
    over as an AsyncCollectiveTensor (the all-reduce not yet waited on); a compiled graph given that
    wrapper returns no gradient to the embedding (measured: a zero embedding gradient with torch 2.13),
    so such an input is materialised eagerly first (one copy of the block's input, once per forward)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    from model.llama import blocks_of

    def compiled(forward):
        graph = torch.compile(forward)

        def run(h, *args, **kwargs):
            if isinstance(h, AsyncCollectiveTensor):
                h = h.clone()  # a dispatched op: waits for the collective, keeps the autograd edge
            return graph(h, *args, **kwargs)
        return run

    for block in blocks_of(model.layers):
        block.forward = compiled(block.forward)


def describe_layout(cfg: Any, engine: Engine, world_size: int) -> str:
    """One start-up line with the whole layout: engine, mesh sizes, communication, compile,
    activation checkpointing and the global batch (samples and tokens per optimizer step)."""
    pp = int(getattr(cfg, "pipeline_parallel_size", 1))
    dp_engine = cfg.parallel
    if dp_engine == "ddp" and cfg.use_distributed_optimizer:
        dp_engine = f"ddp + ZeRO-{cfg.zero_stage}"
    elif dp_engine == "fsdp":
        dp_engine = (f"fsdp (FSDP2, {'ZeRO-3' if cfg.reshard_after_forward else 'ZeRO-2-like'}"
                     f"{', CPU offload' if cfg.cpu_offload else ''})")
    kind = f"pipeline ({pp} stages, {cfg.pipeline_schedule}) over {dp_engine}" if pp > 1 else dp_engine
    from parallel.mesh import MeshLayout
    tp, rep = int(getattr(cfg, "tensor_parallel_size", 1)), int(getattr(cfg, "dp_replicate_size", 1))
    if tp > 1:
        kind += f" + tensor parallel {tp} (DTensor{', sequence parallel' if getattr(cfg, 'sequence_parallel', False) else ''})"
    if rep > 1:
        kind += f", HSDP over {rep} replicas"
    parts = [f"engine {kind}", MeshLayout.from_sizes(world_size, pp=pp, dp_replicate=rep, tp=tp).describe()]
    if cfg.parallel == "ddp":
        hook = cfg.comm_hook
        if hook == "powersgd":
            hook = f"powersgd (rank {cfg.powersgd_rank}, from step {cfg.powersgd_start_iter})"
        overlap = [name for name, on in (("grad reduce", cfg.overlap_grad_reduce),
                                         ("param gather", cfg.overlap_param_gather),
                                         ("optimizer step", cfg.overlap_optim_step)) if on]
        parts.append(f"gradients {hook}, buckets of {cfg.bucket_size:,} elements, overlap "
                     f"{', '.join(overlap) if overlap else 'off'}")
    parts.append(f"compile {'on' if cfg.compile else 'off'}")
    parts.append(f"activation checkpointing {'on' if cfg.gradient_checkpointing else 'off'}")
    samples = cfg.batch_size * cfg.gradient_accumulation_steps * engine.dp_size
    parts.append(f"global batch {cfg.batch_size} x {cfg.gradient_accumulation_steps} x {engine.dp_size} = "
                 f"{samples:,} samples = {samples * cfg.max_seq_len:,} tokens per step")
    return "[layout] " + "; ".join(parts)


def _dp_coordinates(group: Any) -> tuple[int, int]:
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def mesh_layout(cfg: Any, world_size: int):
    """The run's MeshLayout (parallel/mesh.py) from the flags; ValueError when the world does not fit."""
    from parallel.mesh import MeshLayout
    return MeshLayout.from_sizes(world_size, pp=int(getattr(cfg, "pipeline_parallel_size", 1)),
                                 dp_replicate=int(getattr(cfg, "dp_replicate_size", 1)),
                                 tp=int(getattr(cfg, "tensor_parallel_size", 1)))


def needs_process_group(cfg: Any) -> bool:
    """FSDP2 and pipeline stages run on a device mesh: a process group even for one process."""
    return cfg.parallel == "fsdp" or int(getattr(cfg, "pipeline_parallel_size", 1)) > 1


def light_checkpoints_supported(cfg: Any) -> bool:
    """Whether this engine can save only the trainable tensors of a LoRA / embeddings-only run (plus a
    reference to the frozen base): our DDP's format can; fsdp writes its shards without gathering anyway."""
    return cfg.parallel == "ddp"


def _build_engine(model: nn.Module, cfg: Any, group: Any, device: torch.device) -> TrainingEngine:
    from optimizer import OptimizerConfig
    from utils.device import parse_dtype
    # the precision policy: fsdp keeps fp32 sharded parameters (the optimizer's masters) and computes in
    # --dtype through its mixed-precision policy; ddp (and its pipeline stages) run the model in --dtype
    # with fp32 masters in the optimizer
    model.to(dtype=torch.float32 if cfg.parallel == "fsdp" else parse_dtype(cfg.dtype))
    zero = cfg.use_distributed_optimizer
    opt_cfg = OptimizerConfig(
        lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip, precision=cfg.dtype, use_distributed_optimizer=zero, zero_stage=cfg.zero_stage,
        overlap_param_gather=cfg.overlap_param_gather, overlap_optim_step=cfg.overlap_optim_step,
        fused=cfg.device != "cpu")
    pp = int(getattr(cfg, "pipeline_parallel_size", 1))
    if pp > 1:
        from parallel import DDPConfig
        from parallel.pipeline import build_pipeline_engine
        pipe = build_pipeline_engine(
            model, opt_cfg, pp_size=pp, n_microbatches=cfg.gradient_accumulation_steps,
            schedule=cfg.pipeline_schedule, dp_engine=cfg.parallel,
            ddp_config=DDPConfig(bucket_size=cfg.bucket_size, overlap_grad_reduce=cfg.overlap_grad_reduce,
                                 grad_reduce_in_fp32=cfg.grad_reduce_in_fp32, use_distributed_optimizer=zero),
            device=device, param_dtype=parse_dtype(cfg.dtype), reshard_after_forward=cfg.reshard_after_forward,
            cpu_offload=cfg.cpu_offload, tp_size=int(getattr(cfg, "tensor_parallel_size", 1)))
        return PipelineParallelEngine(pipe)
    model.to(device)
    if cfg.parallel == "fsdp":  # FSDP2 over the mesh's data-parallel dims (HSDP with replicas), tensor parallel inside
        import torch.distributed as dist

        from parallel.fsdp import build_fsdp_engine
        from parallel.mesh import build_device_mesh
        layout = mesh_layout(cfg, dist.get_world_size())
        mesh = build_device_mesh(layout, device.type)
        wrapped, opt = build_fsdp_engine(model, opt_cfg, mesh_or_group=mesh, param_dtype=parse_dtype(cfg.dtype),
                                         reshard_after_forward=cfg.reshard_after_forward,
                                         cpu_offload=cfg.cpu_offload,
                                         sequence_parallel=bool(getattr(cfg, "sequence_parallel", False)))
        rank, world = layout.dp_coordinates(dist.get_rank())
        return FSDPEngine(wrapped, opt, wrapped, sharded_optimizer=True, dp_rank=rank, dp_size=world, mesh=mesh,
                          counts_in_sums=layout.coordinates(dist.get_rank())["tp"] == 0)
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
    rank, world = _dp_coordinates(group)
    return DDPEngine(ddp, build_optimizer(ddp, opt_cfg), model, sharded_optimizer=zero, dp_rank=rank,
                     dp_size=world)


def checkpoint_model_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The weights stored in a checkpoint of any engine, in one process (export, sampling, init);
    a pipeline checkpoint's stages are merged into one model's state dict."""
    if is_pipeline_checkpoint(ckpt_dir):
        from safetensors import SafetensorError

        from parallel.pipeline import merge_stage_checkpoints
        try:
            sd = merge_stage_checkpoints(ckpt_dir)
        except (ValueError, KeyError, TypeError, OSError, RuntimeError, SafetensorError) as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: {damaged_file_hint(ckpt_dir, e)}") from e
    elif is_sharded_checkpoint(ckpt_dir):
        from parallel.dcp_checkpoint import load_full_model_state_dict
        sd = load_full_model_state_dict(ckpt_dir)
    else:
        return ckpt.load_model_state(ckpt_dir)  # checked there
    bad = ckpt.first_nonfinite(sd.items())
    if bad is not None:
        raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: {bad}")
    return sd


# ---------------------------------------------------------------------------- pipeline

def is_pipeline_checkpoint(ckpt_dir: str) -> bool:
    from parallel.pipeline import META_FILE
    return os.path.isfile(os.path.join(ckpt_dir, META_FILE))


def read_pipeline_meta_safe(ckpt_dir: str) -> dict:
    from parallel.pipeline import META_FILE
    try:
        return ckpt.read_json(os.path.join(ckpt_dir, META_FILE))
    except (OSError, ValueError):
        return {}


class PipelineParallelEngine(Engine):
    """The trainer's view of a parallel.pipeline.PipelineEngine (this rank's stage on the pp x dp mesh)."""
    kind: ClassVar[str] = "pipeline"

    def __init__(self, pipe: Any) -> None:
        # the P ranks of a pipeline (and the T ranks of a stage's tensor group) hold the same batch and the
        # same broadcast loss: only stage 0's tensor rank 0 counts
        super().__init__(pipe.model, pipe.optimizer, pipe.module, dp_rank=pipe.dp_rank,
                         dp_size=pipe.dp_size, fixed_batch_shape=True, micro_batches_per_call=pipe.n_microbatches,
                         counts_in_sums=pipe.stage_index == 0 and pipe.tp_rank == 0, mesh=pipe.mesh)
        self.pipe = pipe

    def forward_backward(self, batches: Sequence[dict], loss_fn: LossFn, global_units: float,
                         poison: bool = False) -> torch.Tensor:
        out = self.pipe.forward_backward(batches, global_units, poison=poison)
        return torch.tensor([float(out.loss_sum), 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)

    def evaluate(self, batches: Sequence[dict], loss_fn: LossFn, count_units: Callable[[dict], int]) -> torch.Tensor:
        total, units = self.pipe.eval_loss_sum(batches)
        return torch.tensor([total, 0.0, 0.0, 0.0, float(units)], dtype=torch.float64)

    def resume_problem(self, ckpt_dir: str, saved_world: int, world_size: int) -> Optional[str]:
        if not is_pipeline_checkpoint(ckpt_dir):
            return (f"{ckpt_dir} was written without pipeline parallelism; resume it with --pipeline_parallel_size=1 "
                    "(or start a new pipeline run from its weights with --init_from=<that checkpoint>)")
        meta = read_pipeline_meta_safe(ckpt_dir)
        saved = (meta.get("pp_size"), meta.get("dp_size"), meta.get("dp_engine", "ddp"))
        here = (self.pipe.pp_size, self.pipe.dp_size, self.pipe.dp_engine)
        if (saved[0], saved[2]) != (here[0], here[2]):
            return (f"{ckpt_dir} was written on a pipeline mesh of pp={saved[0]} x dp={saved[1]} ({saved[2]}), this "
                    f"run is pp={here[0]} x dp={here[1]} ({here[2]}): a pipeline checkpoint resumes with the same "
                    "number of stages and dp engine, at any dp size (to change the stages, start a new run with "
                    "--init_from=<that checkpoint>)")
        return None

    def save(self, out_dir: str, step: int, *, rank: int, world_size: int, model_config: dict,
             trainer_state: dict, run_config: dict, extra_state: dict, keep_last: int,
             barrier: Callable[[], None], fault_hook: Optional[Callable[[], None]] = None,
             log: Callable[[str], None] = print) -> str:
        """Collective. The stages' files + per-rank RNG into step_N.tmp/, then rank 0 publishes it
        (manifest, COMPLETE, fsync, atomic rename: utils/checkpoint.publish_checkpoint_dir) and prunes."""
        root = ckpt.checkpoint_root(out_dir)
        final = os.path.join(root, ckpt.step_dir_name(step))
        tmp = temp_dir_for(final)
        # a write that does not fit (disk full, a file-size limit): the partial step_N.tmp removed, exit 7
        with ckpt.save_guard(root, step, check_space=rank == 0):
            if rank == 0:
                make_temp_dir(final)  # one left by a crash was never complete: dropped
            barrier()
            self.pipe.write_stage_files(tmp)  # collective over the mesh (FSDP gathers the stage's tensors)
            path = os.path.join(tmp, f"extra_rank{rank}.pt")
            torch.save(extra_state, path)
            fsync_file(path)
            if rank == 0:
                ckpt.write_json(os.path.join(tmp, "model_config.json"), model_config)
                ckpt.write_json(os.path.join(tmp, "config.json"), run_config)
                if fault_hook is not None:
                    fault_hook()  # test hook: die with a half-written checkpoint
            barrier()  # every rank has written and fsynced its files
            if rank == 0:
                ckpt.write_json(os.path.join(tmp, "trainer_state.json"),
                                dict(trainer_state, step=step, world_size=world_size, saved_at=time.time()))
                ckpt.publish_checkpoint_dir(tmp, final, step)
                ckpt.prune_checkpoints(out_dir, keep_last=keep_last, keep_best=True, log=log)
        barrier()
        return final

    def load(self, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
             log: Callable[[str], None] = print) -> Optional[dict]:
        problem = self.resume_problem(ckpt_dir, saved_world, world_size)
        if problem:
            raise ckpt.CheckpointError(problem)
        from safetensors import SafetensorError
        try:
            self.pipe.load(ckpt_dir)
        except (ValueError, KeyError, TypeError, OSError, EOFError, RuntimeError, SafetensorError) as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise ckpt.CheckpointError(f"checkpoint {ckpt_dir}: {damaged_file_hint(ckpt_dir, e)}") from e
        refuse_nonfinite_weights(self.module, ckpt_dir)
        return load_extra_state(ckpt_dir, rank, saved_world, world_size, log)


def damaged_file_hint(ckpt_dir: str, e: BaseException) -> str:
    """The error of a load that failed inside a library that does not say which file it read: the
    first tensor file of the directory that does not load on its own, else the error itself."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        try:
            if name.endswith(".safetensors"):
                load_file(path)
            elif name.endswith(".pt"):
                ckpt.load_tensor_file(path)
        except (SafetensorError, OSError, ckpt.CheckpointError) as bad:
            return f"{name} cannot be read ({ckpt.one_line(bad)[:200]})"
    return f"{type(e).__name__}: {ckpt.one_line(e)[:300]}"
