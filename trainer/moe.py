"""The trainer's side of a mixture-of-experts model: the balancing losses of each micro-batch's forwards, the
DeepSeek-V3 bias update after each optimizer step, and the step's MoE metrics.

Owns: `MoETraining.of` (None for a dense model), the engine's side loss (`units`, `take`: the engine calls `take`
after each micro-batch's forwards on this rank's part of the model and adds aux_coef x balancing loss + z_coef x
z-loss, times the micro-batch's units, to what that micro-batch backpropagates; divided by the step's units like
the loss, it is their unit-weighted mean; the loss value logged stays the task's own. parallel/engine.py
Engine.side_loss says where each engine adds it: to the loss, or under pipeline stages to each stage's output),
`after_step` (the step's statistics of every MoE layer of the model, each rank filling the rows of the layers it
holds, summed over the ranks by `Engine.sum_statistics`; each layer's bias moved from its tokens per expert; the
metrics vector copied to the host behind the step) and `read` (that vector as metrics-row fields).
Must never: read a device value to the host before `read` (the loop reads a step's row a step late), or branch on
the engine.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Hashable, Optional

import torch

from model.moe import MoEFeedForward, take_aux_losses, update_expert_bias
from utils.device import HostCopy


def layer_number(name: str, model_cfg: Any) -> int:
    """The block number of an MoE layer from its module name: `layers.<i>.` (a model's block i), or
    `mtp.depths.<k>.` (multi-token prediction's depth k: block n_layers + k, model/mtp.py)."""
    found = re.search(r"(?:^|\.)mtp\.depths\.(\d+)\.", name + ".")
    if found is not None:
        return model_cfg.n_layers + int(found.group(1))
    return int(re.search(r"layers\.(\d+)\.", name + ".").group(1))


class MoETraining:
    def __init__(self, cfg: Any, layers: list, layer_ids: list[int], all_ids: list[int],
                 count_units: Optional[Callable[[dict], int]] = None, *, experts: int = 0,
                 capacity: bool = False) -> None:
        self.layers, self.layer_ids = layers, layer_ids  # this rank's MoE blocks and their global layer numbers
        self.all_ids = all_ids  # the model's MoE layer numbers (a pipeline stage holds some of them)
        self.rows = [all_ids.index(i) for i in layer_ids]
        self.aux_coef, self.z_coef, self.rate = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef, cfg.moe_bias_update_rate
        self.count_units = count_units
        # this step's statistics by micro-batch key (a later take of the same key replaces the earlier one: a
        # pipeline schedule's shape inference runs micro-batch 0's forward once more): ([L, 3] losses, [L, E] counts,
        # [L] pairs dropped at capacity)
        self._filed: dict[Hashable, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.capacity = capacity or any(layer.capacity_factor > 0 for layer in layers)
        self.experts = experts or layers[0].num_experts

    @classmethod
    def of(cls, cfg: Any, model: torch.nn.Module,
           count_units: Optional[Callable[[dict], int]] = None) -> Optional["MoETraining"]:
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, MoEFeedForward)]
        model_cfg = getattr(model, "cfg", None)
        ids = [layer_number(name, model_cfg) for name, _ in named]
        blocks = model_cfg.n_layers + getattr(model_cfg, "mtp_num_layers", 0) if model_cfg is not None else 0
        all_ids = ([i for i in range(blocks) if model_cfg.is_moe_layer(i)]
                   if hasattr(model_cfg, "is_moe_layer") else ids)
        if not all_ids:
            return None  # (a pipeline stage of an MoE model without MoE blocks of its own still joins the step's
            # statistics sum, a collective: it gets an instance with no layers)
        for _, layer in named:  # --moe_aux_loss_type=sequence: each layer's balancing loss per sequence
            layer.aux_per_sequence = getattr(cfg, "moe_aux_loss_type", "batch") == "sequence"
        return cls(cfg, [m for _, m in named], ids, all_ids, count_units,
                   experts=int(getattr(model_cfg, "moe_num_experts", 0)) or named[0][1].num_experts,
                   capacity=float(getattr(model_cfg, "moe_capacity_factor", 0.0)) > 0)

    # ------------------------------------------------------------------ the engine's side loss
    def units(self, batch: dict) -> float:
        """The micro-batch's target units (the task's count): what its balancing terms are weighted by."""
        if self.count_units is None:
            raise ValueError("MoETraining.of(..., count_units) is needed to weigh the balancing losses")
        return float(self.count_units(batch))

    def take(self, key: Optional[Hashable], batch: Optional[dict]) -> Optional[torch.Tensor]:
        """This rank's MoE layers' statistics of the forwards since the last take, filed under micro-batch `key`
        (None: dropped), and aux_coef x balancing + z_coef x z-loss summed over them times the micro-batch's units,
        with its gradient (None when no forward with grad ran, for no batch, or when both coefficients are 0)."""
        aux = take_aux_losses(self.layers)
        if aux is None:
            return None
        counts = torch.stack([layer.take_counts() for layer in self.layers])
        dropped = torch.stack([layer.take_dropped().to(counts.device) for layer in self.layers])
        if key is not None:
            self._filed[key] = (aux.detach(), counts, dropped)
        if batch is None or not (self.aux_coef or self.z_coef):
            return None
        return (aux[:, 0].sum() * self.aux_coef + aux[:, 1].sum() * self.z_coef) * self.units(batch)

    # ------------------------------------------------------------------ after the step
    def after_step(self, engine: Any, device: torch.device) -> HostCopy:
        """After the optimizer step: the step's counts [L, E], losses and forwards of every MoE layer of the model,
        summed over the ranks; this rank's layers' biases moved by --moe_bias_update_rate from their counts; the
        metrics vector on its way to the host."""
        n_all, n_exp = len(self.all_ids), self.experts
        counts = torch.zeros(n_all, n_exp, dtype=torch.float64, device=device)
        aux = torch.zeros(n_all, 3, dtype=torch.float64, device=device)
        dropped = torch.zeros(n_all, dtype=torch.float64, device=device)
        rows = torch.tensor(self.rows, dtype=torch.long, device=device)
        for a, c, d in self._filed.values():
            aux.index_add_(0, rows, a.to(device, torch.float64))
            counts.index_add_(0, rows, c.to(device, torch.float64))
            dropped.index_add_(0, rows, d.to(device, torch.float64))
        self._filed = {}
        vec = engine.sum_statistics(torch.cat([counts.reshape(-1), aux.reshape(-1), dropped]), device,
                                    to_host=False)
        if self.rate:
            total = vec[:counts.numel()].view_as(counts)
            for layer, r in zip(self.layers, self.rows):
                update_expert_bias(layer.expert_bias, total[r].to(layer.expert_bias.device).float(), self.rate)
        return HostCopy(vec)

    def read(self, copy: HostCopy) -> dict:
        """The metrics-row fields of a step: moe_aux_loss / moe_z_loss (raw, mean over layers and forwards),
        moe_load_max_mean (the worst layer's max/mean tokens per expert) and per layer, tokens per expert (as
        routed); with a capacity factor moe_dropped_frac (the routed pairs dropped, all layers)."""
        vec = copy.get().double().cpu()
        n_layers, n_exp = len(self.all_ids), self.experts
        counts = vec[:n_layers * n_exp].view(n_layers, n_exp)
        aux = vec[n_layers * n_exp:n_layers * (n_exp + 3)].view(n_layers, 3)
        dropped = vec[n_layers * (n_exp + 3):]
        forwards = max(1e-12, float(aux[:, 2].sum()))
        load = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)).tolist()
        rec = {"moe_aux_loss": float(aux[:, 0].sum()) / forwards,
               "moe_z_loss": float(aux[:, 1].sum()) / forwards,
               "moe_load_max_mean": max(load)}
        rec.update({f"moe_load_max_mean_l{i}": v for i, v in zip(self.all_ids, load)})
        rec["moe_tokens_per_expert"] = [[int(round(c)) for c in row] for row in counts.tolist()]
        if self.capacity:  # the share of the routed (token, expert) pairs dropped at capacity, all layers
            rec["moe_dropped_frac"] = float(dropped.sum()) / max(1.0, float(counts.sum()))
        return rec
