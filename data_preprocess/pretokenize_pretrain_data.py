"""Pretokenize raw pretraining text into token shards (`python -m data_preprocess.pretokenize_pretrain_data`).

Owns: turning .txt/.jsonl/.json/.parquet documents (the tokenizer trainer's file set) into
`<stem>_<k:05d>.bin` shards of `<s> ids </s>` documents with sidecars (format in `shard_format.py`),
tokenizing in worker processes (pretrain_workers.py: in this process for one worker or little input to do;
the tokenizer is loaded once, in this process, and workers get its backend as JSON: the shards are the same
bytes either way) with a bounded number of characters per call (documents longer than
`max_doc_chars` are tokenized in consecutive pieces and concatenated into the same document),
collecting *every* worker exception with the file it came from, and resuming: inputs whose shards are
complete and consistent are skipped, the rest redone (the shards and that rule: pretrain_shards.py).
Exact-duplicate documents (the same text as an earlier document of the inputs, in input order: a 128-bit BLAKE2b
of the text, kept in a set, ~100 bytes of memory per document) are counted and reported; `dedup` drops them (the first copy kept), recorded in the sidecars
("dedup": true) and counted in each input's final sidecar ("duplicate_documents").

Must never: hard-code the id dtype, write a sidecar before its shard is on disk, report success
when a worker failed or when no token was produced, or read the shards it is writing as input.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from data_preprocess.readers import (FileFieldCheck, SkipCounter, collect_inputs, extract_text, input_paths,
                                     inputs_name, iter_records, parse_text_fields, root_of, skip_counter,
                                     split_long_text, text_fields_spec)
from tokenizer.contract import optional_special_id, special_ids
from tokenizer.corpus import input_kind, is_dataset_source, source_size
from tokenizer.documents import TEXT_FIELDS_HELP
from tokenizer.dataset_source import add_hf_dataset_flags, hf_dataset_from_args
from data_preprocess.shard_format import SHARD_RE, DataError, dtype_for_vocab, remove_temp_files
from data_preprocess.pretrain_shards import ShardWriter, complete_shard_tokens, stem_files, stem_for
from data_preprocess.pretrain_workers import InProcess, open_executor, tokenize_batch
from data_preprocess.worker_tokenizer import FileFailed, raise_failed, worker_result
from utils.writable import check_writable_dir

log = logging.getLogger("pretokenize_pretrain")

DEFAULT_SHARD_TOKENS = 100_000_000  # 200 MB of uint16: large enough for few files, small enough to copy
BATCH_DOCS = 256                     # documents per worker task: amortizes pickling, keeps latency low
DEFAULT_MAX_DOC_CHARS = 1_000_000    # characters per tokenizer call: a few hundred MB of encoder state at most
MAX_LOGGED_SPLITS = 5                # per file



def _doc_hash(text: str) -> bytes:
    """What makes two documents exact duplicates: the same text (a 128-bit BLAKE2b of its UTF-8)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _hash_documents(path: Any, alternatives: list[list[str]], seen: set[bytes]) -> None:
    """Add the hashes of an input's documents to `seen` without tokenizing (an input whose shards are complete,
    read so that a later input's duplicates of its documents are found); records are read as `_process_file`
    reads them, skips not logged again."""
    is_txt = not is_dataset_source(path) and input_kind(path) == "txt"
    skips = SkipCounter(quiet=True)
    for where, _, rec in iter_records(path, skips):
        text = rec if is_txt else extract_text(rec, alternatives, where, skips)
        if text and not text.isspace():
            seen.add(_doc_hash(text))


# ----------------------------------------------------------------------------- driver

def default_pretrain_out_dir(items: Sequence[str]) -> str:
    """out/pretrain_tokenized/<name of the input(s)> under the working directory: a folder named for what it holds,
    not a sibling dropped next to the user's raw data (as the SFT / DPO pretokenizers' default)."""
    return os.path.join("out", "pretrain_tokenized", inputs_name(items) or "corpus")


