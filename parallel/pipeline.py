"""Pipeline parallelism's pieces on `torch.distributed.pipelining`: the stage split and the schedule.

Owns: splitting the Transformer's layers into P stages (`split_layers`, `pipeline_stage_module`: a stage is
the Transformer pruned as torchtitan does, run by Transformer.forward itself; the first stage holds
`embed_tokens`, the last `norm` + `lm_head` and computes the model's per-token losses), the checks of a pipeline's
options (`validate_pipeline_options`), what the task's loss_fn sees of the last stage's output
(`LastStageOutput`: per-token losses by row group), building this rank's `PipelineStage` + schedule (`build_schedule`:
`ScheduleGPipe` / `Schedule1F1B`, by name), and merging the stages' state dicts into one with the model's own key
names (`merge_stage_state_dicts`; checkpoint/pipeline.py reads per-stage checkpoint files with it).

    stage_module = pipeline_stage_module(model, stage_index, num_stages)
    stage, schedule = build_schedule(wrapped_stage, stage_index, num_stages, device, pp_group,
                                     n_microbatches, "1f1b", loss_fn)
    full_sd = merge_stage_state_dicts([stage_0_state_dict, stage_1_state_dict, ...])

The engine that runs them (mesh, DDP / FSDP per stage, optimizer, step, state) is
parallel/engine_pipeline.py's `PipelineParallelEngine`.

Must never: hold an optimizer, a mesh or a step, or silently accept a layout it cannot run (tied
embeddings across stages, a layer count that does not split, fewer micro-batches than 1F1B needs).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn

from model.llama import Transformer
from model.mtp import shifted_embeddings

SCHEDULES = ("gpipe", "1f1b")


# ---------------------------------------------------------------------------- splitting

def split_layers(n_layers: int, num_stages: int, allow_uneven: bool = False) -> list[tuple[int, int]]:
    """[lo, hi) layer ranges per stage. A count that does not divide is a ValueError unless
    `allow_uneven`, then the first `n_layers % num_stages` stages get one layer more."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    if n_layers < num_stages:
        raise ValueError(f"cannot split {n_layers} layer(s) into {num_stages} pipeline stages: every stage needs "
                         f"at least one transformer layer")
    if n_layers % num_stages and not allow_uneven:
        raise ValueError(f"n_layers={n_layers} does not divide into pipeline_parallel_size={num_stages} equal "
                         f"stages; choose a divisor of {n_layers} (or pass allow_uneven_split=True to give the "
                         f"first {n_layers % num_stages} stage(s) one layer more)")
    base, extra = divmod(n_layers, num_stages)
    out, lo = [], 0
    for s in range(num_stages):
        hi = lo + base + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class PipelineStageModule(Transformer):
    """One stage: the Transformer pruned (`Transformer.pruned`) to the model's own submodules of this
    stage (`layers` a ModuleDict keyed by the global layer index, the embedding on the first stage, norm
    + LM head on the last), so its state_dict keys are exactly the full model's and merging the stages'
    state dicts is a plain union. Its forward IS Transformer.forward, with the schedule's signature:

    forward(x, labels=None, attention_mask=None, position_ids=None): x is token ids on the first stage
    and the hidden state [B, T, D] elsewhere. Non-last stages return the hidden state; the last returns
    (Transformer.forward(..., reduction=self.reduction): the model's loss choice per its cfg) the
    micro-batch's SUM of per-token losses as a shape-[1] fp32 tensor ("sum", the default), or its per-token
    losses [B, T] in fp32 ("none", 0 at ignored positions: DPO's sequence log-probs); the engine computes
    the task's loss from them (LastStageOutput) and sets `reduction` for the batches it runs."""

    stage_index: int
    num_stages: int
    reduction: str = "sum"
    # the schedule's micro-batch this forward runs (set by build_schedule's stage around each forward; None for a
    # forward outside one: the schedule's shape inference), and what the engine does to each training output
    # (parallel/engine_pipeline.py: the MoE balancing losses of the stage's own layers join its backward)
    micro_batch: Optional[int] = None
    after_forward: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    @property
    def is_first(self) -> bool:
        return self.embed_tokens is not None

    @property
    def is_last(self) -> bool:
        return self.lm_head is not None

    @property
    def layer_range(self) -> tuple[int, int]:
        ids = [int(k) for k in self.layers]
        return ids[0], ids[-1] + 1

    @property
    def carried_depths(self) -> int:
        """Multi-token prediction's depths whose inputs travel with the hidden state: the first stage embeds each
        depth's shifted tokens (model/mtp.py shifted_embeddings) and sends them on beside it, [B, T, (1 + D) dim],
        every stage passes them through untouched (their gradients flow back to the embedding), and the last
        stage's depths take them: the embedding stays on the first stage alone (no tied copy to keep in sync)."""
        return int(getattr(self.cfg, "mtp_num_layers", 0)) if self.num_stages > 1 else 0

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        D, extras = self.carried_depths, None
        if D and self.is_first:
            extras = shifted_embeddings(D, x, self.embed_tokens)
        elif D:  # the hidden state, then the depths' embedded inputs
            x, *extras = x.split(self.cfg.dim, dim=-1)
        if self.lm_head is None:
            out = super().forward(x, attention_mask=attention_mask, position_ids=position_ids)
            if extras:
                out = torch.cat([out, *extras], dim=-1)
        elif labels is None:
            raise ValueError("the last pipeline stage computes the loss: it needs labels")
        else:
            loss = super().forward(x, labels, self.reduction, attention_mask, position_ids,
                                   mtp_embedded=extras).float()
            # "sum": [1] (and not a view of the 0-d loss), as the schedule merges micro-batches along dim 0
            out = torch.stack([loss]) if self.reduction == "sum" else loss
        if self.after_forward is not None and self.training and torch.is_grad_enabled():
            out = self.after_forward(out)
        return out


