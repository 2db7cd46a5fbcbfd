"""Tool-calling conversations (function calling) in SFT records: OpenAI's fine-tuning shape and transformers'.

A record may offer the model tools (`"tools"`: function schemas, a list or a JSON text of one, as OpenAI's files and
the Hub's tool-calling sets store them); an assistant turn may call them (`"tool_calls"`, its content then optional)
and a `"tool"` turn answers a call (its content the result; `"name"` / `"tool_call_id"` kept). Calls are normalised to
what chat templates read (transformers' shape): `{"type": "function", "function": {"name", "arguments": {...}}}`, the
arguments an object (OpenAI's JSON text of one is parsed), an `"id"` kept. The tokenizer's own chat template renders
them (Qwen2.5 / Qwen3 / Llama 3.1 write their tool formats); the learned tokens of a calling turn are what the model
writes after the generation prompt, its calls included (tokenizer/chat_template.py).

Owns: those shapes and their checks. Every problem is a ValueError naming it (the SFT reader's counted skip).
"""
from __future__ import annotations

import json
from typing import Any, Optional


def tool_calls(turn: dict) -> Optional[list[dict]]:
    """A turn's `tool_calls` normalised (None when it has none)."""
    calls = turn.get("tool_calls")
    if calls is None or calls == []:
        return None
    if not isinstance(calls, list):
        raise ValueError(f"'tool_calls' is {type(calls).__name__}, not a list")
    return [_call(c) for c in calls]


def _call(call: Any) -> dict:
    if not isinstance(call, dict):
        raise ValueError("a tool call is not an object")
    fn = call.get("function", call)  # (transformers also takes {"name", "arguments"} without the wrapper)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError("a tool call has no function name")
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI's: a JSON text of the arguments
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(f"tool call {fn['name']!r}: 'arguments' is not JSON") from None
    if not isinstance(args, dict):
        raise ValueError(f"tool call {fn['name']!r}: 'arguments' must be an object (or a JSON text of one)")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def tools(rec: dict) -> Optional[list[dict]]:
    """A record's `tools` (function schemas offered to the model), checked; None when it has none."""
    value = rec.get("tools")
    if isinstance(value, str):  # (tool-calling sets on the Hub often store the schemas as a JSON text)
        try:
            value = json.loads(value) if value.strip() else None
        except ValueError:
            raise ValueError("'tools' is a text that is not JSON") from None
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ValueError("'tools' must be a list of function schemas (objects)")
    return value


def tool_turn_fields(turn: dict) -> dict:
    """The fields a tool result keeps beside its content (`name`, `tool_call_id`: templates read them)."""
    return {k: turn[k] for k in ("name", "tool_call_id") if isinstance(turn.get(k), str)}
