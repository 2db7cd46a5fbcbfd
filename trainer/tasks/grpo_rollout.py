"""GRPO's rollouts: G completions of each prompt sampled from the current policy with the model's KV cache (or, for
exact parity, whole-row forwards of the training shape), the log-probability of every sampled token recorded.

Owns: `rollout_seed` (a completion group is a function of (seed, step, prompt index) only: never of the rank, the
number of ranks or the micro-batch layout), `sample_groups` (the G completions of one or several prompts decoded
together, each group from its own generator; `sample_group`: one prompt's; `sample_in_calls`: a micro-batch's prompts
in calls of --rollout_batch_prompts), and `Group` (what the task builds training rows from).
Must never: touch the training's random number generators, track gradients, or leave the model in eval mode.

Why one group at a time by default (--rollout_batch_prompts=1): every rank then runs the same shapes for the same
prompt, so the numbers, and the tokens drawn, do not depend on which rank holds the prompt or which prompts share its
batch. Several prompts per call (K > 1: K x G rows, the prompts left-padded, model/decode.py prefill_groups) decode in
fewer, fuller steps; each group still draws from its own generator, but its logits round as the batch does, so a
token drawn near a tie may differ from the one-group run's (and with the layout). The log-probabilities are those of
logits / temperature (the distribution before top-k / top-p / min-p truncation), as the trainer computes them.

Parity (docs/grpo.md): with the KV cache the new token's logits come from model/decode.py's Decoder (the prompt
prefilled once for the group, then one-row matmuls and attention over the cache), a different summation order than
the trainer's whole-row forward; in fp32 they differ by rounding (~1e-7).
With generation_kv_cache=False each step runs the whole [K x G, max_prompt + max_completion] rows, the training
shape at K = 1; a position's value does not depend on the tokens after it (causal mask, same kernel blocking for the
same shape), so the recorded values equal the trainer's bit for bit on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from model.decode import Decoder, left_pad
from model.generate import decode_dtype, penalize_repeats, sample_scaled

_MIX = 0x9E3779B97F4A7C15  # splitmix64's constant: distinct (seed, step, prompt) give unrelated streams


def rollout_seed(seed: int, step: int, prompt_index: int) -> int:
    """The seed of the generator of one prompt's group at one rollout step (a 63-bit int)."""
    x = (int(seed) * 1_000_003 + int(step)) * _MIX + int(prompt_index) * 0xBF58476D1CE4E5B9
    x ^= x >> 31
    return x & 0x7FFF_FFFF_FFFF_FFFF


# turn_end(prompt k of the call, row j of its group, the turn's ids through its stop id, tokens left) -> ids to feed
TurnEnd = Callable[[int, int, list, int], Optional[Sequence[int]]]


