"""Resuming across engines (ddp <-> fsdp): both keep their optimizer state over fp32 masters per parameter name
(AdamW: exp_avg, exp_avg_sq, step; Muon's matrices: momentum and Muon's step count), so a checkpoint of one engine
is converted exactly into the other's state. The one exchange shape: full fp32 weights {name: tensor}, the state
{name: {"exp_avg", "exp_avg_sq": full tensors shaped like the weight, "step": float}} or, for a matrix Muon
steps, {name: {"momentum": full tensor, "step": float}}, and the scalars {"lr", "scaler", "prev_grad_norm",
"optimizer": "adamw" | "muon"}. Switching optimizers across the conversion is refused, as within an engine.

- DCP (FSDP2) checkpoint -> that shape in one process: `load_full_training_state`; that shape -> an FSDP2
  model and optimizer (each rank keeps its shard): `load_full_state_into_fsdp`.
- our DDP checkpoint (ZeRO shards included) -> that shape: `read_ddp_training_state`; that shape -> our
  DDP optimizer's state dict (ZeRO re-shards it): `ddp_optimizer_state`.

`load_dcp_into_replicated` and `load_plain_into_dtensor` load the other format into an engine (CheckpointManager.load
calls them when the checkpoint's format is not the engine's own).

Owns: the conversion. Must never: write checkpoints, or accept a light (LoRA) or pipeline checkpoint.
Memory: every rank briefly holds the whole model and both moments while converting.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from optimizer.fsdp_optimizer import MUON_KEY, MUON_STEPS_KEY
from optimizer.mixed_precision_optimizer import STATE_FORMAT
from checkpoint.dcp import (MODEL_PREFIX, OPTIM_PREFIX, OPTIM_SCALARS, dcp_load, group_barrier, mesh_group, model_specs,
                            usable_checkpoint)
from checkpoint.dcp_files import DCPCheckpointError
from checkpoint.files import first_nonfinite, load_model_state, load_rank_file
from checkpoint.reads import agreed_reads, load_errors_named, load_extra_state, load_weights, refuse_nonfinite_weights
from utils.checkpoint_json import read_trainer_state
from utils.checkpoint_layout import DCP_METADATA, optimizer_file
from utils.errors import CheckpointError, CheckpointMismatchError, one_line


_MOMENTS = ("exp_avg", "exp_avg_sq")


def load_full_training_state(ckpt_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, dict], Optional[dict]]:
    """A DCP checkpoint's whole training state in ONE process (no process group), for another engine to
    resume from: (full fp32 weights {name: tensor}, AdamW state {name: {"exp_avg", "exp_avg_sq": full
    tensors shaped like the weight, "step": float}} of every parameter that has one, the optimizer's
    scalars {"lr", "scaler", "prev_grad_norm"} from dcp_manifest.json or None when it records none).
    Materialises the model and both moments in this process's memory."""
    meta, md = usable_checkpoint(ckpt_dir)
    specs = {}
    for k, v in md.state_dict_metadata.items():
        if not k.startswith((OPTIM_PREFIX + "state.", OPTIM_PREFIX + MUON_KEY)) and k != OPTIM_PREFIX + MUON_STEPS_KEY:
            continue
        dtype, size = getattr(getattr(v, "properties", None), "dtype", None), getattr(v, "size", None)
        if not isinstance(v, TensorStorageMetadata) or not isinstance(dtype, torch.dtype) or size is None:
            raise DCPCheckpointError(f"{os.path.join(ckpt_dir, DCP_METADATA)}: {k} is not described as a tensor "
                                     "(size, dtype)")
        specs[k] = (tuple(size), dtype)
    out = {MODEL_PREFIX + k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in model_specs(ckpt_dir, md).items()}
    out.update({k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in specs.items()})
    dcp_load(out, ckpt_dir, None)
    weights = {k[len(MODEL_PREFIX):]: v for k, v in out.items() if k.startswith(MODEL_PREFIX)}
    bad = first_nonfinite(weights.items())
    if bad is not None:
        raise DCPCheckpointError(f"checkpoint {ckpt_dir}: {bad}")
    per_param: dict[str, dict] = {}
    for k in specs:
        if k.startswith(OPTIM_PREFIX + "state."):
            fqn, kind = k[len(OPTIM_PREFIX + "state."):].rsplit(".", 1)
            per_param.setdefault(fqn, {})[kind] = out[k]
    muon_steps = out.get(OPTIM_PREFIX + MUON_STEPS_KEY)
    muon = {k[len(OPTIM_PREFIX + MUON_KEY):]: out[k] for k in specs if k.startswith(OPTIM_PREFIX + MUON_KEY)}
    state = {}
    for fqn, entry in per_param.items():
        if fqn not in weights or any(m not in entry for m in (*_MOMENTS, "step")):
            raise DCPCheckpointError(f"{os.path.join(ckpt_dir, DCP_METADATA)}: the optimizer state of {fqn} is not "
                                     f"AdamW's exp_avg, exp_avg_sq and step of a weight (has {sorted(entry)})")
        state[fqn] = {"exp_avg": entry["exp_avg"].float(), "exp_avg_sq": entry["exp_avg_sq"].float(),
                      "step": float(entry["step"].reshape(-1)[0]) if entry["step"].numel() else 0.0}
    for fqn, momentum in muon.items():
        if fqn not in weights or muon_steps is None:
            raise DCPCheckpointError(f"{os.path.join(ckpt_dir, DCP_METADATA)}: Muon's momentum of {fqn} "
                                     + ("names no weight" if fqn not in weights else "comes without Muon's step count"))
        state[fqn] = {"momentum": momentum.float(), "step": float(muon_steps.reshape(-1)[0])}
    saved = meta.get("optimizer")
    scalars = None if not isinstance(saved, dict) or any(k not in saved for k in OPTIM_SCALARS) else \
        {**{k: saved[k] for k in ("lr", "scaler", "prev_grad_norm")},
         "optimizer": "muon" if muon_steps is not None else "adamw"}
    return weights, state, scalars


