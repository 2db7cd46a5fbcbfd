"""The state dict of our DDP's optimizers (MixedPrecisionOptimizer, DistributedOptimizer): its format, its checks
and the re-sharding on load.

Format (STATE_FORMAT 1): {"format", "optimizer" ("adamw" | "muon"), "sharded", "world_size", "rank", "lr",
"scaler", "prev_grad_norm", "params": {name: {"shape", "numel", "lo", "hi", "main", <the update's entries>,
"step"}}, and with expert-parallel shards "zero" (0 | 1), "expert_parallel_size"}, every tensor flat over the
piece's [lo, hi) of the whole tensor (an expert-parallel shard's range moved to its place in the full tensor, whose
shape and numel are given: "sharded" is then 1, every rank saving what it holds; ranges of replicated state may
overlap between ranks, holding the same values): AdamW's "exp_avg" / "exp_avg_sq" (fp32, or bf16 with
--optimizer_state_dtype=bf16), Muon's "momentum". Tensors, ints, floats and strings only
(torch.load(weights_only=True)). A piece's entries are its update's (optimizer/adamw.py BucketAdamW,
optimizer/muon.py MuonState: `piece_state` / `load_piece`).
Must never: load a state saved by another --optimizer, cast a saved tensor to another dtype than the one it is
kept in (the moments excepted: fp32 <-> bf16, logged), or load a shard of a multi-rank run into another world
without every rank's shard.
"""
from __future__ import annotations

import logging
import math
from typing import Union

import torch

STATE_FORMAT = 1
log = logging.getLogger(__name__)


def ddp_state_dict(opt, to_host: bool = True) -> dict:
    """`opt.state_dict(to_host)` (optimizer/mixed_precision_optimizer.py says what to_host=False means)."""
    opt.settle_steps()  # the step counts (a skip not read yet would be counted as a step)
    opt.finish_param_sync()
    own = (lambda t: t.cpu().clone()) if to_host else (lambda t: t)  # noqa: E731
    params = {}
    for pc in opt.pieces:
        shape, lo, hi = opt.full_layout(pc)
        params[pc.name] = {"shape": shape, "numel": math.prod(shape), "lo": lo, "hi": hi,
                           "main": own(pc.main.detach().reshape(-1).float()),
                           **opt.update_of(pc).piece_state(pc, own)}
    experts = {"zero": int(opt.sharded), "expert_parallel_size": opt.expert_parallel_size} if opt.has_experts else {}
    return {"format": STATE_FORMAT, "optimizer": opt.config.optimizer, "sharded": int(opt.sharded or opt.has_experts),
            "world_size": opt.world_size, "rank": opt.rank, **experts, **opt.scaling_state(), "params": params}


def own_state_fits(opt, sd: dict) -> bool:
    """Whether this rank's own saved state dict (same world size) holds everything its pieces need: saved with the
    same ZeRO-ness and expert-parallel size (so the same ranges)."""
    zero = bool(sd.get("zero", sd.get("sharded")))
    return zero == bool(opt.sharded) and int(sd.get("expert_parallel_size", 1)) == opt.expert_parallel_size


def _check_states(opt, sds: list[dict]) -> None:
    """Refuse dicts that cannot fill this optimizer: another format or --optimizer, a missing rank, a shard
    of another world."""
    if not sds:
        raise ValueError("empty optimizer state")
    for sd in sds:
        if sd is None:
            raise ValueError("an optimizer state dict is missing (None): was a rank's optimizer file "
                             "not found? A ZeRO run saves one per rank")
        if sd.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown optimizer state format {sd.get('format')!r}")
        saved_kind = sd.get("optimizer", "adamw")  # states older than --optimizer were AdamW's
        if saved_kind != opt.config.optimizer:
            raise ValueError(f"the checkpoint's optimizer state is {saved_kind}'s but this run has "
                             f"--optimizer={opt.config.optimizer}: switching optimizers on resume is refused")
    if len(sds) > 1:
        shard_runs = {int(sd["world_size"]) for sd in sds if sd["sharded"]}
        if len(shard_runs) > 1:
            raise ValueError(f"the optimizer state dicts come from ZeRO runs of {sorted(shard_runs)} ranks; "
                             "pass the dicts of one run")
        for n in shard_runs:
            ranks = {int(sd["rank"]) for sd in sds if sd["sharded"]}
            missing = sorted(set(range(n)) - ranks)
            if missing:
                raise ValueError(f"rank {missing[0]} of {n} is missing from the optimizer state dicts "
                                 f"(got ranks {sorted(ranks)}); pass every rank's state dict to re-shard")
    # One shard of a multi-rank ZeRO run can't fill another world's shards; a 1-rank run's
    # state (sharded or not) is complete and loads at any world size (1 -> N).
    if len(sds) == 1 and sds[0]["sharded"] and int(sds[0]["world_size"]) not in (1, opt.world_size):
        raise ValueError(
            f"this sharded optimizer state is one rank of a world of {sds[0]['world_size']} ranks, "
            f"but the current world has {opt.world_size}; pass the list of all "
            f"{sds[0]['world_size']} ranks' state dicts to re-shard")


