"""The trainer's side of multi-token prediction (model/mtp.py): the MTP losses of each micro-batch's forwards joined
to its backward, and the step's MTP metrics.

Owns: `MTPTraining.of` (None for a model without MTP), the engine's side loss (`take`: after each micro-batch's
forwards, --mtp_loss_weight / D x the summed losses of the D depths, in the task's loss units, so that divided by
the step's units like the loss it is weight x the mean over depths of each depth's per-target loss, Megatron's
scaling), `after_step` (the step's summed losses and targets per depth, summed over the ranks, on their way to the
host) and `read` (metrics-row fields: mtp_loss, the mean over depths of each depth's mean loss per target, and
mtp_loss_<k> per depth when there are several).
Must never: read a device value to the host before `read`, or change the logged next-token loss.
"""
from __future__ import annotations

from typing import Any, Hashable, Optional

import torch

from model.mtp import MultiTokenPrediction
from utils.device import HostCopy


class MTPTraining:
    def __init__(self, cfg: Any, module: Optional[MultiTokenPrediction], depths: int) -> None:
        self.module, self.depths = module, depths  # module None: a pipeline stage without the depths
        self.weight = float(cfg.mtp_loss_weight)
        self._filed: dict[Hashable, torch.Tensor] = {}  # this step's [D, 2] (summed loss, targets) by micro-batch

    @classmethod
    def of(cls, cfg: Any, model: torch.nn.Module) -> Optional["MTPTraining"]:
        """For a model with depths, and for every pipeline stage of one (the stages without them take nothing but
        join the step's statistics sum, a collective)."""
        found = [m for m in model.modules() if isinstance(m, MultiTokenPrediction)]
        depths = len(found[0].depths) if found else int(getattr(getattr(model, "cfg", None), "mtp_num_layers", 0))
        return cls(cfg, found[0] if found else None, depths) if depths else None

    def take(self, key: Optional[Hashable], batch: Optional[dict]) -> Optional[torch.Tensor]:
        """The MTP losses of the forwards since the last take: filed under `key` (None: dropped), and weight / D
        x their sum with its gradient (None when no training forward ran, for no batch, or at weight 0)."""
        if self.module is None:
            return None
        loss, stats = self.module.take()
        if loss is None:
            return None
        if key is not None:
            self._filed[key] = stats
        if batch is None or not self.weight:
            return None
        return loss * (self.weight / self.depths)

    def after_step(self, engine: Any, device: torch.device) -> HostCopy:
        vec = torch.zeros(self.depths, 2, dtype=torch.float64, device=device)
        for s in self._filed.values():
            vec += s.to(device)
        self._filed = {}
        return HostCopy(engine.sum_statistics(vec.reshape(-1), device, to_host=False))

    def read(self, copy: HostCopy) -> dict:
        vec = copy.get().double().cpu().view(self.depths, 2)
        per_depth = [float(s) / max(1.0, float(n)) for s, n in vec.tolist()]
        rec = {"mtp_loss": sum(per_depth) / self.depths}
        if self.depths > 1:
            rec.update({f"mtp_loss_{k + 1}": v for k, v in enumerate(per_depth)})
        return rec
