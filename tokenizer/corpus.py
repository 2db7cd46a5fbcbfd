"""Streaming corpus reader for tokenizer training: find files, yield documents, sample to a byte budget.

Owns: which files are read (.txt one document per line, .json array of objects, .jsonl, .parquet),
how text fields become one document, the bad-input policy (count and log a skip, or raise under
strict), and the uniform random document sample behind ``--max_train_bytes``.
Must never: read a whole file into memory, hold more than one document (or one parquet batch, or one
JSON array element) at a time, or silently drop input without counting it.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from tqdm import tqdm

log = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".txt", ".json", ".jsonl", ".parquet")
MAX_LOGGED_SKIPS = 5
_JSON_CHUNK = 1 << 20


class CorpusError(Exception):
    """Bad or unreadable training data (exit code 3). The message names the file and line."""


class CorpusConfigError(ValueError):
    """Impossible request about the corpus, e.g. an unsupported file type (exit code 2)."""


@dataclass
class SkipStats:
    """Counts skipped records by reason; remembers the first few locations; raises if strict."""

    strict: bool = False
    quiet: bool = False
    counts: Counter = field(default_factory=Counter)
    first_locations: list[str] = field(default_factory=list)
    empty_documents: int = 0

    def skip(self, path: str, line: int, reason: str, what: str = "line") -> None:
        where = f"{path}:{line}" if what == "line" else f"{path} {what} {line}"
        if self.strict:
            raise CorpusError(f"{where}: {reason} (run without --strict to skip and count such records)")
        self.counts[reason.split(":")[0]] += 1
        if len(self.first_locations) < MAX_LOGGED_SKIPS:
            self.first_locations.append(f"{where}: {reason}")
            if not self.quiet:
                log.warning("skipping %s: %s", where, reason)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict[str, Any]:
        return {"skipped": self.total, "skipped_by_reason": dict(self.counts),
                "first_skipped": list(self.first_locations), "empty_documents": self.empty_documents}


def input_kind(path: str | os.PathLike) -> str | None:
    """The input format of a file from its extension, case-insensitive: "txt", "jsonl", "json",
    "parquet", or None for any other file. The one rule, shared with data_preprocess, for what is an input."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    return ext[1:] if ext in SUPPORTED_EXTENSIONS else None


@dataclass
class InputFiles:
    files: list[str]    # inputs, sorted within each given item, de-duplicated
    ignored: list[str]  # files found in a directory / by a pattern whose extension is not an input type


MAX_NAMED_IGNORED = 20


def collect_input_files(data_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike],
                        file_glob: str = "**/*", recursive: bool = True,
                        exclude_dir: str | None = None) -> InputFiles:
    """Which files are inputs, for the tokenizer trainer and the pretokenizer alike.

    Directories are expanded with ``file_glob`` (hidden entries are never matched), glob patterns are
    expanded, explicit files are taken as given. A found file is an input when ``input_kind`` knows its
    extension (any case); every other found file is returned in ``ignored`` and named in a warning.
    An explicit file of another type is an error (CorpusConfigError), a missing path too (CorpusError).
    Files under ``exclude_dir`` (an output folder inside the input folder) are left out silently.
    """
    items = [data_dir_or_files] if isinstance(data_dir_or_files, (str, os.PathLike)) else list(data_dir_or_files)
    excl = os.path.abspath(exclude_dir) + os.sep if exclude_dir else None
    out: list[str] = []
    ignored: list[str] = []

    def take(found: Iterable[str]) -> None:
        for f in sorted(found):
            if not os.path.isfile(f) or (excl and os.path.abspath(f).startswith(excl)):
                continue
            (out if input_kind(f) else ignored).append(f)

    for item in items:
        p = os.fspath(item)
        if os.path.isdir(p):
            pattern = os.path.join(glob.escape(p), file_glob if recursive else file_glob.replace("**/", ""))
            take(glob.glob(pattern, recursive=recursive))
        elif os.path.isfile(p):
            if input_kind(p) is None:
                raise CorpusConfigError(f"{p}: unsupported file type (supported: {', '.join(SUPPORTED_EXTENSIONS)},"
                                        f" any case)")
            out.append(p)
        elif any(ch in p for ch in "*?["):
            take(glob.glob(p, recursive=True))
        else:
            raise CorpusError(f"{p}: no such file or directory")
    files = list(dict.fromkeys(out))
    ignored = list(dict.fromkeys(ignored))
    for f in files:
        if not os.access(f, os.R_OK):
            raise CorpusError(f"{f}: file is not readable (permission denied)")
    if ignored:
        named = ", ".join(ignored[:MAX_NAMED_IGNORED])
        more = f" and {len(ignored) - MAX_NAMED_IGNORED} more" if len(ignored) > MAX_NAMED_IGNORED else ""
        log.warning("ignoring %d file(s) with an unsupported extension (inputs are %s, any case): %s%s",
                    len(ignored), "/".join(SUPPORTED_EXTENSIONS), named, more)
    return InputFiles(files, ignored)


