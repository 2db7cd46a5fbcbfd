"""Load a saved tokenizer directory and encode user text safely.

Owns: ``load_tokenizer``, ``load_tokenizer_meta`` and ``encode_texts``, the only sanctioned way for the
pipeline to turn user text into ids.
Must never: add special tokens to user text, or map the literal text of a special token
(``<|im_end|>``, ``</s>`` ...) in user text to a special id (prompt injection into the chat format).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

from tokenizer.contract import META_FILENAME, TokenizerMetaError, check_meta, check_meta_fields, fingerprint_dir

_SAFE_BACKEND_ATTR = "_injection_safe_backend"


def load_tokenizer_meta(tok_dir: str, verify_fingerprint: bool = False) -> dict[str, Any]:
    """Read tokenizer_meta.json; optionally recompute the fingerprint and refuse a changed directory."""
    path = os.path.join(tok_dir, META_FILENAME)
    with open(path, "rb") as f:  # a missing file or directory: OSError (the flag names nothing)
        raw = f.read()
    try:
        meta = json.loads(raw.decode("utf-8"))
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError: a damaged file
        raise TokenizerMetaError(f"{path}: not valid JSON ({' '.join(str(e).split())[:160]})") from e
    check_meta_fields(meta, path)
    try:
        check_meta(meta)
    except ValueError as e:
        raise TokenizerMetaError(f"{path}: {e}") from e
    if verify_fingerprint and fingerprint_dir(tok_dir) != meta["fingerprint"]:
        raise ValueError(f"{tok_dir}: tokenizer files changed since {META_FILENAME} was written (fingerprint mismatch)")
    return meta


def check_tokenizer_files(tok_dir: str, meta: dict[str, Any]) -> None:
    """Raise TokenizerMetaError naming the file when a tokenizer file the meta lists ("files": name -> sha256,
    recorded when the tokenizer was written) is missing or has other bytes (a truncated tokenizer.json was
    exported without a word and broke sample.py with a traceback). Metas written before the list: nothing
    to compare."""
    files = meta.get("files")
    if files is None:
        return
    if not isinstance(files, dict):
        raise TokenizerMetaError(f"{os.path.join(tok_dir, META_FILENAME)}: field 'files' is not an object")
    for name, digest in files.items():
        path = os.path.join(tok_dir, os.path.basename(str(name)))
        try:
            with open(path, "rb") as f:
                got = hashlib.sha256(f.read()).hexdigest()
        except OSError as e:
            raise TokenizerMetaError(f"{path}: a tokenizer file listed in {META_FILENAME} cannot be read "
                                     f"({e.strerror or e})") from e
        if got != digest:
            raise TokenizerMetaError(f"{path}: changed since {META_FILENAME} was written (sha256 {got[:12]}... not "
                                     f"{str(digest)[:12]}...): truncated or edited? restore it, or retrain the "
                                     "tokenizer")


def load_tokenizer(tok_dir: str):  # -> transformers.PreTrainedTokenizerFast
    """AutoTokenizer without remote code; with a meta, its listed files checked first (`check_tokenizer_files`)
    and len(tokenizer) checked against it."""
    from transformers import AutoTokenizer

    meta = load_tokenizer_meta(tok_dir) if os.path.exists(os.path.join(tok_dir, META_FILENAME)) else None
    if meta is not None:
        check_tokenizer_files(tok_dir, meta)
    tok = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False)
    if meta is not None:
        if len(tok) != meta["vocab_size"]:
            raise ValueError(f"{tok_dir}: len(tokenizer)={len(tok)} != meta vocab_size={meta['vocab_size']}")
    return tok


def safe_backend(tok: Any):
    """A private copy of the fast backend that never matches added/special tokens in the input text.

    A copy (cached on the tokenizer object) rather than flipping the shared backend: the shared one must
    keep matching the markers for ``apply_chat_template(tokenize=True)``.
    """
    backend = getattr(tok, _SAFE_BACKEND_ATTR, None)
    if backend is None:
        from tokenizers import Tokenizer

        src = tok.backend_tokenizer if hasattr(tok, "backend_tokenizer") else tok
        backend = Tokenizer.from_str(src.to_str())
        backend.encode_special_tokens = True
        backend.no_truncation()
        backend.no_padding()
        try:
            setattr(tok, _SAFE_BACKEND_ATTR, backend)
        except AttributeError:
            pass
    return backend


def encode_texts(tok: Any, texts: Sequence[str]) -> list[list[int]]:
    """Encode user texts: no special tokens added, special-token text encoded as ordinary text."""
    if isinstance(texts, str):
        raise TypeError("encode_texts takes a list of strings, not a string")
    if not texts:
        return []
    encs = safe_backend(tok).encode_batch(list(texts), add_special_tokens=False)
    return [e.ids for e in encs]
