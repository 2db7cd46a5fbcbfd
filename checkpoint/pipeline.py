"""The pipeline format: a "stages" engine's state (PipelineParallelEngine.state_dict(), each stage gathered to full
tensors) as per-stage files in the common step_N/ layout, with the common manifest / COMPLETE / atomic rename.

  stage{s}_model.safetensors     stage s's weights, full-model key names (written by its dp rank 0, tp rank 0)
  stage{s}_optimizer_dp{r}.pt    its optimizer state: one file (dp0), or one per dp rank when ZeRO shards it
  pipeline.json                  the split: pp_size, dp_size, tp_size, n_layers, layer_ranges, schedule, dp_engine...
  extra_rank{r}.pt, trainer_state.json, model_config.json, config.json   as in every format

Resumable with the same stages and dp engine at any dp size (ZeRO shards re-sharded by the optimizer); under our
DDP also at another split of the stages, and across the pipeline layout (a plain DDP / ZeRO checkpoint into stages,
`load_pipeline_into_replicated` the other way): our DDP's optimizer files hold each parameter's state by name over
ranges of the whole tensor, so every file of the checkpoint fills any split (`whole_ddp_training_files`).
`merge_stage_checkpoints` gives one process the full model (export, sampling, --init_from).

Owns: these files, written and read. Must never: gather or re-shard the state itself (the engine's state_dict /
load_state_dict do), or publish before every rank's files are written.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from checkpoint.async_writer import AsyncCheckpointer, save_in_background
from checkpoint.protocol import (SaveGuard, SaveJob, agreed_phase, prepare_step_dir, publish_checkpoint_dir, save_guard,
                                 step_dir_paths)
from checkpoint.files import load_model_state, load_rank_file, load_tensor_file, load_weights_file
from checkpoint.reads import (agreed_reads, check_optimizer_state, check_weights_fit, is_pipeline_checkpoint,
                              is_sharded_checkpoint, load_errors_named, load_extra_state, load_optimizer_state,
                              load_weights, read_pipeline_meta_safe)
from checkpoint.verify import prune_checkpoints
from parallel.config import CAPABILITIES
from parallel.pipeline import merge_stage_state_dicts
from utils.checkpoint_json import read_json, read_trainer_state, write_json
from utils.checkpoint_layout import (COMPLETE_MARKER, MODEL_CONFIG, PIPELINE_META, RUN_CONFIG, TRAINER_STATE,
                                     checkpoint_root, extra_file, optimizer_file, stage_model_file,
                                     stage_optimizer_file)
from utils.errors import CheckpointError, CheckpointMismatchError
from utils.publish import fsync_file

FORMAT = 1
META_KEYS = ("pp_size", "dp_size", "tp_size", "n_layers", "layer_ranges", "schedule", "n_microbatches", "dp_engine",
             "sharded_optimizer", "optimizer_files")


def optimizer_files(meta: dict) -> int:
    """How many optimizer files each stage of a sharded (ZeRO / expert-parallel) checkpoint holds (pipeline.json's
    meta), or a run writes (the engine's stages spec): one per rank of its dp wrap (dp, or dp x cp; older
    checkpoints: dp)."""
    return int(meta.get("optimizer_files", meta["dp_size"]))


# ---------------------------------------------------------------------------- reading in one process

def read_pipeline_meta(ckpt_dir: str) -> dict:
    path = os.path.join(ckpt_dir, PIPELINE_META)
    if not os.path.isfile(os.path.join(ckpt_dir, COMPLETE_MARKER)) or not os.path.isfile(path):
        raise ValueError(f"{ckpt_dir} is not a complete pipeline checkpoint (no {COMPLETE_MARKER} / {PIPELINE_META})")
    meta = read_json(path)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown pipeline checkpoint format {meta.get('format')}")
    return meta


def merge_stage_checkpoints(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """One process, no process group: the full model state dict of a pipeline checkpoint, with the
    Transformer's key names (load it with Transformer.load_state_dict, or export it to HF)."""
    meta = read_pipeline_meta(ckpt_dir)
    full = merge_stage_state_dicts([load_file(os.path.join(ckpt_dir, stage_model_file(s)))
                                    for s in range(meta["pp_size"])])
    layers = {int(k.split(".")[1]) for k in full if k.startswith("layers.")}
    if layers != set(range(meta["n_layers"])):
        raise ValueError(f"{ckpt_dir}: the stages hold layers {sorted(layers)}, expected 0..{meta['n_layers'] - 1}")
    return full


