"""The trainer's side of a mixture-of-experts model: the balancing losses added to each micro-batch's loss, the
DeepSeek-V3 bias update after each optimizer step, and the step's MoE metrics.

Owns: `MoETraining.of` (None for a dense model), `wrap_loss` (the loss function the engine calls, with
aux_coef x balancing loss + z_coef x z-loss of that micro-batch's forwards added to its gradient, times its units:
divided by the step's units like the loss, it is their unit-weighted mean; the loss value logged stays the task's
own), `after_step` (the step's tokens per expert summed over every rank, the bias update from them, the metrics
vector copied to the host behind the step) and `read` (that vector as metrics-row fields).
Must never: read a device value to the host before `read` (the loop reads a step's row a step late), or branch on
the engine (its `sum_over_data` sums over the ranks whichever runs).
"""
from __future__ import annotations

import re
from typing import Any, Callable, Optional

import torch

from model.moe import MoEFeedForward, take_aux_losses, update_expert_bias
from utils.device import HostCopy


class MoETraining:
    def __init__(self, cfg: Any, layers: list, layer_ids: list[int]) -> None:
        self.layers, self.layer_ids = layers, layer_ids  # the MoE blocks and their global layer numbers
        self.aux_coef, self.z_coef, self.rate = cfg.moe_aux_loss_coef, cfg.moe_z_loss_coef, cfg.moe_bias_update_rate
        self._aux_sum: Optional[torch.Tensor] = None  # [L, 2] raw losses summed over this step's micro-batches
        self._micro_batches = 0

    @classmethod
    def of(cls, cfg: Any, model: torch.nn.Module) -> Optional["MoETraining"]:
        named = [(name, m) for name, m in model.named_modules() if isinstance(m, MoEFeedForward)]
        ids = [int(re.search(r"layers\.(\d+)\.", name + ".").group(1)) for name, _ in named]
        return cls(cfg, [m for _, m in named], ids) if named else None

    def wrap_loss(self, loss_fn: Callable, count_units: Callable[[dict], int]) -> Callable:
        def loss_with_aux(model, batch):
            loss_sum, stats = loss_fn(model, batch)
            aux = take_aux_losses(self.layers)
            if aux is None:  # a forward without grad (evaluation)
                return loss_sum, stats
            self._aux_sum = aux.detach() if self._aux_sum is None else self._aux_sum + aux.detach()
            self._micro_batches += 1
            if self.aux_coef or self.z_coef:
                extra = (aux[:, 0].sum() * self.aux_coef + aux[:, 1].sum() * self.z_coef) * count_units(batch)
                # the gradient of loss + extra, the value of loss: the logged loss stays the task's
                loss_sum = loss_sum + (extra - extra.detach()).to(loss_sum.dtype)
            return loss_sum, stats
        return loss_with_aux

    def after_step(self, engine: Any, device: torch.device) -> HostCopy:
        """After the optimizer step: the step's counts [L, E] and losses summed over every rank, each layer's bias
        moved by --moe_bias_update_rate from them; the metrics vector on its way to the host."""
        counts = torch.stack([layer.take_counts().to(device) for layer in self.layers])
        aux = self._aux_sum if self._aux_sum is not None else torch.zeros(len(self.layers), 2, device=device)
        vec = torch.cat([counts.reshape(-1).double(), aux.to(device).reshape(-1).double(),
                         torch.tensor([float(self._micro_batches)], dtype=torch.float64, device=device)])
        self._aux_sum, self._micro_batches = None, 0
        vec = engine.sum_over_data(vec, device, to_host=False)
        if self.rate:
            total = vec[:counts.numel()].view_as(counts)
            for layer, c in zip(self.layers, total):
                update_expert_bias(layer.expert_bias, c.to(layer.expert_bias.device).float(), self.rate)
        return HostCopy(vec)

    def read(self, copy: HostCopy) -> dict:
        """The metrics-row fields of a step: moe_aux_loss / moe_z_loss (raw, mean over layers and micro-batches),
        moe_load_max_mean (the worst layer's max/mean tokens per expert) and per layer, tokens per expert."""
        vec = copy.get().double().cpu()
        n_layers, n_exp = len(self.layers), self.layers[0].num_experts
        counts = vec[:n_layers * n_exp].view(n_layers, n_exp)
        aux = vec[n_layers * n_exp:-1].view(n_layers, 2)
        micro = max(1.0, float(vec[-1]))
        load = (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-12)).tolist()
        rec = {"moe_aux_loss": float(aux[:, 0].sum()) / (micro * n_layers),
               "moe_z_loss": float(aux[:, 1].sum()) / (micro * n_layers),
               "moe_load_max_mean": max(load)}
        rec.update({f"moe_load_max_mean_l{i}": v for i, v in zip(self.layer_ids, load)})
        rec["moe_tokens_per_expert"] = [[int(round(c)) for c in row] for row in counts.tolist()]
        return rec
