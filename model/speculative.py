"""Speculative decoding with the model's own multi-token prediction depth as the draft (DeepSeek-V3, section 5.4.3:
its MTP module predicts the token after next, accepted 85-90% of the time, ~1.8x the tokens per second).

Owns: `generate_mtp` (sample.py's `--speculative=mtp`), `MTPDraft` (the first MTP depth over its own KV cache),
`why_not` (where it cannot run).

One step, for the last emitted token t_P (not yet in the model's cache) and the draft d of the token after it:
  1. the model runs [t_P, d] at positions P, P + 1 over its cache (one forward of two tokens);
  2. the logits at P decide whether d stands: greedy, iff it is their argmax; sampled, with probability
     min(1, p(d) / q(d)), else the token is drawn from max(0, p - q) renormalised (speculative sampling, Leviathan
     et al. 2023 / Chen et al. 2023: each emitted token is distributed as plain sampling's, p and q both the
     temperature / top-k / top-p distributions);
  3. if d stands in every row, it is emitted with a token from the logits at P + 1 (two tokens per forward); else
     each row's token at P + 1 is emitted alone and the model's cache forgets position P + 1;
  4. the depth extends its own cache with the verified positions (the model's hidden state at i and token i + 1)
     and its logits at the last one give the next draft.
A batch moves together (one cache position for every row): a second token is emitted only where every unfinished
row's draft stood. Only the first depth drafts (as DeepSeek-V3 evaluated it); further depths would chain drafts.

The repetition penalty (`repetition_penalty`) applies where plain decoding applies it: to the logits of a position
over the ids before it (the prompt and every emitted token; the draft's and the verified logits are of the same
position), so the rule above compares the penalized distributions.
Numerics: greedy decoding emits plain greedy's tokens up to argmax ties within rounding (the verifying forward
multiplies two rows where plain decoding multiplies one); sampling draws the same distribution with other random
numbers (not plain sampling's tokens for a seed).
Must never: emit a token the model's own distribution would not (a draft only saves forwards), or change the model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

from model.decode import Decoder, fast_path_applies
from model.generate import (StopRule, check_repetition_penalty, decode_dtype, multinomial_one, penalize_repeats,
                            sample_next, truncate)
from model.kv_cache import KVCache, kv_heads_of
from model.llama import Transformer


def why_not(model: torch.nn.Module) -> Optional[str]:
    """Why `generate_mtp` cannot run on this model, or None."""
    mtp = getattr(model, "mtp", None)
    if mtp is None or len(mtp.depths) == 0:
        return "the model has no multi-token prediction depth (train with --mtp_num_layers >= 1)"
    if not fast_path_applies(model):
        return "the model is not a whole single-process Llama model (sharded, pruned or with other blocks)"
    return None


@dataclass
class SpecStats:
    """What a `generate_mtp` call did: `steps` verifying forwards, `accepted` of them emitting two tokens,
    `row_drafts` / `row_accepted`: the unfinished rows' drafts and those that stood (per row)."""
    steps: int = 0
    accepted: int = 0
    row_drafts: int = 0
    row_accepted: int = 0
    forwards: int = 0     # the model's forwards: the prefill, the verifying steps and plain last steps
    new_tokens: int = 0   # tokens emitted per row (the longest row's)

    def summary(self) -> str:
        rate = self.row_accepted / max(self.row_drafts, 1)
        per = self.new_tokens / max(self.forwards, 1)
        return (f"speculative decoding (multi-token prediction depth 1): {self.row_accepted} of {self.row_drafts} "
                f"drafts accepted ({rate:.0%}), {per:.2f} tokens per forward of the model")


