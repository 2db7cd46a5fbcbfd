"""Pretokenize SFT conversations (`python -m data_preprocess.pretokenize_sft_data`).

Owns: the pretokenized SFT format and writing it atomically (the layout shared with DPO, the kinds and
the writer live in `chat_tokens`):
  <out>/input_ids.bin   token ids, dtype uint16 if vocab_size <= 65536 else uint32
  <out>/labels.bin      int32, = id on assistant content and its <|im_end|>, -100 elsewhere
  <out>/samples.npy     int64 [n, 4]: token offset, length, file id, position in that file (1-based
                        line of a .jsonl, 0-based record index of a .json array / .parquet)
  <out>/sft_meta.json   written last: dtype, vocab/pad ids, max_seq_len, overlong policy, counts,
                        tokenizer fingerprint, files [{path, file_id, first_sample, num_samples, ...}]
Labels are stored unshifted (aligned with the ids); `dataset.dataset_sft` shifts them.
`tokenize_sft_records` makes the same arrays in memory (`chat_tokens.ChatTokens`) from raw records: what
the trainer hands `dataset.dataset_sft` when --data_dir holds records, so both paths read the same items.
With --num_workers > 1 records are rendered + tokenized in worker processes (`sft_format.ChatRenderer`)
and consumed in input order, so the files are the same byte for byte for any number of workers; a
worker exception fails its input file, and every failed file is reported at the end.

Also owns what the SFT and DPO pretokenizers share: `ChatTask` (a kind's records tokenized file by file
with per-file counts, `tokenize_files`; written to a folder, `pretokenize`; or kept in memory for the
trainer, `tokenize_records`; `SFT_TASK` is SFT's, `pretokenize_dpo_data.DPO_TASK` DPO's), their inputs
and default output folder (`chat_inputs`), and the command line (`chat_pretokenize_cli`).

Must never: store labels unsigned (trap 2), record a count where a file id belongs (trap 3), or
drop a sample without counting it.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from data_preprocess.chat_tokens import (SFT, ChatKind, ChatTokens, check_not_other_kind, is_pretokenized,
                                         write_tokenized)
from data_preprocess.readers import RECORD_KINDS, find_input_files, input_paths, inputs_name, skip_counter
from data_preprocess.sft_format import (ChatRenderer, Encode, apply_overlong,
                                        encode_file_records, labels_from_mask, make_chat_encoder,
                                        sft_messages)
from data_preprocess.shard_format import DataError, dtype_for_vocab
from data_preprocess.worker_tokenizer import FileFailed, raise_failed
from tokenizer.contract import optional_special_id, special_ids
from tokenizer.corpus import CorpusConfigError
from tokenizer.dataset_source import add_hf_dataset_flags, hf_dataset_from_args
from utils.writable import check_writable_dir

log = logging.getLogger("pretokenize_sft")
SFT_FORMAT_VERSION = SFT.format_version
# (ids int64, labels int32, index int64 [n, kind.cols], per-file stats) of a kind's records
Tokenized = tuple[np.ndarray, np.ndarray, np.ndarray, list[dict], Optional[np.ndarray]]


def as_renderer(encode: "Encode | ChatRenderer") -> ChatRenderer:
    return encode if isinstance(encode, ChatRenderer) else ChatRenderer(encode=encode)


def values_meta(kind: ChatKind, values: Optional[np.ndarray], stats: list[dict]) -> dict:
    """The meta fields of the rows' float values: the columns and how many rows' records carried each ({} without
    a values file)."""
    if values is None:
        return {}
    return {"values_columns": list(kind.values),
            **{f"num_with_{n}": sum(int(f.get(f"num_with_{n}", 0)) for f in stats) for n in kind.values}}


def check_vocab(ids: np.ndarray, vocab: int) -> None:
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise DataError(f"token id {int(ids.max())} outside vocab_size {vocab}")


def default_out_dir(kind: ChatKind, data_dir: Union[str, Sequence[str]], max_seq_len: int) -> str:
    """`out/<kind>_tokenized/<name of the input(s)>_L<max_seq_len>` under the working directory: a folder
    named for what it holds, not a sibling dropped next to the user's raw data."""
    name = inputs_name(input_paths(data_dir)) or kind.kind
    return os.path.join("out", f"{kind.kind}_tokenized", f"{name}_L{max_seq_len}")


