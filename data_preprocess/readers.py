"""Reading raw records for the pretokenizers: .txt (one document per line), .jsonl, .json (a top-level
array) and .parquet, through the one reader in `tokenizer.raw_records`.

Owns: the pretokenizers' view of that reader: the input file set (`tokenizer.corpus.collect_input_files`,
so the tokenizer trainer and the pretokenizer read the same files: extensions in any case, every other
file named in a warning) narrowed to the kinds a command takes, records with a location ("file:line" for
.txt/.jsonl, "file:record N" for json arrays, "file:row N" for parquet), the pretokenizers' wording of the
bad-record policy (`skip_counter`: a counted, logged skip by default; an error naming file and line
under strict=True), extracting the text of a pretraining document from the --text_fields (the grammar and
its rules are tokenizer.documents's `parse_text_fields` / `document_text`, re-exported here; lone
surrogates are a counted skip: they cannot be encoded), and splitting very long documents into pieces
for the tokenizer (`split_long_text`).

Must never: tokenize, silently drop a record or a file without counting or naming it, or guess at a
text from a non-string field.
"""
from __future__ import annotations

import logging
import os
import re
import unicodedata
from typing import Any, Iterator, Optional, Sequence, Union

from data_preprocess.shard_format import DataError
from tokenizer.corpus import (SUPPORTED_EXTENSIONS, CorpusConfigError, CorpusError, InputFiles, SkipCounter,
                              UnreadableFile, collect_input_files, input_kind, is_dataset_source)
from tokenizer.documents import FileFieldCheck, document_text, parse_text_fields, text_fields_spec
from tokenizer.raw_records import iter_raw_records

log = logging.getLogger(__name__)

INPUT_EXTENSIONS = SUPPORTED_EXTENSIONS  # matched case-insensitively (tokenizer.corpus.input_kind)
RECORD_KINDS = ("jsonl", "json", "parquet")  # inputs that hold JSON-like records (SFT, DPO)
MAX_LOGGED_SKIPS = 20  # per file: enough to diagnose, not enough to flood the log
_SURROGATE = re.compile("[\ud800-\udfff]")


def skip_counter(strict: bool = False) -> SkipCounter:
    """A file's skip counter in the pretokenizers' wording: strict raises DataError "file:line: reason:
    detail"; the first 20 skips are logged as "skipping file:line: reason (detail)"; invalid UTF-8 carries
    the codec's message. Counts are per reason."""
    return SkipCounter(strict=strict, error=DataError, strict_hint="", max_logged=MAX_LOGGED_SKIPS,
                       detail_in_parens=True, codec_messages=True, logger=log)


def collect_inputs(data_dir_or_files: str | Sequence[str], exclude_dir: Optional[str] = None,
                   kinds: Sequence[str] = ("txt",) + RECORD_KINDS, what: str = "pretraining") -> InputFiles:
    """Absolute, sorted input files and the ignored ones (named in a warning).

    The file set is `tokenizer.corpus.collect_input_files`'s (hidden entries and `exclude_dir` left
    out); a file of a known type outside `kinds` (e.g. .txt for SFT) is ignored and named too."""
    try:
        found = collect_input_files(data_dir_or_files, exclude_dir=exclude_dir)
    except (CorpusError, CorpusConfigError) as e:
        raise DataError(str(e)) from None
    files = sorted(os.path.abspath(p) for p in found.files if input_kind(p) in kinds)
    wrong = [p for p in found.files if input_kind(p) not in kinds]
    given = [data_dir_or_files] if isinstance(data_dir_or_files, str) else list(data_dir_or_files)
    given_files = {os.path.abspath(p) for p in given if os.path.isfile(p)}
    for p in wrong:
        if os.path.abspath(p) in given_files:
            raise DataError(f"{p}: not a {what} input (want {', '.join('.' + k for k in kinds)}, any case)")
    if wrong:
        log.warning("ignoring %d file(s) that are not %s inputs (want %s): %s%s", len(wrong), what,
                    ", ".join("." + k for k in kinds), ", ".join(wrong[:20]),
                    f" and {len(wrong) - 20} more" if len(wrong) > 20 else "")
    return InputFiles(files, sorted(os.path.abspath(p) for p in found.ignored + wrong))


def find_input_files(data_dir_or_files: str | Sequence[str], exclude_dir: Optional[str] = None,
                     kinds: Sequence[str] = ("txt",) + RECORD_KINDS, what: str = "pretraining") -> list[str]:
    """Sorted absolute input files under a directory (recursively) or an explicit list."""
    return collect_inputs(data_dir_or_files, exclude_dir, kinds, what).files