class MTPDraft:
    """The first MTP depth (model/mtp.py MTPDepth) over its own one-layer KV cache: position i holds the model's
    hidden state h_i (after its final norm, model/mtp.py) and the embedding of token i + 1; its logits at i are the
    draft of token i + 2. Shares the decoder's prepared layout and RoPE tables."""

    def __init__(self, decoder: Decoder, max_len: int, device: torch.device):
        model = decoder.model
        self.dec, self.depth = decoder, model.mtp.depths[0]
        self.layers = [decoder.prepare(self.depth.block)]
        self.proj = decoder.project((self.depth.eh_proj,))
        self.cache = KVCache(model.cfg, decoder.rows, max_len, device, decoder.dtype, kv_heads_of(model), n_layers=1)

    def extend(self, h: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """h [B, n, D]: the model's hidden states at the next n positions; next_tokens [B, n]: the tokens after
        them -> the draft logits [B, V] of the token after the last one."""
        d = self.depth
        e = self.dec.model.embed(next_tokens)
        h = self.dec.norm(self.dec.model.norm, h)
        x = self.proj(torch.cat([self.dec.norm(d.enorm, e), self.dec.norm(d.hnorm, h)], dim=-1))
        return self.dec.logits(self.dec.hidden(x, self.layers, self.cache)[:, -1], d.norm)


@torch.no_grad()
def generate_mtp(model: Transformer, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 stop_ids: Optional[Iterable[int]] = None, generator: Optional[torch.Generator] = None,
                 pack: Optional[bool] = None, min_p: Optional[float] = None,
                 repetition_penalty: float = 1.0) -> tuple[torch.Tensor, SpecStats]:
    """`model/generate.py generate`'s contract (a batch of equal-length prompts [B, T] -> [B, T + n], n <=
    max_new_tokens, stop ids, the repetition penalty) with the first MTP depth drafting the token after next;
    returns the tokens and what the drafts saved. ValueError where `why_not` names a reason."""
    problem = why_not(model)
    if problem:
        raise ValueError(f"speculative decoding: {problem}")
    check_repetition_penalty(repetition_penalty)
    was_training = model.training
    model.eval()
    try:
        return _generate(model, input_ids, max_new_tokens, temperature, (top_k, top_p, min_p, repetition_penalty),
                         stop_ids, generator, pack)
    finally:
        model.train(was_training)


def _generate(model, input_ids, max_new_tokens, temperature, cuts, stop_ids, generator, pack):
    top_k, top_p, min_p, penalty = cuts
    B, T = input_ids.shape
    device = input_ids.device
    stats = SpecStats()
    if max_new_tokens <= 0:
        return input_ids, stats
    dec = Decoder(model, B, T + max_new_tokens, device, decode_dtype(model, device), pack)
    draft = MTPDraft(dec, T + max_new_tokens, device)
    rows = StopRule(B, device, stop_ids)
    finite = torch.ones((), dtype=torch.bool, device=device)  # read once at the end, as generate does

    def penalized(logits: torch.Tensor) -> torch.Tensor:
        """The logits of the position after the ids so far (the prompt and every emitted token), with the
        repetition penalty over those ids, as plain decoding penalizes them."""
        if penalty == 1.0:
            return logits
        seen = torch.cat([input_ids, torch.stack(rows.tokens, dim=1)], dim=1) if rows.tokens else input_ids
        return penalize_repeats(logits, seen, penalty)

    def pick(logits: torch.Tensor) -> torch.Tensor:
        nonlocal finite
        finite &= torch.isfinite(logits).all()
        return sample_next(penalized(logits), temperature, top_k, top_p, generator, min_p)

    def probs(logits: torch.Tensor) -> torch.Tensor:
        return truncate(logits.float() / temperature, top_k, top_p, min_p).softmax(dim=-1)

    def drafts_left() -> bool:  # a draft is worth computing while two or more tokens are still to come
        return max_new_tokens - len(rows.tokens) >= 2

    with torch.inference_mode():
        h = dec.hidden(model.embed(input_ids), dec.layers, dec.cache)
        stats.forwards += 1
        last = rows.emit(pick(dec.logits(h[:, -1])))
        if drafts_left():
            draft_logits = draft.extend(h, torch.cat([input_ids[:, 1:], last[:, None]], dim=1))
        while len(rows.tokens) < max_new_tokens and not rows.done():
            active = ~rows.finished
            if len(rows.tokens) == max_new_tokens - 1:  # one token left: a plain step
                h = dec.hidden(model.embed(last[:, None]), dec.layers, dec.cache)
                stats.forwards += 1
                last = rows.emit(pick(dec.logits(h[:, -1])))
                break
            finite &= torch.isfinite(draft_logits).all()  # a broken depth must not pick tokens
            draft_logits = penalized(draft_logits)  # (the draft's position is the verified one's below)
            if temperature == 0:
                d = draft_logits.argmax(dim=-1)
            else:
                q = probs(draft_logits)
                d = multinomial_one(q, generator)
            h = dec.hidden(model.embed(torch.stack([last, d], dim=1)), dec.layers, dec.cache)
            logits = dec.logits(h[:, 0])
            finite &= torch.isfinite(logits).all()
            logits = penalized(logits)
            if temperature == 0:
                nxt = logits.argmax(dim=-1)
                stood = nxt == d
            else:
                p = probs(logits)
                pd, qd = p.gather(1, d[:, None])[:, 0], q.gather(1, d[:, None])[:, 0]
                u = torch.rand(B, generator=generator, device=device)
                stood = u * qd < pd
                residual = (p - q).clamp_(min=0)
                residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # stood rows: unused
                nxt = torch.where(stood, d, multinomial_one(residual, generator))
            stats.steps += 1
            stats.forwards += 1
            stats.row_drafts += int(active.sum())
            stats.row_accepted += int((stood & active).sum())
            if bool((stood | ~active).all()):
                stats.accepted += 1
                first = rows.emit(d)
                if rows.done():  # every row stopped at the first token: plain decoding ends here too
                    break
                last = rows.emit(pick(dec.logits(h[:, 1])))
                if drafts_left():
                    draft_logits = draft.extend(h, torch.stack([first, last], dim=1))
            else:
                dec.cache.pos -= 1  # position P + 1 held the draft
                last = rows.emit(nxt)
                if drafts_left():
                    draft_logits = draft.extend(h[:, :1], last[:, None])
    stats.new_tokens = len(rows.tokens)
    if not bool(finite):
        raise ValueError("generate: the model's logits are not finite (NaN or inf)")
    return torch.cat([input_ids, torch.stack(rows.tokens, dim=1)], dim=1), stats