def chat_inputs(kind: ChatKind, data_dir: Union[None, str, Sequence[str]], output_dir: Optional[str], max_seq_len: int,
                hf_dataset: Any) -> tuple[str, list]:
    """(output dir, inputs) of the SFT / DPO pretokenizers: the record files under `data_dir`, then `hf_dataset`
    (a tokenizer.dataset_source.DatasetSource: a Hugging Face dataset's split, read as one more input)."""
    if not data_dir and hf_dataset is None:
        raise CorpusConfigError("no input: give --data_dir and/or --hf_dataset")
    if not data_dir and not output_dir:
        raise CorpusConfigError("--hf_dataset without --data_dir needs --out_dir")
    items = input_paths(data_dir)
    out = os.path.abspath(output_dir or default_out_dir(kind, items, max_seq_len))
    check_writable_dir(out, "--out_dir")  # exit 2 before any record is tokenized
    files: list = (find_input_files(items, exclude_dir=out, kinds=RECORD_KINDS, what=kind.kind.upper())
                   if items else [])
    if items and not files and hf_dataset is None:
        raise DataError(f"{', '.join(items)}: no .jsonl/.json/.parquet inputs (any case)")
    return out, files + ([hf_dataset] if hf_dataset is not None else [])


@dataclass(frozen=True)
class ChatTask:
    """One kind of chat data as the shared pretokenizer handles it: `to_convs` turns a record into its
    conversations (one per branch; RecordError for a bad record), `label_mask` picks the labelled tokens
    of a branch's assistant mask, `no_target_key` is what a dropped row counts as when no branch was
    over-long, `empty_detail(per-file stats)` ends the error for no row at all, and `extra_meta` are meta
    fields written before `files`."""
    kind: ChatKind
    to_convs: Callable[[Any], list[list[dict]]]
    label_mask: Callable[[np.ndarray], np.ndarray]
    no_target_key: str
    empty_detail: Callable[[list[dict]], str]
    extra_meta: dict = field(default_factory=dict)

    def tokenize_files(self, files: Sequence[str], encode: "Encode | ChatRenderer", max_seq_len: int,
                       overlong: str = "truncate", strict: bool = False) -> Tokenized:
        """(ids int64, labels int32, index int64 [n, kind.cols], per-file stats, values) for the records of `files`;
        values: float64 [n, len(kind.values)] where a kept row's record carried one (0.0 where not), else None.

        A row whose branch is over-long (> max_seq_len+1 tokens) is truncated (kept while every branch keeps
        a target token) or dropped ("drop"); a dropped row counts as dropped_overlong when a branch was
        over-long, else as `no_target_key`. `encode` is an in-process encode(messages) -> (ids, mask) or a
        ChatRenderer (worker pool); either way the result is the same. A file whose rendering failed (worker
        exception) or that cannot be read (broken .json/.parquet) is collected; after every file was tried,
        one DataError lists them all (under strict a bad record stops the run at once)."""
        kind, no_target_key = self.kind, self.no_target_key
        flog = logging.getLogger(f"pretokenize_{kind.kind}")
        renderer = as_renderer(encode)
        id_chunks: list[np.ndarray] = []
        lab_chunks: list[np.ndarray] = []
        rows: list[tuple[int, ...]] = []
        row_values: list[tuple[float, ...]] = []
        stats: list[dict] = []
        failed: dict[str, list[str]] = {}
        offset = 0
        for file_id, path in enumerate(files):
            skips = skip_counter(strict)
            st = {"path": str(path), "file_id": file_id, kind.first_key: len(rows), kind.count_key: 0,
                  "truncated": 0, "dropped_overlong": 0}
            st.setdefault(no_target_key, 0)
            try:
                for _, recno, branches, tags, values in encode_file_records(path, skips, self.to_convs, renderer):
                    kept = [(ids, apply_overlong(ids, labels_from_mask(ids, self.label_mask(mask)), max_seq_len,
                                                 overlong)) for ids, mask in branches]
                    if any(k is None for _, k in kept):
                        over = any(ids.size > max_seq_len + 1 for ids, _ in kept)
                        st["dropped_overlong" if over else no_target_key] += 1
                        continue
                    if any(k[0].size < ids.size for ids, k in kept):
                        st["truncated"] += 1
                    row: list[int] = []
                    for _, (ids, labels) in kept:
                        row += [offset, ids.size]
                        id_chunks.append(ids)
                        lab_chunks.append(labels)
                        offset += ids.size
                    rows.append((*row, *tags, file_id, recno))
                    row_values.append(values)
                    for name, v in zip(kind.values, values):  # counted per file where a record carries one
                        if v == v:
                            st[f"num_with_{name}"] = st.get(f"num_with_{name}", 0) + 1
                    st[kind.count_key] += 1
            except FileFailed as e:
                failed[path] = e.errors
            except DataError as e:
                if strict:
                    raise
                failed[path] = [str(e)]
            st["skipped"] = dict(skips.counts)
            if skips.total:
                flog.info("%s: skipped %d record(s): %s", path, skips.total, skips.counts)
            if st[kind.count_key] == 0 and path not in failed:
                why = ", %d without a target" % st[no_target_key] if no_target_key != "dropped_overlong" else ""
                flog.warning("%s: no usable %s: skipped %s, dropped %d over-long%s", path, kind.unit,
                             dict(skips.counts) or "none", st["dropped_overlong"], why)
            stats.append(st)
        raise_failed(failed)
        index = np.asarray(rows, dtype=np.int64).reshape(-1, kind.cols)
        ids = np.concatenate(id_chunks) if id_chunks else np.empty(0, np.int64)
        labels = np.concatenate(lab_chunks) if lab_chunks else np.empty(0, np.int32)
        return ids, labels, index, stats, self.row_values(row_values)

    def row_values(self, rows: list[tuple[float, ...]]) -> Optional[np.ndarray]:
        """The kept rows' float values [n, len(kind.values)] (NaN, a record without the value, as 0.0), or None
        when no kept row's record carried one."""
        width = len(self.kind.values)
        if not width:
            return None
        values = np.asarray(rows, dtype=np.float64).reshape(-1, width)
        if np.isnan(values).all():
            return None
        return np.nan_to_num(values, nan=0.0)

    def pretokenize(self, data_dir: Union[None, str, Sequence[str]], tokenizer_dir: str, max_seq_len: int,
                    output_dir: Optional[str] = None, overlong: str = "truncate", strict: bool = False,
                    num_workers: int = 1, encode_fn: Optional[Encode] = None, hf_dataset: Any = None) -> dict:
        """Write the pretokenized folder of this kind for every input under `data_dir` (and `hf_dataset`, a
        Hugging Face dataset's split); returns its meta (+ out_dir).

        `num_workers` > 1 renders and tokenizes in worker processes; the files are the same byte for
        byte whatever the number. `encode_fn` (picklable) replaces the tokenizer's encoder (tests)."""
        kind = self.kind
        out, files = chat_inputs(kind, data_dir, output_dir, max_seq_len, hf_dataset)
        encode, tmeta = make_chat_encoder(tokenizer_dir)  # loads here first: a bad tokenizer dir fails early
        sp = special_ids(tmeta, ("pad", "eos"), f"the {kind.kind} files' layout")  # before any input is read
        with ChatRenderer(tokenizer_dir, num_workers, encode=encode if num_workers <= 1 and encode_fn is None else None,
                          encode_fn=encode_fn) as renderer:
            ids, labels, index, stats, values = self.tokenize_files(files, renderer, max_seq_len, overlong, strict)
        if len(index) == 0:
            raise DataError(f"{', '.join(input_paths(data_dir)) or hf_dataset}: no usable {kind.unit} ({self.empty_detail(stats)})")
        vocab = int(tmeta["vocab_size"])
        check_vocab(ids, vocab)
        dtype = dtype_for_vocab(vocab)
        meta = {
            "format_version": kind.format_version, "kind": kind.kind, "dtype": dtype.str, "labels_dtype": "<i4",
            "vocab_size": vocab, "pad_id": sp["pad"], "bos_id": optional_special_id(tmeta, "bos"),
            "eos_id": sp["eos"], "tokenizer_fingerprint": tmeta.get("fingerprint", ""),
            "max_seq_len": int(max_seq_len), "overlong": overlong, kind.count_key: int(len(index)),
            "num_tokens": int(ids.size), "num_target_tokens": int((labels != -100).sum()), **self.extra_meta,
            **values_meta(kind, values, stats), "files": stats,
        }
        write_tokenized(out, kind, ids, labels, dtype, index, meta, values)
        return dict(meta, out_dir=out)

    def tokenize_records(self, path: str, tokenizer_dir: Optional[str], max_seq_len: Optional[int],
                         overlong: str = "truncate", strict: bool = False) -> "ChatTokens | str":
        """What the dataset of this kind reads for `path` (the trainer's --data_dir): raw records (a file or a
        folder) tokenized in this process with `tokenizer_dir`, the arrays `pretokenize` would write
        (`ChatTokens`); a pretokenized folder of this kind is returned as it is (its path). A pretokenized
        folder of the other kind, or no tokenizer, is a DataError."""
        kind = self.kind
        if is_pretokenized(path, kind):
            return path
        check_not_other_kind(path, kind)
        if tokenizer_dir is None or max_seq_len is None:
            raise DataError(f"{path}: no {kind.meta_name}; raw records need tokenizer_dir and max_seq_len")
        encode, tmeta = make_chat_encoder(tokenizer_dir)
        files = find_input_files(path, kinds=RECORD_KINDS, what=kind.kind.upper())
        ids, labels, index, stats, values = self.tokenize_files(files, encode, int(max_seq_len), overlong, strict)
        meta = {"pad_id": int(tmeta["special_tokens"]["pad"]["id"]), "files": stats, kind.count_key: len(index),
                "max_seq_len": int(max_seq_len), **values_meta(kind, values, stats)}
        return ChatTokens(kind, path, meta, ids, labels, index, values)


