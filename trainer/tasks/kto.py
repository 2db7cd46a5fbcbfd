"""Kahneman-Tversky Optimization (Ethayarajh et al. 2024; TRL's KTOTrainer): preference pairs unpaired into desirable
and undesirable examples (dataset/dataset_kto.py), each judged alone against the frozen reference model.

Per example, with r = log pi(y|x) - log ref(y|x) (summed over the reply's tokens) and z the KL estimate of the
step, the mean over the mismatched rows (prompt of one example, reply of the next) of every micro-batch and
data-parallel rank of log pi - log ref, clamped at 0 and detached:
  kto:                desirable  lambda_D (1 - sigma(beta (r - z)));  undesirable  lambda_U (1 - sigma(beta (z - r)))
  apo_zero_unpaired:  desirable  1 - sigma(beta r);                   undesirable  sigma(beta r)   (no KL rows)
  bco:                desirable  -log sigma(beta r - delta);         undesirable  -log sigma(delta - beta r)
                      (BCO, Jung et al. 2024; TRL's BCOTrainer without its density-ratio classifier; delta the
                      running mean of beta r over the examples seen: trainer/tasks/bco.py; no KL rows)
averaged over the step's examples (TRL's loss is their mean). z is computed before the step from every micro-batch's
KL rows (`before_step`: the same forwards, no gradient) and summed over the ranks, so it does not depend on how the
step's examples are laid out over ranks and micro-batches; TRL averages each process's micro-batch mean over the
processes, which is the same value with one micro-batch of equal size per process. A validation micro-batch uses its
own rows' estimate. The loss is pure tensor math (`kto_loss`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from data_preprocess.chat_tokens import DPO, KTO
from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
from data_preprocess.pretokenize_kto_data import holds_pairs, tokenize_kto_records
from dataset.dataset_kto import build_kto_splits
from trainer.config import KTO_LOSSES
from trainer.tasks.base import Task, TaskData
from trainer.tasks.bco import BCORunningMean
from trainer.tasks.data import chat_data
from trainer.tasks.dpo import sequence_logps
from trainer.tasks.sft import chat_val_words
from utils.device import to_device


def kto_loss(policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor, *, beta: float,
             loss_type: str = "kto", desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             bco_delta: "torch.Tensor | float" = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example losses [N] and rewards beta * (log pi - log ref) [N] (detached) of summed reply log-probabilities
    `policy`, `ref` [N], `desirable` [N] bool, `kl` the micro-batch's estimate (a 0-d tensor; used by kto),
    `bco_delta` the running mean of the rewards (bco: -log sigma(beta r - delta) desirable, -log sigma(delta - beta
    r) undesirable; TRL's BCOTrainer without its density-ratio classifier)."""
    if loss_type not in KTO_LOSSES:
        raise ValueError(f"unknown kto loss {loss_type!r}; expected one of {KTO_LOSSES}")
    r = policy - ref
    if loss_type == "kto":
        good, bad = 1 - torch.sigmoid(beta * (r - kl)), 1 - torch.sigmoid(beta * (kl - r))
    elif loss_type == "bco":
        z = beta * r - bco_delta
        good, bad = -F.logsigmoid(z), -F.logsigmoid(-z)
    else:
        good, bad = 1 - torch.sigmoid(beta * r), torch.sigmoid(beta * r)
    losses = torch.where(desirable, desirable_weight * good, undesirable_weight * bad)
    return losses, beta * r.detach()


