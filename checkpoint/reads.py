"""Reading and checking checkpoint files for every format: each rank's reads agreed on by all ranks before
any collective (`agreed_reads`), extra (RNG) state, optimizer files in any saved layout, light (LoRA)
weights, the frozen base's fingerprint, and which kind of checkpoint a directory is.

Owns: what a checkpoint directory holds and how a damaged or mismatched file is named in one line.
Must never: write checkpoints (the formats' writers do) or build engines.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import sys
from typing import Any, Callable, Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from checkpoint.files import first_nonfinite, load_rank_file, load_tensor_file
from checkpoint.rng import rng_state_problem
from parallel.engine import trainable_names
from utils.checkpoint_json import read_json
from utils.checkpoint_layout import (DCP_FILES_DESCRIPTION, DCP_MANIFEST, MODEL_FILE, PIPELINE_META,
                                     STAGE_FILES_DESCRIPTION, extra_file, optimizer_file)
from utils.constants import EXIT_BAD_CHECKPOINT
from utils.dist import first_error_of_ranks
from utils.errors import CheckpointError, one_line


def is_pipeline_checkpoint(ckpt_dir: str) -> bool:
    return os.path.isfile(os.path.join(ckpt_dir, PIPELINE_META))


def read_pipeline_meta_safe(ckpt_dir: str) -> dict:
    try:
        return read_json(os.path.join(ckpt_dir, PIPELINE_META))
    except (OSError, ValueError):
        return {}


def is_sharded_checkpoint(ckpt_dir: str) -> bool:
    """A DCP (FSDP2) checkpoint: its manifest names the shards."""
    return os.path.isfile(os.path.join(ckpt_dir, DCP_MANIFEST))


@contextlib.contextmanager
def agreed_reads(module: nn.Module):
    """Reads and checks of one rank's own checkpoint files (no collective inside), then ONE collective of every
    rank's verdict: when any rank raised a CheckpointError (a damaged file, named), every rank raises the same
    one (the lowest rank's), so each prints the same line and exits with the same code; no rank goes on into a
    collective that the failed rank never joins (which ended the others with gloo's "Connection closed by
    peer")."""
    verdict = None
    try:
        yield
    except CheckpointError as e:
        verdict = (EXIT_BAD_CHECKPOINT, one_line(e))
    device = next((p.device for p in module.parameters()), None)
    agreed = first_error_of_ranks(verdict, device)
    if agreed is not None:
        raise CheckpointError(agreed[1])


def refuse_nonfinite_weights(module: nn.Module, ckpt_dir: str) -> None:
    """One pass over this rank's loaded weights (its shard of a sharded model, its stage of a pipeline) and
    one collective of every rank's verdict: CheckpointError (exit 5) with the same line on every rank,
    naming the first tensor that holds NaN or inf, when any rank found one."""

    params = [(n, p.to_local() if _is_dtensor(p) else p) for n, p in module.named_parameters()]
    bad = first_nonfinite(params)
    device = params[0][1].device if params else None
    verdict = first_error_of_ranks(None if bad is None else (EXIT_BAD_CHECKPOINT, f"checkpoint {ckpt_dir}: {bad}"),
                                   device)
    if verdict is not None:
        raise CheckpointError(verdict[1])


def load_extra_state(ckpt_dir: str, rank: int, saved_world: int, world_size: int,
                     log: Callable[[str], None] = print, same_world_only: bool = True) -> Optional[dict]:
    """This rank's extra_rank{r}.pt (RNG states, comm-hook state), checked: its RNG state must restore.
    None at another world size (same_world_only: not even read), or when the file is missing, which at
    the same world size is logged: the run goes on with this process's own RNG state (seeded by --seed),
    so dropout and sampling after the resume do not repeat the uninterrupted run's."""
    if same_world_only and saved_world != world_size:
        return None
    path = os.path.join(ckpt_dir, extra_file(rank))
    extra = load_rank_file(ckpt_dir, "extra", rank)
    if extra is None:
        if saved_world == world_size:
            log(f"[resume] warning: rank {rank}: {path} is missing: continuing with fresh RNG state (this process's "
                "own, seeded by --seed) and a fresh comm-hook state, so random draws after the resume (dropout, "
                "PowerSGD) differ from the uninterrupted run's")
        return None
    if "rng" in extra:
        problem = rng_state_problem(extra["rng"])
        if problem:
            raise CheckpointError(f"{path}: {problem}")
    elif saved_world == world_size:
        raise CheckpointError(f"{path}: holds no RNG state (keys {sorted(map(str, extra))[:5]})")
    return extra



def read_optimizer_state(ckpt_dir: str, sharded: bool, rank: int, world_size: int,
                         saved_world: int, own_fits: Optional[Callable[[dict], bool]] = None) -> tuple[Any, str]:
    """The optimizer files this rank loads (no collective): (its state dict or the list of every saved rank's,
    the file name(s) for messages). `own_fits(sd)`: whether this rank's own file of a run of the same world size is
    all it needs (the optimizer's answer: saved with the same ZeRO-ness and expert-parallel size).
    CheckpointError naming a file that is missing or damaged."""
    def read(r: int) -> dict:
        sd = load_rank_file(ckpt_dir, "optimizer", r)
        if sd is None:
            raise CheckpointError(f"checkpoint {ckpt_dir}: {optimizer_file(r)} is missing "
                                       f"(the run saved {saved_world} rank(s))")
        return sd
    if sharded and saved_world == world_size and os.path.isfile(os.path.join(ckpt_dir, optimizer_file(rank))):
        own = read(rank)
        if isinstance(own, dict) and own.get("sharded") and (own_fits is None or own_fits(own)):
            return own, optimizer_file(rank)
    first = read(0)
    n = first.get("world_size", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {optimizer_file(0)} does not load into this optimizer "
                                   f"(ValueError: world_size={n!r} is not an integer >= 1)")
    if not first.get("sharded") or n == 1:
        return first, optimizer_file(0)
    return [first] + [read(r) for r in range(1, n)], f"{optimizer_file(0)} .. {optimizer_file(n - 1)}"


def check_optimizer_state(opt, ckpt_dir: str, read: tuple[Any, str]) -> None:
    """What load_optimizer_state(opt, ckpt_dir, read) would refuse (another dtype, a missing parameter, a range
    that does not fit), found at this rank with no collective and nothing loaded: called inside `agreed_reads`, so
    that a file that reads but does not load at ONE rank is the same line at every rank (the others would
    otherwise be in ZeRO's parameter re-gather when it fails). CheckpointError naming the file(s)."""
    state, name = read
    with _naming_a_bad_optimizer_file(ckpt_dir, lambda: name):
        opt.check_state_dict(state)


def check_weights_fit(module: nn.Module, state: dict) -> None:
    """What a strict `module.load_state_dict(state)` would refuse, found without loading or a collective (a
    DTensor's shape is its full one, and so is an expert-parallel shard's under our DDP: the files hold every
    expert): ValueError naming missing or unexpected tensors, or the first whose shape differs."""
    from parallel.distributed_data_parallel import SHARD_OF_ATTR
    own = {k: list(t.shape) for k, t in module.state_dict().items()}
    own.update({n: list(getattr(p, SHARD_OF_ATTR)[0]) for n, p in module.named_parameters()
                if getattr(p, SHARD_OF_ATTR, None) is not None})
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"missing tensors {missing[:3]}{' ...' if len(missing) > 3 else ''}, unexpected tensors "
                         f"{unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}")
    for name, shape in own.items():
        if list(state[name].shape) != shape:
            raise ValueError(f"{name}: saved shape {list(state[name].shape)}, this model's {shape}")


def load_optimizer_state(opt, ckpt_dir: str, read: tuple[Any, str]) -> None:
    """What read_optimizer_state read (this rank's ZeRO shard at the same world size; otherwise rank 0's file when
    it holds everything, else every saved rank's file, which the optimizer re-shards to this world size) into the
    optimizer; CheckpointError naming the file(s) when the state does not load into it."""
    state, name = read
    with _naming_a_bad_optimizer_file(ckpt_dir, lambda: name):
        opt.load_state_dict(state)


LOAD_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError)


