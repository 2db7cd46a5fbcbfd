"""Pretokenize DPO preference pairs (`python -m data_preprocess.pretokenize_dpo_data`).

Owns: rendering {"prompt" | "conversations", "chosen", "rejected"} records (shapes and bad-record
policy of `data_preprocess.sft_format`) into two chat branches, prompt + reply each, with labels
only on the final reply (its content and <|im_end|>, -100 elsewhere), the over-long policy for a
pair, and the pretokenized DPO format, written atomically:
  <out>/input_ids.bin   token ids of every pair, chosen branch then rejected branch; dtype uint16 if
                        vocab_size <= 65536 else uint32
  <out>/labels.bin      int32, aligned with the ids (unshifted); -100 outside the final reply
  <out>/pairs.npy       int64 [n, 6]: chosen offset, chosen length, rejected offset, rejected length,
                        file id, position in that file (1-based line of a .jsonl, 0-based record of a
                        .json array / row of a .parquet)
  <out>/dpo_meta.json   written last: format version, dtype, vocab/pad ids, tokenizer fingerprint,
                        max_seq_len, overlong policy, counts, files [{path, file_id, first_pair, ...}]
`tokenize_dpo_files` is also what `dataset.dataset_dpo.DPODataset` runs on raw records, so training
from the raw files and from this folder reads the same items.

Must never: store labels unsigned (trap 2), label a prompt token (earlier assistant turns included),
or drop a pair without counting it.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any, Optional, Sequence

import numpy as np

from data_preprocess.pretokenize_sft_data import as_renderer, chat_inputs, check_vocab, raise_failed, write_tokenized
from data_preprocess.readers import skip_counter
from data_preprocess.sft_format import (ChatRenderer, Encode, FileFailed, apply_overlong, dpo_messages,
                                        encode_file_records, labels_from_mask, last_run_only,
                                        make_chat_encoder)
from data_preprocess.shard_format import DataError, dtype_for_vocab

log = logging.getLogger("pretokenize_dpo")
DPO_FORMAT_VERSION = 1
DPO_META = "dpo_meta.json"


def dpo_conversations(rec: Any) -> list[list[dict[str, str]]]:
    """[prompt + chosen reply, prompt + rejected reply]; RecordError for a bad record."""
    prompt, chosen, rejected = dpo_messages(rec)
    return [prompt + [{"role": "assistant", "content": chosen}],
            prompt + [{"role": "assistant", "content": rejected}]]


def tokenize_dpo_files(files: Sequence[str], encode: "Encode | ChatRenderer", max_seq_len: int,
                       overlong: str = "truncate", strict: bool = False
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[dict]]:
    """(ids int64, labels int32, pairs int64 [n, 6], per-file stats) for DPO records.

    A pair whose branch is over-long (> max_seq_len+1 tokens) is truncated (the reply's tail; kept
    when both replies keep a target token) or dropped ("drop"); counted per file. Failed files
    (worker exception, broken .json/.parquet) are collected and listed in one DataError at the end."""
    renderer = as_renderer(encode)
    id_chunks: list[np.ndarray] = []
    lab_chunks: list[np.ndarray] = []
    rows: list[tuple[int, int, int, int, int, int]] = []
    stats: list[dict] = []
    failed: dict[str, list[str]] = {}
    offset = 0
    for file_id, path in enumerate(files):
        skips = skip_counter(strict)
        st = {"path": str(path), "file_id": file_id, "first_pair": len(rows), "num_pairs": 0,
              "truncated": 0, "dropped_overlong": 0}
        try:
            for _, recno, branches in encode_file_records(path, skips, dpo_conversations, renderer):
                kept = []
                for ids, mask in branches:
                    labels = labels_from_mask(ids, last_run_only(mask))
                    kept.append((ids, apply_overlong(ids, labels, max_seq_len, overlong)))
                if any(k is None for _, k in kept):
                    st["dropped_overlong"] += 1
                    continue
                if any(k[0].size < ids.size for ids, k in kept):
                    st["truncated"] += 1
                row: list[int] = []
                for _, (ids, labels) in kept:
                    row += [offset, ids.size]
                    id_chunks.append(ids)
                    lab_chunks.append(labels)
                    offset += ids.size
                rows.append((*row, file_id, recno))
                st["num_pairs"] += 1
        except FileFailed as e:
            failed[path] = e.errors
        except DataError as e:
            if strict:
                raise
            failed[path] = [str(e)]
        st["skipped"] = dict(skips.counts)
        if skips.total:
            log.info("%s: skipped %d record(s): %s", path, skips.total, skips.counts)
        if st["num_pairs"] == 0 and path not in failed:
            log.warning("%s: no usable DPO pair: skipped %s, dropped %d over-long", path,
                        dict(skips.counts) or "none", st["dropped_overlong"])
        stats.append(st)
    raise_failed(failed)
    pairs = np.asarray(rows, dtype=np.int64).reshape(-1, 6)
    ids = np.concatenate(id_chunks) if id_chunks else np.empty(0, np.int64)
    labels = np.concatenate(lab_chunks) if lab_chunks else np.empty(0, np.int32)
    return ids, labels, pairs, stats


def dpo_stats(files: list[dict]) -> dict:
    """Totals over the per-file stats: {dropped_overlong, truncated, skipped: {reason: n}}."""
    out: dict[str, Any] = {"dropped_overlong": 0, "truncated": 0, "skipped": {}}
    for f in files:
        out["dropped_overlong"] += int(f["dropped_overlong"])
        out["truncated"] += int(f["truncated"])
        for k, v in f["skipped"].items():
            out["skipped"][k] = out["skipped"].get(k, 0) + int(v)
    return out


def default_dpo_out_dir(data_dir: str, max_seq_len: int) -> str:
    """`out/dpo_tokenized/<name of the input>_L<max_seq_len>` under the working directory."""
    name = os.path.splitext(os.path.basename(os.path.abspath(data_dir).rstrip(os.sep)))[0] or "dpo"
    return os.path.join("out", "dpo_tokenized", f"{name}_L{max_seq_len}")


def pretokenize_dpo(data_dir: Optional[str], tokenizer_dir: str, max_seq_len: int, output_dir: Optional[str] = None,
                    overlong: str = "truncate", strict: bool = False, num_workers: int = 1,
                    encode_fn: Optional[Encode] = None, hf_dataset: Any = None) -> dict:
    """Write the pretokenized DPO files for every input under `data_dir` (and `hf_dataset`, a Hugging Face
    dataset's split); returns dpo_meta (+ out_dir).

    The files are the same byte for byte for any `num_workers`."""
    out, files = chat_inputs(data_dir, output_dir, max_seq_len, hf_dataset, "DPO", default_dpo_out_dir)
    encode, tmeta = make_chat_encoder(tokenizer_dir)
    with ChatRenderer(tokenizer_dir, num_workers, encode=encode if num_workers <= 1 and encode_fn is None else None,
                      encode_fn=encode_fn) as renderer:
        ids, labels, pairs, stats = tokenize_dpo_files(files, renderer, max_seq_len, overlong, strict)
    if len(pairs) == 0:
        raise DataError(f"{data_dir or hf_dataset}: no usable DPO pair ({dpo_stats(stats)}; see the log for file:line)")
    vocab = int(tmeta["vocab_size"])
    check_vocab(ids, vocab)
    dtype = dtype_for_vocab(vocab)
    sp = tmeta["special_tokens"]
    meta = {
        "format_version": DPO_FORMAT_VERSION, "kind": "dpo", "dtype": dtype.str, "labels_dtype": "<i4",
        "vocab_size": vocab, "pad_id": int(sp["pad"]["id"]), "bos_id": int(sp["bos"]["id"]),
        "eos_id": int(sp["eos"]["id"]), "tokenizer_fingerprint": tmeta.get("fingerprint", ""),
        "max_seq_len": int(max_seq_len), "overlong": overlong, "num_pairs": int(len(pairs)),
        "num_tokens": int(ids.size), "num_target_tokens": int((labels != -100).sum()),
        "pairs_columns": ["chosen_offset", "chosen_length", "rejected_offset", "rejected_length",
                          "file_id", "position"],
        "files": stats,
    }
    write_tokenized(out, DPO_META, ids, labels, dtype, "pairs.npy", pairs, meta)
    return dict(meta, out_dir=out)


HELP_EPILOG = """\
records: {"prompt": str | "conversations": [{"role"|"from", "content"|"value"}], "chosen", "rejected",
  "system"?}; chosen/rejected a string or an assistant message (or a list ending with one). Each
  branch is prompt + reply rendered with the chat template; labels are the ids of the final reply
  and its <|im_end|>, -100 on every prompt token (earlier assistant turns included).
over-long policy (--overlong): a branch may hold max_seq_len+1 tokens. truncate (default) cuts the
  tail and keeps the pair if both replies keep a target token; drop drops the pair. Counted per file.
inputs: .jsonl, .json (an array), .parquet, extensions in any case; other files in the folder (.txt
  included) are ignored and named in a warning.
bad-input policy: malformed JSON, invalid UTF-8, records that are not objects, a missing prompt,
  chosen or rejected, non-string fields, text holding a lone surrogate (a JSON "\\ud800" escape):
  counted, logged (file:line) and skipped; --strict makes the first one an error (exit 3). A file
  without any usable pair is named in a warning; no usable pair at all is an error (exit 3). A broken
  .json array or parquet file, or a worker exception, fails that input: the others are still read,
  then every failed input is listed with its file and lines (exit 3).
output: train with --task_type=dpo --data_dir=<out>; the trainer checks that --tokenizer_dir is the
  tokenizer the pairs were made with (fingerprint, vocab size). The files are the same byte for
  byte for any --num_workers.
"""


def main(argv: Optional[list[str]] = None) -> int:
    from data_preprocess.pretokenize_sft_data import chat_pretokenize_cli
    code, meta = chat_pretokenize_cli(
        "python -m data_preprocess.pretokenize_dpo_data",
        "Render DPO preference pairs with the chat template and store chosen/rejected ids + labels (int32, "
        "-100 outside the final reply).", HELP_EPILOG, "pairs", "out/dpo_tokenized/<input name>_L<max_seq_len>",
        pretokenize_dpo, argv)
    if meta is None:
        return code
    for f in meta["files"]:
        log.info("%s: %d pairs, %d truncated, %d dropped over-long, skipped %s", f["path"], f["num_pairs"],
                 f["truncated"], f["dropped_overlong"], f["skipped"] or "none")
    log.info("%d pairs, %d tokens (%d targets)", meta["num_pairs"], meta["num_tokens"], meta["num_target_tokens"])
    print(f"wrote {meta['num_pairs']} DPO pairs to {meta['out_dir']} "
          f"(train with --task_type=dpo --data_dir={meta['out_dir']})")
    return code


if __name__ == "__main__":
    sys.exit(main())