def kl_rows_sum(model, ref_model, batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log pi - log ref over a batch's KL rows, how many rows count): a row whose prompt alone filled it has
    no reply token and is left out. Call under no_grad."""
    kl_policy, n = sequence_logps(model, batch, device, "kl_")
    kl_ref, _ = sequence_logps(ref_model, batch, device, "kl_")
    has = n > 0
    return ((kl_policy - kl_ref).double() * has).sum(), has.sum().double()


class KTOTask(Task):
    name = "kto"
    units = "examples"
    stat_keys = ("desirable", "desirable_reward", "undesirable_reward", "kl")
    needs_reference = True
    chat = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        # bco's delta: the running mean of the examples' rewards (the step's desirable + undesirable reward sums)
        self.bco = (BCORunningMean(("desirable_reward", "undesirable_reward"))
                    if getattr(cfg, "kto_loss", "kto") == "bco" else None)

    def stateful(self):
        return {} if self.bco is None else {"bco": self.bco}

    def datasets(self, tok_meta, val_ratio, fixed_shape, log):
        cfg = self.cfg
        kl_rows = cfg.kto_loss == "kto"

        def read(path: str, what: str):  # labelled examples, or DPO pairs (each a desirable + an undesirable one)
            paired = holds_pairs(path)
            tokenize, kind = (tokenize_dpo_records, DPO) if paired else (tokenize_kto_records, KTO)
            return chat_data(cfg, path, tokenize, kind, tok_meta, what, log), paired

        data, paired = read(cfg.data_dir, "train")
        train, val, collate = build_kto_splits(data, cfg.max_seq_len, val_ratio=val_ratio, seed=cfg.seed,
                                               pad_to=cfg.max_seq_len if fixed_shape else None, kl_rows=kl_rows,
                                               paired=paired)
        if log is not None:
            log(self._balance(train, paired))
        if cfg.eval_data_dir:
            ev, ev_paired = read(cfg.eval_data_dir, "validation")
            val = build_kto_splits(ev, cfg.max_seq_len, val_ratio=0.0, seed=cfg.seed, kl_rows=kl_rows,
                                   paired=ev_paired)[0]
        return TaskData(train, val, collate, "DPO pairs (two examples each)" if paired else "KTO examples",
                        *chat_val_words(cfg))

    def _balance(self, train, paired: bool) -> str:
        """The [data] line of the training examples' kinds and their weighted ratio (TRL's advice: 1 to 4/3)."""
        if paired:
            good = bad = len(train)
        else:
            good = int(train.base.index[train.indices, 2].sum())
            bad = len(train) - good
        wd, wu = self.cfg.kto_desirable_weight, self.cfg.kto_undesirable_weight
        ratio = f"{wd * good / (wu * bad):.2f}" if bad else "inf"
        return (f"[data] kto: {good} desirable and {bad} undesirable examples; --kto_desirable_weight x desirable / "
                f"(--kto_undesirable_weight x undesirable) = {ratio} (the KTO paper and TRL advise 1 to 4/3)")

    def before_step(self, loop, draw):
        """The step's micro-batches, each carrying the step's KL estimate z (`_kto_kl`): every micro-batch's KL rows
        forwarded by the policy and the reference (no gradient, as TRL's), summed over the data-parallel ranks."""
        batches, skipped = draw()
        if self.cfg.kto_loss != "kto":
            return batches, skipped
        engine, device = loop.engine, loop.info.device
        engine.optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
        with torch.no_grad():
            sums = [kl_rows_sum(engine.module, loop.ref_model, b, device) for b in batches]
        local = [float(sum(s for s, _ in sums)), float(sum(n for _, n in sums))]  # (host values: one sync)
        total, rows = (float(x) for x in engine.sum_over_data(local, device))
        z = max(0.0, total / max(rows, 1.0))
        return [dict(b, _kto_kl=z) for b in batches], skipped

    def micro_batch_loss(self, model, ref_model, batch, device):
        cfg = self.cfg
        policy, _ = sequence_logps(model, batch, device)
        with torch.no_grad():
            ref, _ = sequence_logps(ref_model, batch, device)
            if cfg.kto_loss == "kto" and "_kto_kl" in batch:  # the step's (before_step)
                kl = torch.tensor(batch["_kto_kl"], dtype=policy.dtype, device=policy.device)
            elif cfg.kto_loss == "kto":  # (validation) this micro-batch's own rows
                total, rows = kl_rows_sum(model, ref_model, batch, device)
                kl = (total / rows.clamp(min=1)).clamp(min=0).to(policy.dtype)
            else:
                kl = torch.zeros((), device=policy.device)
        desirable = to_device(batch["desirable"], device)
        delta = 0.0
        if self.bco is not None:  # the running mean, with this micro-batch's rewards
            delta = self.bco.delta((cfg.dpo_beta * (policy - ref)).detach().sum(), len(policy))
        losses, rewards = kto_loss(policy, ref, desirable, kl, beta=cfg.dpo_beta, loss_type=cfg.kto_loss,
                                   desirable_weight=cfg.kto_desirable_weight,
                                   undesirable_weight=cfg.kto_undesirable_weight, bco_delta=delta)
        good = desirable.float()
        stats = {"desirable": good.sum(), "desirable_reward": (rewards * good).sum(),  # on the device
                 "undesirable_reward": (rewards * (1 - good)).sum(), "kl": kl.detach() * len(good)}
        return losses.sum(), stats

    def count_units(self, batch):
        return int(batch["input_ids"].shape[0])

    def tokens_seen(self, units, tokens):
        """An example is the unit: the tokens read (padding excluded) are what it saw."""
        return int(tokens)

    def step_metrics(self, per_unit: dict) -> dict:
        """The rewards as means over the desirable and the undesirable examples, their margin, and the KL estimate
        (the examples' mean of their micro-batch's)."""
        share = per_unit["desirable"]
        good = per_unit["desirable_reward"] / share if share > 0 else 0.0
        bad = per_unit["undesirable_reward"] / (1 - share) if share < 1 else 0.0
        return {"desirable_reward": good, "undesirable_reward": bad, "reward_margin": good - bad,
                "kl": per_unit["kl"]}
