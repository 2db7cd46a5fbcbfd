"""Autoregressive generation with a KV cache.

Owns: `generate(...)` and the token-sampling rule (greedy, temperature, top-k, top-p, min-p, the repetition penalty,
stop ids; `sample_scaled` / `multinomial_one` / `penalize_repeats`, which GRPO's rollouts share; `truncate`,
`StopRule`, `decode_dtype`, which speculative decoding shares). The KV-cache forward is model/decode.py's `Decoder`.
With use_cache=False every step re-runs the whole sequence: the slow reference that the KV-cache path
must equal (greedy, and sampled under a fixed seed, since both draw the same random numbers).

Must never: change the model's train/eval mode permanently, or track gradients.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from model.decode import Decoder
from model.llama import Transformer


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                min_p: Optional[float] = None) -> torch.Tensor:
    """logits [B, V] -> next ids [B]. temperature == 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    return sample_scaled(logits.float() / temperature, top_k, top_p, generator, min_p)


def sample_scaled(logits: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None,
                  generator: Optional[torch.Generator] = None, min_p: Optional[float] = None) -> torch.Tensor:
    """`sample_next` of logits already divided by the temperature (fp32 [B, V]): the same draws, for a caller
    that needs the scaled logits too (the rollout's log-probabilities)."""
    return multinomial_one(truncate(logits, top_k, top_p, min_p).softmax(dim=-1), generator)


def truncate(logits: torch.Tensor, top_k: Optional[int] = None, top_p: Optional[float] = None,
             min_p: Optional[float] = None) -> torch.Tensor:
    """Scaled logits [B, V] with the tokens top-k, top-p and min-p leave out set to -inf, in that order (as
    transformers' warpers): their softmax is the distribution `sample_scaled` draws from (speculative decoding
    compares two such distributions). min-p (Nguyen et al. 2024) drops a token less probable than min_p times the
    most probable one (which always stays)."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked before it already hold top_p of the mass (keeps >= 1)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None and 0.0 < min_p:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def penalize_repeats(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty of CTRL (Keskar et al. 2019), as transformers' RepetitionPenaltyLogitsProcessor: the
    logit of every token in `seen` [B, T] (the prompt and what was generated) divided by `penalty` where positive,
    multiplied by it where negative (> 1 discourages repeats, < 1 encourages them); fp32 logits [B, V] back. It
    applies to the raw logits, before the temperature and the cuts (and before greedy's argmax)."""
    logits = logits.float()
    got = logits.gather(1, seen)
    return logits.scatter(1, seen, torch.where(got < 0, got * penalty, got / penalty))


def check_repetition_penalty(penalty: float) -> None:
    """ValueError unless the penalty is > 0 (generate's and model/speculative.py generate_mtp's check)."""
    if not penalty > 0:
        raise ValueError(f"generate: repetition_penalty must be > 0, got {penalty}")