def pretokenize_pretrain(data_dir: Union[None, str, Sequence[str]], tokenizer_dir: Optional[str], output_dir: Optional[str] = None,
                         num_workers: int = 2, text_fields: str | Sequence[str] = "text",
                         shard_size_tokens: int = DEFAULT_SHARD_TOKENS, strict: bool = False,
                         progress: bool = True, encode_fn: Optional[Callable] = None,
                         tokenizer_meta: Optional[dict] = None,
                         max_doc_chars: int = DEFAULT_MAX_DOC_CHARS, hf_dataset: Any = None,
                         dedup: bool = False) -> dict[str, Any]:
    """Tokenize every input file into shards; returns a summary dict.

    Exact-duplicate documents (same text as an earlier one, inputs in order) are counted in
    "duplicate_documents"; `dedup` drops them, keeping the first. With `dedup` an input redone makes every later
    input redone too (which of their documents are repeats depends on it).

    `data_dir`: one input path or several (folders searched recursively, files); the shards go to `output_dir`,
    by default out/pretrain_tokenized/<the input's name> under the working directory (never beside the input).
    `hf_dataset` (a tokenizer.dataset_source.DatasetSource: a Hugging Face dataset's split) is one more input,
    read with the same `text_fields`, its shards `hf_<name>_<split>_<k>.bin`; `data_dir` may then be None
    (output_dir is required).

    Raises DataError listing every failed input (worker exceptions included) after processing
    all the others, and DataError when the inputs hold no usable document at all (0 tokens).
    A document longer than `max_doc_chars` characters (0: no limit) is tokenized in consecutive
    pieces (`readers.split_long_text`) written as one document; counted in "split_documents".
    `encode_fn`/`tokenizer_meta` replace the tokenizer (tests, custom encoders);
    `encode_fn` must be picklable (a module-level function)."""
    if max_doc_chars < 0:
        raise ValueError(f"max_doc_chars must be >= 0 (0 = no limit), got {max_doc_chars}")
    if not data_dir and hf_dataset is None:
        raise ValueError("no input: give --data_dir and/or --hf_dataset")
    if not data_dir and not output_dir:
        raise ValueError("--hf_dataset without --data_dir needs --out_dir")
    items = input_paths(data_dir)
    output_dir = os.path.abspath(output_dir or default_pretrain_out_dir(items))
    if tokenizer_meta is None:
        from tokenizer import load_tokenizer_meta
        tokenizer_meta = load_tokenizer_meta(tokenizer_dir)
    ends = special_ids(tokenizer_meta, ("eos",), "the shards' document layout [<s>] ids </s>")
    bos = optional_special_id(tokenizer_meta, "bos")  # None: documents are `ids </s>` (Qwen's tokenizer has no bos)
    vocab_size = int(tokenizer_meta["vocab_size"])
    alternatives = parse_text_fields(text_fields)
    spec = text_fields_spec(alternatives)
    check_writable_dir(output_dir, "--out_dir")  # exit 2 before any input is read
    os.makedirs(output_dir, exist_ok=True)
    remove_temp_files(output_dir)
    inputs = collect_inputs(items, exclude_dir=output_dir) if items else None
    files: list[Any] = list(inputs.files) if inputs else []
    if inputs and not files and hf_dataset is None:
        raise DataError(f"{', '.join(items)}: no .txt/.jsonl/.json/.parquet inputs (any case)"
                        + (f"; ignored {len(inputs.ignored)} other file(s)" if inputs.ignored else ""))
    if hf_dataset is not None:
        files.append(hf_dataset)
    base_meta = {
        "dtype": dtype_for_vocab(vocab_size).str, "vocab_size": vocab_size,
        "bos_id": bos, "eos_id": ends["eos"],
        "tokenizer_fingerprint": str(tokenizer_meta.get("fingerprint", "")),
        "tokenizer_type": tokenizer_meta.get("tokenizer_type"), "text_fields": spec,
        "document_layout": "<s> ids </s>" if bos is not None else "ids </s>", "max_doc_chars": int(max_doc_chars),
        **({"dedup": True} if dedup else {}),  # absent = repeats kept (shards made before the flag stay complete)
    }
    summary: dict[str, Any] = {"output_dir": output_dir, "files": {}, "skipped_complete": [],
                               "ignored_files": list(inputs.ignored) if inputs else [], "failed": {}, "tokens": 0,
                               "documents": 0, "split_documents": 0, "skips": {}, "duplicate_documents": 0,
                               "dedup": bool(dedup)}
    t0 = time.time()
    taken: set[str] = set()
    jobs = [(p, stem_for(p, root_of(p, items) if isinstance(p, str) else None, taken)) for p in files]
    # what messages call the inputs: --data_dir and/or the dataset (hf:<spec>[<split>])
    named = " and ".join(items + [str(hf_dataset)] * (hf_dataset is not None))
    foreign = sorted({m.group("stem") for n in os.listdir(output_dir) if (m := SHARD_RE.match(n))} - taken)
    if foreign:  # readers take every shard of the folder: say so rather than mix corpora silently
        log.warning("%s holds shards of inputs not in %s (%s); readers will include them",
                    output_dir, named, ", ".join(foreign[:5]))
    from tqdm import tqdm
    bar = tqdm(total=sum(source_size(p) for p, _ in jobs), unit="B", unit_scale=True,
               desc="pretokenize", disable=not progress, file=sys.stderr)
    plan = _plan(jobs, output_dir, base_meta, dedup)
    complete_tokens = _tokenize(plan, summary, bar, output_dir, alternatives, shard_size_tokens, strict, vocab_size,
                                num_workers, max_doc_chars, dedup, tokenizer_dir, encode_fn)
    bar.close()
    summary["seconds"] = time.time() - t0
    raise_failed(summary["failed"])
    if summary["tokens"] + complete_tokens == 0:
        raise DataError(f"{named}: no tokens: none of the {len(files)} input file(s) holds a usable document "
                        f"(skips: {summary['skips'] or 'none'}; see the warnings above for file:line)")
    return summary


