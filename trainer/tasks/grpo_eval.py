"""GRPO's held-out evaluation (--eval_data_dir): every held-out prompt answered with model/generate.py's `generate`,
each answer scored by the run's reward functions. By default one greedy answer (temperature 0) per prompt: the step
row gets `val_reward` (the mean weighted reward), `val_reward_<function>` and `val_completion_length`; with a 0/1
reward such as exact_match, `val_reward` is the greedy pass@1. With --eval_num_generations=k, k answers sampled at
the rollouts' --temperature / --top_p (TRL samples its eval completions so): the means over each prompt's k, and
`val_reward_best`, the mean over prompts of the best of their k (pass@k for a 0/1 reward).

Owns: `eval_plan` (the prompts in batches, dealt to the data-parallel ranks), `held_out_sums` (one rank's sums),
`held_out_metrics` (the sums of every rank as the row's values), `batch_seed`.
Must never: draw from the training's random generators (greedy decoding draws nothing; sampling draws from its own
generator per batch, seeded by the run's seed and the batch's first prompt: the same answers at any number of ranks,
at every evaluation, and a run trains the same with or without evaluation), or let one rank run fewer forwards than
another (FSDP all-gathers in every forward).

The batches: up to `rows` answers of prompts next to each other in (length, index) order over the whole held-out set
(so little padding: `generate` takes them left-padded with their attention mask), dealt round-robin, so a prompt is
decoded in the same batch, with the same numbers, at any number of ranks. With several ranks every batch decodes the
full --max_completion_length tokens (no early stop at the stop ids: every rank then runs the same forwards) and a rank
short of a batch decodes a filler batch it does not count; the tokens before a row's first stop id are those a single
process, which stops early, decodes (a sampled step draws for every row, finished or not).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from model.decode import left_pad
from model.generate import generate


def eval_plan(lengths: Sequence[int], rows: int, rank: int = 0, world: int = 1) -> list[tuple[list[int], bool]]:
    """This rank's batches as (prompt indices, counted): at most `rows` prompts each, taken in (length, index) order;
    a rank short of a batch ends with a filler batch (the first one, not counted) so that every rank decodes as
    many."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches = [order[i:i + rows] for i in range(0, len(order), rows)]
    mine = [(b, True) for b in batches[rank::world]]
    return mine + [(batches[0], False)] * (-(-len(batches) // world) - len(mine)) if batches else []


def first_stop(row: Sequence[int], stop_ids: Sequence[int]) -> Optional[int]:
    """The index of the first stop id in `row`, None when it has none."""
    return next((j for j, t in enumerate(row) if t in stop_ids), None)


def batch_seed(seed: int, first_prompt: int) -> int:
    """The seed of a sampled evaluation batch's generator: a function of the run's seed and the batch's first prompt
    (its index in the held-out set), never of the rank or the step."""
    return (int(seed) * 1_000_003 + 7919 * int(first_prompt) + 0x5EED) % (2 ** 63)


@torch.no_grad()
def held_out_sums(model: Any, prompts: Sequence[Any], rewards: Any, decode: Any, *, rows: int, max_new_tokens: int,
                  stop_ids: Sequence[int], device: Any, rank: int = 0, world: int = 1,
                  answers: Optional[list] = None, samples: int = 0, temperature: float = 1.0, top_p: float = 1.0,
                  seed: int = 0, cuts: Optional[dict] = None, tools: Optional[Callable] = None,
                  use_cache: bool = True) -> list[float]:
    """[prompts scored, sum of the weighted rewards, sum of each function's reward..., sum of completion tokens, sum
    of the best weighted reward] over this rank's share of `prompts` (grpo_data.Prompt: ids, text, answer, record,
    where); with `samples` = k >= 1 each prompt's values are the means over its k sampled answers (the best: their
    maximum), else its one greedy answer's. `rows`: the answers decoded together at most (a batch holds
    max(1, rows // k) prompts). `rewards`: a grpo_rewards.RewardSet; `decode(ids) -> text`. A completion is its tokens
    before the first stop id (the stop token counts in its length, as in training); one without a stop id is the
    whole max_new_tokens. `answers`, when given a list, gets (prompt index, completion text, [each function's
    reward]) per answer. `cuts`: the sampled answers' other truncations (generate's top_k, min_p), as the rollouts'.
    `tools(the batch's prompts) -> grpo_tools.ToolRunner` (--tools): the answers are decoded by the rollouts' sampler
    with the calls run (`_tool_answers`; `use_cache` as the rollouts'), and scored as the rollouts are."""
    stops = [int(s) for s in stop_ids]
    k = max(1, samples)
    F = len(rewards.names)
    sums = [0.0] * (4 + 2 * F)  # prompts, total, each function's values and its applicable answers, length, best
    for batch, counted in eval_plan([len(p.ids) for p in prompts], max(1, rows // k), rank, world):
        if tools is not None:
            got = _tool_answers(model, [prompts[i] for i in batch], batch, tools, k, max_new_tokens, stops, device,
                                world, samples, temperature, top_p, seed, cuts, use_cache)
        else:
            got = _answers(model, [prompts[i].ids for i in batch], k, max_new_tokens, stops, device, world, samples,
                           temperature, top_p, batch_seed(seed, batch[0]), cuts, decode)
        if not counted:
            continue
        for i, (texts, kept, messages) in zip(batch, got):
            p = prompts[i]
            totals, per_function, applied, length = [], [0.0] * F, [0.0] * F, 0.0
            for text, c, vals in zip(texts, kept, rewards.score_many(p.text, texts, p.record, p.answer, p.where,
                                                                     p.ids, kept, messages)):
                totals.append(rewards.total(vals))
                per_function = [a + v if v == v else a for a, v in zip(per_function, vals)]  # (NaN: None)
                applied = [a + 1.0 if v == v else a for a, v in zip(applied, vals)]
                length += float(len(c))  # (through the stop token, which counts as in training)
                if answers is not None:
                    answers.append((i, text, vals))
            sums[0] += 1.0
            sums[1] += sum(totals) / k
            for f, (v, c) in enumerate(zip(per_function, applied)):
                sums[2 + f] += v / k
                sums[2 + F + f] += c / k
            sums[-2] += length / k
            sums[-1] += max(totals)
    return sums


def _answers(model: Any, ids: list, k: int, max_new_tokens: int, stops: list, device: Any, world: int, samples: int,
             temperature: float, top_p: float, seed: int, cuts: Optional[dict], decode: Any) -> list[tuple]:
    """[(texts, token ids through the stop, None)] per prompt of a batch, k answers each, from `generate`."""
    x, mask = left_pad([p for p in ids for _ in range(k)], device)  # (to the batch's longest)
    P = x.shape[1]
    stop = stops if world == 1 else None
    if samples:
        g = torch.Generator(device=device).manual_seed(seed)
        out = generate(model, x, max_new_tokens, temperature=temperature, top_p=top_p, stop_ids=stop, generator=g,
                       attention_mask=mask, **(cuts or {}))
    else:
        out = generate(model, x, max_new_tokens, temperature=0.0, stop_ids=stop, attention_mask=mask)
    done, got = out[:, P:].tolist(), []
    for n in range(len(ids)):
        ends = [first_stop(row, stops) for row in done[n * k:(n + 1) * k]]
        kept = [row[:end + 1] if end is not None else row for row, end in zip(done[n * k:(n + 1) * k], ends)]
        got.append(([decode(c[:-1] if end is not None else c) for c, end in zip(kept, ends)], kept, None))
    return got


def _tool_answers(model: Any, prompts: list, batch: list, tools: Callable, k: int, max_new_tokens: int, stops: list,
                  device: Any, world: int, samples: int, temperature: float, top_p: float, seed: int,
                  cuts: Optional[dict], use_cache: bool) -> list[tuple]:
    """[(the last turns' texts, token ids through the last one's stop, transcripts)] per prompt of a batch, k
    answers each, decoded as the rollouts are (grpo_rollout.sample_groups with the calls run), each prompt's
    generator seeded by `batch_seed(seed, its index)`; several ranks decode the full length (FSDP's forwards)."""
    from trainer.tasks.grpo_rollout import completion_lengths, sample_groups
    runner = tools(prompts)
    cuts = cuts or {}
    out = sample_groups(model, [p.ids for p in prompts], k, max_new_tokens, temperature=temperature if samples else 0.0,
                        top_p=top_p if samples else 1.0, top_k=int(cuts.get("top_k") or 0) if samples else 0,
                        min_p=float(cuts.get("min_p") or 0.0) if samples else 0.0,
                        repetition_penalty=float(cuts.get("repetition_penalty") or 1.0) if samples else 1.0,
                        stop_ids=stops, pad_id=0, use_cache=use_cache,
                        generators=[torch.Generator(device=device).manual_seed(batch_seed(seed, i)) for i in batch],
                        all_done=(lambda done: False) if world > 1 else None, turn_end=runner.turn_end)
    got = []
    for n, (toks, mask, _) in enumerate(out):
        kept = [row[:m] for row, m in zip(toks.tolist(), completion_lengths(mask).tolist())]
        done = [runner.finish(n, j, c) for j, c in enumerate(kept)]
        got.append(([d[0] for d in done], kept, [d[1] for d in done]))
    return got


def held_out_metrics(sums: Sequence[float], reward_names: Sequence[str], samples: int = 0) -> dict:
    """The row's values from the sums of every rank (`held_out_sums`, summed); `val_reward_best` with samples."""
    n = max(float(sums[0]), 1e-30)
    out = {"val_reward": float(sums[1]) / n}
    F = len(reward_names)
    for k, name in enumerate(reward_names):  # over the answers it applied to (all, unless it returned None)
        if float(sums[2 + F + k]) > 0:
            out[f"val_reward_{name}"] = float(sums[2 + k]) / float(sums[2 + F + k])
    out["val_completion_length"] = float(sums[-2]) / n
    out["val_prompts"] = float(sums[0])
    if samples:
        out["val_reward_best"] = float(sums[-1]) / n
    return out
