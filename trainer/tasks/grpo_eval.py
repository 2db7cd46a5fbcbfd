"""GRPO's held-out evaluation (--eval_data_dir): every held-out prompt answered greedily (temperature 0) with
model/generate.py's `generate`, each answer scored by the run's reward functions. The step row gets `val_reward`
(the mean weighted reward), `val_reward_<function>` and `val_completion_length`; with a 0/1 reward such as
exact_match, `val_reward` is the greedy pass@1.

Owns: `eval_plan` (the prompts in batches of equal length, dealt to the data-parallel ranks), `greedy_sums` (one
rank's sums), `held_out_metrics` (the sums of every rank as the row's values).
Must never: draw a random number (greedy decoding draws none, so a run trains the same with or without
evaluation), or let one rank run fewer forwards than another (FSDP all-gathers in every forward).

Why batches of equal length: `generate` continues equal-length prompts (no padding, no attention mask). The batches
are made from the whole held-out set in (length, index) order and dealt round-robin, so a prompt is decoded in the
same batch, with the same numbers, at any number of ranks. With several ranks every batch decodes the full
--max_completion_length tokens (no early stop at the stop ids: every rank then runs the same forwards) and a rank
short of a batch decodes a filler batch it does not count; the tokens before a row's first stop id are those a
single process, which stops early, decodes.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from model.generate import generate


def eval_plan(lengths: Sequence[int], rows: int, rank: int = 0, world: int = 1) -> list[tuple[list[int], bool]]:
    """This rank's batches as (prompt indices, counted): at most `rows` prompts of one length each; a rank short of
    a batch ends with a filler batch (the first one, not counted) so that every rank decodes as many."""
    batches: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (lengths[i], i)):
        if batches and len(batches[-1]) < rows and lengths[batches[-1][0]] == lengths[i]:
            batches[-1].append(i)
        else:
            batches.append([i])
    mine = [(b, True) for b in batches[rank::world]]
    return mine + [(batches[0], False)] * (-(-len(batches) // world) - len(mine)) if batches else []


def first_stop(row: Sequence[int], stop_ids: Sequence[int]) -> Optional[int]:
    """The index of the first stop id in `row`, None when it has none."""
    return next((j for j, t in enumerate(row) if t in stop_ids), None)


@torch.no_grad()
def greedy_sums(model: Any, prompts: Sequence[Any], rewards: Any, decode: Any, *, rows: int, max_new_tokens: int,
                stop_ids: Sequence[int], device: Any, rank: int = 0, world: int = 1,
                answers: Optional[list] = None) -> list[float]:
    """[prompts scored, sum of the weighted rewards, sum of each function's reward..., sum of completion tokens]
    over this rank's share of `prompts` (grpo_data.Prompt: ids, text, answer, record, where). `rewards`: a
    grpo_rewards.RewardSet; `decode(ids) -> text`. A completion is its tokens before the first stop id (the stop
    token counts in its length, as in training); one without a stop id is the whole --max_completion_length.
    `answers`, when given a list, gets (prompt index, completion text, [each function's reward]) per prompt."""
    stops = [int(s) for s in stop_ids]
    sums = [0.0] * (3 + len(rewards.names))
    for batch, counted in eval_plan([len(p.ids) for p in prompts], rows, rank, world):
        P = len(prompts[batch[0]].ids)
        x = torch.tensor([list(prompts[i].ids) for i in batch], dtype=torch.long, device=device)
        out = generate(model, x, max_new_tokens, temperature=0.0, stop_ids=stops if world == 1 else None)
        if not counted:
            continue
        for i, row in zip(batch, out[:, P:].tolist()):
            end = first_stop(row, stops)
            text = decode(row[:end] if end is not None else row)
            p = prompts[i]
            vals = rewards.score(p.text, text, p.record, p.answer, p.where)
            sums[0] += 1.0
            sums[1] += rewards.total(vals)
            for k, v in enumerate(vals):
                sums[2 + k] += v
            sums[-1] += float(end + 1 if end is not None else len(row))
            if answers is not None:
                answers.append((i, text, vals))
    return sums


def held_out_metrics(sums: Sequence[float], reward_names: Sequence[str]) -> dict:
    """The row's values from the sums of every rank (`greedy_sums`, summed)."""
    n = max(float(sums[0]), 1e-30)
    out = {"val_reward": float(sums[1]) / n}
    for k, name in enumerate(reward_names):
        out[f"val_reward_{name}"] = float(sums[2 + k]) / n
    out["val_completion_length"] = float(sums[-1]) / n
    out["val_prompts"] = float(sums[0])
    return out
