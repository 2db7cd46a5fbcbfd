"""Conversation records -> chat messages -> (ids, labels), shared by SFT and DPO.

Owns: the accepted record shapes and their mapping to `[{"role", "content"}]` messages,
turning `encode_chat`'s assistant mask into labels (ids where assistant, else -100), and the
over-long policy. The chat template itself belongs to `tokenizer.chat.encode_chat`.

Record shapes:
  instruction: {"instruction", "input"?, "output", "system"?}
      -> user = instruction + "\\n" + input (input non-empty), assistant = output
  multi-turn:  {"conversations" | "messages": [{"role"|"from": ..., "content"|"value": ...}], "system"?, "tools"?}
      roles human->user, gpt->assistant (user/assistant/system/tool kept); a turn's "weight": 0 (OpenAI's) keeps an
      assistant turn as context; "tool_calls" / "tools": sft_tools.py
  DPO:         {"prompt": str | "conversations": [...], "chosen": str|message, "rejected": str|message, "system"?}

Text holding a lone surrogate (a JSON "\\ud800" escape; it cannot be encoded) is a RecordError,
so it is a counted skip with file:line like any other bad record.

Also owns rendering conversations in order, in this process or in a pool of worker processes
(`ChatRenderer`, `encode_file_records`): records are read and checked here (skips keep their
file:line), rendered + tokenized in batches by the workers, and handed back in input order, so
the output does not depend on the number of workers. A worker exception is collected with the
file and lines it came from (`worker_tokenizer.FileFailed`), never lost.

Must never: store labels in an unsigned dtype (-100 must survive; known trap 2), or label a
token that is not assistant content / its <|im_end|>.
"""
from __future__ import annotations

import json
import math
import numbers
import os
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable, Iterator, Optional

import numpy as np

from data_preprocess import sft_tools
from data_preprocess.readers import SkipCounter, iter_records, lone_surrogate
from data_preprocess.worker_tokenizer import FileFailed, WorkerTokenizer, backend_json, chat_attrs, worker_result
from tokenizer.chat_template import Conversation
from utils.constants import EXIT_BAD_DATA, IGNORE_INDEX

ROLE_MAP = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
            "system": "system", "bot": "assistant", "tool": "tool"}


class RecordError(ValueError):
    """A record that does not fit the documented shapes; the message is the skip reason."""
    exit_code, exit_prefix = EXIT_BAD_DATA, "data: "  # as DataError (utils.errors.exit_code_for)


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
        role = ROLE_MAP[role.lower()]
        try:
            calls = sft_tools.tool_calls(t)
        except ValueError as e:
            raise RecordError(str(e)) from None
        if calls is not None and role != "assistant":
            raise RecordError(f"'tool_calls' on a {role} turn")
        if content is None and calls is not None:
            content = ""  # (a turn that only calls tools)
        if not isinstance(content, str):
            raise RecordError(f"turn content is {type(content).__name__}, not a string")
        _encodable(content, "a conversation turn")
        msg = {"role": role, "content": _with_reasoning(t, content)}
        if calls is not None:
            _encodable(json.dumps(calls, ensure_ascii=False), "'tool_calls'")
            msg["tool_calls"] = calls
        if role == "tool":
            msg.update(sft_tools.tool_turn_fields(t))
        if _weight(t, role) == 0:
            msg["weight"] = 0
        out.append(msg)
    return out


def _weight(turn: dict, role: str) -> int:
    """A turn's `weight` (OpenAI's fine-tuning format: 0 = this assistant turn is context, not learned; 1 or absent =
    learned), checked."""
    w = turn.get("weight")
    if w is None:
        return 1
    if type(w) is not int or w not in (0, 1):
        raise RecordError(f"turn 'weight' must be 0 or 1, got {w!r}")
    if role != "assistant":
        raise RecordError(f"'weight' on a {role} turn (only an assistant turn is learned or not)")
    return w


REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")  # a turn's reasoning, as transformers reads them


def _with_reasoning(turn: dict, content: str) -> str:
    """The content of a turn with a reasoning field (`reasoning_content`, ...: distilled reasoning data) as one
    `<think>\n{reasoning}\n</think>\n\n{content}` block, the text Qwen3's template writes for it; without one, the
    content."""
    field = next((f for f in REASONING_FIELDS if turn.get(f) is not None), None)
    if field is None:
        return content
    reasoning = turn[field]
    if not isinstance(reasoning, str):
        raise RecordError(f"turn '{field}' is {type(reasoning).__name__}, not a string")
    if "</think>" in content:
        raise RecordError(f"turn has '{field}' and a <think> block in its content: give the reasoning once")
    _encodable(reasoning, f"'{field}'")
    return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"


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
    elif "prompt" in rec and "completion" in rec:  # TRL's prompt-completion shape (texts, or lists of messages)
        msgs = _prompt_completion(rec)
    elif "instruction" in rec or "output" in rec:
        instruction, output = _str(rec, "instruction"), _str(rec, "output")
        inp = _str(rec, "input", required=False)
        user = instruction + "\n" + inp if inp else instruction
        msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    else:
        raise RecordError("neither 'conversations' nor 'instruction'/'output' nor 'prompt'/'completion'")
    msgs = _with_system(rec, msgs)
    if not any(m["role"] == "assistant" and (m["content"] or m.get("tool_calls")) and m.get("weight", 1)
               for m in msgs):
        raise RecordError("no non-empty assistant turn to learn (none, or each one has 'weight': 0)")
    return with_tools(rec, msgs)


