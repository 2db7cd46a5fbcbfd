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
from typing import Any

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

# Exactly `<|im_start|>{role}\n{content}<|im_end|>\n` per message; one line so jinja adds no whitespace.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


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


def build_meta(tokenizer_type: str, learned_vocab_size: int, token_to_id: dict[str, int],
               fingerprint: str, training: dict[str, Any] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "tokenizer_type": tokenizer_type,
        "vocab_size": padded_vocab_size(learned_vocab_size),
        "learned_vocab_size": learned_vocab_size,
        "special_tokens": {key: {"token": tok, "id": token_to_id[tok]} for key, tok in SPECIAL_TOKENS},
        "fingerprint": fingerprint,
    }
    if training is not None:
        meta["training"] = training
    return meta


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
