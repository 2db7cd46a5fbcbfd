"""The tokenizer as a pretokenizer worker process gets it: a backend rebuilt from JSON.

Owns: `backend_json(tok)` (parent side, on a tokenizer from `tokenizer.load_tokenizer`) and
`WorkerTokenizer` (worker side). `tokenizer.encode_texts` / `tokenizer.encode_chat` only use a
tokenizer's `backend_tokenizer` (through `tokenizer.loading.safe_backend`), so on a
`WorkerTokenizer` built from the parent's backend they return exactly what they return on the
parent's tokenizer, while the worker starts in tens of milliseconds: it never imports transformers
(and with it torch: seconds per process, all workers at once) nor reads the tokenizer directory.

Also owns the parent's side of a worker batch, the same for the pretraining and the SFT / DPO
pretokenizers: its result, or its exception collected with the lines it came from
(`worker_result`); a file's collected errors (`FileFailed`); and every failed input listed in one
DataError at the end (`raise_failed`).

Must never: load a tokenizer another way than `load_tokenizer` did in the parent, or change the
backend it is given.
"""
from __future__ import annotations

import traceback
from concurrent.futures import Future
from typing import Any, Optional

from data_preprocess.shard_format import DataError


CHAT_ATTRS = ("chat_template", "bos_token", "eos_token", "pad_token", "unk_token")


def backend_json(tok: Any) -> str:
    """The serialized fast backend of a tokenizer loaded by `tokenizer.load_tokenizer`."""
    return getattr(tok, "backend_tokenizer", tok).to_str()


def chat_attrs(tok: Any) -> dict[str, Optional[str]]:
    """What `tokenizer.encode_chat` reads of a tokenizer besides its backend: its chat template and the special
    tokens' strings the template may print."""
    return {k: (None if getattr(tok, k, None) is None else str(getattr(tok, k))) for k in CHAT_ATTRS}


class WorkerTokenizer:
    """Holds `backend_tokenizer` as `tokenizer.loading.safe_backend` expects it (which caches its
    injection-safe copy on this object, once per worker), and the parent's `chat_attrs` for conversations."""

    def __init__(self, backend_json: str, chat: Optional[dict[str, Optional[str]]] = None):
        from tokenizers import Tokenizer
        self.backend_tokenizer = Tokenizer.from_str(backend_json)
        for k in CHAT_ATTRS:
            setattr(self, k, (chat or {}).get(k))


class FileFailed(Exception):
    """Part of one input file failed (worker exceptions, ids outside the vocabulary); `errors` name
    the lines of each failed batch."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


def worker_result(fut: Future, where: str, errors: list[str]) -> Optional[Any]:
    """The result of the batch of `where` (a file:line, or a span of them), or None: a worker's
    exception is appended to `errors`; once `errors` holds one, the file is lost already and later
    results are dropped (their exceptions are still collected)."""
    try:
        result = fut.result()
    except Exception as e:  # noqa: BLE001 - the worker's exception, reported with its lines
        tb = "".join(traceback.format_exception_only(type(e), e)).strip()
        errors.append(f"worker failed on {where}: {tb}")
        return None
    return None if errors else result


def raise_failed(failed: dict[str, list[str]]) -> None:
    """One DataError listing every failed input with its errors (worker exceptions, broken files); one line when
    one input failed with one error."""
    if len(failed) == 1 and len(next(iter(failed.values()))) == 1:
        (p, (err,)), = failed.items()
        raise DataError(err if err.startswith(str(p)) else f"{p}: {err}")
    if failed:
        lines = [f"{len(failed)} input file(s) failed:"]
        for p, errs in failed.items():
            lines += [f"  {p}:"] + [f"    {e}" for e in errs[:10]]
        raise DataError("\n".join(lines))
