"""FSDPOptimizer: AdamW over FSDP2's sharded fp32 DTensor parameters, with the API of our DDP's optimizers.

Owns: the optimizer of a model wrapped by parallel/fsdp.py's wrap_fsdp (zero_grad, scale_loss, set_lr,
step -> (stepped, grad_norm), finish_param_sync, loss_scale, a sharded DCP-ready state_dict /
load_state_dict), on optimizer/base.py's step skeleton: the squared norm summed over the mesh dimensions
each gradient is sharded on, the tensor group's partial gradients (sequence parallelism) summed first;
the options FSDP has no use for among the optimizer's own (`fsdp_optimizer_problems`); and the names of
the attributes wrap_fsdp records on the model for it (WRAP_CONFIG_ATTR, MESH_ATTR, TP_PARTIAL_ATTR).
It reads what the wrapper recorded by those names and never imports parallel/ (it sits below it).
Must never: change the model's dtype (the sharded parameters stay fp32: they ARE the masters; bf16/fp16
exist only as FSDP's compute copies), clip with a norm that is not global over all shards of all ranks
(trap 8), or decide "skip this step" differently on different ranks.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from optimizer.adamw import build_adamw
from optimizer.base import GlobalNormOptimizer
from optimizer.muon import DTensorMuon
from optimizer.optimizer_config import OptimizerConfig

STATE_FORMAT = 1
# What parallel/fsdp.py records on the model it wraps, read here:
WRAP_CONFIG_ATTR = "_fsdp_engine_config"  # on the wrapped root: what wrap_fsdp was asked for
MESH_ATTR = "_fsdp_engine_mesh"  # on the wrapped root: the mesh its parameters are sharded over
TP_PARTIAL_ATTR = "_tp_partial_grads"
# Muon's entries in the optimizer's flat state dict (beside AdamW's "state.<fqn>.exp_avg", ...)
MUON_KEY, MUON_STEPS_KEY = "muon_momentum.", "muon_steps"  # set by shard_on_mesh: (parameter names, tensor group) to all-reduce


def fsdp_optimizer_problems(*, use_distributed_optimizer: bool = False, overlap_optim_step: bool = False,
                            overlap_param_gather: bool = False, zero_stage: int = 1,
                            state_dtype: str = "fp32") -> list[str]:
    """What is wrong with these optimizer options under FSDP (options of our DDP's optimizers only), one
    sentence each; [] when nothing is."""
    problems = []
    if use_distributed_optimizer:
        problems.append("--use_distributed_optimizer=true is ZeRO-1/2 of --parallel=ddp; FSDP already shards "
                        "parameters, gradients and optimizer state (drop the flag)")
    if zero_stage != 1:
        problems.append(f"--zero_stage={zero_stage} belongs to --parallel=ddp with ZeRO; FSDP's stage is chosen "
                        "by --reshard_after_forward (true: ZeRO-3, false: ZeRO-2-like)")
    if overlap_optim_step:
        problems.append("--overlap_optim_step=true is not supported with FSDP (its per-bucket step needs our DDP "
                        "buckets; FSDP overlaps communication with compute by itself)")
    if overlap_param_gather:
        problems.append("--overlap_param_gather=true belongs to ZeRO under --parallel=ddp; FSDP prefetches "
                        "parameter all-gathers itself")
    if state_dtype != "fp32":
        problems.append(f"--optimizer_state_dtype={state_dtype} belongs to --parallel=ddp's one-launch AdamW; FSDP "
                        "keeps torch's AdamW with fp32 moments")
    return problems


def raise_fsdp_problems(problems: list[str]) -> None:
    """One ValueError naming every problem of the FSDP options, if there is any."""
    if problems:
        raise ValueError("bad options for --parallel=fsdp: " + "; ".join(problems))


class FSDPOptimizer(GlobalNormOptimizer):
    """AdamW over the sharded fp32 DTensor parameters, with the MixedPrecisionOptimizer API.

    Only parameters with requires_grad are optimized (frozen LoRA bases are left out); weight decay
    applies to ndim >= 2 only; clipping uses the global norm over every shard of every rank; with
    precision='fp16' a DynamicGradScaler scales the loss and a non-finite global norm (the same
    all-reduced value on every rank) skips the step everywhere.
    """
    sharded = True
    norm_sum_dtype = torch.float32  # the stages' squared norms are summed in fp32 here (float64 in our DDP's)

    def __init__(self, model: nn.Module, config: OptimizerConfig, norm_groups: Sequence = ()):
        raise_fsdp_problems(fsdp_optimizer_problems(
            use_distributed_optimizer=config.use_distributed_optimizer, overlap_optim_step=config.overlap_optim_step,
            overlap_param_gather=config.overlap_param_gather, zero_stage=config.zero_stage,
            state_dtype=config.state_dtype))
        if not isinstance(model, FSDPModule):
            raise ValueError("FSDPOptimizer needs a model wrapped by wrap_fsdp")
        self.model, self.config = model, config
        wcfg = getattr(model, WRAP_CONFIG_ATTR, {})
        if wcfg.get("param_dtype") == torch.float16 and config.precision != "fp16":
            raise ValueError("param_dtype=float16 needs precision='fp16' (loss scaling)")
        self.named_params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not self.named_params:
            raise ValueError("the model has no trainable parameters")
        for n, p in self.named_params:
            if not isinstance(p, DTensor):
                raise ValueError(f"parameter {n} is not sharded (a DTensor): wrap every module with wrap_fsdp")
            if p.dtype != torch.float32:
                raise ValueError(f"parameter {n} is {p.dtype}; FSDP masters must be fp32")
        self.params = [p for _, p in self.named_params]
        # sequence parallelism: the norms' gradients are partial sums over the tensor ranks
        names, self.tp_group = getattr(model, TP_PARTIAL_ATTR, ((), None))
        self.tp_partial = [p for n, p in self.named_params if n in set(names)]
        self.mesh: DeviceMesh = getattr(model, MESH_ATTR, None) or self.params[0].device_mesh
        # the data-parallel shard dimension: what "world_size" in the optimizer state means
        self.world_size = self.mesh.size(self.mesh.ndim - 1)
        self._init_scaling(config, norm_groups)  # norm_groups: more groups the norm spans (pipeline stages)
        # --optimizer=muon: Muon on the hidden matrices (optimizer/muon.py's DTensorMuon), AdamW on the rest
        self.muon = DTensorMuon(self.named_params, config) if config.optimizer == "muon" else None
        muon_ids = {id(p) for _, p in self.muon.params} if self.muon else set()
        rest = [p for p in self.params if id(p) not in muon_ids]
        # CPU (or offloaded) shards: the plain single-tensor loop
        self.adamw = build_adamw([p for p in rest if p.ndim >= 2], [p for p in rest if p.ndim < 2],
                                 config, self.params[0].device.type, single_tensor_on_cpu=True)
        # The all-reduce of the norm runs on the mesh's device (gloo: cpu; nccl: the rank's accelerator),
        # which is not where offloaded gradients live.
        self._comm_device = (torch.device("cpu") if self.mesh.device_type == "cpu" else
                             torch.device(self.mesh.device_type,
                                          torch.get_device_module(self.mesh.device_type).current_device()))

    # ------------------------------------------------------------------ per step API
    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> tuple[bool, float]:
        """Unscale, skip on inf/nan (decided from the all-reduced norm, so every rank agrees), clip by
        the global norm, AdamW (and Muon) on the shards, the host deciding (DTensorMuon and the CPU's single-tensor
        AdamW take no device flag). Returns (stepped, grad_norm); (False, inf) when skipped.
        (finish_param_sync is the base's no-op: FSDP gathers parameters in its own forward hooks.)"""
        return self.host_decided_step()

    # ------------------------------------------------------------------ the skeleton's hooks
    def _adamws(self) -> list[torch.optim.AdamW]:
        return [self.adamw]

    def _sync_grads(self) -> None:
        """FSDP reduce-scattered in backward; what is left: one all-reduce over the tensor group of the
        gradients that are partial sums there (sequence parallelism's norms)."""
        grads = [p.grad.to_local() for p in self.tp_partial if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.tp_group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad.to_local() for p in self.params if p.grad is not None]

    def _sumsq(self) -> torch.Tensor:
        """The sum of grad^2 over every element of every parameter of this model part, each counted once,
        identical on all ranks. A local shard's sum of squares is summed over the mesh dimensions its
        gradient is sharded on, never over those it is replicated on (HSDP replicas; norms under tensor
        parallelism): the parameters are grouped by (mesh, sharded dimensions), one all-reduce of a scalar
        per group and dimension (one in all for plain FSDP)."""
        buckets: dict[tuple, list] = {}
        for p in self.params:
            if p.grad is None:
                continue
            g = p.grad
            # sharded = not replicated (FSDP's _StridedShard on a 2-D mesh is not a Shard subclass)
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate() and g.device_mesh.size(i) > 1)
            buckets.setdefault((id(g.device_mesh), dims), [g.device_mesh, dims, []])[2].append(g.to_local())
        sumsq = torch.zeros((), dtype=torch.float32, device=self._comm_device)
        for mesh, dims, grads in buckets.values():
            part = torch.stack([n.float() ** 2 for n in torch._foreach_norm(grads, 2)]).sum().to(self._comm_device)
            for dim in dims:
                dist.all_reduce(part, group=mesh.get_group(dim))
            sumsq = sumsq + part
        return sumsq

    def _update(self, norm: float) -> None:
        if self.muon is not None:
            self.muon.step()
        self.adamw.step()  # the sharded parameters are the fp32 masters: nothing to copy back
        self.prev_grad_norm = norm

    def _drop_grads(self) -> None:
        self.zero_grad()

    # ------------------------------------------------------------------ memory accounting
    def state_bytes(self) -> int:
        """Bytes of this rank's Adam moments (the local shards; `step` counters excluded)."""
        return self._moment_bytes() + (self.muon.state_bytes() if self.muon else 0)

    # ------------------------------------------------------------------ state
    def _sd_options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict:
        """Sharded, DCP-ready: {"adamw": flat {"state.<fqn>.exp_avg": DTensor, ..., "param_groups.<fqn>.lr":
        float, ...}, "scaler": {...}, "lr", "prev_grad_norm", "format", "world_size"}. For a never-stepped
        optimizer the dict holds zero moments with step=1 (torch's get_optimizer_state_dict makes them
        with an lr=0 step), so a template built before loading has every tensor DCP must fill; the
        optimizer itself stays fresh (a save before the first step would resume with step=1)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        fresh = not self.adamw.state
        adamw = get_optimizer_state_dict(self.model, self.adamw, options=self._sd_options())
        if fresh:  # the zero moments (with step=1) were only made for the returned template: stay fresh
            self.adamw.state.clear()
        if self.muon is not None:  # beside AdamW's flat entries (the DCP files' one optimizer dict): DTensors
            # laid out like their parameters, re-sharded by DCP like the moments
            adamw.update({MUON_KEY + n: m for n, m in self.muon.momentum.items()})
            adamw[MUON_STEPS_KEY] = torch.tensor(float(self.muon.steps))
        return {"format": STATE_FORMAT, "engine": "fsdp", "world_size": self.world_size, **self.scaling_state(),
                "adamw": adamw}

    def load_state_dict(self, sd: dict) -> None:
        """Load a dict shaped like state_dict() (its DTensors may come from any world size via DCP).
        Hyper-parameters other than lr (betas, eps, weight decay) stay those of this run's config."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        self.check_state_dict(sd)
        adamw = dict(sd["adamw"])
        saved_muon = {k[len(MUON_KEY):]: adamw.pop(k) for k in list(adamw) if k.startswith(MUON_KEY)}
        saved_steps = adamw.pop(MUON_STEPS_KEY, None)
        current = {k: v for k, v in self.adamw.param_groups[0].items() if k != "params"}
        for k in list(adamw):
            if k.startswith("param_groups."):
                hp = k.rsplit(".", 1)[1]
                if hp in current and hp != "lr":
                    adamw[k] = self._group_of(k)[hp]
        set_optimizer_state_dict(self.model, self.adamw, adamw, options=self._sd_options())
        if self.muon is not None:
            with torch.no_grad():
                for name, m in self.muon.momentum.items():
                    if saved_muon[name] is not m:  # DCP loads into the template's own DTensors in place
                        m.copy_(saved_muon[name])
            self.muon.steps = int(float(saved_steps))
        self.load_scaling_state(sd)

    def check_state_dict(self, sd: dict) -> None:
        """The refusals of load_state_dict that need no collective: the format, another --optimizer, and the
        scalars. (Whether each tensor fits is found by DCP's or the FSDP state-dict API's collective load.)"""
        if not isinstance(sd, dict) or sd.get("format") != STATE_FORMAT:
            saved = sd.get("format") if isinstance(sd, dict) else sd
            raise ValueError(f"unknown FSDP optimizer state format {saved!r}")
        if not isinstance(sd.get("adamw"), dict):
            raise ValueError(f"the FSDP optimizer state's 'adamw' is {type(sd.get('adamw')).__name__}, not a dict")
        saved_muon = MUON_STEPS_KEY in sd["adamw"]
        if (self.muon is not None) != saved_muon:
            saved_kind = "muon" if saved_muon else "adamw"
            raise ValueError(f"the checkpoint's optimizer state is {saved_kind}'s but this run has "
                             f"--optimizer={self.config.optimizer}: switching optimizers on resume is refused")
        self.check_scaling_state(sd)

    def _group_of(self, flat_key: str) -> dict:
        fqn = flat_key[len("param_groups."):].rsplit(".", 1)[0]
        p = dict(self.named_params).get(fqn)
        for g in self.adamw.param_groups:
            if any(q is p for q in g["params"]):
                return g
        return self.adamw.param_groups[0]
