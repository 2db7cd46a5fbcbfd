"""Autoregressive generation with a KV cache.

Owns: `generate(...)` and the token-sampling rule (greedy, temperature, top-k, top-p, stop ids).
With use_cache=False every step re-runs the whole sequence: the slow reference that the KV-cache path
must equal (greedy, and sampled under a fixed seed, since both draw the same random numbers).

Must never: change the model's train/eval mode permanently, or track gradients.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from model.llama import KVCache, Transformer


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits [B, V] -> next ids [B]. temperature == 0 is greedy (argmax)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # drop a token when the tokens ranked before it already hold top_p of the mass (keeps >= 1)
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)


@torch.no_grad()
def generate(model: Transformer, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: Optional[int] = None, top_p: Optional[float] = None,
             stop_ids: Optional[Iterable[int]] = None, use_cache: bool = True,
             generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Continue a batch of equal-length prompts [B, T]; returns [B, T + n] with n <= max_new_tokens.

    A row that emits one of `stop_ids` is finished: its later positions repeat that stop id. Generation
    ends early once every row has finished.
    """
    was_training = model.training
    model.eval()
    try:
        B, T = input_ids.shape
        device = input_ids.device
        stops = torch.tensor(sorted(set(stop_ids or [])), dtype=torch.long, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        fill = torch.zeros(B, dtype=torch.long, device=device)
        out = input_ids
        cache = None
        if use_cache:
            dtype = model.embed_tokens.weight.dtype
            if torch.is_autocast_enabled(device.type):
                dtype = torch.get_autocast_dtype(device.type)
            cache = KVCache(model.cfg, B, T + max_new_tokens, device, dtype)
        step_input = input_ids
        for _ in range(max_new_tokens):
            if use_cache:
                logits = model(step_input, cache=cache, logits_to_keep=1)[:, -1]
            else:
                logits = model(out, logits_to_keep=1)[:, -1]
            nxt = sample_next(logits, temperature, top_k, top_p, generator)
            nxt = torch.where(finished, fill, nxt)
            if stops.numel():
                hit = torch.isin(nxt, stops) & ~finished
                fill = torch.where(hit, nxt, fill)
                finished = finished | hit
            out = torch.cat((out, nxt[:, None]), dim=1)
            step_input = nxt[:, None]
            if stops.numel() and bool(finished.all()):
                break
        return out
    finally:
        model.train(was_training)