# ---------------------------------------------------------------------------- writing

def write_stage_state(dir_path: str, stages: dict, sd: dict, global_rank: int, guard: SaveGuard,
                      copy: bool = True) -> None:
    """This rank's stage files from the engine's state_dict() (no collective): the stage's dp rank 0 (tp rank 0)
    writes its weights and, unless ZeRO shards it, its optimizer state; with ZeRO every dp rank its own; global
    rank 0 also pipeline.json. copy=False: `sd` already holds host copies of its own (the background writer).
    `guard.file` names the file being written."""
    s, dp_rank = stages["stage_index"], stages["dp_rank"]
    # one writer per stage (the tensors are gathered; the cp ranks of a stage hold the same state)
    first = dp_rank == 0 and stages["tp_rank"] == 0 and stages.get("cp_rank", 0) == 0
    if first:
        path = guard.file = os.path.join(dir_path, stage_model_file(s))
        tensors = {k: v.to("cpu").contiguous().clone() for k, v in sd["model"].items()} if copy else sd["model"]
        save_file(tensors, path, metadata={"format": "pt", "stage": str(s)})
        fsync_file(path)
    if first or stages["sharded_optimizer"]:  # (its rank in the dp wrap: dp, or dp x cp)
        path = guard.file = os.path.join(dir_path, stage_optimizer_file(s, stages.get("optimizer_rank", dp_rank)))
        torch.save(sd["optimizer"], path)
        fsync_file(path)
    if global_rank == 0:
        guard.file = os.path.join(dir_path, PIPELINE_META)
        write_json(guard.file, {"format": FORMAT, **{k: stages[k] for k in META_KEYS if k in stages},
                                "optimizer_files": optimizer_files(stages)})


def write_extra_and_configs(tmp: str, rank: int, extra_state: Any, model_config: dict, run_config: dict,
                            fault_hook: Optional[Callable[[], None]] = None, guard: Any = None) -> None:
    """A stage checkpoint's per-rank extra (RNG) file, fsynced, and on rank 0 the model and run configs (the
    synchronous save and the background writer alike); `guard.file` names the file being written."""
    path = os.path.join(tmp, extra_file(rank))
    if guard is not None:
        guard.file = path
    torch.save(extra_state, path)
    fsync_file(path)
    if rank == 0:
        write_json(os.path.join(tmp, MODEL_CONFIG), model_config)
        write_json(os.path.join(tmp, RUN_CONFIG), run_config)
        if fault_hook is not None:
            fault_hook()  # test hook: die with a half-written checkpoint


def _trainer_state(trainer_state: dict, step: int, world_size: int) -> dict:
    return dict(trainer_state, step=step, world_size=world_size, saved_at=time.time())


def save_stages(engine: Any, job: SaveJob, writer: Optional[AsyncCheckpointer] = None) -> str:
    """Collective. The stages' files + per-rank RNG into step_N.tmp/, then rank 0 publishes it and prunes.
    Always full stage files (no light LoRA checkpoints). writer: the files written in the background once the
    gathered state is copied to host memory here."""
    stages = engine.state_spec().stages
    out_dir, step, rank, world_size, barrier = job.out_dir, job.step, job.rank, job.world_size, job.barrier
    model_config, run_config, trainer_state = job.model_config, job.run_config, job.trainer_state
    fault_hook = job.fault_hook
    if writer is not None:
        writer.wait()  # at most one save in flight
        sd, extra, model_config, run_config, trainer_state = writer.snapshot(
            {"stage": engine.state_dict(), "extra": job.extra_state}, model_config, run_config, trainer_state)
        global_rank = dist.get_rank()

        def write_files(tmp: str, guard: Any) -> None:
            write_stage_state(tmp, stages, sd, global_rank, guard, copy=False)
            write_extra_and_configs(tmp, rank, extra, model_config, run_config, fault_hook, guard)

        def publish(tmp: str, final: str, guard: SaveGuard) -> None:
            guard.file = os.path.join(tmp, TRAINER_STATE)
            write_json(guard.file, _trainer_state(trainer_state, step, world_size))
            publish_checkpoint_dir(tmp, final, step)
        return save_in_background(out_dir, step, rank, world_size, writer, write_files, publish, barrier=barrier,
                                  keep_last=job.keep_last, log=job.log)
    root = checkpoint_root(out_dir)
    final, tmp = step_dir_paths(root, step)
    # a write that does not fit (disk full, a file-size limit) at any rank: the partial step_N.tmp removed, exit 7
    # at every rank (each phase ends in one verdict of every rank: checkpoint/protocol.agreed_phase)
    with save_guard(root, step) as guard:
        prepare_step_dir(guard, rank)
        sd = engine.state_dict()  # collective over the mesh (FSDP gathers the stage's tensors)
        with agreed_phase(guard):  # every rank has written and fsynced its files
            write_stage_state(tmp, stages, sd, dist.get_rank(), guard)
            del sd
            write_extra_and_configs(tmp, rank, job.extra_state, model_config, run_config, fault_hook, guard)
        with agreed_phase(guard):
            if rank == 0:
                guard.file = os.path.join(tmp, TRAINER_STATE)
                write_json(guard.file, _trainer_state(trainer_state, step, world_size))
                publish_checkpoint_dir(tmp, final, step)
                prune_checkpoints(out_dir, keep_last=job.keep_last, keep_best=True, log=job.log)
    barrier()
    return final


