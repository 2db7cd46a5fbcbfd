"""Reward functions the GRPO tests name with --reward_fn (importable from the repository root)."""
from __future__ import annotations


def vowels(prompt, completion, record):
    """Share of the completion's characters that are vowels: varies between completions, so advantages do too."""
    return sum(c in "aeiou" for c in completion) / max(1, len(completion))


def broken(prompt, completion, record):
    raise ZeroDivisionError("no score for " + record.get("prompt", "?"))


def trl_vowels(completions, **kwargs):
    """`vowels` written for TRL's GRPOTrainer: all of a prompt's completions at once (strings, or a chat prompt's
    [{"role": "assistant", "content": ...}])."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [vowels(None, t, None) for t in texts]


def trl_odd_only(prompts, completions, **kwargs):
    """A TRL-style reward of one task among several: `trl_vowels` for prompts whose first number is odd, None (not
    applicable) for the others."""
    return [v if int(str(p).split()[0]) % 2 else None for p, v in zip(prompts, trl_vowels(completions))]
