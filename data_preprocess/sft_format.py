"""Conversation records -> chat messages -> (ids, labels), shared by SFT and DPO.

Owns: the accepted record shapes and their mapping to `[{"role", "content"}]` messages,
turning `encode_chat`'s assistant mask into labels (ids where assistant, else -100), and the
over-long policy. The chat template itself belongs to `tokenizer.chat.encode_chat`.

Record shapes:
  instruction: {"instruction", "input"?, "output", "system"?}
      -> user = instruction + "\\n" + input (input non-empty), assistant = output
  multi-turn:  {"conversations" | "messages": [{"role"|"from": ..., "content"|"value": ...}], "system"?}
      roles human->user, gpt->assistant (user/assistant/system kept)
  DPO:         {"prompt": str | "conversations": [...], "chosen": str|message, "rejected": str|message, "system"?}

Text holding a lone surrogate (a JSON "\\ud800" escape; it cannot be encoded) is a RecordError,
so it is a counted skip with file:line like any other bad record.

Must never: store labels in an unsigned dtype (-100 must survive; known trap 2), or label a
token that is not assistant content / its <|im_end|>.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from data_preprocess.readers import lone_surrogate
from utils.constants import IGNORE_INDEX

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "system": "system", "bot": "assistant"}


class RecordError(ValueError):
    """A record that does not fit the documented shapes; the message is the skip reason."""


def _encodable(text: str, what: str) -> str:
    if lone_surrogate(text) is not None:
        raise RecordError(f"invalid Unicode: lone surrogate in {what}")
    return text


def _str(rec: dict, key: str, required: bool = True) -> Optional[str]:
    v = rec.get(key)
    if v is None:
        if required:
            raise RecordError(f"missing field '{key}'")
        return None
    if not isinstance(v, str):
        raise RecordError(f"field '{key}' is {type(v).__name__}, not a string")
    return _encodable(v, f"'{key}'")


def _messages_from_list(turns: Any) -> list[dict[str, str]]:
    if not isinstance(turns, list) or not turns:
        raise RecordError("'conversations' must be a non-empty list")
    out = []
    for t in turns:
        if not isinstance(t, dict):
            raise RecordError("a conversation turn is not an object")
        role = t.get("role", t.get("from"))
        content = t.get("content", t.get("value"))
        if not isinstance(role, str) or role.lower() not in ROLE_MAP:
            raise RecordError(f"unknown role {role!r}")
        if not isinstance(content, str):
            raise RecordError(f"turn content is {type(content).__name__}, not a string")
        _encodable(content, "a conversation turn")
        out.append({"role": ROLE_MAP[role.lower()], "content": content})
    return out


def _with_system(rec: dict, msgs: list[dict[str, str]]) -> list[dict[str, str]]:
    system = _str(rec, "system", required=False)
    if system and not (msgs and msgs[0]["role"] == "system"):
        msgs = [{"role": "system", "content": system}] + msgs
    return msgs


def sft_messages(rec: Any) -> list[dict[str, str]]:
    """Messages of an SFT record; RecordError when the shape is wrong or nothing is learnable."""
    if not isinstance(rec, dict):
        raise RecordError("record is not an object")
    if "conversations" in rec or "messages" in rec:
        msgs = _messages_from_list(rec.get("conversations", rec.get("messages")))
    elif "instruction" in rec or "output" in rec:
        instruction, output = _str(rec, "instruction"), _str(rec, "output")
        inp = _str(rec, "input", required=False)
        user = instruction + "\n" + inp if inp else instruction
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    else:
        raise RecordError("neither 'conversations' nor 'instruction'/'output'")
    msgs = _with_system(rec, msgs)
    if not any(m["role"] == "assistant" and m["content"] for m in msgs):
        raise RecordError("no non-empty assistant turn")
    return msgs


def dpo_messages(rec: Any) -> tuple[list[dict[str, str]], str, str]:
    """(prompt messages, chosen reply, rejected reply) of a DPO record."""
    if not isinstance(rec, dict):
        raise RecordError("record is not an object")
    if "conversations" in rec:
        prompt = _messages_from_list(rec["conversations"])
    else:
        prompt = [{"role": "user", "content": _str(rec, "prompt")}]
    prompt = _with_system(rec, prompt)

    def reply(key: str) -> str:
        v = rec.get(key)
        if isinstance(v, list) and v:
            v = v[-1]
        if isinstance(v, dict):
            v = v.get("content", v.get("value"))
        if not isinstance(v, str) or not v:
            raise RecordError(f"'{key}' must be a non-empty string (or assistant message)")
        return _encodable(v, f"'{key}'")

    return prompt, reply("chosen"), reply("rejected")


def labels_from_mask(ids: list[int] | np.ndarray, mask: list[bool] | np.ndarray) -> np.ndarray:
    ids = np.asarray(ids, dtype=np.int64)
    mask = np.asarray(mask, dtype=bool)
    if ids.shape != mask.shape:
        raise ValueError(f"encode_chat returned {ids.size} ids but a mask of {mask.size}")
    return np.where(mask, ids, IGNORE_INDEX).astype(np.int32)


def last_run_only(mask: np.ndarray) -> np.ndarray:
    """Keep only the last contiguous run of True: the final assistant reply (DPO)."""
    mask = np.asarray(mask, dtype=bool).copy()
    idx = np.flatnonzero(mask)
    if idx.size:
        end = idx[-1]
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        mask[:start] = False
    return mask


def apply_overlong(ids: np.ndarray, labels: np.ndarray, max_seq_len: int,
                   policy: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """A sample feeds len-1 positions to the model, so it may hold max_seq_len+1 tokens.

    "truncate": keep the first max_seq_len+1 tokens (None if no target token survives);
    "drop": None for any over-long sample."""
    if policy not in ("truncate", "drop"):
        raise ValueError(f"overlong policy must be 'truncate' or 'drop', got {policy!r}")
    limit = max_seq_len + 1
    if ids.size > limit:
        if policy == "drop":
            return None
        ids, labels = ids[:limit], labels[:limit]
    if not (labels[1:] != IGNORE_INDEX).any():  # position 0 is never a target after the shift
        return None
    return ids, labels


def make_chat_encoder(tokenizer_dir: str) -> tuple[Callable[[list[dict]], tuple[Any, Any]], dict]:
    """(encode(messages) -> (ids, assistant_mask), tokenizer meta) for a tokenizer directory."""
    from tokenizer import load_tokenizer, load_tokenizer_meta
    from tokenizer.chat import encode_chat
    tok = load_tokenizer(tokenizer_dir)
    meta = load_tokenizer_meta(tokenizer_dir)
    return (lambda msgs: encode_chat(tok, msgs)), meta