def _prompt_completion(rec: dict) -> list[dict[str, str]]:
    """TRL's prompt-completion SFT record: "prompt" a text (one user turn) or messages, "completion" a text (the
    assistant's reply) or messages (the assistant's turns, continuing the conversation). As TRL's completion-only
    loss: the prompt's own assistant turns are context (weight 0), only the completion's are learned."""
    prompt, completion = rec["prompt"], rec["completion"]
    msgs = ([dict(m, weight=0) if m["role"] == "assistant" else m for m in _messages_from_list(prompt)]
            if isinstance(prompt, list) else [{"role": "user", "content": _str(rec, "prompt")}])
    if isinstance(completion, list):
        return msgs + _messages_from_list(completion)
    return msgs + [{"role": "assistant", "content": _str(rec, "completion")}]


def dpo_messages(rec: Any) -> tuple[list[dict[str, str]], dict[str, Any], dict[str, Any]]:
    """(prompt messages, chosen reply, rejected reply: assistant messages, tool calls kept) of a DPO record: an
    explicit prompt ("prompt" or "conversations"), or TRL's implicit one (chosen and rejected whole conversations or
    texts sharing it)."""
    if isinstance(rec, dict) and "prompt" not in rec and "conversations" not in rec and "chosen" in rec:
        return _implicit_prompt(rec)
    prompt = _prompt_messages(rec)
    return prompt, _reply(rec, "chosen"), _reply(rec, "rejected")


def _implicit_prompt(rec: dict) -> tuple[list[dict[str, str]], dict[str, Any], dict[str, Any]]:
    """TRL's implicit-prompt preference record (trl-lib/ultrafeedback_binarized, Anthropic's hh-rlhf): "chosen" and
    "rejected" each the whole conversation, prompt included. As message lists: their common first messages are the
    prompt and each one's last message, the assistant's, the reply (they must differ only there). As texts (TRL's
    extract_prompt): their common prefix is the prompt (a space before the first difference goes to the replies),
    one user turn."""
    chosen, rejected = rec.get("chosen"), rec.get("rejected")
    if isinstance(chosen, list) and isinstance(rejected, list):
        c, r = _messages_from_list(chosen), _messages_from_list(rejected)
        n = 0
        while n < min(len(c), len(r)) and c[n] == r[n]:
            n += 1
        if n == 0 or n != len(c) - 1 or n != len(r) - 1:
            raise RecordError("implicit prompt: 'chosen' and 'rejected' must share every message but their last "
                              "(the reply), or give 'prompt'")
        if any(m["role"] != "assistant" or not (m["content"] or m.get("tool_calls")) for m in (c[-1], r[-1])):
            raise RecordError("implicit prompt: the last message of 'chosen' and 'rejected' must be a non-empty "
                              "assistant reply")
        return _with_system(rec, c[:n]), _unweighted(c[-1]), _unweighted(r[-1])
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        if 0 < n < len(chosen) and chosen[n - 1] == " ":
            n -= 1
        if not chosen[:n].strip() or n >= len(chosen) or n >= len(rejected):
            raise RecordError("implicit prompt: 'chosen' and 'rejected' must share a prompt and then differ, or give "
                              "'prompt'")
        prompt = _encodable(chosen[:n], "'chosen'")
        return (_with_system(rec, [{"role": "user", "content": prompt}]),
                {"role": "assistant", "content": _encodable(chosen[n:], "'chosen'")},
                {"role": "assistant", "content": _encodable(rejected[n:], "'rejected'")})
    raise RecordError("missing field 'prompt' (or 'chosen' and 'rejected' both whole conversations or texts: an "
                      "implicit prompt)")


def _unweighted(message: dict) -> dict:
    return {k: v for k, v in message.items() if k != "weight"}


def dpo_margin(rec: dict) -> float:
    """A DPO record's optional "margin" (how much better chosen is than rejected: a reward model's loss is
    -log sigma(r_c - r_r - margin), Llama 2's and TRL's RewardTrainer's): a finite number, NaN where the record has
    none (absent, null, or NaN: pandas' missing value in a parquet column); RecordError for anything else."""
    v = rec.get("margin")
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return math.nan
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise RecordError("'margin' must be a finite number (or absent / null)")
    return float(v)