# ---------------------------------------------------------------------------- loading into the engine

def stages_resume_problem(stages: dict, ckpt_dir: str) -> Optional[str]:
    """Why a pipeline of `stages` cannot resume `ckpt_dir`, or None. Our DDP's stages resume any pipeline split of
    our DDP's stages, and a plain (DDP / ZeRO) checkpoint, since both keep the optimizer state per parameter name
    (`other_layout_problem`); under FSDP stages only the same split and dp engine."""
    if not is_pipeline_checkpoint(ckpt_dir):
        return other_layout_problem(ckpt_dir, "this pipeline" if state_per_name(stages["dp_engine"]) else None)
    meta = read_pipeline_meta_safe(ckpt_dir)
    saved = (meta.get("pp_size"), meta.get("dp_size"), meta.get("dp_engine", "ddp"))
    if saved[2] != stages["dp_engine"] or not state_per_name(saved[2]) and not same_split(meta, stages):
        return (f"{ckpt_dir} was written on a pipeline mesh of pp={saved[0]} x dp={saved[1]} ({saved[2]}), this "
                f"run is pp={stages['pp_size']} x dp={stages['dp_size']} ({stages['dp_engine']}): a pipeline "
                "checkpoint resumes with the same dp engine, and under --parallel=fsdp with the same stages too, at "
                "any dp size (otherwise start a new run from its weights with --init_from=<that checkpoint>)")
    return None


def state_per_name(dp_engine: str) -> bool:
    """Whether the stages' dp engine keeps the optimizer state per parameter name over ranges of the whole tensors
    (our DDP's; parallel/config.py CAPABILITIES), so that its files fill any other split of the parameters."""
    return "state_per_parameter_name" in CAPABILITIES.get(dp_engine, frozenset())


def same_split(meta: dict, stages: dict) -> bool:
    """Whether a pipeline checkpoint's pipeline.json has this run's stages (number and layer ranges)."""
    return meta.get("pp_size") == stages["pp_size"] and \
        [tuple(r) for r in meta.get("layer_ranges") or []] == [tuple(r) for r in stages["layer_ranges"]]


def other_layout_problem(ckpt_dir: str, engine: Optional[str]) -> Optional[str]:
    """Why `engine` (our DDP's stages, or our DDP without stages: its name for messages; None when it runs
    FSDP) cannot resume `ckpt_dir` of the other layout (plain <-> pipeline, or another pipeline split), or None:
    the checkpoint must be our DDP's (a pipeline of our DDP's stages, or a plain DDP / ZeRO one with its optimizer
    files) and whole (not a light LoRA checkpoint)."""
    if is_pipeline_checkpoint(ckpt_dir):
        meta = read_pipeline_meta_safe(ckpt_dir)
        ours = state_per_name(meta.get("dp_engine", "ddp"))
        what = f"a pipeline checkpoint (pp={meta.get('pp_size')}, {meta.get('dp_engine', 'ddp')} stages)"
    else:
        light = bool(read_trainer_state(ckpt_dir).get("lora_base"))
        ours = not is_sharded_checkpoint(ckpt_dir) and not light
        what = ("a light (LoRA) checkpoint" if light else
                "an FSDP (DCP) checkpoint" if is_sharded_checkpoint(ckpt_dir) else "a DDP checkpoint")
    if engine is not None and ours:
        return None
    return (f"{ckpt_dir} is {what}; {engine or 'an FSDP engine'} resumes another pipeline layout only from our DDP's "
            "whole checkpoints (a plain DDP / ZeRO one, or a pipeline of --parallel=ddp stages): resume it with "
            "its own layout, or start a new run from its weights with --init_from=<that checkpoint>")