def _plan(jobs: list, output_dir: str, base_meta: dict, dedup: bool) -> list:
    """(path, stem, meta, done) per input, in order: done = (tokens, duplicates) of its complete shards, or None
    when it is to be tokenized (no shards, stale ones, or with `dedup` an earlier input redone)."""
    plan = []
    redo_rest = False
    for path, stem in jobs:
        if is_dataset_source(path):
            meta = dict(base_meta, source=path.identity())
        else:
            st = os.stat(path)
            meta = dict(base_meta, source={"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        done = complete_shard_tokens(output_dir, stem, {k: meta.get(k) for k in (
            "source", "tokenizer_fingerprint", "text_fields", "dtype", "max_doc_chars", "dedup")})
        if dedup and redo_rest:
            done = None  # an earlier input is redone: which documents here repeat one of it is decided again
        redo_rest = redo_rest or done is None
        plan.append((path, stem, meta, done))
    return plan


def _tokenize(plan: list, summary: dict, bar, output_dir: str, alternatives, shard_size_tokens: int, strict: bool,
              vocab_size: int, num_workers: int, max_doc_chars: int, dedup: bool, tokenizer_dir: Optional[str],
              encode_fn: Optional[Callable]) -> int:
    """Tokenize the inputs the plan marks, count the complete ones, add each input's figures (or its failure)
    to `summary`; the tokens of the inputs whose shards were complete already."""
    complete_tokens = 0
    last_todo = max((i for i, (*_, d) in enumerate(plan) if d is None), default=-1)
    seen: set[bytes] = set()  # hashes of the documents so far, in input order
    todo_bytes = sum(source_size(path) for path, _, meta, done in plan if done is None)
    with open_executor(todo_bytes, num_workers, tokenizer_dir, encode_fn) as pool:
        for i, (path, stem, meta, done) in enumerate(plan):
            if done is not None:
                summary["skipped_complete"].append(path)
                complete_tokens += done[0]
                summary["duplicate_documents"] += done[1]
                if i < last_todo:  # a later input is tokenized: its duplicates of these documents count too
                    _hash_documents(path, alternatives, seen)
                bar.update(source_size(path))
                continue
            for n in stem_files(output_dir, stem):  # stale or partial: redo from scratch
                os.remove(os.path.join(output_dir, n))
            try:
                stats = _process_file(pool, path, stem, output_dir, meta, alternatives,
                                      shard_size_tokens, strict, vocab_size, num_workers, max_doc_chars,
                                      seen=seen, dedup=dedup)
            except Exception as e:  # noqa: BLE001 - every failure is collected and reported
                summary["failed"][path] = (e.errors if isinstance(e, FileFailed)
                                           else [str(e)] if isinstance(e, DataError)  # names its file itself
                                           else [f"{type(e).__name__}: {e}"])
                for n in stem_files(output_dir, stem):
                    os.remove(os.path.join(output_dir, n))
            else:
                summary["files"][path] = stats
                summary["tokens"] += stats["tokens"]
                summary["documents"] += stats["documents"]
                summary["split_documents"] += stats["split_documents"]
                summary["duplicate_documents"] += stats["duplicate_documents"]
                for k, v in stats["skips"].items():
                    summary["skips"][k] = summary["skips"].get(k, 0) + v
            bar.update(source_size(path))
    return complete_tokens


