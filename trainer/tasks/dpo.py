"""Direct Preference Optimization: a frozen reference model (the initial weights, or --ref_model), sequence
log-probabilities of the chosen and rejected replies, a sigmoid / IPO / hinge loss per pair, and the implicit rewards
logged; or a reference-free preference loss (SimPO, ORPO: no reference model is loaded) on the replies' mean
log-probabilities. The loss functions are pure tensor math (`dpo_loss`, `reference_free_loss`)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from data_preprocess.chat_tokens import DPO
from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
from dataset.dataset_dpo import build_dpo_splits
from trainer.config import DPO_LOSSES, REFERENCE_FREE_LOSSES
from trainer.tasks.base import Task, TaskData
from trainer.tasks.bco import BCORunningMean
from trainer.tasks.data import chat_data
from trainer.tasks.dpo_terms import SFT_TERM, dpo_loss_terms
from trainer.tasks.sft import chat_val_words
from utils.device import to_device

DPO_LOSS_TYPES = DPO_LOSSES  # (trainer/config.py, torch-free: the flag's choices)
REFERENCE_FREE = REFERENCE_FREE_LOSSES  # no reference model: the policy's mean log-probabilities alone


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
             ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, *, beta: float = 0.1,
             loss_type: str = "sigmoid", label_smoothing: float = 0.0, discopop_tau: float = 0.05,
             bco_delta: "torch.Tensor | float" = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses and the implicit rewards beta * (log pi - log pi_ref).

    Inputs are summed log-probabilities of the reply tokens, shape [P]. Returns
    (losses [P], chosen_rewards [P], rejected_rewards [P]); rewards are detached.
    sigmoid: -(1-eps) log sigma(beta*h) - eps log sigma(-beta*h)  (eps = label smoothing, cDPO)
    ipo:     (h - 1/(2 beta))^2                                   (Azar et al. 2023)
    hinge:   relu(1 - beta*h)                                     (SLiC)
    robust:  (-(1-eps) log sigma(beta*h) + eps log sigma(-beta*h)) / (1 - 2 eps)   (rDPO, Chowdhury et al. 2024)
    exo_pair: sigma(beta*h) (log sigma(beta*h) - log(1-eps)) + sigma(-beta*h) (log sigma(-beta*h) - log eps),
             eps 1e-3 when 0                                      (EXO, Ji et al. 2024)
    nca_pair: -log sigma(a) - log sigma(-a) / 2 - log sigma(-b) / 2   (NCA, Chen et al. 2024)
    sppo_hard: (a/beta - 1/(2 beta))^2 + (b/beta + 1/(2 beta))^2  (SPPO, Wu et al. 2024, hard labels)
    apo_zero: 1 - sigma(a) + sigma(b);  apo_down: sigma(a) + 1 - sigma(a - b)   (APO, D'Oosterlinck et al. 2024)
    discopop: -log sigma(beta*h) (1 - m) + exp(-beta*h) m, m = sigma(beta*h / tau)   (DiscoPOP, Chris Lu et al. 2024)
    bco_pair: -log sigma(a - delta) - log sigma(-(b - delta)), delta = `bco_delta` (the running mean of the rewards
             (a + b) / 2 over the pairs seen: trainer/tasks/bco.py)   (BCO, Jung et al. 2024)
    aot:     sigmoid's loss of beta*d, d = sort(log pi(c) - log pi(r)) - sort(log ref(c) - log ref(r)) over the
             micro-batch's pairs; aot_unpaired (TRL's earlier aot_pair): d = sort(a) / beta - sort(b) / beta
             (AOT, Melnyk et al. 2024: each sorted over the micro-batch, so a pair's loss depends on the others')
    where h = (log pi(c) - log pi(r)) - (log ref(c) - log ref(r)), a = beta (log pi(c) - log ref(c)),
    b = beta (log pi(r) - log ref(r)): TRL's DPOTrainer loss_type of the same name.
    """
    if loss_type not in DPO_LOSS_TYPES or loss_type in REFERENCE_FREE:
        raise ValueError(f"unknown dpo loss {loss_type!r}; expected one of {DPO_LOSS_TYPES}")
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * h)
    elif loss_type == "bco_pair":
        a, b = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
        losses = -F.logsigmoid(a - bco_delta) - F.logsigmoid(-(b - bco_delta))
    elif loss_type.startswith("aot"):  # distributional: the sorted log-ratios of the micro-batch's pairs
        mine, other = ((policy_chosen - policy_rejected, ref_chosen - ref_rejected) if loss_type == "aot" else
                       (policy_chosen - ref_chosen, policy_rejected - ref_rejected))
        z = beta * (torch.sort(mine).values - torch.sort(other).values)
        losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    else:
        losses = _more_losses(loss_type, beta * h, beta * (policy_chosen - ref_chosen),
                              beta * (policy_rejected - ref_rejected), beta, label_smoothing, discopop_tau)
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def _more_losses(loss_type: str, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float, eps: float,
                 tau: float) -> torch.Tensor:
    """The other reference-based losses of `dpo_loss` (z = beta * h; a, b the chosen / rejected rewards)."""
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "exo_pair":
        eps = eps or 1e-3
        return z.sigmoid() * (F.logsigmoid(z) - math.log(1 - eps)) + (-z).sigmoid() * (F.logsigmoid(-z) - math.log(eps))
    if loss_type == "nca_pair":
        return -F.logsigmoid(a) - 0.5 * F.logsigmoid(-a) - 0.5 * F.logsigmoid(-b)
    if loss_type == "sppo_hard":
        return (a / beta - 0.5 / beta) ** 2 + (b / beta + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(a) + torch.sigmoid(b)
    if loss_type == "apo_down":
        return torch.sigmoid(a) + 1 - torch.sigmoid(a - b)
    mod = torch.sigmoid(z / tau)  # discopop
    return -F.logsigmoid(z) * (1 - mod) + torch.exp(-z) * mod


def reference_free_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, chosen_tokens: torch.Tensor,
                        rejected_tokens: torch.Tensor, *, beta: float = 0.1, loss_type: str = "simpo",
                        label_smoothing: float = 0.0, gamma: float = 0.5
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses of a preference loss without a reference model, and the rewards beta * (mean log pi).

    Inputs: summed log-probabilities of the reply tokens and the replies' token counts, shape [P]; with
    c, r = the chosen / rejected replies' mean log-probabilities (a sum over its tokens / their number):
    simpo: -(1-eps) log sigma(beta (c - r) - gamma) - eps log sigma(-(beta (c - r) - gamma))   (Meng et al. 2024;
           TRL's CPOTrainer loss_type="simpo" with cpo_alpha=0)
    orpo:  -c - beta log sigma(log odds(c) - log odds(r)), log odds(x) = x - log(1 - e^x): the chosen reply's
           negative log-likelihood (per token) plus the odds-ratio term (Hong et al. 2024; TRL's ORPOTrainer, whose
           likelihood term also counts the prompt's tokens, over the batch's tokens)
    """
    if loss_type not in REFERENCE_FREE:
        raise ValueError(f"unknown reference-free loss {loss_type!r}; expected one of {REFERENCE_FREE}")
    c = policy_chosen / chosen_tokens.clamp(min=1)
    r = policy_rejected / rejected_tokens.clamp(min=1)
    if loss_type == "simpo":
        z = beta * (c - r) - gamma
        losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    else:
        log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))  # (log(1-e^x), stably)
        losses = -c - beta * F.logsigmoid(log_odds)
    return losses, beta * c.detach(), beta * r.detach()


def token_nll(model, batch: dict, device, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(-log p of each position's label [N, T] in fp32, 0 where it is ignored; the labels [N, T]) of a batch's
    `<prefix>input_ids` / `<prefix>labels` rows (with `<prefix>attention_mask` where the batch has one)."""
    y = to_device(batch[f"{prefix}labels"], device)
    mask = f"{prefix}attention_mask"
    kw = {"attention_mask": to_device(batch[mask], device)} if mask in batch else {}
    return model(to_device(batch[f"{prefix}input_ids"], device), labels=y, reduction="none", **kw).float(), y


def sequence_logps(model, batch: dict, device, prefix: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of each row's labelled tokens [N], their count [N]) of a batch's `<prefix>` rows
    (token_nll): DPO's chosen / rejected rows, KTO's examples and KL rows."""
    per_token, y = token_nll(model, batch, device, prefix)
    return -per_token.sum(dim=-1), (y != -100).sum(dim=-1)


def ld_logps(per_token: torch.Tensor, labels: torch.Tensor, public: torch.Tensor, alpha: float) -> torch.Tensor:
    """LD-DPO's log-probability of each row's reply (Liu et al. 2024; TRL's ld_alpha): its first `public` [N] labelled
    tokens whole, the ones after x alpha (`per_token`: token_nll's -log p)."""
    place = (labels != -100).cumsum(dim=-1)  # each token's place in its reply, from 1
    weight = torch.where(place <= public[:, None].to(place.device), 1.0, float(alpha))
    return -(per_token * weight).sum(dim=-1)


def preference_data(cfg, tok_meta: dict, val_ratio: float, fixed_shape: bool, log, margins: bool = False) -> TaskData:
    """The preference pairs of --data_dir (raw records or a pretokenized DPO folder) and their validation split
    or --eval_data_dir: DPO's and the reward model's data (`margins`: batches carry the pairs' margins)."""
    data = chat_data(cfg, cfg.data_dir, tokenize_dpo_records, DPO, tok_meta, "train", log)
    # fixed_shape: rows of --max_seq_len (context parallel's whole chunks; pipeline stages' one shape)
    train, val, collate = build_dpo_splits(data, cfg.max_seq_len, val_ratio=val_ratio, seed=cfg.seed,
                                           pad_to=cfg.max_seq_len if fixed_shape else None, margins=margins)
    if cfg.eval_data_dir:
        ev = chat_data(cfg, cfg.eval_data_dir, tokenize_dpo_records, DPO, tok_meta, "validation", log)
        val = build_dpo_splits(ev, cfg.max_seq_len, val_ratio=0.0, seed=cfg.seed, margins=margins)[0]
    return TaskData(train, val, collate, DPO.units, *chat_val_words(cfg))


class DPOTask(Task):
    name = "dpo"
    units = "preference pairs"
    stat_keys = ("chosen_reward", "rejected_reward", "reward_acc")
    val_stat_keys = ("reward_acc",)
    needs_reference = True
    chat = True

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.needs_reference = cfg.dpo_loss not in REFERENCE_FREE  # (SimPO, ORPO: no reference model is loaded)
        self.terms = dpo_loss_terms(cfg.dpo_loss, cfg.dpo_loss_weights)  # [(loss, weight)]: one, or MPO's sum
        # bco_pair's delta: the running mean of (a + b) / 2, the step's chosen and rejected reward sums halved
        self.bco = (BCORunningMean(("chosen_reward", "rejected_reward"), scale=0.5)
                    if any(n == "bco_pair" for n, _ in self.terms) else None)

    def datasets(self, tok_meta, val_ratio, fixed_shape, log):
        return preference_data(self.cfg, tok_meta, val_ratio, fixed_shape, log)

    def micro_batch_loss(self, model, ref_model, batch, device):
        cfg = self.cfg
        (tc, yc), (tr, yr) = (token_nll(model, batch, device, p) for p in ("chosen_", "rejected_"))
        tokens = [(yc != -100).sum(dim=-1), (yr != -100).sum(dim=-1)]
        pc, pr = -tc.sum(dim=-1), -tr.sum(dim=-1)
        nll = -pc / tokens[0].clamp(min=1)  # the chosen reply's per-token NLL, per pair
        if getattr(cfg, "ld_alpha", 1.0) != 1.0:  # LD-DPO: the policy's replies past the shorter one's length x alpha
            public = torch.minimum(*tokens)
            pc, pr = ld_logps(tc, yc, public, cfg.ld_alpha), ld_logps(tr, yr, public, cfg.ld_alpha)
        if cfg.dpo_loss in REFERENCE_FREE:
            losses, ch_r, rj_r = reference_free_loss(pc, pr, *tokens, beta=cfg.dpo_beta, loss_type=cfg.dpo_loss,
                                                     label_smoothing=cfg.dpo_label_smoothing, gamma=cfg.simpo_gamma)
        else:
            with torch.no_grad():
                rc, rr = (sequence_logps(ref_model, batch, device, p)[0] for p in ("chosen_", "rejected_"))
            delta = 0.0
            if self.bco is not None:  # the running mean, with this micro-batch's rewards
                delta = self.bco.delta((cfg.dpo_beta * ((pc - rc) + (pr - rr)) / 2).detach().sum(), len(pc))
            losses = torch.zeros_like(pc)
            for name, weight in self.terms:  # (one loss, or a weighted sum: MPO's sigmoid,bco_pair,sft)
                if name == SFT_TERM:
                    term = nll
                else:
                    term = dpo_loss(pc, pr, rc, rr, beta=cfg.dpo_beta, loss_type=name,
                                    label_smoothing=cfg.dpo_label_smoothing, discopop_tau=cfg.discopop_tau,
                                    bco_delta=delta)[0]
                losses = losses + weight * term
            ch_r, rj_r = cfg.dpo_beta * (pc - rc).detach(), cfg.dpo_beta * (pr - rr).detach()  # (every loss's rewards)
            if cfg.rpo_alpha:  # RPO (Pang et al. 2024): the chosen reply's per-token NLL beside the preference loss
                losses = losses + cfg.rpo_alpha * nll
        stats = {"chosen_reward": ch_r.detach().sum(), "rejected_reward": rj_r.detach().sum(),  # on the device
                 "reward_acc": (ch_r > rj_r).float().sum()}
        return losses.sum(), stats

    def stateful(self):
        return {} if self.bco is None else {"bco": self.bco}

    def count_units(self, batch):
        return int(batch["chosen_input_ids"].shape[0])

    def tokens_seen(self, units, tokens):
        """A pair is the unit: the tokens read (chosen and rejected, padding excluded) are what it saw."""
        return int(tokens)