# SFT: labels on every assistant turn; an over-long sample is truncated or dropped, one left without a target dropped
SFT_TASK = ChatTask(SFT, lambda rec: [sft_messages(rec)], lambda mask: mask, "dropped_no_target",
                    lambda stats: "see the skip counts in the log")
tokenize_sft_files = SFT_TASK.tokenize_files  # (ids, labels, samples [n, 4], per-file stats)
pretokenize_sft = SFT_TASK.pretokenize  # writes the folder; returns sft_meta (+ out_dir)
tokenize_sft_records = SFT_TASK.tokenize_records  # what dataset_sft.SFTDataset reads for raw records, in memory


HELP_EPILOG = """\
records: {"instruction","input"?,"output","system"?} or {"conversations"|"messages": [{"role"|"from",
  "content"|"value", "reasoning_content"?, "weight"?, "tool_calls"?}], "system"?, "tools"?} or TRL's
  {"prompt", "completion"} (texts or messages); human->user, gpt->assistant; reasoning becomes a
  <think> block before the content; "weight": 0 keeps an assistant turn as context (not learned);
  tool calls, "tool" turns and "tools" are written by the chat template (ChatML: Qwen2.5's format).
  Labels are the ids of what the assistant says (its content, its tool calls, and the token closing its
  turn, <|im_end|> in ChatML; the tokenizer's own chat template where it has one); everything else is -100.
over-long policy (--overlong): a sample may hold max_seq_len+1 tokens (the model sees len-1 after the
  shift). truncate (default) keeps the first max_seq_len+1 tokens; drop drops the sample. Samples with
  no target token left are dropped. All are counted per file in sft_meta.json and the log.
inputs: .jsonl, .json (an array), .parquet, extensions in any case; other files in the folder (.txt
  included) are ignored and named in a warning. --hf_dataset reads a Hugging Face dataset's split (a
  save_to_disk folder, or what datasets.load_dataset takes, streamed) as one more input, rows as records.
bad-input policy: malformed JSON, invalid UTF-8, wrong record shapes, missing or non-string fields,
  text holding a lone surrogate (a JSON "\\ud800" escape), conversations without an assistant turn:
  counted, logged (file:line) and skipped; --strict makes the first one an error (exit 3). A file
  without any usable sample is named in a warning; no usable sample at all is an error (exit 3).
  A broken .json array or parquet file, or a worker exception (tokenizer error), fails that input:
  every other input is still read, then every failed input is listed with its file and lines (exit 3).
workers (--num_workers): records are read and checked in the main process and rendered +
  tokenized in worker processes in batches, consumed in input order: the output files are the
  same byte for byte for any number of workers.
"""