def load_full_state_into_fsdp(model: nn.Module, optimizer, weights: dict[str, torch.Tensor],
                              state: Optional[dict[str, dict]], scalars: Optional[dict], source: str) -> None:
    """Collective over the model's FSDP mesh: full (unsharded) weights and, when `state` is given, the AdamW
    state of each parameter (load_full_training_state's shapes; another engine's checkpoint converted
    per parameter name) into an FSDP2 model + FSDPOptimizer, each rank keeping its own shard. Every rank
    passes the same full tensors. CheckpointMismatchError when the names or shapes do not fit the model."""
    def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        if isinstance(like, DTensor):
            return distribute_tensor(full.to(dtype=like.dtype, device=like.device).reshape(like.shape),
                                     like.device_mesh, like.placements)
        return full.to(dtype=like.dtype, device=like.device).reshape(like.shape)

    current = get_model_state_dict(model)
    missing, unexpected = sorted(set(current) - set(weights)), sorted(set(weights) - set(current))
    wrong = sorted(k for k in current if k in weights and tuple(weights[k].shape) != tuple(current[k].shape))
    if missing or unexpected or wrong:
        raise CheckpointMismatchError(f"checkpoint {source}: its weights do not fit the model (missing {missing[:5]}, "
                                      f"unexpected {unexpected[:5]}, other shapes {wrong[:5]})")
    set_model_state_dict(model, {k: shard_like(weights[k], v) for k, v in current.items()})
    if optimizer is None or state is None:
        return
    sd = optimizer.state_dict()  # the template: every flat key this optimizer holds, zero moments when fresh
    scalars = dict(scalars or {})
    saved_kind, run_kind = scalars.pop("optimizer", "adamw"), "muon" if MUON_STEPS_KEY in sd["adamw"] else "adamw"
    if saved_kind != run_kind:
        raise CheckpointMismatchError(f"checkpoint {source}: its optimizer state is {saved_kind}'s but this run has "
                                      f"--optimizer={run_kind}: switching optimizers on resume is refused")
    adamw = dict(sd["adamw"])
    for key, like in sd["adamw"].items():
        if key.startswith(MUON_KEY):  # Muon's momentum of a matrix: zeros where the saved run never stepped it
            fqn = key[len(MUON_KEY):]
            momentum = state.get(fqn, {}).get("momentum")
            adamw[key] = shard_like(momentum.float() if momentum is not None else torch.zeros(current[fqn].shape),
                                    like)
            continue
        if key == MUON_STEPS_KEY:
            steps = max((float(e["step"]) for e in state.values() if "momentum" in e), default=0.0)
            adamw[key] = torch.full_like(like, steps) if torch.is_tensor(like) else steps
            continue
        if not key.startswith("state."):
            continue
        fqn, kind = key[len("state."):].rsplit(".", 1)
        entry = state.get(fqn)
        if entry is None:  # never stepped in the saved run: zero moments, step 0
            entry = {"exp_avg": torch.zeros(current[fqn].shape), "exp_avg_sq": torch.zeros(current[fqn].shape),
                     "step": 0.0}
        if kind == "step":
            adamw[key] = torch.full_like(like, float(entry["step"])) if torch.is_tensor(like) else float(entry["step"])
        elif kind in _MOMENTS:
            if tuple(entry[kind].shape) != tuple(current[fqn].shape) and entry[kind].numel() != current[fqn].numel():
                raise CheckpointMismatchError(f"checkpoint {source}: the optimizer's {kind} of {fqn} has shape "
                                              f"{list(entry[kind].shape)}, the weight {list(current[fqn].shape)}")
            adamw[key] = shard_like(entry[kind].float(), like)
        else:
            raise CheckpointMismatchError(f"checkpoint {source}: this optimizer keeps {key}, which AdamW's state "
                                          "of another engine does not have")
    optimizer.load_state_dict({**sd, **scalars, "adamw": adamw})
    group_barrier(mesh_group(model))


