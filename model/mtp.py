"""Multi-token prediction (MTP): DeepSeek-V3's sequential MTP modules (DeepSeek-AI 2024, section 2.2; Megatron's
--mtp-num-layers; HF's num_nextn_predict_layers), trained beside the next-token loss.

Depth k (1..D) is one more transformer block after the model's. At position i it combines the previous depth's
hidden state there (for k = 1 the model's final hidden state, after its final norm, as DeepSeek-V3's and GLM-4.5's
released MTP layers read it in transformers' MtpLayer and vLLM) with the embedding of token i + k, and predicts token
i + k + 1:
    x_i = eh_proj([enorm(embed(t[i + k])); hnorm(h_i^(k-1))])      (a [2D -> D] projection, HF's order)
    h^k = norm_k(block_k(x))                                       (causal attention over the same sequence; the
                                                                    depth's own final norm, `shared_head.norm`)
    loss_k = cross-entropy(lm_head(h_i^k), t[i + k + 1])           (the model's embedding and LM head, shared)
The causal chain is kept: h_i^k sees tokens up to i + k, never its target. A target is trained on only where the
next-token loss trains on it (its label is not ignored) and it lies in the same sample as position i (packed
samples: the same document, from position_ids restarting or doc_ids; padding: the attention mask); the shifted
inputs and targets are built from whole sequences before context parallelism splits them (`targets`).

What the forward records (training forwards with grad only): each depth's summed loss (with its gradient) and its
number of targets, taken by the trainer (`take`, trainer/mtp.py), which adds weight / D x the sum of the depths'
losses to what the micro-batch backpropagates, normalised like the next-token loss (Megatron's scaling); the
logged loss stays the next-token one. Evaluation, generation, DPO's and GRPO's per-token paths never run it.

Must never: let a depth see its target, train on a target the next-token loss ignores, or change the parameter
names of a model without MTP (state dict keys `mtp.depths.K.*` exist only when mtp_num_layers > 0).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from model.loss import lm_head_loss
from utils.constants import IGNORE_INDEX


def shift_left(t: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """[B, T] -> [B, T]: t[:, i + k] at i, `fill` where i + k >= T."""
    out = torch.full_like(t, fill)
    if k < t.shape[1]:
        out[:, :t.shape[1] - k] = t[:, k:]
    return out


def targets(depths: int, input_ids: Optional[torch.Tensor], labels: torch.Tensor,
            position_ids: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None,
            attention_mask: Optional[torch.Tensor] = None) -> list[tuple[Optional[torch.Tensor], torch.Tensor]]:
    """[(the input ids of depth k [B, T], its labels [B, T])] for k = 1..depths, from whole sequences: at i the
    token i + k (0 past the end) and the label of position i + k (labels are already shifted: labels[i] is token
    i + 1), ignored where that label is, past the end, or in another sample than position i. input_ids None (a
    pipeline's last stage, whose depths get their inputs embedded by the first: `shifted_embeddings`): ids None."""
    B, T = labels.shape
    out = []
    for k in range(1, depths + 1):
        ids = shift_left(input_ids, k, 0) if input_ids is not None else None
        lab = shift_left(labels, k, IGNORE_INDEX)
        keep = torch.ones_like(lab, dtype=torch.bool)
        if position_ids is not None:  # packed samples restart their positions: i + k is in i's sample iff +k
            pos = position_ids.expand(B, T)
            keep &= shift_left(pos, k, -1) == pos + k
        if doc_ids is not None:
            keep &= shift_left(doc_ids, k, -1) == doc_ids
        if attention_mask is not None and attention_mask.shape == (B, T):
            keep &= shift_left(attention_mask.long(), k, 0) != 0
        out.append((ids, lab.masked_fill(~keep, IGNORE_INDEX)))
    return out


def shifted_embeddings(depths: int, input_ids: torch.Tensor, embed: nn.Module) -> list[torch.Tensor]:
    """[embed(the input ids of depth k)] for k = 1..depths (`targets`' ids): what a pipeline's first stage sends on
    beside the hidden state, for the depths on the last stage (parallel/pipeline.py)."""
    return [embed(shift_left(input_ids, k, 0)) for k in range(1, depths + 1)]


class MTPDepth(nn.Module):
    """One MTP module: the two input norms, the [2D -> D] projection, a transformer block (dense or MoE by the
    model's rule for block n_layers + k) and its own final norm; the embedding and LM head are the model's."""

    def __init__(self, cfg: Any, k: int, norm_cls: type, block_cls: type) -> None:
        super().__init__()
        norm = (cfg.dim, cfg.norm_eps, cfg.fused_rmsnorm, cfg.kernel_backend)
        self.enorm, self.hnorm = norm_cls(*norm), norm_cls(*norm)
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        self.block = block_cls(cfg, cfg.n_layers + k)
        self.norm = norm_cls(*norm)
        self.cfg = cfg

    def forward(self, h: torch.Tensor, e: torch.Tensor, head_weight: torch.Tensor, cos, sin, spec,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(this depth's normed hidden state, its summed loss) from the previous depth's (normed) hidden state h and
        the embedded shifted tokens e (one module call: FSDP2 gathers a depth's parameters around it)."""
        h = self.norm(self.block(self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1)), cos, sin, spec, None))
        return h, lm_head_loss(h, head_weight, labels, "sum", self.cfg)


class MultiTokenPrediction(nn.Module):
    """The D MTP modules (`depths`) and what their training forwards recorded since the last `take`. `norm_cls` and
    `block_cls` are the model's RMSNorm and TransformerBlock (model/llama.py passes its own: no import cycle)."""

    def __init__(self, cfg: Any, norm_cls: type, block_cls: type) -> None:
        super().__init__()
        self.cfg = cfg
        self.depths = nn.ModuleList(MTPDepth(cfg, k, norm_cls, block_cls) for k in range(cfg.mtp_num_layers))
        # (this rank, the ranks) under sequence parallelism, set by parallel/transforms/tensor_parallel.py: the normed
        # hidden states arrive gathered (the LM heads read whole sequences), each depth takes its rank's positions
        self.sequence_shard: Optional[tuple[int, int]] = None
        self._loss: Optional[torch.Tensor] = None   # sum over forwards of the depths' summed losses, with grad
        self._stats: Optional[torch.Tensor] = None  # [D, 2] fp64: (summed loss, targets) per depth, detached

    def targets(self, *args, **kwargs) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return targets(len(self.depths), *args, **kwargs)

    def forward(self, h: torch.Tensor, embed: Optional[nn.Module], head_weight: torch.Tensor, cos, sin, spec,
                shifted: list[tuple[Optional[torch.Tensor], torch.Tensor]], checkpointing: bool = False,
                embedded: Optional[list[torch.Tensor]] = None) -> torch.Tensor:
        """h: the model's hidden state after its blocks and its final norm, this rank's positions; `shifted`:
        `targets` (split like h under context parallelism); `embedded`: the depths' inputs already embedded
        (`shifted_embeddings`, a pipeline's first stage), else embed(ids). Records and returns the summed loss over
        depths (this rank's positions' part)."""
        total, stats = None, []
        for k, (depth, (ids, lab)) in enumerate(zip(self.depths, shifted)):
            if self.sequence_shard is not None:  # (the gathered sequence's gradient is this rank's slice's)
                rank, ranks = self.sequence_shard
                n = h.shape[1] // ranks
                h = h[:, rank * n:(rank + 1) * n]
            args = (h, embed(ids) if embedded is None else embedded[k], head_weight, cos, sin, spec, lab)
            h, loss = checkpoint(depth, *args, use_reentrant=False) if checkpointing else depth(*args)
            total = loss if total is None else total + loss
            stats.append(torch.stack([loss.detach().double(), (lab != IGNORE_INDEX).sum().double()]))
        s = torch.stack(stats)
        self._loss = total if self._loss is None else self._loss + total
        self._stats = s if self._stats is None else self._stats + s
        return total

    def take(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(the summed loss of the training forwards since the last take, with its gradient; their [D, 2]
        (summed loss, targets) per depth), both None when none ran. Taking clears them."""
        out = (self._loss, self._stats)
        self._loss = self._stats = None
        return out