SEGMENTS = ("", "chosen_", "rejected_")  # the row groups a micro-batch may hold: tokens, or DPO's pairs


class LastStageOutput:
    """The task's loss_fn's `model` on the last stage: its calls (in the order the task makes them, one per
    row group: tokens, or DPO's chosen then rejected) return that group's rows of the micro-batch's per-token
    losses (the stage's output with reduction "none"; padding cut off), or their sum with reduction "sum"
    (the stage's output with reduction "sum" is that sum already, shape [1])."""

    def __init__(self, per_token: torch.Tensor, segments: list[tuple[int, int, int]]) -> None:
        self.per_token, self.segments, self.calls = per_token, segments, 0

    def __call__(self, x: torch.Tensor, labels: Any = None, reduction: str = "mean", **_: Any) -> torch.Tensor:
        if self.calls >= len(self.segments) or reduction not in ("sum", "none"):
            raise ValueError(f"a pipeline's last stage gives the task's loss_fn {len(self.segments)} group(s) of "
                             f"per-token losses (reduction 'sum' or 'none'); call {self.calls + 1} asked "
                             f"reduction={reduction!r}")
        lo, hi, t = self.segments[self.calls]
        self.calls += 1
        if tuple(x.shape) != (hi - lo, t):
            raise ValueError(f"the task's loss_fn asked for rows of shape {tuple(x.shape)}; the pipeline ran "
                             f"{(hi - lo, t)} for that group")
        if self.per_token.dim() == 1:  # the stage summed (one row group)
            if reduction != "sum":
                raise ValueError("this micro-batch's last stage returns its loss sum only (reduction 'sum')")
            return self.per_token.sum()
        out = self.per_token[lo:hi, :t]
        return out.sum() if reduction == "sum" else out


def pipeline_stage_module(model: Transformer, stage_index: int, num_stages: int,
                          allow_uneven_split: bool = False) -> PipelineStageModule:
    """Stage `stage_index` of `num_stages` of `model` (sharing its parameters, not copying them)."""
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is not in [0, {num_stages})")
    if num_stages > 1 and model.cfg.tie_embeddings:
        raise ValueError("tie_embeddings=True cannot be pipelined: the embedding (first stage) and the LM head "
                         "(last stage) would be one weight on two ranks; train untied or without pipeline "
                         "parallelism")
    lo, hi = split_layers(model.cfg.n_layers, num_stages, allow_uneven_split)[stage_index]
    stage = PipelineStageModule.pruned(model, range(lo, hi), embedding=stage_index == 0,
                                       head=stage_index == num_stages - 1)
    stage.stage_index, stage.num_stages = stage_index, num_stages
    return stage