@contextlib.contextmanager
def load_errors_named(message: "str | Callable[[], str]", error: type = CheckpointError, width: int = 200):
    """A library's error while state loads (wrong shapes, keys, types) becomes ONE line,
    `error(f"{message} ({type}: {what it said})")`; our CheckpointErrors and out-of-memory pass through.
    `message` may be a function, read when the error happens (the file being read at that moment)."""
    try:
        yield
    except LOAD_ERRORS as e:
        if isinstance(e, (CheckpointError, torch.OutOfMemoryError)):
            raise
        text = message() if callable(message) else message
        raise error(f"{text} ({type(e).__name__}: {one_line(e)[:width]})") from e


def _naming_a_bad_optimizer_file(ckpt_dir: str, name: Callable[[], str]):
    """An optimizer state that does not load becomes a CheckpointError naming the file `name()` was reading."""
    return load_errors_named(lambda: f"checkpoint {ckpt_dir}: {name()} does not load into this optimizer")


# ---------------------------------------------------------------------------- light LoRA checkpoints

def load_weights(module: nn.Module, state: dict[str, torch.Tensor], partial: bool, source: str,
                 mismatch: Optional[type] = None) -> None:
    """Full checkpoints must match the model exactly; a light (LoRA) one must cover exactly the
    trainable parameters, and the rest must be the base the checkpoint references (checked by the caller).
    Names or shapes that do not fit raise `mismatch` (default CheckpointError: the checkpoint's tensors
    disagree with the model its own model_config.json builds); the trainer's resume passes
    CheckpointMismatchError (a configuration that builds another model)."""
    mismatch = mismatch or CheckpointError
    where = weights_file_name(source)
    if not partial:
        try:
            module.load_state_dict(state)
        except RuntimeError as e:  # missing / unexpected keys, size mismatch
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise mismatch(f"checkpoint {source}: {where} does not fit the model ({one_line(e)[:300]})") from e
        return
    want = trainable_names(module)
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
        raise mismatch(f"checkpoint {source}: {where} does not fit the model ({one_line(e)[:300]})") from e


