"""GRPO's rewards: the built-in verifiable ones (exact match after a marker, numeric match with a tolerance, a format
regex), DAPO's soft length penalty, a user's own `module:function` (ours, or one written for TRL's GRPOTrainer), a
reward model's score (--reward_model), and their weighted sum.

Owns: `build_rewards` (the flags' functions, imported and checked once at the start), `RewardSet.score_many` (every
function on a prompt's completions, each value checked), `RewardError` (a reward that raised or gave a non-number:
one line naming the function and the record, exit 3 as bad data).
Must never: turn a failing reward into a silent 0, or import torch (rewards are host Python on decoded text).
"""
from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from trainer.tasks.grpo_flags import BUILTIN_REWARDS, MODEL_REWARD, needs_answer, reward_specs
from utils.constants import EXIT_BAD_DATA

_NUMBER = re.compile(r"[-+]?(?:\d+(?:[.,]\d+)*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


class RewardError(ValueError):
    """A reward function failed on a record; the message names both."""
    exit_code, exit_prefix = EXIT_BAD_DATA, "data: "


def after_marker(completion: str, marker: str) -> Optional[str]:
    """The text after the last `marker` (stripped), the whole completion when the marker is empty, None when absent."""
    if not marker:
        return completion.strip()
    i = completion.rfind(marker)
    return None if i < 0 else completion[i + len(marker):].strip()


def first_number(text: Optional[str]) -> Optional[float]:
    """The first number in `text` (thousands commas allowed: "1,234" is 1234), None when there is none."""
    if text is None:
        return None
    m = _NUMBER.search(text)
    if m is None:
        return None
    try:
        return float(m.group(0).replace(",", ""))
    except ValueError:
        return None


def exact_match(completion: str, answer: str, marker: str) -> float:
    got = after_marker(completion, marker)
    if got is None:
        return 0.0
    got = got.splitlines()[0].strip() if got else got
    return 1.0 if got == str(answer).strip() else 0.0


def numeric_match(completion: str, answer: Any, marker: str, tolerance: float) -> float:
    got = first_number(after_marker(completion, marker))
    want = answer if isinstance(answer, numbers.Real) else first_number(str(answer))
    if got is None or want is None:
        return 0.0
    return 1.0 if abs(got - float(want)) <= tolerance * max(1.0, abs(float(want))) else 0.0


def format_reward(completion: str, pattern: "re.Pattern") -> float:
    return 1.0 if pattern.fullmatch(completion) else 0.0


def load_reward_fn(spec: str, flag: str = "--reward_fn / --reward_funcs") -> Callable:
    """`module:function` imported (ValueError naming `flag` and it when it cannot be; --tools' functions too)."""
    module, _, name = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{flag} {spec!r}: cannot import it ({type(e).__name__}: {e})") from e
    if not callable(fn):
        raise ValueError(f"{flag} {spec!r}: {type(fn).__name__}, not a function")
    return fn


@dataclass
class SoftOverlong:
    """DAPO's soft overlong punishment (Yu et al. 2025; TRL's get_soft_overlong_punishment): a completion of L tokens
    (through its stop token) scores 0 while L <= max_len - cache, (max_len - cache - L) / cache above that (-1 at
    max_len), and -1 past it."""
    max_len: int
    cache: int

    def value(self, length: int) -> float:
        free = self.max_len - self.cache
        if length <= free:
            return 0.0
        return (free - length) / self.cache if length <= self.max_len else -1.0

    def many(self, prompt: str, completions: Sequence[str], record: dict, prompt_ids: Sequence[int],
             completion_ids: Sequence[Sequence[int]]) -> list[float]:
        return [self.value(len(ids)) for ids in completion_ids]


@dataclass
class TRLReward:
    """A reward function written for TRL's GRPOTrainer (a parameter named `completions`): called once for a prompt's
    G completions as fn(prompts=[...] * G, completions=[...], completion_ids=[...], <each other field of the record>=
    [value] * G), returning G numbers. A chat prompt (the record's --messages_field) comes as its messages and each
    completion as [{"role": "assistant", "content": text}], TRL's conversational shapes (with --tools its transcript:
    each calling turn with its tool_calls, the tool results, the last turn); a plain prompt and the completions as
    strings. A function without **kwargs gets only the arguments it names."""
    fn: Callable
    messages_field: str
    prompt_field: str

    def __post_init__(self) -> None:  # the arguments it takes: read once, not per prompt
        params = inspect.signature(self.fn).parameters
        self.named = (None if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
                      else frozenset(params))  # None: it takes **kwargs, so every argument

    def many(self, prompt: str, completions: Sequence[str], record: dict, prompt_ids: Sequence[int],
             completion_ids: Sequence[Sequence[int]], messages: Optional[Sequence[list]] = None) -> list:
        g = len(completions)
        shown = record.get(self.messages_field)
        if shown is None:
            shown = record.get(self.prompt_field, prompt)
        chat = isinstance(shown, list)  # (a chat prompt's messages: --messages_field, or TRL's "prompt" list)
        kwargs = {"prompts": [shown] * g, "completion_ids": [list(ids) for ids in completion_ids],
                  "completions": ([list(m) for m in messages] if messages is not None else
                                  [[{"role": "assistant", "content": c}] for c in completions]) if chat
                  else list(completions)}
        skip = {self.messages_field, self.prompt_field, "completion", *kwargs}
        kwargs.update({k: [v] * g for k, v in record.items() if k not in skip})
        if self.named is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.named}
        out = self.fn(**kwargs)
        if not isinstance(out, (list, tuple)) or len(out) != g:
            raise ValueError(f"a TRL-style reward returns one number per completion: {g} expected, got "
                             f"{type(out).__name__}{f' of {len(out)}' if isinstance(out, (list, tuple)) else ''}")
        return list(out)