def _prompt_messages(rec: Any) -> list[dict[str, str]]:
    """The prompt of a DPO / KTO record: "conversations" or "prompt" as a list (turns), or "prompt" a string (one user
    turn), with its system."""
    if not isinstance(rec, dict):
        raise RecordError("record is not an object")
    if "conversations" in rec:
        prompt = _messages_from_list(rec["conversations"])
    elif isinstance(rec.get("prompt"), list):  # (TRL's conversational shape: the prompt's messages)
        prompt = _messages_from_list(rec["prompt"])
    else:
        prompt = [{"role": "user", "content": _str(rec, "prompt")}]
    return _with_system(rec, prompt)


def _reply(rec: dict, key: str) -> dict[str, Any]:
    """A record's reply field as the assistant's message: a string, an assistant message (its tool calls kept), or a
    list of messages ending with one."""
    v = rec.get(key)
    if isinstance(v, list) and v:
        v = v[-1]
    if isinstance(v, str) and v:
        return {"role": "assistant", "content": _encodable(v, f"'{key}'")}
    if isinstance(v, dict) and isinstance(v.get("content", v.get("value")), (str, type(None))):
        msg = _messages_from_list([{k: x for k, x in v.items() if k not in ("from", "weight")} | {"role": "assistant"}])
        if msg[0]["content"] or msg[0].get("tool_calls"):
            return msg[0]
    raise RecordError(f"'{key}' must be a non-empty string (or assistant message)")


def record_tools(rec: dict) -> Optional[list]:
    """A record's offered tools (function schemas: sft_tools.tools), or None; RecordError for bad ones."""
    try:
        offered = sft_tools.tools(rec)
    except ValueError as e:
        raise RecordError(str(e)) from None
    if offered is not None:
        _encodable(json.dumps(offered, ensure_ascii=False), "'tools'")
    return offered


def with_tools(rec: dict, messages: list) -> list:
    """`messages` as a Conversation offering the record's tools, where it has some."""
    offered = record_tools(rec)
    return messages if offered is None else Conversation(messages, tools=offered)


def kto_messages(rec: Any) -> tuple[list[dict[str, str]], dict[str, Any], bool]:
    """(prompt messages, the completion as the assistant's message, desirable) of a KTO record (TRL's unpaired
    preference shape: "prompt" or "conversations", "completion" a string or an assistant message, "label" a bool)."""
    prompt = _prompt_messages(rec)
    reply = _reply(rec, "completion")
    label = rec.get("label")
    if not isinstance(label, bool):
        raise RecordError(f"'label' must be true or false, got {label!r}")
    return prompt, reply, label


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
    from tokenizer.chat import check_chat, encode_chat
    tok = load_tokenizer(tokenizer_dir)
    meta = load_tokenizer_meta(tokenizer_dir)
    check_chat(tok)  # no template and no ChatML markers, or an unusable template: one line, exit 2, before any input
    return (lambda msgs: encode_chat(tok, msgs)), meta


# ----------------------------------------------------------------------------- rendering in order, in workers

BATCH_CONVERSATIONS = 64  # conversations per worker task: amortizes pickling, keeps memory per task small
Encode = Callable[[list[dict]], tuple[Any, Any]]
_WORKER_ENCODE: Optional[Encode] = None


def _init_chat_worker(backend: Optional[str], encode_fn: Optional[Encode], chat: Optional[dict] = None) -> None:
    """The parent's tokenizer backend as JSON (`backend`): no transformers/torch import here
    (seconds per worker), and `encode_chat` encodes exactly as on the parent's tokenizer."""
    global _WORKER_ENCODE
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism
    if encode_fn is not None:
        _WORKER_ENCODE = encode_fn
        return
    from tokenizer.chat import encode_chat
    tok = WorkerTokenizer(backend, chat)
    _WORKER_ENCODE = lambda msgs: encode_chat(tok, msgs)  # noqa: E731


