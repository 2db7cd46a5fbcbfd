"""Load a saved tokenizer directory and encode user text safely.

Owns: ``load_tokenizer``, ``load_tokenizer_meta`` and ``encode_texts``, the only sanctioned way for the
pipeline to turn user text into ids; ``load_tokenizer_and_meta``, what a command that needs both loads a
--tokenizer_dir with; and ``TokenizerLoadError`` (exit 2, one line naming the file), what a directory that
does not load as a tokenizer without remote code raises (a tokenizer_config.json with an ``auto_map``, a
tokenizer.json that is not a tokenizers file, no tokenizer_meta.json where one is needed).
Must never: add special tokens to user text, or map the literal text of a special token
(``<|im_end|>``, ``</s>`` ...) in user text to a special id (prompt injection into the chat format).
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

from tokenizer.contract import (META_FILENAME, TokenizerMetaError, check_meta, check_meta_fields, fingerprint_dir,
                                optional_special_id)
from utils.constants import EXIT_BAD_CONFIG

_SAFE_BACKEND_ATTR = "_injection_safe_backend"


class TokenizerLoadError(ValueError):
    """A tokenizer directory that does not load as this project loads tokenizers (AutoTokenizer without remote
    code): a bad --tokenizer_dir, exit 2 (the class carries its code for utils.errors). The message is one line
    naming the file at fault (tokenizer_config.json, tokenizer.json, tokenizer_meta.json) or the directory."""
    exit_code = EXIT_BAD_CONFIG


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
    try:
        tok = AutoTokenizer.from_pretrained(tok_dir, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers / tokenizers raise many types (ValueError, TypeError, ...)
        raise TokenizerLoadError(_why_not_loaded(tok_dir, e)) from e
    if meta is not None:
        if len(tok) != meta["vocab_size"]:
            raise ValueError(f"{tok_dir}: len(tokenizer)={len(tok)} != meta vocab_size={meta['vocab_size']}")
    return tok


def load_tokenizer_and_meta(tok_dir: str) -> tuple[Any, dict[str, Any]]:
    """(tokenizer, tokenizer_meta.json) of a --tokenizer_dir, as sample.py needs them (and eval_lm.py should):
    only named errors, each one line naming the file: TokenizerLoadError (exit 2) for a directory without
    tokenizer_meta.json or one that does not load without remote code; TokenizerMetaError (exit 3) for a
    damaged meta or a tokenizer file that changed since the meta listed it."""
    try:
        meta = load_tokenizer_meta(tok_dir)
    except OSError as e:  # no tokenizer_meta.json (or no directory): not a tokenizer this project wrote
        raise TokenizerLoadError(f"{os.path.join(tok_dir, META_FILENAME)}: cannot be read ({e.strerror or e}); "
                                 "a tokenizer made by tokenizer.train_tokenizer or extend_tokenizer has one") from e
    return load_tokenizer(tok_dir), meta


def _json_file(path: str) -> tuple[Any, str]:
    """(parsed JSON, "") or (None, why it is not JSON: one line naming the file)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8")), ""
    except (OSError, ValueError) as e:
        return None, f"{path}: not valid JSON ({' '.join(str(e).split())[:160]})"


def _why_not_loaded(tok_dir: str, e: BaseException) -> str:
    """Why AutoTokenizer could not load `tok_dir`, naming the file at fault where one is (the tokenizer files
    are read here only after a failure: loading stays one read)."""
    cfg_path, tj_path = os.path.join(tok_dir, "tokenizer_config.json"), os.path.join(tok_dir, "tokenizer.json")
    cfg: Any = None
    if os.path.isfile(cfg_path):
        cfg, bad = _json_file(cfg_path)
        if bad:
            return bad
        if not isinstance(cfg, dict):
            return f"{cfg_path}: not a tokenizer configuration (a JSON {type(cfg).__name__}, not an object)"
    if os.path.isfile(tj_path):
        tj, bad = _json_file(tj_path)
        if bad:
            return bad
        if not isinstance(tj, dict):
            return f"{tj_path}: not a tokenizers file (a JSON {type(tj).__name__}, not an object)"
        if not isinstance(tj.get("model"), dict):
            return f"{tj_path}: not a tokenizers file (no 'model' object)"
    if isinstance(cfg, dict) and cfg.get("auto_map"):
        return (f"{cfg_path}: asks for remote code (auto_map {json.dumps(cfg['auto_map'])[:120]}); tokenizers "
                "are loaded without trust_remote_code: use one whose tokenizer_class is a transformers class "
                "(such as PreTrainedTokenizerFast, what tokenizer.train_tokenizer writes)")
    msg = " ".join(str(e).split())[:300]
    return f"{tok_dir}: transformers cannot load the tokenizer ({type(e).__name__}: {msg})"


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


def encode_prompts(tok: Any, tokenizer_meta: dict[str, Any], texts: Sequence[str]) -> list[list[int]]:
    """Plain-text prompts as a model continues them: the tokenizer's bos (none for a tokenizer without one, Qwen2's),
    then each text's ids as `encode_texts` encodes user text."""
    bos = optional_special_id(tokenizer_meta, "bos")
    return [([bos] if bos is not None else []) + ids for ids in encode_texts(tok, texts)]