def _pieces(text: str, max_chars: int) -> Iterator[tuple[str, bool, bool]]:
    """(piece, first, last) for the pieces of one document."""
    it = split_long_text(text, max_chars)
    prev, first = next(it), True
    for piece in it:
        yield prev, first, False
        prev, first = piece, False
    yield prev, first, True


def _process_file(pool: "InProcess | ProcessPoolExecutor", path: str, stem: str, out_dir: str, meta: dict,
                  alternatives: list[list[str]], shard_tokens: int, strict: bool, vocab_size: int,
                  num_workers: int, max_doc_chars: int = DEFAULT_MAX_DOC_CHARS,
                  seen: Optional[set[bytes]] = None, dedup: bool = False) -> dict:
    """Tokenize one input into its shards. `seen`: hashes of the documents before this one (this input's are
    added): a document already there is counted as a duplicate, and dropped under `dedup`."""
    skips = skip_counter(strict)
    writer = ShardWriter(out_dir, stem, shard_tokens, meta)
    errors: list[str] = []
    pending: list[tuple[str, list[tuple[bool, bool]], Future]] = []
    empty = split = dups = 0
    seen = set() if seen is None else seen
    max_pending = 2 * max(1, num_workers)  # bounded: memory stays flat on huge files
    # Characters per worker task: with max_doc_chars set, one encoder call never sees more than
    # max(max_doc_chars, one piece) characters, which is what bounds the tokenizer's memory.
    batch_chars_limit = max_doc_chars or None
    is_txt = not is_dataset_source(path) and input_kind(path) == "txt"
    check = FileFieldCheck(path, alternatives)  # a file none of whose records has the fields: named, with its keys

    def drain(limit: int) -> None:
        while len(pending) > limit:
            where, flags, fut = pending.pop(0)
            result = worker_result(fut, where, errors)
            if result is None:
                continue
            flat, lengths = result
            if flat.size and (flat.min() < 0 or flat.max() >= vocab_size):
                errors.append(f"{where}: token id {int(flat.max())} outside vocab_size {vocab_size}")
                continue
            pos = 0
            for n, (first, last) in zip(lengths, flags):
                if first:
                    writer.begin_doc()
                writer.extend(flat[pos:pos + n])
                if last:
                    writer.end_doc()
                pos += n

    batch: list[str] = []
    flags: list[tuple[bool, bool]] = []
    batch_chars = 0
    first_where = last_where = ""

    def submit() -> None:
        nonlocal batch, flags, batch_chars
        where = first_where if first_where == last_where else f"{first_where} .. {last_where}"
        pending.append((where, flags, pool.submit(tokenize_batch, batch)))
        batch, flags, batch_chars = [], [], 0
        drain(max_pending)

    for where, _, rec in iter_records(path, skips):
        text = rec if is_txt else extract_text(rec, alternatives, where, skips, check)
        if text is None:
            continue
        if not text or text.isspace():  # not text.strip(): no copy of a huge document
            empty += 1  # empty documents carry nothing to learn: always a counted skip
            continue
        h = _doc_hash(text)
        if h in seen:
            dups += 1
            if dedup:
                continue
        seen.add(h)
        if max_doc_chars and len(text) > max_doc_chars:
            split += 1
            if split <= MAX_LOGGED_SPLITS:
                log.info("%s: document of %d characters tokenized in pieces of at most %d (--max_doc_chars)",
                         where, len(text), max_doc_chars)
        for piece, first, last in _pieces(text, max_doc_chars):
            if batch and (len(batch) >= BATCH_DOCS
                          or (batch_chars_limit and batch_chars + len(piece) > batch_chars_limit)):
                submit()
            if not batch:
                first_where = where
            last_where = where
            batch.append(piece)
            flags.append((first, last))
            batch_chars += len(piece)
    if batch:
        submit()
    drain(0)
    if errors:
        raise FileFailed(errors)
    writer.meta["duplicate_documents"] = dups  # the final sidecar's: repeats of earlier documents (dropped: "dedup")
    writer.close()
    if skips.total or empty:
        log.info("%s: skipped %d bad record(s) %s and %d empty document(s)", path, skips.total,
                 skips.counts, empty)
    if split:
        log.info("%s: %d document(s) longer than --max_doc_chars=%d were tokenized in pieces", path, split,
                 max_doc_chars)
    if check.skipped_whole():
        log.warning("%s", check.warning())
    elif writer.docs == 0:
        log.warning("%s: no usable document: %d bad record(s) skipped %s, %d empty document(s)", path,
                    skips.total, dict(skips.counts), empty)
    return {"tokens": writer.tokens, "documents": writer.docs, "shards": writer.k, "split_documents": split,
            "duplicate_documents": dups,
            "skips": dict(skips.counts, empty_document=empty) if empty else dict(skips.counts)}


