"""The tokenizer contract shared with the rest of the pipeline (see docs/INTERFACES.md).

Owns: the special-token strings and their order, the vocabulary padding rule, the ChatML template,
the layout of ``tokenizer_meta.json`` and how its fingerprint is computed.
Must never: train, load or encode anything; the values here are the contract and change only together
with data_preprocess/ and dataset/.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Optional, Sequence

# (meta key, token string) in id order; ids start right after the learned vocabulary.
SPECIAL_TOKENS: tuple[tuple[str, str], ...] = (
    ("unk", "<unk>"),
    ("bos", "<s>"),
    ("eos", "</s>"),
    ("pad", "<pad>"),
    ("im_start", "<|im_start|>"),
    ("im_end", "<|im_end|>"),
)
NUM_SPECIAL = len(SPECIAL_TOKENS)
VOCAB_MULTIPLE = 64
META_FILENAME = "tokenizer_meta.json"
TOKENIZER_TYPES = ("hf_bbpe", "sp_bbpe")

# Exactly `<|im_start|>{role}\n{content}<|im_end|>\n` per message; one line so jinja adds no whitespace. Tokenizers
# trained before tool calling hold this one (still ChatML, written directly; no tools).
CHATML_TEMPLATE_BEFORE_TOOLS = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Tool calling in Qwen2.5's ChatML format (served by vLLM with its "hermes" tool parser; not tried here), without its
# default system prompt: the offered tools in a system turn (after the record's own system text), each call a
# `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` line of the assistant's turn, consecutive results
# one user turn of `<tool_response>` blocks. Without tools the text is CHATML_TEMPLATE_BEFORE_TOOLS's. `chatml_turns`
# is the same rendering in Python, for the direct encoder (tokenizer/chat.py).
TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
              "function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")


def _jinja_text(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n") + "'"


CHATML_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{ " + _jinja_text(TOOLS_HEAD) + " }}{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ " + _jinja_text(TOOLS_TAIL) + " + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_call>\\n{\"name\": \"' + fn['name'] + '\", \"arguments\": ' + (fn['arguments'] | tojson) + "
    "'}\\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user\\n' }}"
    "{%- else %}{{ '\\n' }}{%- endif %}"
    "{{ '<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chatml_turns(messages: Sequence[Mapping[str, Any]], tools: Optional[list], trained: Sequence[bool]
                 ) -> list[tuple[str, str, bool]]:
    """(role, text, learned) of each `<|im_start|>{role}\n{text}<|im_end|>` turn CHATML_TEMPLATE writes for
    `messages` (`trained[i]`: whether message i is learned) and the offered `tools`."""
    turns: list[tuple[str, str, bool]] = []
    start = 0
    if tools:
        system = messages[0]["content"] + "\n\n" if messages and messages[0]["role"] == "system" else ""
        start = 1 if system else 0
        schemas = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        turns.append(("system", system + TOOLS_HEAD + schemas + TOOLS_TAIL, False))
    for i in range(start, len(messages)):
        m = messages[i]
        if m["role"] == "tool":
            block = "<tool_response>\n" + m["content"] + "\n</tool_response>"
            if turns and i > 0 and messages[i - 1]["role"] == "tool":
                turns[-1] = (turns[-1][0], turns[-1][1] + "\n" + block, False)
            else:
                turns.append(("user", block, False))
        elif m["role"] == "assistant" and m.get("tool_calls"):
            text = m["content"]
            for k, call in enumerate(m["tool_calls"]):
                fn = call.get("function", call)
                text += ("\n" if m["content"] or k else "") + '<tool_call>\n{"name": "' + fn["name"] + \
                    '", "arguments": ' + json.dumps(fn["arguments"], ensure_ascii=False) + "}\n</tool_call>"
            turns.append(("assistant", text, trained[i]))
        else:
            turns.append((m["role"], m["content"], trained[i]))
    return turns


class MissingSpecialTokenError(ValueError):
    """A tokenizer without a special token a data layout needs (an adopted Hub tokenizer: Qwen2's has no bos):
    a choice the user makes when adopting it, exit 2 (utils.errors reads the class's code)."""
    exit_code = 2


def special_ids(meta: dict[str, Any], roles: tuple[str, ...], what: str) -> dict[str, int]:
    """role -> id of the tokenizer meta's special tokens `roles` (unk/bos/eos/pad/im_start/im_end); ValueError
    naming the missing ones and `what` needs them (an adopted tokenizer without, say, a bos token: name one with
    `python -m tokenizer.extend_tokenizer --num_new_tokens=0 --bos_token=...`)."""
    st = meta.get("special_tokens") or {}
    missing = [r for r in roles if r not in st]
    if missing:
        flags = " ".join(f"--{r}_token=..." for r in missing)
        raise MissingSpecialTokenError(f"the tokenizer has no {' / '.join(missing)} token, which {what} needs; name "
                                       "one of its tokens for the role when adopting it (python -m "
                                       f"tokenizer.extend_tokenizer --num_new_tokens=0 {flags})")
    return {r: int(st[r]["id"]) for r in roles}


def optional_special_id(meta: dict[str, Any], role: str) -> int | None:
    """The id of the tokenizer meta's special token `role`, or None when it has none (an adopted tokenizer without a
    bos, Qwen2's: its documents and prompts start with their text)."""
    entry = (meta.get("special_tokens") or {}).get(role)
    return None if entry is None else int(entry["id"])


def reserved_token(k: int) -> str:
    return f"<|reserved_{k}|>"


def padded_vocab_size(learned_vocab_size: int) -> int:
    """Learned pieces + the 6 specials, rounded up to a multiple of 64 with reserved tokens."""
    n = learned_vocab_size + NUM_SPECIAL
    return -(-n // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def added_tokens(learned_vocab_size: int) -> list[str]:
    """All tokens appended after the learned vocabulary, in id order (specials then reserved)."""
    toks = [t for _, t in SPECIAL_TOKENS]
    n_reserved = padded_vocab_size(learned_vocab_size) - learned_vocab_size - NUM_SPECIAL
    return toks + [reserved_token(k) for k in range(n_reserved)]


def fingerprint_dir(tok_dir: str) -> str:
    """sha256 over (name, length, bytes) of every file in the directory except the meta file, sorted by name.

    Length-prefixing makes the hash unambiguous; excluding the meta avoids a self-reference.
    """
    h = hashlib.sha256()
    for name in sorted(os.listdir(tok_dir)):
        path = os.path.join(tok_dir, name)
        if name == META_FILENAME or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        h.update(name.encode("utf-8") + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def file_hashes(tok_dir: str) -> dict[str, str]:
    """sha256 of each tokenizer file of a directory being written (every file but the meta), recorded in the
    meta as "files": a reader checks the files it uses by name (`tokenizer.loading.check_tokenizer_files`),
    also where a copy sits beside other files (an exported Hugging Face model directory)."""
    out = {}
    for name in sorted(os.listdir(tok_dir)):
        path = os.path.join(tok_dir, name)
        if name != META_FILENAME and os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = hashlib.sha256(f.read()).hexdigest()
    return out


def build_meta(tokenizer_type: str, learned_vocab_size: int, token_to_id: dict[str, int],
               fingerprint: str, training: dict[str, Any] | None = None,
               files: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "tokenizer_type": tokenizer_type,
        "vocab_size": padded_vocab_size(learned_vocab_size),
        "learned_vocab_size": learned_vocab_size,
        "special_tokens": {key: {"token": tok, "id": token_to_id[tok]} for key, tok in SPECIAL_TOKENS},
        "fingerprint": fingerprint,
    }
    if files is not None:
        meta["files"] = files
    if training is not None:
        meta["training"] = training
    return meta


class TokenizerMetaError(ValueError):
    """A tokenizer_meta.json that is not the contract's shape (a list, "vocab_size": null, no special
    tokens...): damaged data, exit 3 (EXIT_BAD_DATA; the class carries its code for utils.errors). The
    message names the file and the field."""
    exit_code, exit_prefix = 3, "data: "


def _int(path: str, obj: Any, key: str, label: str) -> int:
    v = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise TokenizerMetaError(f"{path}: field '{label}' is {json.dumps(v)[:40]}, not an integer >= 0")
    return v


def check_meta_fields(meta: Any, path: str = META_FILENAME) -> None:
    """Raise TokenizerMetaError naming `path` and the field when a parsed tokenizer_meta.json lacks the
    shape every reader relies on: an object with integer vocab_size (and learned_vocab_size, unless it is
    an extended tokenizer's, whose "extension" holds base_vocab_size and new_token_ids), and special_tokens
    {name: {"token": str, "id": int}} for every special token of the contract (an extended tokenizer: for
    each special it lists)."""
    if not isinstance(meta, dict):
        raise TokenizerMetaError(f"{path}: holds a JSON {type(meta).__name__}, not an object")
    if _int(path, meta, "vocab_size", "vocab_size") < 1:
        raise TokenizerMetaError(f"{path}: field 'vocab_size' is 0")
    ext = meta.get("extension")
    if ext is not None:
        _int(path, ext, "base_vocab_size", "extension.base_vocab_size")
        ids = ext.get("new_token_ids") if isinstance(ext, dict) else None
        if not (isinstance(ids, list) and len(ids) == 2 and all(isinstance(i, int) and not isinstance(i, bool)
                                                                 for i in ids)):
            raise TokenizerMetaError(f"{path}: field 'extension.new_token_ids' is {json.dumps(ids)[:40]}, "
                                     "not [first, end]")
    else:
        _int(path, meta, "learned_vocab_size", "learned_vocab_size")
    sp = meta.get("special_tokens")
    if not isinstance(sp, dict):
        raise TokenizerMetaError(f"{path}: field 'special_tokens' is {json.dumps(sp)[:40]}, not an object "
                                 f"of {{name: {{token, id}}}} for {', '.join(k for k, _ in SPECIAL_TOKENS)}")
    # the contract's tokenizers list every special; an extended one lists those its base has
    for key in (sp if ext is not None else [k for k, _ in SPECIAL_TOKENS]):
        entry = sp.get(key)
        if not isinstance(entry, dict) or not isinstance(entry.get("token"), str):
            raise TokenizerMetaError(f"{path}: field 'special_tokens.{key}' is {json.dumps(entry)[:60]}, "
                                     "not {\"token\": str, \"id\": int}")
        _int(path, entry, "id", f"special_tokens.{key}.id")
    if not isinstance(meta.get("fingerprint", ""), str):
        raise TokenizerMetaError(f"{path}: field 'fingerprint' is not a string")


def check_meta(meta: dict[str, Any]) -> None:
    """Raise ValueError if a meta dict breaks the contract (ids right after the learned vocabulary).

    An extended tokenizer (tokenizer/extend_tokenizer.py, meta with an "extension" section) keeps the
    base's ids wherever the base put its specials, so for it the rule is: vocab_size a multiple of 64,
    every special it lists inside the vocabulary, and the new ids after the base's."""
    if "extension" in meta:
        vocab = int(meta["vocab_size"])
        if vocab % VOCAB_MULTIPLE:
            raise ValueError(f"vocab_size {vocab} is not a multiple of {VOCAB_MULTIPLE}")
        for key, entry in meta["special_tokens"].items():
            if not 0 <= int(entry["id"]) < vocab:
                raise ValueError(f"special token {key}: id {entry['id']} outside the vocabulary of {vocab}")
        lo, hi = meta["extension"]["new_token_ids"]
        if not int(meta["extension"]["base_vocab_size"]) <= lo <= hi <= vocab:
            raise ValueError(f"extension: new ids [{lo}, {hi}) do not follow the base's "
                             f"{meta['extension']['base_vocab_size']} ids inside the vocabulary of {vocab}")
        return
    learned = int(meta["learned_vocab_size"])
    if meta["vocab_size"] != padded_vocab_size(learned):
        raise ValueError(f"vocab_size {meta['vocab_size']} != padded({learned})")
    for i, (key, tok) in enumerate(SPECIAL_TOKENS):
        entry = meta["special_tokens"][key]
        if entry["token"] != tok or entry["id"] != learned + i:
            raise ValueError(f"special token {key}: {entry} != {{'token': {tok!r}, 'id': {learned + i}}}")


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=2)
        f.write("\n")
