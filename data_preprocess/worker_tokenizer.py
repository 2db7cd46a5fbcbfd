"""The tokenizer as a pretokenizer worker process gets it: a backend rebuilt from JSON.

Owns: `backend_json(tok)` (parent side, on a tokenizer from `tokenizer.load_tokenizer`) and
`WorkerTokenizer` (worker side). `tokenizer.encode_texts` / `tokenizer.encode_chat` only use a
tokenizer's `backend_tokenizer` (through `tokenizer.loading.safe_backend`), so on a
`WorkerTokenizer` built from the parent's backend they return exactly what they return on the
parent's tokenizer, while the worker starts in tens of milliseconds: it never imports transformers
(and with it torch: seconds per process, all workers at once) nor reads the tokenizer directory.

Must never: load a tokenizer another way than `load_tokenizer` did in the parent, or change the
backend it is given.
"""
from __future__ import annotations

from typing import Any


def backend_json(tok: Any) -> str:
    """The serialized fast backend of a tokenizer loaded by `tokenizer.load_tokenizer`."""
    return getattr(tok, "backend_tokenizer", tok).to_str()


class WorkerTokenizer:
    """Holds `backend_tokenizer` as `tokenizer.loading.safe_backend` expects it (which caches its
    injection-safe copy on this object, once per worker)."""

    def __init__(self, backend_json: str):
        from tokenizers import Tokenizer
        self.backend_tokenizer = Tokenizer.from_str(backend_json)
