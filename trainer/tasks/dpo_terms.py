"""--dpo_loss as a weighted sum of losses (TRL's DPOConfig loss_type list with loss_weights; MPO, Wang et al. 2024:
sigmoid + bco_pair + sft): the terms and their weights, checked before torch is imported.

Must never: import torch (the flag checks run before it), or accept a reference-free loss beside another.
"""
from __future__ import annotations

import math

from trainer.config import DPO_LOSSES, REFERENCE_FREE_LOSSES

SFT_TERM = "sft"  # the chosen reply's mean per-token NLL (TRL's loss_type "sft"; ours averaged per pair, as RPO's)


def dpo_loss_terms(loss: str, weights: str = "") -> list[tuple[str, float]]:
    """[(loss, weight)] of --dpo_loss (one name, or comma-separated names of reference-based losses and `sft`) and
    --dpo_loss_weights (comma-separated, one per loss; empty: 1 each); ValueError naming the flag otherwise."""
    names = [n.strip() for n in str(loss).split(",")]
    choices = (*DPO_LOSSES, SFT_TERM)
    for n in names:
        if n not in choices:
            raise ValueError(f"--dpo_loss={loss!r}: {n!r} is not one of {' | '.join(choices)}")
    if len(set(names)) < len(names):
        raise ValueError(f"--dpo_loss={loss!r}: a loss named twice")
    if len(names) > 1 and any(n in REFERENCE_FREE_LOSSES for n in names):
        raise ValueError(f"--dpo_loss={loss!r}: {' and '.join(REFERENCE_FREE_LOSSES)} are reference-free and train "
                         "alone, not in a sum with other losses")
    if not str(weights).strip():
        return [(n, 1.0) for n in names]
    try:
        ws = [float(w) for w in str(weights).split(",")]
    except ValueError:
        ws = []
    if len(ws) != len(names) or not all(math.isfinite(w) for w in ws):
        raise ValueError(f"--dpo_loss_weights={weights!r}: {len(names)} finite number(s), one per --dpo_loss term "
                         f"({', '.join(names)})")
    return list(zip(names, ws))
