"""The trainer's one interface to the parallel engines (`TrainingEngine`), and what every engine shares
(`Engine`: micro-batches with gradient accumulation, forward-only evaluation, sums over the data-parallel
replicas). One class per engine, each in its own module: DDPEngine (engine_ddp.py: our DDP / ZeRO),
FSDPEngine (engine_fsdp.py: FSDP2), PipelineParallelEngine (engine_pipeline.py: stages over either);
parallel/build.py builds the one a ParallelConfig describes, and the trainer never asks which it got.

    engine = build_engine(model, parallel_config, optimizer_config, device=device)
    engine.optimizer.zero_grad()
    sums = engine.forward_backward(batches, loss_fn, global_units)   # this replica's micro-batches
    engine.optimizer.step()
    sums = engine.evaluate(batches, loss_fn)   # no gradients
    totals = engine.sum_over_data(values, device)  # each data-parallel replica counted once
    spec = engine.state_spec()                 # what it holds and how it is sharded (checkpoint/ writes the files)

loss_fn(model, batch) -> (sum of the micro-batch's per-unit losses, {stat: sum}) is the task's loss
(token CE, DPO); the engine decides how micro-batches run and how gradients are normalised (by
`global_units`, the target units of all micro-batches of all data-parallel replicas).
`engine.dp_rank` / `engine.dp_size` are the data-parallel coordinates the data loader must use;
`engine.capabilities` what it declares it can do (parallel/config.py CAPABILITIES).

Checkpoints: an engine exposes its state (`state_spec`: the objects holding the weights and the optimizer state
and how they are sharded; `prepare_state`, `rank_state`), never files: checkpoint/manager.py's CheckpointManager
saves and loads it in the format the spec's layout calls for.

Owns: the interface, the step statistics' layout (step_fields), the shared micro-batch loop.
Must never: run the training loop, decide what the trainer's state holds, or read or write checkpoint files.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional, Protocol, Sequence

import torch
from torch import nn

from utils.dist import all_reduce_sum

# loss_fn(model, batch) -> (sum of the per-unit losses of the micro-batch, {statistic: its sum, ...})
LossFn = Callable[[nn.Module, dict], tuple[torch.Tensor, dict]]


def step_fields(stat_keys: Sequence[str]) -> tuple[str, ...]:
    """The layout of every engine's step / evaluation sums: the loss sum, the task's statistics (in the order its
    `stat_keys` gives, trainer/tasks/), the units. One float64 vector, so that one all-reduce carries it."""
    return ("loss_sum", *stat_keys, "units")


@dataclass
class StepStats:
    """Sums over micro-batches (and, once reduced, over data-parallel replicas) with names: what
    `forward_backward` and `evaluate` return as one float64 vector in step_fields(stat_keys) order. `units`: the
    task's units (target tokens, preference pairs, ...); the forward_backward vector leaves it 0 (the trainer
    counted the step's units before the step)."""
    loss_sum: float = 0.0
    stats: dict = field(default_factory=dict)
    units: float = 0.0

    @classmethod
    def from_tensor(cls, t: torch.Tensor, stat_keys: Sequence[str] = ()) -> "StepStats":
        values = [float(v) for v in t.detach().to("cpu", torch.float64).reshape(-1).tolist()]
        if len(values) != len(stat_keys) + 2:
            raise ValueError(f"a step row of {len(values)} values for the fields {step_fields(stat_keys)}")
        return cls(values[0], dict(zip(stat_keys, values[1:-1])), values[-1])

    def per_unit(self, units: Optional[float] = None) -> dict[str, float]:
        """Each sum divided by `units` (default: its own count, at least 1)."""
        n = max(1.0, self.units if units is None else units)
        return {"loss": self.loss_sum / n, **{k: v / n for k, v in self.stats.items()}}


