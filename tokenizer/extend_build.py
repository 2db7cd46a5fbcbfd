"""The extended tokenizer (tokenizer/extend_tokenizer.py): the base's tokenizer.json with the new pieces (and their
merges) after ALL base ids and ``<|reserved_k|>`` up to a multiple of 64 (`build_extended_json`), the same pieces
appended to a sentencepiece ``tokenizer.model`` (`extend_proto`), the check that every base id kept its string,
and tokens per character (the before / after measure). Builds in memory: saving is extend_tokenizer.py's.
"""
from __future__ import annotations

import json
import re
from typing import Any, Sequence

from tokenizer.contract import SPECIAL_TOKENS, VOCAB_MULTIPLE

from tokenizer.extend_base import all_ids
from tokenizer.extend_pieces import SP_CONTROL, SP_NORMAL

_RESERVED = re.compile(r"^<\|reserved_(\d+)\|>$")


def _next_reserved(all_tokens: Sequence[str]) -> int:
    ks = [int(m.group(1)) for t in all_tokens if (m := _RESERVED.match(t))]
    return max(ks) + 1 if ks else 0


def build_extended_json(tj: dict[str, Any], new_tokens: list[str],
                        primary: dict[str, tuple[str, str]]) -> tuple[dict[str, Any], int, int, list[str]]:
    """Append new_tokens (ids after every base id) with merges, then reserved tokens to a multiple of 64.
    Returns (tokenizer.json dict, first new id, total vocab size, reserved token strings)."""
    tj = json.loads(json.dumps(tj))
    ids = all_ids(tj)
    start = max(ids.values()) + 1 if ids else 0
    vocab = tj["model"]["vocab"]
    # Base added tokens (our specials/reserved after the learned pieces) also go into the model vocab at their
    # ids: tokenizers ignores an added token's id when it falls inside the model's id range, so a hole
    # there would move them. No merge ever builds them, so user text still cannot produce them.
    used = set(vocab.values())
    for t in tj.get("added_tokens", []):
        if t["content"] not in vocab and t["id"] not in used:
            vocab[t["content"]] = t["id"]
            used.add(t["id"])
    for k, t in enumerate(new_tokens):
        vocab[t] = start + k
    known = set(vocab)
    merges_old = tj["model"]["merges"]
    as_strings = bool(merges_old) and isinstance(merges_old[0], str)
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in merges_old]
    seen = set(merges)
    for t in new_tokens:
        if len(t) < 2:
            continue
        first = [primary[t]] if t in primary else []
        for a, b in first + [(t[:k], t[k:]) for k in range(1, len(t))]:
            if a in known and b in known and (a, b) not in seen:
                merges.append((a, b))
                seen.add((a, b))
    if as_strings and any(" " in a or " " in b for a, b in merges):
        as_strings = False  # a piece with a space cannot be written "a b"; the list form always works
    tj["model"]["merges"] = [f"{a} {b}" if as_strings else [a, b] for a, b in merges]
    end = start + len(new_tokens)
    total = -(-end // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    r0 = _next_reserved(list(ids) + new_tokens)
    reserved = [f"<|reserved_{r0 + k}|>" for k in range(total - end)]
    for k, t in enumerate(reserved):
        tj.setdefault("added_tokens", []).append({"id": end + k, "content": t, "single_word": False, "lstrip": False,
                                                  "rstrip": False, "normalized": False, "special": True})
    return tj, start, total, reserved


def extend_proto(proto: Any, tj_base: dict[str, Any], new_tokens: list[str], reserved: list[str]) -> bytes:
    """Chinese-LLaMA style: append pieces to the ModelProto. Base added tokens past the proto (e.g. a pad
    token added in transformers) become CONTROL pieces at their ids first, so proto ids == HF ids."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.CopyFrom(proto)
    by_id = {i: t for t, i in all_ids(tj_base).items()}
    for i in range(len(m.pieces), max(by_id) + 1 if by_id else 0):
        m.pieces.append(pb.ModelProto.SentencePiece(piece=by_id.get(i, f"<|unused_{i}|>"), score=0.0,
                                                    type=SP_CONTROL))
    low = min((p.score for p in m.pieces if p.type == SP_NORMAL), default=0.0)
    for k, t in enumerate(new_tokens):
        # below every base score, decreasing in learned order: base merges first, then ours (= HF merge order)
        m.pieces.append(pb.ModelProto.SentencePiece(piece=t, score=low - 1.0 - k, type=SP_NORMAL))
    for t in reserved:
        m.pieces.append(pb.ModelProto.SentencePiece(piece=t, score=0.0, type=SP_CONTROL))
    return m.SerializeToString()


def check_extended_ids(ext_str: str, base_ids: dict[str, int], new_tokens: list[str], start: int, total: int) -> None:
    """The saved tokenizer, as tokenizers loads it, must keep every base id and place the new ones."""
    from tokenizers import Tokenizer

    tk = Tokenizer.from_str(ext_str)
    for t, i in base_ids.items():
        if tk.token_to_id(t) != i:
            raise RuntimeError(f"internal error: base token {t!r} would move from id {i} to {tk.token_to_id(t)}")
    for k, t in enumerate(new_tokens):
        if tk.token_to_id(t) != start + k:
            raise RuntimeError(f"internal error: new token {t!r} got id {tk.token_to_id(t)}, expected {start + k}")
    if tk.get_vocab_size(with_added_tokens=True) != total:
        raise RuntimeError(f"internal error: vocab size {tk.get_vocab_size(with_added_tokens=True)} != {total}")


def tokens_per_char(tokenizer_json: str, texts: Sequence[str]) -> float | None:
    """Tokens per character of texts with the injection-safe path (no specials added, special text plain)."""
    from tokenizers import Tokenizer

    chars = sum(len(t) for t in texts)
    if not chars:
        return None
    tk = Tokenizer.from_str(tokenizer_json)
    tk.encode_special_tokens = True
    tk.no_truncation()
    tk.no_padding()
    n = sum(len(e.ids) for e in tk.encode_batch(list(texts), add_special_tokens=False))
    return n / chars


def special_tokens_meta(tj: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """Our meta keys (unk/bos/eos/pad/im_start/im_end) for the base's special tokens that exist."""
    ids = all_ids(tj)

    def name(v: Any) -> str | None:
        return v.get("content") if isinstance(v, dict) else v

    roles = {k: name(config.get(f"{k}_token")) for k in ("unk", "bos", "eos", "pad")}
    defaults = dict(SPECIAL_TOKENS)
    out = {}
    for key, default in defaults.items():
        tok = roles.get(key) or default
        if tok in ids:
            out[key] = {"token": tok, "id": ids[tok]}
    return out