def weights_file_name(ckpt_dir: str) -> str:
    """Which file(s) of a checkpoint hold its weights, for messages."""
    if is_pipeline_checkpoint(ckpt_dir):
        return STAGE_FILES_DESCRIPTION
    if is_sharded_checkpoint(ckpt_dir):
        return DCP_FILES_DESCRIPTION
    return MODEL_FILE


def base_fingerprint(module: nn.Module) -> str:
    """sha256 over the names, dtypes, shapes and bytes of the frozen (non-trainable) tensors."""
    h = hashlib.sha256()
    trainable = {id(p) for p in module.parameters() if p.requires_grad}
    for k, v in sorted(module.state_dict(keep_vars=True).items()):
        if id(v) in trainable:
            continue
        t = v.detach().to("cpu").contiguous()
        h.update(f"{k}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()

def _is_dtensor(t: Any) -> bool:
    """isinstance(t, DTensor) without importing torch.distributed.tensor (~1 s) where nothing has: then no tensor
    can be one (sample.py, eval_lm.py and export load plain checkpoints)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def damaged_file_hint(ckpt_dir: str, e: BaseException) -> str:
    """The error of a load that failed inside a library that does not say which file it read: the
    first tensor file of the directory that does not load on its own, else the error itself."""
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        try:
            if name.endswith(".safetensors"):
                load_file(path)
            elif name.endswith(".pt"):
                load_tensor_file(path)
        except (SafetensorError, OSError, CheckpointError) as bad:
            return f"{name} cannot be read ({one_line(bad)[:200]})"
    return f"{type(e).__name__}: {one_line(e)[:300]}"