# Both engines keep AdamW over fp32 masters, per parameter name: exp_avg, exp_avg_sq, step. The one exchange
# shape, {name: {"exp_avg", "exp_avg_sq": full tensors shaped like the weight, "step": float}} + full fp32
# weights + the scalars {"lr", "scaler", "prev_grad_norm"}, is what load_full_training_state reads and
# load_full_state_into_fsdp loads; the two below are our DDP format's side.

def read_ddp_training_state(ckpt_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, dict], Optional[dict]]:
    """A DDP checkpoint's whole training state in this process: (full weights, fp32: the optimizer's masters
    where it keeps them, else model.safetensors cast; per-parameter AdamW state assembled from every rank's
    optimizer_rank{r}.pt, ZeRO shards included; the scalars or None without an optimizer file)."""
    weights = {k: v.float() for k, v in load_model_state(ckpt_dir).items()}
    first = load_rank_file(ckpt_dir, "optimizer", 0)
    if first is None:
        return weights, {}, None
    n = first.get("world_size", 1) if first.get("sharded") else 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {optimizer_file(0)}: world_size={n!r} is not an integer >= 1")
    sds = [first]
    for r in range(1, n):
        sd = load_rank_file(ckpt_dir, "optimizer", r)
        if sd is None:
            raise CheckpointError(f"checkpoint {ckpt_dir}: {optimizer_file(r)} is missing (the run saved {n} "
                                       "optimizer shards)")
        sds.append(sd)
    flat: dict[str, dict] = {}
    for r, sd in enumerate(sds):
        for name, e in (sd.get("params") or {}).items():
            try:
                numel, lo, hi = int(e["numel"]), int(e["lo"]), int(e["hi"])
                kinds = ("main", "momentum") if "momentum" in e else ("main", "exp_avg", "exp_avg_sq")  # Muon's
                f = flat.setdefault(name, {"shape": list(e["shape"]), "step": 0.0,
                                           "covered": torch.zeros(numel, dtype=torch.bool),
                                           **{k: torch.zeros(numel) for k in kinds}})
                for k in kinds:
                    f[k][lo:hi] = e[k].reshape(-1).float()
                f["covered"][lo:hi] = True  # ranges of replicated state saved by several ranks may overlap
                f["step"] = max(f["step"], float(e["step"]))
            except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as err:
                if isinstance(err, torch.OutOfMemoryError):
                    raise
                raise CheckpointError(f"checkpoint {ckpt_dir}: {optimizer_file(r)}: the state of {name} does "
                                           f"not read ({type(err).__name__}: {one_line(err)[:200]})") from err
    state = {}
    for name, f in flat.items():
        if not bool(f["covered"].all()) or name not in weights:
            raise CheckpointError(f"checkpoint {ckpt_dir}: the optimizer files cover {int(f['covered'].sum())} of "
                                  f"the {f['main'].numel()} elements of {name}")
        shape = tuple(f["shape"])
        weights[name] = f["main"].view(shape)  # the fp32 master (the saved weight may be its bf16 copy)
        if "momentum" in f:
            state[name] = {"momentum": f["momentum"].view(shape), "step": f["step"]}
        elif f["step"] > 0:
            state[name] = {"exp_avg": f["exp_avg"].view(shape), "exp_avg_sq": f["exp_avg_sq"].view(shape),
                           "step": f["step"]}
    scalars = {k: first[k] for k in ("lr", "scaler", "prev_grad_norm") if k in first}
    return weights, state, {**scalars, "optimizer": first.get("optimizer", "adamw")} if len(scalars) == 3 else None