def layout_of(ckpt_dir: str) -> str:
    """A checkpoint's layout in words, for log lines: "pp=2 x dp=1, ddp stages" or "no pipeline"."""
    if not is_pipeline_checkpoint(ckpt_dir):
        return "no pipeline"
    meta = read_pipeline_meta_safe(ckpt_dir)
    return f"pp={meta.get('pp_size')} x dp={meta.get('dp_size')}, {meta.get('dp_engine', 'ddp')} stages"


def whole_ddp_training_files(ckpt_dir: str) -> tuple[dict[str, torch.Tensor], list[dict], str]:
    """One process, no collective: (the whole model's weights, every optimizer file's state dict, their names)
    of our DDP's checkpoint of either layout, a pipeline (every stage's files; every dp rank's with ZeRO) or a
    plain one (optimizer_rank{r}.pt of every rank with ZeRO). Each optimizer dict holds its parameters' entries by
    name over ranges of the whole tensors, so together they fill any stage split and any ZeRO sharding (the
    optimizer's load assembles each of its pieces from them). CheckpointError naming a file that cannot be read."""
    if is_pipeline_checkpoint(ckpt_dir):
        meta = read_pipeline_meta(ckpt_dir)
        pp, dp = int(meta["pp_size"]), optimizer_files(meta) if meta["sharded_optimizer"] else 1
        stage_weights = [load_weights_file(os.path.join(ckpt_dir, stage_model_file(s))) for s in range(pp)]
        with load_errors_named(f"checkpoint {ckpt_dir}: its stages' weights do not make one model"):
            weights = merge_stage_state_dicts(stage_weights)  # as merge_stage_checkpoints: no tensor in two stages
        names = [stage_optimizer_file(s, r) for s in range(pp) for r in range(dp)]
    else:
        weights = load_model_state(ckpt_dir)
        first = load_rank_file(ckpt_dir, "optimizer", 0)
        if first is None:
            raise CheckpointError(f"checkpoint {ckpt_dir}: {optimizer_file(0)} is missing: it records no optimizer "
                                  "state to resume")
        n = first.get("world_size", 1) if first.get("sharded") else 1
        names = [optimizer_file(r) for r in range(n if isinstance(n, int) and n >= 1 else 1)]
    states = [load_tensor_file(os.path.join(ckpt_dir, name)) for name in names]
    return weights, states, names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}"


def read_stage_state(stages: dict, ckpt_dir: str) -> tuple[dict, str]:
    """This stage's {"model", "optimizer"} from a checkpoint of the same pipeline split (pp size, layer ranges) and
    dp engine, at any dp size (ZeRO shards of another dp size: the list of every saved shard), and the name(s) of
    the optimizer file(s) read. No collective; CheckpointError naming a file that cannot be read or a split that
    differs."""
    meta = read_pipeline_meta(ckpt_dir)
    ranges = [tuple(r) for r in stages["layer_ranges"]]
    if meta["pp_size"] != stages["pp_size"] or [tuple(r) for r in meta["layer_ranges"]] != ranges:
        raise CheckpointError(f"checkpoint {ckpt_dir} has {meta['pp_size']} stage(s) with layers "
                              f"{meta['layer_ranges']}; this run has {stages['pp_size']} with {ranges}: resume "
                              f"at the same pipeline_parallel_size (or merge_stage_checkpoints() it to one model "
                              f"and start from that)")
    if meta.get("dp_engine", "ddp") != stages["dp_engine"]:
        raise CheckpointError(f"checkpoint {ckpt_dir} was written with dp engine {meta.get('dp_engine')!r}; this "
                              f"run uses {stages['dp_engine']!r} (the optimizer states differ; the weights can be "
                              f"taken with merge_stage_checkpoints())")
    sharded, saved_sharded = stages["sharded_optimizer"], bool(meta["sharded_optimizer"])
    # our DDP's optimizer keeps its state per parameter name over ranges of whole tensors: it assembles its pieces
    # from files of any split (ZeRO or not, expert-parallel shards of any ep)
    by_name = state_per_name(stages["dp_engine"])
    if sharded != saved_sharded and not by_name:
        raise CheckpointError(f"checkpoint {ckpt_dir}: optimizer layout (sharded={meta['sharded_optimizer']}) "
                              f"differs from this run's (sharded={sharded}): resume with the same "
                              "--use_distributed_optimizer")
    s = stages["stage_index"]
    same = sharded == saved_sharded and optimizer_files(meta) == optimizer_files(stages)
    if not saved_sharded:  # one file per stage whatever the dp size (FSDP's state is gathered to it)
        dp_ranks = [0]
    elif same:
        dp_ranks = [stages.get("optimizer_rank", stages["dp_rank"])]
    else:  # shards of another dp size or layout: every saved shard, re-assembled by the optimizer
        dp_ranks = list(range(optimizer_files(meta)))
    opts = [load_tensor_file(os.path.join(ckpt_dir, stage_optimizer_file(s, r))) for r in dp_ranks]
    names = ", ".join(stage_optimizer_file(s, r) for r in dp_ranks)
    model = load_weights_file(os.path.join(ckpt_dir, stage_model_file(s)))
    return {"model": model, "optimizer": opts[0] if same or not saved_sharded else opts}, names