def stat_row(loss_sum: torch.Tensor, stats: dict, stat_keys: Sequence[str] = (), units: float = 0.0) -> torch.Tensor:
    """float64 step_fields(stat_keys) of one micro-batch, on the loss's device, without a host read: tensor
    statistics are detached and cast there, host numbers enter by a fill (`new_full`)."""
    def one(v: Any) -> torch.Tensor:
        if isinstance(v, torch.Tensor):
            return v.detach().to(dtype=torch.float64).reshape(1)
        return loss_sum.new_full((1,), float(v), dtype=torch.float64)
    return torch.cat([one(loss_sum)] + [one(stats.get(k, 0.0)) for k in stat_keys] + [one(units)])


def begin_micro_batch(forward_model: Any) -> None:
    """Tell a model replayed as CUDA graphs (--compile_mode=reduce-overhead: parallel/transforms/compile.py)
    that a new micro-batch starts; other models have no such method."""
    begin = getattr(forward_model, "begin_micro_batch", None)
    if begin is not None:
        begin()


def zero_stats(stat_keys: Sequence[str] = ()) -> torch.Tensor:
    return torch.zeros(len(step_fields(stat_keys)), dtype=torch.float64)


STATE_LAYOUTS = ("replicated", "dtensor", "stages")


@dataclass
class StateSpec:
    """What an engine holds for a checkpoint and how it is sharded (checkpoint/ turns it into files and back).

    layout "replicated": every rank holds the whole model (`model`, unwrapped); the optimizer's state is whole on
           every rank or, with sharded_optimizer, one ZeRO shard per rank (our DDP)
    layout "dtensor": `model` and `optimizer` hold DTensor shards over the mesh the model was wrapped on (FSDP2)
    layout "stages": this rank holds one pipeline stage; the engine's state_dict() gathers it to full tensors and
           load_state_dict() re-shards them; `stages` is the split (pipeline.json's fields) and this rank's place
    """
    layout: str
    model: nn.Module                 # the module whose state_dict / load_state_dict are the weights
    optimizer: Any                   # the optimizer whose state_dict / load_state_dict are its state
    sharded_optimizer: bool = False  # one optimizer state per rank (ZeRO shards)
    # LoRA runs whose frozen base is a file ({"source", "fingerprint"}): only the trainable tensors are state
    lora_base: Optional[dict] = None
    stages: Optional[dict] = None    # stages: pp_size, dp_size, tp_size, n_layers, layer_ranges, schedule,
                                     # n_microbatches, dp_engine, sharded_optimizer; stage_index, dp_rank, tp_rank


def trainable_names(module: nn.Module) -> set[str]:
    """The state-dict names of the trainable parameters (a tied one under each of its names)."""
    return {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}


