"""GRPO with tools (--tools): the policy calls Python functions during its rollouts and reads their results before
it answers, TRL's GRPOTrainer `tools`. A completion is then a transcript: the model's turns, each closed by its stop
id, and between them the results fed back (the template's tool turn and the next generation prompt), which are context:
never trained on, log-probability 0, all of it within --max_completion_length.

Owns: `load_tools` (--tools' functions imported once, each with the JSON schema transformers' get_json_schema writes
from its signature and docstring, what apply_chat_template(tools=[fn]) offers), `call_format` and `parse_calls` (a
turn's calls: <tool_call> JSON blocks, the Qwen2.5 / Qwen3 / Hermes format our ChatML writes, or Llama 3.1's one JSON
object with "parameters"), `ToolRunner` (one rollout call's tool use: grpo_rollout's turn_end, each row's transcript as
messages).
Must never: let a tool's failure stop the run (its error is the result the model reads, counted), feed a result that
does not fit in what is left of the completion (the row then ends at its call, TRL's rule), or import torch.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from trainer.tasks.grpo_rewards import load_reward_fn


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
CALL_MARK = "<tool_call>"


class ToolsError(ValueError):
    """--tools cannot be used (not importable, no schema, a template that writes calls otherwise): the trainer's one
    line, exit 2 (trainer/tasks/grpo.py)."""


@dataclass
class Tool:
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


def load_tools(spec: str) -> dict[str, Tool]:
    """name -> Tool for --tools' comma-separated module:function items (ToolsError naming the item otherwise)."""
    from transformers.utils import get_json_schema
    out: dict[str, Tool] = {}
    for item in [s.strip() for s in str(spec).split(",") if s.strip()]:
        try:
            fn = load_reward_fn(item, "--tools")
        except ValueError as e:
            raise ToolsError(str(e)) from None
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers' own exception types vary by release
            raise ToolsError(f"--tools {item!r}: no JSON schema from its signature and docstring ({e}); every argument "
                             "needs a type hint and a line in the docstring's Args: section") from None
        fname = schema["function"]["name"]
        if fname in out:
            raise ToolsError(f"--tools: two functions named {fname!r}")
        out[fname] = Tool(fn, schema)
    if not out:
        raise ToolsError("--tools: no module:function given")
    return out


def call_format(tok: Any) -> str:
    """How the tokenizer's chat template writes a call: "hermes" (<tool_call> JSON blocks: Qwen2.5, Qwen3, Hermes, our
    ChatML) or "llama" (Llama 3.1 / 3.2's one JSON object {"name", "parameters"} as the turn, results in an ipython
    turn); ToolsError for any other."""
    source = str(getattr(tok, "chat_template", "") or "")
    if CALL_MARK in source:
        return "hermes"
    if '"parameters": ' in source and "ipython" in source:
        return "llama"
    raise ToolsError("--tools: this tokenizer's chat template writes tool calls neither as <tool_call> JSON blocks "
                     "(Qwen2.5 / Qwen3 / Hermes, our own ChatML) nor as Llama 3.1's JSON turn; rollouts with tools "
                     "read those formats only")


def _call(obj: Any, args_key: str) -> Optional[dict]:
    """transformers' call shape of one parsed JSON call, None when it is not {"name": str, args_key: object (or a
    JSON text of one)}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"type": "function", "function": {"name": obj["name"], "arguments": args}}


def parse_calls(text: str, fmt: str = "hermes") -> tuple[str, list[dict], Optional[str]]:
    """(content, calls, problem) of a turn's text. hermes: the text before its first <tool_call> block, and each
    block's JSON {"name": str, "arguments": object}; llama: a turn that is one JSON object {"name": str, "parameters":
    object} (after an optional <|python_tag|>) is one call with no content, any other turn an answer. A malformed
    block makes the turn's problem (its calls are then not run: the turn is an answer, as TRL parses it)."""
    if fmt == "llama":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, [], None
        try:
            call = _call(json.loads(body), "parameters")
        except ValueError:
            return text, [], "a JSON call that does not parse"
        return ("", [call], None) if call else (text, [], 'a JSON call that is not {"name": str, "parameters": object}')
    blocks = list(_CALL.finditer(text))
    if not blocks:
        return text, [], ("an unclosed <tool_call> block" if CALL_MARK in text else None)
    calls = []
    for m in blocks:
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except ValueError:
            return text, [], "a <tool_call> block that is not JSON"
        if call is None:
            return text, [], 'a <tool_call> block that is not {"name": str, "arguments": object}'
        calls.append(call)
    return text[:blocks[0].start()].strip(), calls, None