class _Feed:
    """`sample_groups`' tool-use state: the ids still to feed to each row (a tool's result), where each row's current
    turn started, and which positions were fed (`forced`, [B, n])."""

    def __init__(self, rows: int, n: int, device: Any, turn_end: Optional[TurnEnd], group_size: int) -> None:
        self.pending: dict[int, list[int]] = {}
        self.start = [0] * rows
        self.forced = torch.zeros((rows, n), dtype=torch.bool, device=device) if turn_end is not None else None
        self.turn_end, self.G, self.device = turn_end, group_size, device

    def force(self, nxt: torch.Tensor, t: int) -> torch.Tensor:
        """`nxt` with each fed row's next id in place of its draw (the draw is still made: the group's generator
        advances as without tools)."""
        if not self.pending:
            return nxt
        rows = sorted(self.pending)
        ids = [self.pending[r].pop(0) for r in rows]
        at = torch.tensor(rows, dtype=torch.long, device=self.device)
        nxt = nxt.clone()
        nxt[at] = torch.tensor(ids, dtype=nxt.dtype, device=self.device)
        self.forced[at, t] = True
        for r in rows:
            if not self.pending[r]:
                del self.pending[r]
                self.start[r] = t + 1  # the next turn starts after the generation prompt fed
        return nxt

    def turns_ended(self, toks: torch.Tensor, t: int, hit: torch.Tensor, room: int) -> torch.Tensor:
        """The rows that end at step t: those that drew a stop id (`hit`, fed ids never count) and whose turn_end
        fed nothing more."""
        hit = hit & ~self.forced[:, t]
        if not bool(hit.any()):
            return hit
        for r in hit.nonzero()[:, 0].tolist():
            more = self.turn_end(r // self.G, r % self.G, toks[r, self.start[r]:t + 1].tolist(), room)
            if more:
                if len(more) >= room:
                    raise ValueError(f"turn_end fed {len(more)} ids with {room} tokens left: at most {room - 1}")
                self.pending[r] = [int(i) for i in more]
                hit[r] = False
        return hit


@dataclass
class Group:
    """One prompt's G completions: tokens [G, n] (after a row's stop token: the pad id), mask [G, n] (1 on the
    tokens trained on: up to and including the stop token), logps [G, n] (the sampler's log-probabilities of the
    sampled tokens, 0 where mask is 0)."""
    prompt_index: int
    tokens: torch.Tensor
    mask: torch.Tensor
    logps: torch.Tensor


def sample_group(model, prompt_ids: Sequence[int], group_size: int, max_new_tokens: int, *, generator: torch.Generator,
                 **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [G, n], mask [G, n], logps [G, n]) with n <= max_new_tokens: G completions of one prompt
    (`sample_groups` with one prompt; its keywords)."""
    return sample_groups(model, [prompt_ids], group_size, max_new_tokens, generators=[generator], **kw)[0]


def sample_in_calls(model, prompts: Sequence[Sequence[int]], seeds: Sequence[int], per_call: int, group_size: int,
                    max_new_tokens: int, *, device: Any, **kw) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`sample_groups` over `prompts`, `per_call` of them a call (--rollout_batch_prompts; 0: all in one call), prompt
    k's group drawn from a generator seeded with seeds[k] (`rollout_seed`): [(tokens, mask, logps)] in the prompts'
    order. Ranks holding as many prompts make as many calls (`kw`: sample_groups' keywords, all_done included;
    turn_end gets the prompt's index in `prompts`)."""
    per_call = per_call or max(1, len(prompts))
    out, turn_end = [], kw.pop("turn_end", None)
    for c in range(0, len(prompts), per_call):
        generators = [torch.Generator(device=device).manual_seed(s) for s in seeds[c:c + per_call]]
        if turn_end is not None:  # (its prompt index: the micro-batch's, not the call's)
            kw["turn_end"] = lambda k, j, turn, room, c=c: turn_end(c + k, j, turn, room)
        out += sample_groups(model, prompts[c:c + per_call], group_size, max_new_tokens, generators=generators, **kw)
    return out


@torch.no_grad()
def sample_groups(model, prompts: Sequence[Sequence[int]], group_size: int, max_new_tokens: int, *, temperature: float,
                  top_p: float, stop_ids: Sequence[int], pad_id: int, generators: Sequence[torch.Generator],
                  top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
                  use_cache: bool = True, row_len: int = 0, all_done: Optional[Callable[[bool], bool]] = None,
                  turn_end: Optional[TurnEnd] = None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """[(tokens [G, n], mask [G, n], logps [G, n])] per prompt, n <= max_new_tokens: G completions of each prompt,
    all decoded together (K prompts: K x G rows, the prompts left-padded to the longest: model/decode.py
    prefill_groups), each group's tokens drawn from its own generator (`generators`, one per prompt), so a group
    draws what it draws alone up to the rounding of the batched arithmetic.
    row_len (use_cache=False): the length of the whole-row forward (the training rows' length).
    all_done(these groups are done) -> whether every rank's are (several ranks: a forward that all-gathers, FSDP's,
    must run as often on every rank); a group that finished first decodes on with its rows masked, the same tokens.
    repetition_penalty != 1 penalises the draws (model/generate.py penalize_repeats over the prompt and the row's
    completion so far), not the recorded log-probabilities (TRL's). temperature 0: greedy (held-out answers; the
    log-probabilities recorded are then the logits' own).
    turn_end(k, j, turn, room) (tool use, trainer/tasks/grpo_tools.py): called when row j of prompt k emits a stop id,
    with the ids of its turn (through the stop) and the tokens left; the ids it returns (a tool's result and the next
    generation prompt, fewer than `room`) are fed to the row one a step, recorded with mask 0 and log-probability 0,
    and the row samples on; None ends the row. Without it a stop id ends the row."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        K, G = len(prompts), group_size
        B, lengths = K * G, [len(p) for p in prompts]
        if len(generators) != K:
            raise ValueError(f"sample_groups: {len(generators)} generators for {K} prompts")
        P = max(lengths)
        if repetition_penalty != 1.0:  # the penalty's `seen` prompt rows, once (their pads are ids already there)
            seen_prompts = left_pad(prompts, device)[0].repeat_interleave(G, dim=0)
        stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        # preallocated outputs, column t written at step t; `ended` (the row had finished before step t) masks the
        # log-probabilities and gives the mask once, at the end
        toks = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
        ended = torch.ones((B, max_new_tokens), dtype=torch.bool, device=device)
        lps = torch.zeros((B, max_new_tokens), dtype=torch.float32, device=device)
        feed = _Feed(B, max_new_tokens, device, turn_end, G)
        if use_cache:
            decoder = Decoder(model, B, P + max_new_tokens, device, decode_dtype(model, device))
        else:  # each row: its prompt from position 0, then its completion (the training rows' layout)
            row = torch.full((B, max(row_len, P + max_new_tokens)), pad_id, dtype=torch.long, device=device)
            for k, p in enumerate(prompts):
                row[k * G:(k + 1) * G, :len(p)] = torch.tensor(list(p), dtype=torch.long, device=device)
            at = torch.tensor(lengths, device=device).repeat_interleave(G) - 1  # each row's last prompt position
            rows_idx = torch.arange(B, device=device)
        def by_temperature(x: torch.Tensor) -> torch.Tensor:
            return x / temperature if temperature not in (0.0, 1.0) else x  # x / 1.0 is x: skipping it changes no bit

        n = 0
        for t in range(max_new_tokens):
            if use_cache:
                logits = decoder.prefill_groups(prompts, G) if t == 0 else decoder.step(toks[:, t - 1])
            else:
                logits = model(row)[rows_idx, at + t]
            scaled = by_temperature(logits.float())
            logp_all = torch.log_softmax(scaled, dim=-1)
            draw = scaled
            if repetition_penalty != 1.0:  # the draws only: the recorded log-probabilities stay logits / temperature's
                seen = torch.cat((seen_prompts, toks[:, :t]), dim=1)
                draw = by_temperature(penalize_repeats(logits, seen, repetition_penalty))
            if temperature == 0:
                nxt = draw.argmax(dim=-1)
            else:
                nxt = torch.cat([sample_scaled(draw[k * G:(k + 1) * G], top_k or None, top_p if top_p < 1.0 else None,
                                               gen, min_p or None) for k, gen in enumerate(generators)])
            if turn_end is not None:
                nxt = feed.force(nxt, t)  # rows being fed a tool's result take its next id, not the drawn one
            toks[:, t] = nxt.masked_fill(finished, pad_id)
            ended[:, t] = finished
            lps[:, t] = logp_all.gather(1, nxt[:, None])[:, 0]
            if turn_end is None:
                finished |= torch.isin(nxt, stops)
            else:
                finished |= feed.turns_ended(toks, t, torch.isin(nxt, stops) & ~finished, max_new_tokens - t - 1)
            if not use_cache:
                row[rows_idx, at + t + 1] = toks[:, t]
            n = t + 1
            done = bool(finished.all()) if stops.numel() else False  # without stop ids no row ever finishes
            if all_done(done) if all_done is not None else done:
                break
        if turn_end is not None:  # a tool's result is context, not the policy's: not trained on
            ended |= feed.forced
        lps.masked_fill_(ended, 0.0)
        if not bool(torch.isfinite(lps).all()):  # torch.multinomial's check, once per call (model/generate.py)
            raise ValueError("sampling a rollout: the policy's logits are not finite (NaN or inf): the model diverged")
        return [(toks[k * G:(k + 1) * G, :n].contiguous(), ~ended[k * G:(k + 1) * G, :n],
                 lps[k * G:(k + 1) * G, :n].contiguous()) for k in range(K)]
    finally:
        model.train(was_training)


def every_rank_done(engine: Any, device: Any) -> Callable[[bool], bool]:
    """`sample_groups`' all_done over the data-parallel ranks: whether every rank's groups are done (one all-reduce
    per generated token)."""
    return lambda done: float(engine.sum_over_data([0.0 if done else 1.0], device)[0]) == 0.0


def completion_lengths(mask: torch.Tensor) -> torch.Tensor:
    """Each row's completion length [R]: through its last position of mask 1 (0 for none). Without tools the mask is
    a run from 0, so this is its sum; with tools it spans the results fed between the turns."""
    on = mask.bool()
    at = torch.arange(1, on.shape[1] + 1, device=on.device)
    return torch.where(on, at, torch.zeros_like(at)).amax(dim=1) if on.shape[1] else on.sum(1)


def drop_truncated(tokens: torch.Tensor, mask: torch.Tensor, stop_ids: Sequence[int]) -> torch.Tensor:
    """The mask with the rows whose last sampled token is not a stop id (cut at max_completion_length) zeroed: DAPO's
    overlong filtering, a truncated completion is no evidence of a bad answer. (With tools an earlier turn's stop id
    does not count: the last turn was cut.)"""
    stops = torch.tensor(sorted(set(stop_ids)), dtype=tokens.dtype, device=tokens.device)
    n = completion_lengths(mask)
    last = tokens.gather(1, (n - 1).clamp(min=0)[:, None])
    ended = torch.isin(last, stops) & (n > 0)[:, None]
    return mask & ended if mask.dtype == torch.bool else mask * ended.to(mask.dtype)


def training_rows(prompts: Sequence[Sequence[int]], groups: Sequence[Group], row_len: int, pad_id: int
                  ) -> dict[str, torch.Tensor]:
    """The training batch of some groups: input_ids [R, row_len] (prompt, completion, pad), completion_mask and
    gen_logps [R, row_len - 1] aligned with the next-token targets input_ids[:, 1:] (R = groups x G)."""
    rows, masks, lps = [], [], []
    for ids, g in zip(prompts, groups):
        G, n = g.tokens.shape
        P = len(ids)
        x = torch.full((G, row_len), pad_id, dtype=torch.long)
        x[:, :P] = torch.tensor(list(ids), dtype=torch.long)
        x[:, P:P + n] = g.tokens.cpu()
        m = torch.zeros((G, row_len - 1), dtype=torch.float32)
        m[:, P - 1:P - 1 + n] = g.mask.cpu().float()
        lp = torch.zeros((G, row_len - 1), dtype=torch.float32)
        lp[:, P - 1:P - 1 + n] = g.logps.cpu().float()
        rows.append(x)
        masks.append(m)
        lps.append(lp)
    return {"input_ids": torch.cat(rows), "completion_mask": torch.cat(masks), "gen_logps": torch.cat(lps)}


def token_logps(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float,
                with_entropy: bool = False, cp: Any = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probabilities [B, T-1] of input_ids[:, 1:] under logits[:, :-1] / temperature (fp32), and the entropy
    of those distributions when asked. cp (the model's ContextParallel, model/ring_attention.py): the logits are
    this rank's positions of the whole rows; the values come back as the whole rows' on every cp rank, each rank's
    gradient flowing through its own positions."""
    if cp is not None:
        logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
        logps = cp.next_token_values(logp_all, input_ids)
    else:
        logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
        logps = logp_all.gather(-1, input_ids[:, 1:, None])[..., 0]
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            if cp is not None:
                entropy = cp.gather_tokens(entropy)[:, :-1]
    return logps, entropy