HELP_EPILOG = """\
inputs:
  .txt (one document per line), .jsonl, .json (an array), .parquet, extensions in any case: the
  same file set the tokenizer trainer reads. Other files in the folder are ignored and named in
  a warning; hidden entries and the output folder are left out.
bad-input policy:
  malformed JSON lines, invalid UTF-8, records that are not objects, missing or non-string
  text fields, text holding a lone surrogate (a JSON "\\ud800" escape): counted and logged
  (first 20 per file, with file:line) and skipped; --strict makes the first one an error (exit 3).
  Empty documents are always skipped and counted. A file without any usable document is named
  in a warning; a run that produces no tokens at all exits 3.
  A broken .json array or parquet file, or a worker exception, fails that input: every failed
  input is reported with its file at the end and the command exits 3; the other inputs are kept.
long documents:
  a document longer than --max_doc_chars characters is tokenized in consecutive pieces (cut before
  whitespace near the limit when there is some, never inside a character) and written as one
  <s> ... </s> document, so memory per tokenizer call stays bounded; the token stream differs from
  an unsplit run only at the cuts. Counted and logged (file:line). 0 = no limit.
exact duplicates:
  a document with the same text as an earlier one (inputs in order) is counted and reported;
  --dedup=true drops it (the first copy is kept), recorded in the sidecars ("dedup": true; each
  input's final sidecar counts its "duplicate_documents"). Duplicates left in can land on both
  sides of the validation split.
re-runs:
  inputs whose shards are complete (sidecars present, sizes and source/tokenizer consistent)
  are skipped; everything else is redone.
"""