def multinomial_one(probs: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """One draw per row of probs [B, V] -> [B]: the draws of torch.multinomial(probs, 1, generator=generator),
    computed as torch computes one sample (argmax(probs / q), q ~ Exp(1) from the generator: the exponential race;
    tests/model/test_decode.py holds the equality), without its input checks (min/max/sum passes over probs and
    asserts on every call). Probabilities that are not finite (NaN logits) are not caught here: the caller checks
    what it records (trainer/tasks/grpo_rollout.py)."""
    return (probs / exponential(probs, generator)).argmax(dim=-1)


# relative distance within which torch's vectorised log1p and the C library's agree (a few units in the last
# place of a double: 2^-50 is 4 of them), see `exponential`
_LOG1P_MARGIN = 2.0 ** -50


def exponential(like: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Exp(1) draws shaped like `like`: the values, and the generator's consumption, of
    torch.empty_like(like).exponential_(1, generator=generator).

    Why not that call on the CPU: torch draws them one element at a time, a 53-bit uniform u from the generator's
    64-bit Mersenne Twister and -log1p(-u) by the C library, in float64, rounded to the tensor's dtype (~20 ns an
    element here: 0.65 ms for [8, 4096], a seventh of a dim-256 decode step). The same uniforms come from
    `uniform_` on a float64 tensor (the same generator calls, a fifth of the time) and the vectorised log1p, which
    differs from the C library's by a unit or two in the last place of a double; rounding to float32 absorbs that
    except for values within that distance of a float32 rounding boundary (about 2^-25 of them): those are
    recomputed with `math.log1p`. tests/model/test_decode.py holds the equality, those recomputed ones included.
    Elsewhere (an accelerator, another dtype): torch's own call."""
    if like.device.type != "cpu" or like.dtype != torch.float32:
        return torch.empty_like(like).exponential_(1, generator=generator)
    u = torch.empty(like.shape, dtype=torch.float64).uniform_(generator=generator)
    y = torch.log1p(-u).neg_()
    q = y.float()
    near = (y * (1.0 - _LOG1P_MARGIN)).float() != (y * (1.0 + _LOG1P_MARGIN)).float()
    if bool(near.any()):
        idx = near.nonzero()
        exact = [-math.log1p(-v) for v in u[near].tolist()]
        q[tuple(idx.t())] = torch.tensor(exact, dtype=torch.float64).float()
    return q


class StopRule:
    """The emitted tokens of a batch under the stop rule: a row that emits one of `stop_ids` is finished and repeats
    that id (`generate`'s, and model/speculative.py's)."""

    def __init__(self, batch_size: int, device: torch.device, stop_ids: Optional[Iterable[int]]):
        self.stops = torch.tensor(sorted(set(stop_ids or [])), dtype=torch.long, device=device)
        self.finished = torch.zeros(batch_size, dtype=torch.bool, device=device)
        self.fill = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.tokens: list[torch.Tensor] = []

    def emit(self, nxt: torch.Tensor) -> torch.Tensor:
        """Record the next token of every row [B] (a finished row's is its stop id) and return it."""
        nxt = torch.where(self.finished, self.fill, nxt)
        if self.stops.numel():
            hit = torch.isin(nxt, self.stops) & ~self.finished
            self.fill = torch.where(hit, nxt, self.fill)
            self.finished = self.finished | hit
        self.tokens.append(nxt)
        return nxt

    def done(self) -> bool:
        """Every row has stopped (a host read; never with no stop ids)."""
        return bool(self.stops.numel()) and bool(self.finished.all())


def decode_dtype(model: Transformer, device: torch.device) -> torch.dtype:
    """The dtype of a KV cache for `model`: its weights', or autocast's when autocast is on."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return model.embed_tokens.weight.dtype


def left_pads(attention_mask: torch.Tensor) -> torch.Tensor:
    """The left padding [B] of each row of a [B, T] mask (1 on real tokens), which must be left padding only (zeros
    before the row's first real token, none after) and leave each row a token; ValueError otherwise."""
    mask = attention_mask.to(torch.bool)
    real = mask.sum(1)
    if not bool((real > 0).all()) or not bool((mask[:, 1:] >= mask[:, :-1]).all()):
        raise ValueError("generate: attention_mask must be left padding (0s before each row's first real token, "
                         "none after it) and leave each row at least one token")
    return mask.shape[1] - real


@torch.no_grad()
def generate(model: Transformer, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             stop_ids: Optional[Iterable[int]] = None, use_cache: bool = True,
             generator: Optional[torch.Generator] = None, min_p: Optional[float] = None,
             repetition_penalty: float = 1.0, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Continue a batch of prompts [B, T]; returns [B, T + n] with n <= max_new_tokens.

    Prompts of different lengths come left-padded with their `attention_mask` [B, T] (0 on the pads, as
    transformers' generate takes them): the pads are masked out of every attention, each row's positions count from
    its first real token, and the repetition penalty does not see them. A row that emits one of `stop_ids` is
    finished: its later positions repeat that stop id. Generation ends early once every row has finished.
    repetition_penalty != 1: `penalize_repeats` over each row's ids so far.
    """
    check_repetition_penalty(repetition_penalty)
    was_training = model.training
    model.eval()
    try:
        B, T = input_ids.shape
        device = input_ids.device
        pads = None if attention_mask is None else left_pads(attention_mask.to(device))
        rows = StopRule(B, device, stop_ids)
        out = input_ids
        if pads is not None:  # the pads hold each row's first real token: the penalty's `seen` gains no other id
            first = input_ids.gather(1, pads[:, None])
            out = torch.where(torch.arange(T, device=device)[None] < pads[:, None], first, input_ids)
        finite = torch.ones((), dtype=torch.bool, device=device)  # torch.multinomial's check, read once at the end
        decoder = Decoder(model, B, T + max_new_tokens, device, decode_dtype(model, device)) if use_cache else None
        nxt = input_ids
        for t in range(max_new_tokens):
            if decoder is not None:
                logits = decoder.prefill(out, pads) if t == 0 else decoder.step(nxt)
            elif pads is None:
                logits = model(out, logits_to_keep=1)[:, -1]
            else:  # the model's own padding: a key mask and each row's positions
                positions, real = Decoder.padded(pads, 0, out.shape[1])
                logits = model(out, logits_to_keep=1, attention_mask=real, position_ids=positions)[:, -1]
            finite &= torch.isfinite(logits).all()
            if repetition_penalty != 1.0:
                logits = penalize_repeats(logits, out, repetition_penalty)
            nxt = rows.emit(sample_next(logits, temperature, top_k, top_p, generator, min_p))
            out = torch.cat((out, nxt[:, None]), dim=1)
            if rows.done():
                break
        if not bool(finite):
            raise ValueError("generate: the model's logits are not finite (NaN or inf)")
        return out if pads is None else torch.cat((input_ids, out[:, T:]), dim=1)  # (the caller's pads back)
    finally:
        model.train(was_training)