def trainable_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a LoRA run changes: its trainable parameters (adapters, and the embedding / LM head
    when they train). Everything else is the frozen base, which a light checkpoint references instead.
    By name: a module whose state is not its parameters (parallel/expert_state.py: expert-parallel shards
    gathered whole) hands out other tensors under the same names."""
    names = trainable_names(module)
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if k in names}


class TrainingEngine(Protocol):
    """What the trainer asks of an engine (one class per engine; parallel/build.py `build_engine` picks it)."""
    kind: str
    capabilities: frozenset
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
    def sum_statistics(self, values: torch.Tensor, device: torch.device, to_host: bool = True) -> torch.Tensor: ...
    def state_spec(self) -> StateSpec: ...
    def prepare_state(self) -> None: ...
    def rank_state(self) -> dict: ...
    def load_rank_state(self, state: dict) -> None: ...


@dataclass
class Engine:
    """What every engine shares: micro-batches with gradient accumulation through a DDP-like wrapper
    (`no_sync`), forward-only evaluation, sums over the data-parallel replicas. Subclasses own the
    reference-model layout and say how their state is laid out (state_spec): DDPEngine, FSDPEngine,
    PipelineParallelEngine."""
    kind: ClassVar[str] = "engine"
    capabilities: ClassVar[frozenset] = frozenset()  # parallel/config.py CAPABILITIES[kind]
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
    # every micro-batch must have one [batch, max_seq_len] shape (pipeline stages; context parallel, whose ring
    # splits whole rows into 2 x cp chunks: SFT rows are padded to --max_seq_len, a multiple of 2 x cp)
    fixed_batch_shape: bool = False
    micro_batches_per_call: int = 1  # evaluate() takes a multiple of this many batches
    # False on ranks whose sums repeat another rank's (pipeline stages after the first, tensor-parallel
    # ranks after the first hold the same batch): they add zeros in sum_over_data
    counts_in_sums: bool = True
    mesh: Any = None                 # the run's DeviceMesh (parallel/mesh.py), where the engine built one
    # the ranks the gradient reduction averages over when they are more than dp_size (context parallel: dp x cp,
    # each cp rank holding part of every sequence); 0 = dp_size
    grad_ranks: int = 0
    # the task's logged statistics (trainer/tasks/: DPO's rewards, ...), summed beside the loss in every step row;
    # set by the trainer after the build, the same on every rank (a pipeline's stages broadcast rows of this size)
    stat_keys: tuple = ()
    parallel: Any = None             # the layout's ParallelConfig (parallel/config.py), set by parallel/build.py
    # losses the model's layers add beside the task's (MoE balancing, multi-token prediction: trainer/
    # side_losses.py), set by the trainer: side_loss.take(key, batch) after a micro-batch's forwards on this rank
    # (its statistics filed under `key`) gives a tensor in the task's loss units or None, which joins that
    # micro-batch's backward scaled as its loss is; here added to the loss, under pipeline stages to each stage's
    # output (engine_pipeline.py)
    side_loss: Any = None
    _forwards: int = field(default=0, repr=False)  # the keys this engine gives side_loss.take

    def _with_side_loss(self, loss_sum: torch.Tensor, batch: dict) -> torch.Tensor:
        """What a micro-batch backpropagates: its loss sum plus the side loss of its forwards (in loss units)."""
        if self.side_loss is None:
            return loss_sum
        self._forwards += 1
        extra = self.side_loss.take(self._forwards, batch)
        if extra is None:
            return loss_sum
        return loss_sum + extra.to(loss_sum.dtype)

    def __post_init__(self) -> None:
        if self.forward_model is None:
            self.forward_model = self.model

    def _no_sync(self) -> contextlib.AbstractContextManager:
        """Backward inside it accumulates gradients without communicating (all but the last micro-batch)."""
        return self.model.no_sync()

    # ------------------------------------------------------------------ DPO's reference model
    def place_reference(self, ref: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """DPO's frozen reference model, laid out like the trained one: here a full copy in `dtype` on
        every rank (FSDPEngine shards it), its sequences split over the cp ranks like the policy's."""
        return self._split_sequences(ref.to(device=device, dtype=dtype))

    def _split_sequences(self, ref: nn.Module) -> nn.Module:
        """Context parallel: the reference takes whole rows and keeps this rank's chunks, as the policy does
        (parallel/transforms/context_parallel.py), so its activations are 1/cp too."""
        if self.mesh is not None and self.parallel is not None and self.parallel.cp > 1:
            from parallel.transforms import context_parallel
            context_parallel.apply(ref, self.mesh, self.parallel)
        return ref

    def reference_layout(self) -> str:
        """How place_reference lays out DPO's reference model, for the start-up log."""
        return "a full copy"

    # ------------------------------------------------------------------ one step
    def forward_backward(self, batches: Sequence[dict], loss_fn: LossFn, global_units: float,
                         poison: bool = False) -> torch.Tensor:
        """Forward + backward of this rank's micro-batches; gradients accumulate (no_sync on all but
        the last) and are those of (all replicas' loss sums) / global_units. Returns the float64
        step_fields(stat_keys) sums of this rank's micro-batches (StepStats.from_tensor names them), on the
        device that computed them: nothing here reads a value back to the host (no sync per micro-batch;
        the trainer reads the step's sums once, after the optimizer step).
        poison (a test hook): the step's loss and gradients become NaN."""
        acc = None
        n = len(batches)
        for i, batch in enumerate(batches):
            sync = contextlib.nullcontext() if i == n - 1 else self._no_sync()
            with sync:
                begin_micro_batch(self.forward_model)
                loss_sum, stats = loss_fn(self.forward_model, batch)
                back = self._with_side_loss(loss_sum, batch)
                if poison:
                    loss_sum, back = loss_sum * float("nan"), back * float("nan")
                # our DDP averages gradients over ranks; * world / global_units makes the result the
                # gradient of (sum of all ranks' losses) / (all ranks' target units). Under context parallelism
                # loss_sum is already the cp group's (model/ring_attention.py: identity backward), each cp rank's
                # gradient is its part of it, and the average runs over dp x cp ranks (grad_ranks)
                self.optimizer.scale_loss(back * ((self.grad_ranks or self.dp_size) / global_units)).backward()
            row = stat_row(loss_sum, stats, self.stat_keys)
            acc = row if acc is None else acc + row
        return acc if acc is not None else zero_stats(self.stat_keys)

    @torch.no_grad()
    def evaluate(self, batches: Sequence[dict], loss_fn: LossFn, count_units: Callable[[dict], int]) -> torch.Tensor:
        """float64 step_fields(stat_keys) sums over this rank's validation batches, units counted (forward only;
        the model is back in train mode afterwards)."""
        self.forward_model.eval()
        sums = None
        try:
            for batch in batches:
                begin_micro_batch(self.forward_model)
                loss_sum, stats = loss_fn(self.forward_model, batch)
                row = stat_row(loss_sum, stats, self.stat_keys, units=count_units(batch))  # counted on the host
                sums = row if sums is None else sums + row
        finally:
            self.forward_model.train()
            self._after_forward_only()
        return sums if sums is not None else zero_stats(self.stat_keys)

    def _after_forward_only(self) -> None:
        """Hook after a forward with no backward (FSDPEngine frees the gathered parameters)."""

    def sum_over_data(self, values: "list[float] | torch.Tensor", device: torch.device,
                      to_host: bool = True) -> torch.Tensor:
        """Sum a small float64 vector over the data-parallel replicas (every rank gets the result; ranks
        that repeat another's batch add zeros); to_host=False: left on the device for a later HostCopy
        (utils.dist.all_reduce_sum)."""
        if not self.counts_in_sums:
            t = values.clone() if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
            values = t.zero_()
        return all_reduce_sum(values, device, to_host=to_host)

    def sum_statistics(self, values: torch.Tensor, device: torch.device, to_host: bool = True) -> torch.Tensor:
        """Sum a float64 vector of per-layer statistics (MoE loads) over every rank: each fills the entries of the
        layers it holds from the tokens its forwards saw (data-parallel replicas, pipeline stages, context-parallel
        ranks and tensor-parallel ranks, each of which runs an MoE layer on its own share of the tokens, all add
        their own)."""
        return all_reduce_sum(values, device, to_host=to_host)

    # ------------------------------------------------------------------ state (checkpoint/ saves and loads it)
    def state_spec(self) -> StateSpec:
        """What this engine holds and how it is sharded."""
        raise NotImplementedError

    def prepare_state(self) -> None:
        """Settle the state before it is read for a save (parameters gathered after an overlapped ZeRO step,
        FSDP's gathered units freed after a forward-only pass)."""

    def rank_state(self) -> dict:
        """This rank's state besides the weights and the optimizer's (saved beside its RNG state)."""
        return {}

    def load_rank_state(self, state: dict) -> None:
        """The inverse of rank_state()."""