# ---------------------------------------------------------------------------- validation + schedule

def validate_pipeline_options(*, pp_size: int, n_microbatches: int, schedule: str, dp_engine: str = "ddp",
                              world_size: Optional[int] = None, overlap_optim_step: bool = False,
                              comm_hook: str = "allreduce") -> None:
    """Raise ValueError for a pipeline configuration that cannot run (all problems at once)."""
    problems = []
    if pp_size < 1:
        problems.append(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if schedule.lower() not in SCHEDULES:
        problems.append(f"pipeline_schedule={schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if n_microbatches < 1:
        problems.append(f"the number of micro-batches (gradient_accumulation_steps) must be >= 1, got {n_microbatches}")
    elif schedule.lower() == "1f1b" and n_microbatches < pp_size:
        problems.append(f"the 1F1B schedule needs at least as many micro-batches as stages: "
                        f"gradient_accumulation_steps={n_microbatches} < pipeline_parallel_size={pp_size} "
                        f"(raise gradient_accumulation_steps or use --pipeline_schedule=gpipe)")
    if world_size is not None and pp_size >= 1 and world_size % pp_size:
        problems.append(f"world size {world_size} is not a multiple of pipeline_parallel_size={pp_size} "
                        f"(the mesh is pp x dp)")
    if dp_engine not in ("ddp", "fsdp"):
        problems.append(f"unknown dp engine {dp_engine!r}: ddp or fsdp")
    if overlap_optim_step:
        problems.append("overlap_optim_step=true is not supported with pipeline parallelism (its per-bucket "
                        "collectives differ between stages, and clipping must see every stage's gradients)")
    if comm_hook not in ("allreduce", None, ""):
        problems.append(f"comm_hook={comm_hook}: only the default all-reduce is tested with pipeline parallelism")
    if problems:
        raise ValueError("bad options for pipeline parallelism: " + "; ".join(problems))


def build_schedule(wrapped: nn.Module, stage_index: int, num_stages: int, device: torch.device, pp_group: Any,
                   n_microbatches: int, schedule: str, loss_fn: Callable[[torch.Tensor, Any], torch.Tensor],
                   stage_module: Optional[PipelineStageModule] = None):
    """(PipelineStage, schedule) of this rank: `wrapped` is the stage module in its dp wrapper (our DDP, or the
    FSDPModule, which torch's PipelineStage recognises: no gradient sync per micro-batch, one reduce-scatter
    after the last backward). loss_fn(last stage output, target) -> the tensor to backpropagate;
    scale_grads=False: the engine's loss_fn already normalises by the global units. `stage_module` (the stage
    inside `wrapped`) is told the micro-batch of each forward the schedule runs (`micro_batch`)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    class _Stage(PipelineStage):
        """torch's stage, telling the stage module which micro-batch each of its forwards runs."""

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            if stage_module is None:
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            stage_module.micro_batch = fwd_chunk_id
            try:
                return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            finally:
                stage_module.micro_batch = None

    stage = _Stage(wrapped, stage_index, num_stages, device, group=pp_group)
    sched_cls = ScheduleGPipe if schedule.lower() == "gpipe" else Schedule1F1B
    return stage, sched_cls(stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)


def merge_stage_state_dicts(stage_states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The stages' state dicts (keys are already the full model's) as one dict; a key held by two
    stages is an error (it would mean a weight shared across stages)."""
    full: dict[str, torch.Tensor] = {}
    for s, sd in enumerate(stage_states):
        for k, v in sd.items():
            if k in full:
                raise ValueError(f"tensor {k} is held by two pipeline stages (stage {s} and an earlier one)")
            full[k] = v
    return full
