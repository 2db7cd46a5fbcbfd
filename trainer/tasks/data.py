"""The data checks the tasks share: token files must come from the run's tokenizer; SFT / DPO records (raw, or a
pretokenized folder) are read with an account of what was read."""
from __future__ import annotations

import os
from typing import Any, Optional

from data_preprocess.chat_tokens import ChatTokens, read_summary
from data_preprocess.shard_format import DataError
from utils.checkpoint_json import read_json


def check_data_tokenizer(data_dir: str, fingerprint: str, vocab_size: int, tokenizer_dir: str, tok_meta: dict) -> None:
    """Token files must come from the tokenizer the run uses: same fingerprint (when the files
    record one) and same vocabulary size. Anything else trains on ids that mean other words."""
    want_fp, want_vocab = str(tok_meta.get("fingerprint", "")), int(tok_meta["vocab_size"])
    if (fingerprint and want_fp and fingerprint != want_fp) or int(vocab_size) != want_vocab:
        raise DataError(f"{data_dir} were tokenized with another tokenizer (fingerprint {fingerprint[:12] or '?'}, "
                        f"vocab {vocab_size}) than --tokenizer_dir={tokenizer_dir} (fingerprint {want_fp[:12]}, "
                        f"vocab {want_vocab}); re-tokenize the data with this tokenizer, or pass the one it was "
                        "made with")


def _check_chat_tokenizer(path: str, meta_name: str, cfg: Any, tok_meta: dict) -> Optional[dict]:
    """The meta of a pretokenized SFT / DPO folder (None for raw records), checked against the run's tokenizer."""
    meta_path = os.path.join(path, meta_name)
    if not os.path.isfile(meta_path):
        return None
    meta = read_json(meta_path)
    check_data_tokenizer(path, str(meta.get("tokenizer_fingerprint", "")),
                         int(meta.get("vocab_size", tok_meta["vocab_size"])), cfg.tokenizer_dir, tok_meta)
    return meta


def chat_data(cfg: Any, path: str, tokenize, kind, tok_meta: dict, what: str, log):
    """What the SFT / DPO dataset reads for `path` (raw records tokenized here, or a pretokenized folder), with
    the account of what was read logged (rank 0): records, rows kept, truncated, dropped and skipped by reason,
    tokens."""
    meta = _check_chat_tokenizer(path, kind.meta_name, cfg, tok_meta)
    data = tokenize(path, cfg.tokenizer_dir, cfg.max_seq_len)
    if isinstance(data, ChatTokens):
        meta, tokens = data.meta, int(data.ids.size)
    else:
        tokens = int((meta or {}).get("num_tokens", 0))
    if log is not None and meta is not None:
        log(f"[data] {cfg.task_type} {what} {path}: {read_summary(kind, meta, tokens)}")
    return data