def _encode_batch(convs: list[list[dict]], encode: Optional[Encode] = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat ids int64, flat assistant mask bool, lengths int64): three arrays pickle fast."""
    enc = encode or _WORKER_ENCODE
    assert enc is not None, "worker not initialized"
    ids_parts, mask_parts, lengths = [], [], []
    for msgs in convs:
        ids, mask = enc(msgs)
        ids, mask = np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool)
        if ids.shape != mask.shape:
            raise ValueError(f"encode_chat returned {ids.size} ids but a mask of {mask.size}")
        ids_parts.append(ids)
        mask_parts.append(mask)
        lengths.append(ids.size)
    cat = lambda parts, dt: np.concatenate(parts) if parts else np.empty(0, dt)  # noqa: E731
    return cat(ids_parts, np.int64), cat(mask_parts, bool), np.asarray(lengths, dtype=np.int64)


class ChatRenderer:
    """Renders + tokenizes batches of conversations: in this process (num_workers <= 1, or an
    `encode` callable given) or in `num_workers` worker processes. `submit` returns a Future;
    callers consume futures in submission order, so results never depend on the worker count.
    `encode_fn` (a picklable module-level function) replaces the tokenizer in the workers (tests)."""

    def __init__(self, tokenizer_dir: Optional[str] = None, num_workers: int = 1,
                 encode: Optional[Encode] = None, encode_fn: Optional[Encode] = None):
        self.num_workers = max(1, int(num_workers))
        self.max_pending = 2 * self.num_workers  # bounded: memory stays flat on huge files
        self._pool: Optional[ProcessPoolExecutor] = None
        self._encode: Optional[Encode] = None
        if encode is not None or self.num_workers == 1:
            self._encode = encode or encode_fn or make_chat_encoder(tokenizer_dir)[0]
        else:
            backend, chat = None, None
            if encode_fn is None:  # loaded once here; workers rebuild the backend from its JSON
                from tokenizer import load_tokenizer
                tok = load_tokenizer(tokenizer_dir)
                backend, chat = backend_json(tok), chat_attrs(tok)
            self._pool = ProcessPoolExecutor(max_workers=self.num_workers, initializer=_init_chat_worker,
                                             initargs=(backend, encode_fn, chat))

    def submit(self, convs: list[list[dict]]) -> Future:
        if self._pool is not None:
            return self._pool.submit(_encode_batch, convs)
        fut: Future = Future()
        try:
            fut.set_result(_encode_batch(convs, self._encode))
        except Exception as e:  # noqa: BLE001 - reported like a worker's exception
            fut.set_exception(e)
        return fut

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> "ChatRenderer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class TaggedConversations(list):
    """A record's conversations with integer tags the row keeps beside its token spans (KTO's desirable flag) and
    float values kept beside the rows (a DPO pair's margin; NaN where the record has none)."""

    def __init__(self, convs: list, tags: tuple[int, ...] = (), values: tuple[float, ...] = ()):
        super().__init__(convs)
        self.tags = tuple(int(t) for t in tags)
        self.values = tuple(float(v) for v in values)


def encode_file_records(path: str, skips: SkipCounter, to_convs: Callable[[Any], list[list[dict]]],
                        renderer: ChatRenderer) -> Iterator[tuple[str, int, list[tuple[np.ndarray, np.ndarray]],
                                                                  tuple, tuple]]:
    """Yield (location, position, [(ids, assistant mask) per conversation], tags, values) for every record of
    `path` that `to_convs` accepts, in file order (tags, values: what a `TaggedConversations` carries, else ()).
    `to_convs` raises RecordError for a bad record: a counted skip (error under strict). A failed batch
    (worker exception) is collected; once one failed, nothing more of the file is yielded and FileFailed
    lists every failure at the end."""
    errors: list[str] = []
    pending: deque = deque()
    convs: list[list[dict]] = []
    where_n: list[tuple[str, int, int, tuple, tuple]] = []

    def span(items: list[tuple[str, int, int, tuple, tuple]]) -> str:
        return items[0][0] if len(items) == 1 else f"{items[0][0]} .. {items[-1][0].rsplit(':', 1)[-1]}"

    def results(limit: int) -> Iterator[tuple[str, int, list[tuple[np.ndarray, np.ndarray]], tuple, tuple]]:
        while len(pending) > limit:
            items, fut = pending.popleft()
            result = worker_result(fut, span(items), errors)
            if result is None:
                continue
            flat_ids, flat_mask, lengths = result
            bounds = np.concatenate([[0], np.cumsum(lengths)])
            k = 0
            for where, recno, n, tags, values in items:
                yield where, recno, [(flat_ids[bounds[j]:bounds[j + 1]], flat_mask[bounds[j]:bounds[j + 1]])
                                     for j in range(k, k + n)], tags, values
                k += n

    for where, recno, rec in iter_records(path, skips):
        try:
            rec_convs = to_convs(rec)
        except RecordError as e:
            skips.skip(where, str(e))
            continue
        convs.extend(rec_convs)
        where_n.append((where, recno, len(rec_convs), getattr(rec_convs, "tags", ()),
                        getattr(rec_convs, "values", ())))
        if len(convs) >= BATCH_CONVERSATIONS:
            pending.append((where_n, renderer.submit(convs)))
            convs, where_n = [], []
            yield from results(renderer.max_pending)
    if convs:
        pending.append((where_n, renderer.submit(convs)))
    yield from results(0)
    if errors:
        raise FileFailed(errors)