def check_ddp_state_dict(opt, state: Union[dict, list[dict]]) -> tuple[list[dict], dict[str, list[dict]]]:
    """Everything `load_ddp_state_dict` would refuse, found without changing the optimizer and without a
    collective (so that a checkpoint layer can gather every rank's verdict before any rank loads): the dicts'
    format and --optimizer, a missing rank, each piece's saved entries (present, its shape, every tensor the
    update keeps, of a kept dtype and of its range's length), that they cover the piece's range, and the
    scalars. ValueError / KeyError naming the parameter. Returns (the dicts, each piece name's saved entries)."""
    sds = [state] if isinstance(state, dict) or state is None else list(state)
    _check_states(opt, sds)
    saved: dict[str, list[dict]] = {}
    for sd in sds:
        for name, e in sd["params"].items():
            saved.setdefault(name, []).append(e)
    for pc in opt.pieces:
        entries = saved.get(pc.name)
        if not entries:
            raise KeyError(f"optimizer state has no entry for parameter {pc.name!r}")
        shape, lo, hi = opt.full_layout(pc)
        if list(entries[0]["shape"]) != shape:
            raise ValueError(f"{pc.name}: saved shape {entries[0]['shape']} != {shape}")
        for e in entries:  # saved as fp32 (the moments: as kept, fp32 or bf16): another dtype is refused
            for key in ("main", *opt.update_of(pc).state_keys):
                t = e.get(key)
                ok = (torch.float32, torch.bfloat16) if key in ("exp_avg", "exp_avg_sq") else (torch.float32,)
                if not torch.is_tensor(t):
                    other = {"momentum": "AdamW", "exp_avg": "Muon"}.get(key)
                    hint = f" (it was stepped by {other} there: see --muon_experts)" \
                        if other and ".experts." in pc.name else ""
                    raise KeyError(f"{pc.name}: its saved entry has no {key} tensor{hint}")
                if t.dtype not in ok:
                    raise ValueError(f"{pc.name}: its {key} is saved as {t.dtype}, but this optimizer keeps "
                                     f"{' or '.join(map(str, ok))} (and saves it so): refused rather than cast")
                if t.numel() != int(e["hi"]) - int(e["lo"]):
                    raise ValueError(f"{pc.name}: its {key} holds {t.numel()} values for the saved range "
                                     f"[{e['lo']}, {e['hi']})")
            if not isinstance(e.get("step"), (int, float)) or isinstance(e.get("step"), bool):
                raise ValueError(f"{pc.name}: its saved step is {e.get('step')!r}, not a number")
        _check_coverage(pc.name, lo, hi, entries)
    opt.check_scaling_state(sds[0])
    return sds, saved


def load_ddp_state_dict(opt, state: Union[dict, list[dict]]) -> None:
    """`opt.load_state_dict(state)`: this rank's own dict, a complete one, or every rank's (re-sharding). Checked
    in full first (`check_ddp_state_dict`): nothing is changed when it is refused, and the only collective,
    the parameter re-gather of ZeRO (`after_load`), comes after every local step."""
    opt.settle_steps()  # a verdict read after the load would count its step into the loaded count
    sds, saved = check_ddp_state_dict(opt, state)
    kept = torch.bfloat16 if opt.config.state_dtype == "bf16" else torch.float32
    stored = {e["exp_avg"].dtype for es in saved.values() for e in es if torch.is_tensor(e.get("exp_avg"))}
    if stored - {kept}:
        log.info("optimizer state: AdamW moments saved as %s, kept as %s (--optimizer_state_dtype)%s",
                 "/".join(sorted(str(d) for d in stored)), kept,
                 ": rounded to nearest on load" if kept == torch.bfloat16 else ": widened exactly")
    for update in opt.updates:
        update.begin_load()
    for pc in opt.pieces:
        entries = saved[pc.name]
        _, lo, hi = opt.full_layout(pc)
        update = opt.update_of(pc)
        parts = {k: _assemble(lo, hi, pc.main.device, entries, k) for k in ("main", *update.state_keys)}
        step = max(float(e["step"]) for e in entries)
        with torch.no_grad():
            pc.main.view(-1).copy_(parts["main"])
        update.load_piece(pc, parts, step)
    for update in opt.updates:
        update.end_load()
    opt.load_scaling_state(sds[0])
    opt.copy_main_to_model(opt.pieces)
    opt.after_load()


def _assemble(lo: int, hi: int, device: torch.device, entries: list[dict], key: str) -> torch.Tensor:
    """The piece's [lo, hi) (of its whole tensor) of `key`, from whichever saved ranges cover it (ranges of
    replicated state saved by several ranks may overlap: the same values; `_check_coverage` found them whole)."""
    out = torch.empty(hi - lo, dtype=torch.float32, device=device)
    for e in entries:
        s, t = max(lo, e["lo"]), min(hi, e["hi"])
        if s < t:
            out[s - lo:t - lo].copy_(e[key][s - e["lo"]:t - e["lo"]])
    return out


def _check_coverage(name: str, lo: int, hi: int, entries: list[dict]) -> None:
    """ValueError unless the saved ranges of `entries` cover [lo, hi) (the piece's range of its whole tensor)."""
    spans = sorted((max(lo, int(e["lo"])), min(hi, int(e["hi"]))) for e in entries)
    covered, end = 0, lo
    for s, t in spans:  # the union's length
        if s < t:
            covered += max(0, t - max(s, end))
            end = max(end, t)
    if covered != hi - lo:
        raise ValueError(f"{name}: saved state covers {covered} of the {hi - lo} elements "
                         f"[{lo}, {hi}) this rank needs; pass every rank's state dict")