def chat_pretokenize_cli(prog: str, description: str, epilog: str, what: str, default_out: str,
                         pretokenize, argv: Optional[list[str]]) -> tuple[int, Optional[dict]]:
    """The command line shared by the SFT and DPO pretokenizers: parse, validate, run
    `pretokenize(data_dir, tokenizer_dir, max_seq_len, out_dir, overlong, strict, num_workers)`.
    Returns (exit code, meta or None)."""
    from utils.cli import Parser, add_bool, add_out_dir
    from utils.constants import EXIT_BAD_CONFIG, EXIT_OK
    from utils.errors import exit_code_for
    ap = Parser(prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_dir", nargs="+", action="extend", default=None,
                    help="one or more folders (searched recursively), files or glob patterns, as train_tokenizer "
                         "takes them (required unless --hf_dataset is given)")
    add_hf_dataset_flags(ap)
    ap.add_argument("--tokenizer_dir", required=True)
    ap.add_argument("--max_seq_len", type=int, required=True)
    add_out_dir(ap, f"where the tokenized {what} go (default: {default_out})")
    ap.add_argument("--overlong", choices=("truncate", "drop"), default="truncate")
    ap.add_argument("--num_workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="processes that render and tokenize (1 = in this process); same output for any value")
    add_bool(ap, "strict", False, "bad records are errors, not counted skips")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return (EXIT_OK if e.code == 0 else EXIT_BAD_CONFIG), None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.num_workers < 1 or args.max_seq_len < 1:
        log.error("--num_workers and --max_seq_len must be >= 1")
        return EXIT_BAD_CONFIG, None
    try:
        return EXIT_OK, pretokenize(args.data_dir, args.tokenizer_dir, args.max_seq_len, args.out_dir,
                                    args.overlong, args.strict, args.num_workers,
                                    hf_dataset=hf_dataset_from_args(args))
    except Exception as e:  # noqa: BLE001 - a named error (DataError: 3) ends with its code
        named = exit_code_for(e)
        if named is not None:
            log.error("%s", e)
            return named[0], None
        if not isinstance(e, (OSError, ImportError, KeyError)):
            raise
        log.error("%s: %s", type(e).__name__, e)  # e.g. a --tokenizer_dir that cannot be loaded
        return EXIT_BAD_CONFIG, None


def main(argv: Optional[list[str]] = None) -> int:
    code, meta = chat_pretokenize_cli(
        "python -m data_preprocess.pretokenize_sft_data",
        "Render SFT records with the chat template and store ids + masked labels (int32).", HELP_EPILOG,
        "samples", "out/sft_tokenized/<input name>_L<max_seq_len>", pretokenize_sft, argv)
    if meta is None:
        return code
    for f in meta["files"]:
        log.info("%s: %d samples, %d truncated, %d dropped over-long, %d without target, skipped %s",
                 f["path"], f["num_samples"], f["truncated"], f["dropped_overlong"], f["dropped_no_target"],
                 f["skipped"] or "none")
    log.info("%d samples, %d tokens (%d targets) -> %s (train with --data_dir=%s)", meta["num_samples"],
             meta["num_tokens"], meta["num_target_tokens"], meta["out_dir"], meta["out_dir"])
    return code


if __name__ == "__main__":
    sys.exit(main())
