"""The base tokenizer an extension starts from (tokenizer/extend_tokenizer.py): a sentencepiece-model Llama directory
with ``tokenizer.model``, or any BPE ``tokenizer.json`` (byte-level like GPT-2/Llama-3/ours, or byte-fallback like
our sp_bbpe): which files it has, its fingerprint, its tokenizer.json / model proto / config, its ids. Reads only.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "chat_template.jinja", "chat_template.json")


class BaseTokenizerError(ValueError):
    """The base directory holds no usable tokenizer (exit code 2)."""


def base_files(base_dir: str) -> list[str]:
    return [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(base_dir, n))]


def tokenizer_fingerprint(base_dir: str) -> str:
    """sha256 over the tokenizer files only (a model directory may also hold gigabytes of weights)."""
    h = hashlib.sha256()
    for name in base_files(base_dir):
        with open(os.path.join(base_dir, name), "rb") as f:
            data = f.read()
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def load_base(base_dir: str) -> tuple[str, dict[str, Any], Any]:
    """(kind, tokenizer.json as a dict, sentencepiece ModelProto or None). kind is "sentencepiece" or "bpe"."""
    if not os.path.isdir(base_dir):
        raise BaseTokenizerError(f"--base_tokenizer_dir {base_dir}: not a directory")
    has_model = os.path.isfile(os.path.join(base_dir, "tokenizer.model"))
    has_json = os.path.isfile(os.path.join(base_dir, "tokenizer.json"))
    if not has_model and not has_json:
        raise BaseTokenizerError(f"--base_tokenizer_dir {base_dir}: no tokenizer.json or tokenizer.model in it")
    proto = None
    if has_model:
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        try:
            with open(os.path.join(base_dir, "tokenizer.model"), "rb") as f:
                proto.ParseFromString(f.read())
        except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
            raise BaseTokenizerError(f"{base_dir}/tokenizer.model: not a sentencepiece model: {e}") from None
        if proto.trainer_spec.model_type != 2:  # BPE
            raise BaseTokenizerError(f"{base_dir}/tokenizer.model: sentencepiece model_type "
                                     f"{proto.trainer_spec.model_type} is not BPE (only BPE bases can be extended)")
    if has_json:
        with open(os.path.join(base_dir, "tokenizer.json"), encoding="utf-8") as f:
            tj = json.load(f)
    else:  # a Llama directory with only tokenizer.model: let transformers convert it as AutoTokenizer does
        from transformers import AutoTokenizer

        tj = json.loads(AutoTokenizer.from_pretrained(base_dir, trust_remote_code=False).backend_tokenizer.to_str())
    model = tj.get("model", {})
    if model.get("type") != "BPE":
        raise BaseTokenizerError(f"{base_dir}: tokenizer.json model type {model.get('type')!r} is not BPE")
    if proto is not None and len(proto.pieces) > 0:
        for i, p in enumerate(proto.pieces):
            if model["vocab"].get(p.piece, i) != i:
                raise BaseTokenizerError(f"{base_dir}: tokenizer.json and tokenizer.model disagree on piece "
                                         f"{p.piece!r} (id {model['vocab'][p.piece]} vs {i})")
    return ("sentencepiece" if proto is not None else "bpe"), tj, proto


def all_ids(tj: dict[str, Any]) -> dict[str, int]:
    ids = dict(tj["model"]["vocab"])
    for t in tj.get("added_tokens", []):
        ids.setdefault(t["content"], t["id"])
    return ids


def uses_byte_level(tj: dict[str, Any]) -> bool:
    def walk(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(walk(v) for v in node.values())
        if isinstance(node, list):
            return any(walk(v) for v in node)
        return False
    return walk(tj.get("pre_tokenizer"))