def is_trl_reward(fn: Callable) -> bool:
    """Whether `fn` takes TRL's batched arguments (a parameter named `completions`) rather than ours (prompt,
    completion, record)."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class RewardSet:
    """The run's reward functions in order, with their weights. A function is fn(prompt, completion, record, answer)
    on decoded text, or an object with `many(prompt, completions, record, prompt_ids, completion_ids) -> [value]`
    scoring a prompt's completions together (--reward_model: trainer/tasks/grpo_reward_model.py)."""
    names: list
    weights: list
    fns: list
    needs_answer: bool

    def score_many(self, prompt: str, completions: Sequence[str], record: dict, answer: Any, where: str,
                   prompt_ids: Sequence[int] = (), completion_ids: Sequence[Sequence[int]] = (),
                   messages: Optional[Sequence[list]] = None) -> list[list[float]]:
        """Each function's value on each of a prompt's completions (text, and token ids through the stop token for a
        model's reward); a user function's None ("not applicable" to this completion, TRL's convention for rewards of
        one task among several) is NaN here and left out of the total and of that function's mean; RewardError
        naming the function and `where` (file:line of the record) when one raises or returns anything else but a
        finite real number. `messages` (--tools): each completion's transcript, for the functions written for TRL
        (the others read the text of the last turn, `completions`)."""
        out: list[list[float]] = [[] for _ in completions]
        for name, fn in zip(self.names, self.fns):
            try:
                if isinstance(fn, TRLReward):
                    values = fn.many(prompt, completions, record, prompt_ids, completion_ids, messages)
                elif hasattr(fn, "many"):
                    values = list(fn.many(prompt, completions, record, prompt_ids, completion_ids))
                else:
                    values = [fn(prompt, c, record, answer) for c in completions]
            except Exception as e:  # noqa: BLE001 - any failure of the user's code is reported, never a silent 0
                msg = " ".join(str(e).split())[:200]
                raise RewardError(f"reward {name} raised {type(e).__name__} ({msg}) on the record at {where}") from e
            for row, v in zip(out, values):
                if v is None and name not in BUILTIN_REWARDS:  # "not applicable" (TRL's None): left out, as NaN
                    row.append(math.nan)
                    continue
                if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                    raise RewardError(f"reward {name} returned {v!r:.80} ({type(v).__name__}), not a finite number, "
                                      f"on the record at {where}")
                row.append(float(v))
        return out

    def total(self, values: list[float]) -> float:
        """The weighted sum of a completion's values, those not applicable (NaN) left out (TRL's nansum)."""
        return sum(w * v for w, v in zip(self.weights, values) if v == v)


def build_rewards(cfg: Any, model_reward: Any = None) -> RewardSet:
    """The functions --reward_funcs / --reward_fn / --reward_model / --reward_weights name (ValueError naming a flag
    otherwise); `model_reward`: --reward_model's scorer, loaded by the caller (it needs torch and the device)."""
    names, weights, fns = [], [], []
    marker, tol = cfg.answer_marker, float(cfg.numeric_tolerance)
    for spec, w in reward_specs(cfg):
        if spec == "exact_match":
            fn = lambda p, c, r, a: exact_match(c, a, marker)  # noqa: E731
        elif spec == "numeric_match":
            fn = lambda p, c, r, a: numeric_match(c, a, marker, tol)  # noqa: E731
        elif spec == "format":
            pattern = re.compile(cfg.format_regex)
            fn = lambda p, c, r, a, pattern=pattern: format_reward(c, pattern)  # noqa: E731
        elif spec == "soft_overlong":
            fn = SoftOverlong(int(cfg.max_completion_length), int(cfg.soft_punish_cache))
        elif spec == MODEL_REWARD:
            if model_reward is None:
                raise ValueError("--reward_model: its scorer was not loaded")
            fn = model_reward
        else:
            user = load_reward_fn(spec)
            if is_trl_reward(user):
                fn = TRLReward(user, cfg.messages_field, cfg.prompt_field)
            else:
                fn = lambda p, c, r, a, user=user: user(prompt=p, completion=c, record=r)  # noqa: E731
        names.append(spec if spec in BUILTIN_REWARDS or spec == MODEL_REWARD else spec.replace(":", "."))
        weights.append(float(w))
        fns.append(fn)
    return RewardSet(names, weights, fns, needs_answer(cfg))