def main(argv: Optional[list[str]] = None) -> int:
    from utils.constants import EXIT_BAD_CONFIG, EXIT_OK
    from utils.cli import Parser, add_bool, add_out_dir
    from utils.errors import exit_code_for
    ap = Parser(prog="python -m data_preprocess.pretokenize_pretrain_data",
                                 description="Tokenize raw text into <stem>_<k:05d>.bin token shards "
                                             "with JSON sidecars; each document is <s> ids </s>.",
                                 epilog=HELP_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data_dir", nargs="+", action="extend", default=None,
                    help="one or more folders (searched recursively), files or glob patterns, as train_tokenizer "
                         "takes them (required unless --hf_dataset is given)")
    add_hf_dataset_flags(ap)
    ap.add_argument("--tokenizer_dir", required=True)
    add_out_dir(ap, "where the shards go (default: out/pretrain_tokenized/<name of the first --data_dir>, under "
                    "the working directory)")
    ap.add_argument("--num_workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--text_fields", default="text", help=TEXT_FIELDS_HELP)
    ap.add_argument("--shard_size_tokens", type=int, default=DEFAULT_SHARD_TOKENS)
    ap.add_argument("--max_doc_chars", type=int, default=DEFAULT_MAX_DOC_CHARS,
                    help="tokenize longer documents in pieces of at most this many characters "
                         f"(bounded memory; 0 = no limit; default {DEFAULT_MAX_DOC_CHARS:,})")
    add_bool(ap, "strict", False, "bad records are errors, not counted skips")
    add_bool(ap, "dedup", False, "drop exact-duplicate documents (same text as an earlier one), keeping the first")
    add_bool(ap, "progress", True, "progress bar", false_aliases=("quiet",))
    try:
        args = ap.parse_args([a for a in (argv if argv is not None else sys.argv[1:])])
    except SystemExit as e:
        return EXIT_OK if e.code == 0 else EXIT_BAD_CONFIG
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.shard_size_tokens < 2 or args.num_workers < 1 or args.max_doc_chars < 0:
        log.error("--shard_size_tokens must be >= 2, --num_workers >= 1 and --max_doc_chars >= 0")
        return EXIT_BAD_CONFIG
    try:
        from tokenizer import load_tokenizer_meta
        tok_meta = load_tokenizer_meta(args.tokenizer_dir)
    except Exception as e:  # noqa: BLE001 - any failure here means a bad --tokenizer_dir
        log.error("--tokenizer_dir=%s: cannot load tokenizer meta (%s: %s)", args.tokenizer_dir, type(e).__name__, e)
        return EXIT_BAD_CONFIG
    try:
        source = hf_dataset_from_args(args)
        s = pretokenize_pretrain(args.data_dir, args.tokenizer_dir, args.out_dir, args.num_workers,
                                 args.text_fields, args.shard_size_tokens, args.strict, args.progress,
                                 tokenizer_meta=tok_meta, max_doc_chars=args.max_doc_chars, hf_dataset=source,
                                 dedup=args.dedup)
    except Exception as e:  # noqa: BLE001 - a named error (DataError: 3) ends with its code; others re-raise
        named = exit_code_for(e)
        if named is None and isinstance(e, ValueError):  # e.g. neither --data_dir nor --hf_dataset
            named = (EXIT_BAD_CONFIG, str(e))
        if named is None:
            raise
        log.error("%s", e)
        return named[0]
    log.info("wrote %d tokens, %d documents from %d file(s) to %s in %.1fs (%d already complete); skips: %s; "
             "split documents: %d; ignored files: %d", s["tokens"], s["documents"], len(s["files"]), s["output_dir"],
             s["seconds"], len(s["skipped_complete"]), s["skips"] or "none", s["split_documents"],
             len(s["ignored_files"]))
    if s["duplicate_documents"] and s["dedup"]:
        log.info("dropped %d exact-duplicate document(s) (--dedup=true: the first copy of each kept)",
                 s["duplicate_documents"])
    elif s["duplicate_documents"]:
        log.warning("%d exact-duplicate document(s) (the same text as an earlier one) are in the shards: they can "
                    "land on both sides of the validation split; --dedup=true drops them", s["duplicate_documents"])
    else:
        log.info("no exact-duplicate documents")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