def load_stages(engine: Any, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
                log: Callable[[str], None] = print) -> Optional[dict]:
    """Collective: this stage's files into the engine (its load_state_dict re-shards them); this rank's extra
    state. Every file this rank reads is read and checked against its stage and optimizer before any collective,
    then one collective of every rank's verdict (checkpoint/reads.agreed_reads): a stage's file damaged at one
    rank is the same line at every rank. CheckpointError naming the file."""
    stages = engine.state_spec().stages
    problem = stages_resume_problem(stages, ckpt_dir)
    if problem:
        raise CheckpointError(problem)
    ours = is_pipeline_checkpoint(ckpt_dir) and same_split(read_pipeline_meta_safe(ckpt_dir), stages)
    with agreed_reads(engine.module):
        if ours:
            state, opt_names = read_stage_state(stages, ckpt_dir)
            model_name = stage_model_file(stages["stage_index"])
        else:  # another split, or a plain checkpoint: this stage's tensors of the whole state
            weights, opt_states, opt_names = whole_ddp_training_files(ckpt_dir)
            state = {"model": {k: weights[k] for k in engine.module.state_dict() if k in weights},
                     "optimizer": opt_states}
            model_name = "its weights"
        with load_errors_named(f"checkpoint {ckpt_dir}: {model_name} does not fit this stage"):
            check_weights_fit(engine.module, state["model"])
        check_optimizer_state(engine.optimizer, ckpt_dir, (state["optimizer"], opt_names))
        # the RNG of rank r of the same layout only (rank r held another part before)
        extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log) if ours else None
    with load_errors_named(f"checkpoint {ckpt_dir}: {model_name} / {opt_names} do not load into this stage"):
        engine.load_state_dict(state)
    if not ours:
        log(f"[resume] {ckpt_dir} was written with another layout ({layout_of(ckpt_dir)}): this stage's "
            "weights and optimizer state taken from it per parameter name; the RNG state starts fresh (this "
            "process's own, seeded by --seed)")
    return extra


def load_pipeline_into_replicated(engine: Any, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
                                  log: Callable[[str], None] = print) -> None:
    """A pipeline checkpoint of our DDP's stages resumed by our DDP / ZeRO without stages: the stages' weights as
    one model, every stage's optimizer files as the state dicts the optimizer assembles its pieces from (ZeRO
    re-shards them). Collective; CheckpointError naming a file that cannot be read or does not load. The RNG
    state starts fresh (a stage's rank r held another part of the model)."""
    spec = engine.state_spec()
    with agreed_reads(spec.model):
        weights, opt_states, opt_names = whole_ddp_training_files(ckpt_dir)
    # the same files at every rank: the same verdict everywhere; another model is CheckpointMismatchError (exit 2)
    load_weights(spec.model, weights, partial=False, source=ckpt_dir, mismatch=CheckpointMismatchError)
    with agreed_reads(spec.model):
        check_optimizer_state(spec.optimizer, ckpt_dir, (opt_states, opt_names))
    load_optimizer_state(spec.optimizer, ckpt_dir, (opt_states, opt_names))
    log(f"[resume] {ckpt_dir} was written with another layout ({layout_of(ckpt_dir)}): its weights and optimizer "
        "state taken per parameter name; the RNG state starts fresh (this process's own, seeded by --seed)")