def iter_records(path: str, skips: SkipCounter) -> Iterator[tuple[str, int, Any]]:
    """Yield (location, position, record) for every decodable record of a file; position is the
    1-based line of a .txt/.jsonl, the 0-based record/row index of a .json array or .parquet.
    A .txt record is the line itself (a str, trailing newline removed; blank lines are not records).

    Undecodable lines (invalid UTF-8, malformed JSON) go through `skips` (error if strict). A .json file
    is an array (streamed) or one object; one the json module refuses, like an unreadable parquet file,
    is a DataError. An empty file yields nothing and is logged; the caller counts documents."""
    if is_dataset_source(path):  # a Hugging Face dataset's split (tokenizer/dataset_source.py): rows
        try:
            for _, index, rec in path.records():
                yield f"{path} row {index + 1}", index, rec
        except CorpusError as e:  # a damaged dataset or data file (named): that input fails, as a broken file does
            raise DataError(str(e)) from None
        return
    if os.path.getsize(path) == 0:
        log.warning("%s: empty file", path)
        return
    kind = input_kind(path)
    if kind is None:
        raise DataError(f"{path}: unsupported input type")
    try:
        for line, index, rec in iter_raw_records(path, skips, json_file="array_or_object",
                                                 unicode_blank_lines=True):
            if kind == "txt":
                if rec:
                    yield f"{path}:{line}", line, rec
            elif kind == "jsonl":
                yield f"{path}:{line}", line, rec
            elif kind == "json":
                yield f"{path}:record {index}", index, rec
            else:
                yield f"{path}:row {index}", index, rec
    except UnreadableFile as e:
        msg = f"{path}: unreadable parquet ({e.cause})" if kind == "parquet" else str(e)
        raise DataError(msg) from e.cause


def extract_text(rec: Any, alternatives: list[list[str]], where: str, skips: SkipCounter,
                 check: Optional[FileFieldCheck] = None) -> Optional[str]:
    """The document text of a record under parsed --text_fields (tokenizer.documents.document_text: the one
    grammar of every command), or None (a counted skip in the pretokenizers' wording). `check` learns
    whether the record had the fields (a file none of whose records has them is named in a warning)."""
    text, why = document_text(rec, alternatives)
    if check is not None:
        check.saw(rec, why is not None and why[0] == "missing")
    if why is None:
        return text
    kind, data = why
    if kind == "not_object":
        skips.skip(where, "record is not an object", data)
    elif kind == "missing":
        skips.skip(where, "missing text field", "want " + text_fields_spec(alternatives).replace("|", " | "))
    elif kind == "non_string":
        skips.skip(where, "non-string text field", ", ".join(f"{f}={t}" for f, t in data))
    else:
        skips.skip(where, "invalid Unicode", data)
    return None


def lone_surrogate(text: str) -> Optional[int]:
    """Index of the first surrogate code point (U+D800..U+DFFF) in `text`, or None.

    Only a JSON escape such as "\\ud800" can put one into a str here (UTF-8 input is decoded
    strictly); it cannot be encoded to UTF-8, so no tokenizer can take it."""
    if text.isascii():  # O(1) for the common case
        return None
    m = _SURROGATE.search(text)
    return m.start() if m else None


def _cut_ok(text: str, p: int) -> bool:
    """True when a cut before text[p] separates whole characters: not inside a surrogate pair held as
    two code units, not before a combining mark or zero-width joiner that belongs to text[p-1]."""
    c = text[p]
    if "\udc00" <= c <= "\udfff" and "\ud800" <= text[p - 1] <= "\udbff":
        return False
    return not (c == "\u200d" or text[p - 1] == "\u200d" or unicodedata.combining(c))


def split_long_text(text: str, max_chars: int) -> Iterator[str]:
    """Consecutive pieces of `text`, each at most `max_chars` characters, that concatenate to `text`.

    Bounds the tokenizer's memory per call for very long documents (`--max_doc_chars`). A cut goes
    before the whitespace run that holds the last newline (else the last whitespace) in the second
    half of the window, so the pieces tokenize like the whole text except near a few cuts; without
    whitespace it is a hard cut that still never splits a character. max_chars <= 0: no splitting."""
    n = len(text)
    if max_chars <= 0 or n <= max_chars:
        yield text
        return
    start = 0
    while n - start > max_chars:
        hi = start + max_chars            # the piece is text[start:p] with start < p <= hi
        lo = start + max(1, max_chars // 2)
        p = text.rfind("\n", lo, hi + 1)
        if p < 0:
            p = max(text.rfind(ws, lo, hi + 1) for ws in (" ", "\t", "\r", "\u3000"))
        if p >= lo:
            while p > lo and text[p - 1].isspace():  # keep the whole whitespace run together
                p -= 1
        else:
            p = hi
            while p > lo and not _cut_ok(text, p):
                p -= 1
        yield text[start:p]
        start = p
    yield text[start:]


def input_paths(data_dir: Union[None, str, Sequence[str]]) -> list[str]:
    """--data_dir as the pretokenizers take it, like the tokenizer trainer's: one path or several (folders searched
    recursively, files, glob patterns), absolute, in the order given; [] for none."""
    items = [data_dir] if isinstance(data_dir, (str, os.PathLike)) else list(data_dir or [])
    return [os.path.abspath(os.fspath(p)) for p in items if os.fspath(p)]


def inputs_name(paths: Sequence[str]) -> str:
    """What messages and default output folders call the inputs: the one path's name, or the first one's with how
    many more."""
    first = os.path.splitext(os.path.basename(paths[0].rstrip(os.sep)))[0] if paths else ""
    return first + (f"_and_{len(paths) - 1}_more" if len(paths) > 1 else "")


def root_of(path: str, roots: Sequence[str]) -> Optional[str]:
    """The input folder `path` was found under (its shard stem is relative to it), or None for a file given as is."""
    for root in roots:
        if os.path.isdir(root) and os.path.abspath(path).startswith(root.rstrip(os.sep) + os.sep):
            return root
    return None