def find_files(data_dir_or_files: str | os.PathLike | Sequence[str | os.PathLike],
               file_glob: str = "**/*", recursive: bool = True) -> list[str]:
    """The input files (``collect_input_files``); an error when there are none."""
    files = collect_input_files(data_dir_or_files, file_glob, recursive).files
    if not files:
        raise no_input_files_error(data_dir_or_files, file_glob)
    return files


def no_input_files_error(data_dir_or_files: Any, file_glob: str = "**/*") -> CorpusError:
    return CorpusError(f"no {'/'.join(SUPPORTED_EXTENSIONS)} files found in {data_dir_or_files} (glob {file_glob!r})")


# ---------------------------------------------------------------- per-format readers
# Each yields (line_or_row_number, record); a record is a str (.txt) or a parsed JSON value / row dict.

def _iter_txt(path: str, stats: SkipStats) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            raw = raw.rstrip(b"\n").rstrip(b"\r")
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                stats.skip(path, lineno, f"invalid UTF-8: byte {e.start} of the line")


def _iter_jsonl(path: str, stats: SkipStats) -> Iterator[tuple[int, Any]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                stats.skip(path, lineno, f"invalid UTF-8: byte {e.start} of the line")
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError as e:
                stats.skip(path, lineno, f"malformed JSON: {e}")


def _iter_json_array(path: str, stats: SkipStats) -> Iterator[tuple[int, Any]]:
    """Stream the elements of a top-level JSON array with bounded memory (one element at a time).

    A file whose first character is not '[' is read as JSON Lines. A syntax error inside an array
    cannot be resynchronised, so the rest of that file is skipped (one counted skip) or raised under strict.
    """
    with open(path, "rb") as fb:
        head = fb.read(4096).lstrip(b"\xef\xbb\xbf").lstrip()
    if not head.startswith(b"["):
        yield from _iter_jsonl(path, stats)
        return
    dec = json.JSONDecoder()
    with open(path, "r", encoding="utf-8-sig", errors="strict", newline="") as f:
        buf, pos, line, eof, chunk = "", 0, 1, False, _JSON_CHUNK

        def more() -> bool:
            nonlocal buf, pos, eof, chunk
            if eof:
                return False
            try:
                data = f.read(chunk)
            except UnicodeDecodeError as e:
                raise _ArrayBroken(f"invalid UTF-8 near byte {e.start} of a read block") from None
            chunk = min(chunk * 2, 64 << 20) if len(buf) - pos > chunk // 2 else chunk  # grow for huge elements
            buf, pos = buf[pos:] + data, 0
            eof = not data
            return bool(data)

        def skip_ws() -> None:
            nonlocal pos, line
            while True:
                n = len(buf)
                while pos < n and buf[pos] in " \t\r\n":
                    if buf[pos] == "\n":
                        line += 1
                    pos += 1
                if pos < n or not more():
                    return

        try:
            skip_ws()
            pos += 1  # the '['
            skip_ws()
            if pos < len(buf) and buf[pos] == "]":
                return
            while True:
                skip_ws()
                while True:
                    try:
                        obj, end = dec.raw_decode(buf, pos)
                        if end < len(buf) or eof:
                            break  # a value ending at the buffer end may be a truncated number: read more
                    except json.JSONDecodeError as e:
                        if eof:
                            raise _ArrayBroken(f"malformed JSON: {e.msg}") from None
                    more()  # at EOF this sets eof=True and the next attempt is final
                start_line = line
                line += buf.count("\n", pos, end)
                pos = end
                yield start_line, obj
                skip_ws()
                if pos >= len(buf):
                    raise _ArrayBroken("malformed JSON: unterminated array")
                if buf[pos] == "]":
                    return
                if buf[pos] != ",":
                    raise _ArrayBroken(f"malformed JSON: expected ',' or ']' but found {buf[pos]!r}")
                pos += 1
        except _ArrayBroken as e:
            stats.skip(path, line, f"{e} (rest of the file skipped)")


class _ArrayBroken(Exception):
    pass


def _iter_parquet(path: str, fields: Sequence[str], stats: SkipStats) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise CorpusError(f"{path}: cannot read parquet file: {e}") from e
    present = [c for c in fields if c in pf.schema_arrow.names]
    row = 0
    # Only the needed columns, one record batch at a time, so memory is one batch whatever the file size.
    for batch in pf.iter_batches(batch_size=1024, columns=present or None):
        cols = {c: batch.column(c).to_pylist() for c in present}
        for i in range(batch.num_rows):
            row += 1
            yield row, {c: cols[c][i] for c in present}


# ---------------------------------------------------------------- documents

def record_text(record: Any, fields: Sequence[str]) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason). Several fields are joined with a newline."""
    if isinstance(record, str) and tuple(fields) == ("text",):
        return record, None
    if not isinstance(record, dict):
        return None, f"record is a {type(record).__name__}, not an object"
    parts = []
    for name in fields:
        value = record.get(name)
        if value is None:
            return None, f"missing field: {name!r}"
        if not isinstance(value, str):
            return None, f"non-string field: {name!r} is {type(value).__name__}"
        parts.append(value)
    return "\n".join(parts), None


def iter_file_documents(path: str, text_fields: Sequence[str], stats: SkipStats) -> Iterator[tuple[str, int]]:
    """Yield (document, utf8_byte_length) for one file, skipping or raising per the policy."""
    kind = input_kind(path)
    what = "row" if kind == "parquet" else "line"
    if kind == "txt":
        records: Iterable[tuple[int, Any]] = _iter_txt(path, stats)
    elif kind == "jsonl":
        records = _iter_jsonl(path, stats)
    elif kind == "json":
        records = _iter_json_array(path, stats)
    elif kind == "parquet":
        records = _iter_parquet(path, text_fields, stats)
    else:
        raise CorpusConfigError(f"{path}: unsupported file type")
    is_txt = kind == "txt"
    try:
        for lineno, rec in records:
            if is_txt:
                text, reason = rec, None
            else:
                text, reason = record_text(rec, text_fields)
            if reason is not None:
                stats.skip(path, lineno, reason, what)
                continue
            if not text:
                stats.empty_documents += 1
                continue
            try:
                nbytes = len(text.encode("utf-8"))
            except UnicodeEncodeError:  # lone surrogate from a JSON "\ud800" escape
                stats.skip(path, lineno, "invalid Unicode: lone surrogate", what)
                continue
            yield text, nbytes
    except OSError as e:
        raise CorpusError(f"{path}: cannot read: {e}") from e


def iter_documents(files: Sequence[str], text_fields: Sequence[str], stats: SkipStats,
                   progress: bool = False, desc: str = "reading") -> Iterator[str]:
    """All documents of all files in order, with a tqdm bar over document bytes."""
    total = sum(os.path.getsize(f) for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, mininterval=1.0) as bar:
        for path in files:
            for text, nbytes in iter_file_documents(path, text_fields, stats):
                bar.update(nbytes)
                yield text


@dataclass
class CorpusCount:
    documents: int = 0
    bytes: int = 0


def count_documents(files: Sequence[str], text_fields: Sequence[str], stats: SkipStats,
                    progress: bool = False) -> CorpusCount:
    c = CorpusCount()
    total = sum(os.path.getsize(f) for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="counting", disable=not progress, mininterval=1.0) as bar:
        for path in files:
            for _, nbytes in iter_file_documents(path, text_fields, stats):
                c.documents += 1
                c.bytes += nbytes
                bar.update(nbytes)
    return c


def sample_documents(files: Sequence[str], text_fields: Sequence[str], max_bytes: int, seed: int,
                     count: CorpusCount, progress: bool = False) -> Iterator[str]:
    """A uniform random subset of documents whose expected total size is ``max_bytes``.

    Two passes: ``count`` comes from the first; here k = round(N * max_bytes / total_bytes) documents
    are chosen by selection sampling (Knuth's Algorithm S: take the next document with probability
    (k - taken) / (N - seen)), which picks every k-subset with equal probability while streaming.
    Nothing is buffered, so memory does not depend on the corpus or sample size.
    """
    quiet = SkipStats(strict=False, quiet=True)  # skips were already counted and logged in the first pass
    if count.bytes <= max_bytes:
        yield from iter_documents(files, text_fields, quiet, progress, desc="reading")
        return
    n = count.documents
    k = max(1, min(n, round(n * max_bytes / count.bytes)))
    rng = random.Random(seed)
    taken = seen = 0
    with tqdm(total=k, unit="doc", desc="sampling", disable=not progress, mininterval=1.0) as bar:
        for path in files:
            for text, _ in iter_file_documents(path, text_fields, quiet):
                if (n - seen) * rng.random() < (k - taken):
                    taken += 1
                    bar.update(1)
                    yield text
                seen += 1
                if taken >= k:
                    return