def run_call(tools: dict[str, Tool], offered: Sequence[str], call: dict) -> tuple[str, bool]:
    """(the result's text, whether the call failed): the function's return value (a string as is, anything else as
    JSON), or {"error": ...} when the tool is not offered, its arguments do not fit or it raised."""
    fn = call["function"]
    name = fn["name"]
    if name not in offered:
        return json.dumps({"error": f"no tool named {name!r}"}, ensure_ascii=False), True
    try:
        out = tools[name].fn(**fn["arguments"])
    except Exception as e:  # noqa: BLE001 - the model reads the failure, as TRL feeds it back
        return json.dumps({"error": f"{type(e).__name__}: {e}"}, ensure_ascii=False), True
    if isinstance(out, str):
        return out, False
    try:
        return json.dumps(out, ensure_ascii=False), False
    except (TypeError, ValueError):
        return str(out), False


@dataclass
class Transcript:
    """One rollout row's tool use so far: its messages (each calling turn, then its results), the completion tokens
    they take (turns and fed results), the calls run and how many failed."""
    messages: list = field(default_factory=list)
    consumed: int = 0
    calls: int = 0
    failures: int = 0


class ToolRunner:
    """One rollout call's tool use. `turn_end` (grpo_rollout.sample_groups') runs the calls of a row's turn and
    returns the ids that follow its stop id: the template's tool turn holding the results and the next generation
    prompt, cut from a render of [user, the calling turn, the results] after the calling turn's closing stop id (as
    TRL cuts them; the results are never re-tokenized with what the model wrote)."""

    def __init__(self, tok: Any, tools: dict[str, Tool], offered: Sequence[Sequence[dict]], stop_ids: Sequence[int],
                 template_kwargs: Optional[dict] = None, max_rounds: int = 0) -> None:
        self.tok, self.tools, self.stop_ids = tok, tools, set(int(s) for s in stop_ids)
        self.format = call_format(tok)
        self.offered = [[s["function"]["name"] for s in schemas] for schemas in offered]
        self.schemas = list(offered)
        self.kwargs = dict(template_kwargs or {})
        self.max_rounds = int(max_rounds)
        self.rows: dict[tuple[int, int], Transcript] = {}

    def text(self, ids: Sequence[int], raw: bool = False) -> str:
        """A turn's text, its stop ids left out: as the rewards read it (special tokens skipped), or `raw` (kept: a
        tokenizer may hold <tool_call> as one)."""
        return self.tok.decode([t for t in ids if t not in self.stop_ids], skip_special_tokens=not raw)

    def turn_end(self, k: int, j: int, turn: list, room: int) -> Optional[list[int]]:
        row = self.rows.setdefault((k, j), Transcript())
        content, calls, problem = parse_calls(self.text(turn, raw=True), self.format)
        if problem or not calls or (self.max_rounds and self._rounds(row) >= self.max_rounds):
            return None
        results = [run_call(self.tools, self.offered[k], c) for c in calls]
        said = {"role": "assistant", "content": content, "tool_calls": calls}
        fed = [{"role": "tool", "name": c["function"]["name"], "content": r} for c, (r, _) in zip(calls, results)]
        try:
            ids = self.results_ids(said, fed, k)
        except ValueError:  # (a call the template refuses, e.g. holding a control token's text: the row ends)
            return None
        if len(ids) >= room:  # no room for the results and a token after them: the row ends at its call (TRL)
            return None
        row.messages += [said, *fed]
        row.consumed += len(turn) + len(ids)
        row.calls += len(calls)
        row.failures += sum(failed for _, failed in results)
        return ids

    @staticmethod
    def _rounds(row: Transcript) -> int:
        return sum(1 for m in row.messages if m["role"] == "assistant")

    def results_ids(self, said: dict, fed: list, k: int = 0) -> list[int]:
        """The ids after a calling turn's stop id: its results' turn and the next generation prompt."""
        from tokenizer import encode_chat
        kwargs = {**self.kwargs, "tools": self.schemas[k]} if self.schemas[k] else self.kwargs
        head = [{"role": "user", "content": "."}, said]
        before = encode_chat(self.tok, head, train_roles=(), template_kwargs=kwargs)[0]  # (ids only: no turn's mask)
        after = encode_chat(self.tok, head + fed, add_generation_prompt=True, train_roles=(), template_kwargs=kwargs)[0]
        # the calling turn closes at the n-th stop id of both renders (the last of `before`): a template may write
        # the turn itself otherwise once results follow (Qwen3 drops an empty reasoning block), never its end
        n = sum(1 for t in before if t in self.stop_ids)
        ends = [i for i, t in enumerate(after) if t in self.stop_ids]
        if n == 0 or len(ends) < n:
            raise ValueError("the chat template does not close a calling turn with a stop id")
        return list(after[ends[n - 1] + 1:])

    def finish(self, k: int, j: int, ids: Sequence[int]) -> tuple[str, list, Transcript]:
        """(the last turn's text, the transcript's messages, its counts) of row j of prompt k, whose completion
        tokens are `ids` (through its last sampled one)."""
        row = self.rows.get((k, j), Transcript())
        last = self.text(ids[row.consumed:])
        content, calls, _ = parse_calls(self.text(ids[row.consumed:], raw=True), self.format)
        final = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        return last, row.messages + [final], row