def ddp_optimizer_state(weights: dict[str, torch.Tensor], state: dict[str, dict], scalars: dict) -> dict:
    """Another engine's per-parameter AdamW state as our DDP optimizers' state dict: one complete rank
    (unsharded), which MixedPrecisionOptimizer loads and the ZeRO DistributedOptimizer re-shards."""
    params = {}
    for name, w in weights.items():
        e = state.get(name)
        zeros = torch.zeros(w.numel(), dtype=torch.float32)
        if e is not None and "momentum" in e:  # a matrix Muon steps
            params[name] = {"shape": list(w.shape), "numel": w.numel(), "lo": 0, "hi": w.numel(),
                            "main": w.detach().reshape(-1).float().clone(),
                            "momentum": e["momentum"].reshape(-1).float().clone(), "step": float(e["step"])}
            continue
        params[name] = {"shape": list(w.shape), "numel": w.numel(), "lo": 0, "hi": w.numel(),
                        "main": w.detach().reshape(-1).float().clone(),
                        "exp_avg": e["exp_avg"].reshape(-1).float().clone() if e else zeros,
                        "exp_avg_sq": e["exp_avg_sq"].reshape(-1).float().clone() if e else zeros.clone(),
                        "step": float(e["step"]) if e else 0.0}
    return {"format": STATE_FORMAT, "sharded": 0, "world_size": 1, "rank": 0, "optimizer": "adamw", **scalars,
            "params": params}


# ---------------------------------------------------------------------------- into an engine of the other kind

def load_dcp_into_replicated(engine: Any, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
                             log: Callable[[str], None]) -> Optional[dict]:
    """A --parallel=fsdp (DCP) checkpoint resumed under our DDP ("replicated"): every rank reads the full weights
    and AdamW state in one process, converted per parameter name into this optimizer's format (one complete rank;
    ZeRO re-shards it)."""
    spec = engine.state_spec()
    if spec.lora_base is not None:
        raise CheckpointError(f"checkpoint {ckpt_dir} was written by --parallel=fsdp, which saves whole "
                              "models; a LoRA run whose base is a file resumes only its own light "
                              "checkpoints: resume it with --parallel=fsdp")
    with agreed_reads(spec.model):
        weights, state, scalars = load_full_training_state(ckpt_dir)
        extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log, same_world_only=False)
    load_weights(spec.model, weights, partial=False, source=ckpt_dir, mismatch=CheckpointMismatchError)
    if scalars is None:
        log(f"[resume] warning: {ckpt_dir} (--parallel=fsdp) records no optimizer state: resuming its weights "
            "under --parallel=ddp with FRESH AdamW moments (the next steps differ from the uninterrupted run's)")
    else:
        with load_errors_named(f"checkpoint {ckpt_dir}: its (--parallel=fsdp) optimizer state does not convert to "
                               "this --parallel=ddp optimizer", CheckpointMismatchError, width=300):
            spec.optimizer.load_state_dict(ddp_optimizer_state(weights, state, scalars))
        log(f"[resume] {ckpt_dir} was written by --parallel=fsdp: its weights and optimizer state (AdamW's "
            "exp_avg, exp_avg_sq and step, Muon's momentum, per parameter) converted to --parallel=ddp")
    return extra if saved_world == world_size else None


def load_plain_into_dtensor(engine: Any, ckpt_dir: str, saved_world: int, rank: int, world_size: int,
                            log: Callable[[str], None]) -> Optional[dict]:
    """A --parallel=ddp checkpoint resumed under FSDP2 ("dtensor"): every rank reads the full weights (the
    optimizer's fp32 masters) and the AdamW state assembled from every optimizer_rank{r}.pt (ZeRO shards
    included), and keeps its own shard of each."""
    spec = engine.state_spec()
    with agreed_reads(spec.model):
        if read_trainer_state(ckpt_dir).get("lora_base"):
            raise CheckpointError(f"checkpoint {ckpt_dir} holds only a LoRA run's trainable tensors (its "
                                  "base is a file): resume it with --parallel=ddp")
        weights, state, scalars = read_ddp_training_state(ckpt_dir)
        extra = load_extra_state(ckpt_dir, rank, saved_world, world_size, log)
    if scalars is None:
        log(f"[resume] warning: {ckpt_dir} (--parallel=ddp) has no optimizer file: resuming its weights under "
            "--parallel=fsdp with FRESH AdamW moments (the next steps differ from the uninterrupted run's)")
    load_full_state_into_fsdp(spec.model, spec.optimizer, weights, state if scalars is not None else None, scalars,
                              ckpt_dir)
    refuse_nonfinite_weights(spec.model, ckpt_dir)
    if scalars is not None:
        log(f"[resume] {ckpt_dir} was written by --parallel=ddp: its weights and optimizer state (AdamW's "
            "exp_avg, exp_avg_sq and step, Muon's momentum, per parameter) converted to --parallel=fsdp")
    return extra
