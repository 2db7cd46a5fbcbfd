"""The one raw-input reader (tokenizer trainer/extender and the pretokenizers), and documents + sampling
for tokenizer training.

Owns: which files are inputs (.txt one document per line, .json array of objects, .jsonl, .parquet;
`collect_input_files`), reading a file record by record with its line or row (`iter_raw_records`), the
bad-input policy (`SkipCounter`: count and log a skip, or raise under strict), how text fields become
one document, and the uniform random document sample behind ``--max_train_bytes``.
data_preprocess/readers.py reads through here: where the two tools used to differ (message wording,
blank JSON Lines, a .json file that is not an array), a parameter keeps each tool's behaviour.
Must never: read a whole file into memory (except, under the pretokenizers' rules, a .json file that is
not an array, or a broken one to word its error), hold more than one document (or one parquet batch, or
one JSON array element) at a time, or silently drop input without counting it.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Sequence

from tqdm import tqdm

from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA

log = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".txt", ".json", ".jsonl", ".parquet")
MAX_LOGGED_SKIPS = 5
STRICT_HINT = " (run without --strict to skip and count such records)"
PARQUET_BATCH_ROWS = 1024
_JSON_CHUNK = 1 << 20
JSON_FILE_RULES = ("array_or_lines", "array_or_object")


class CorpusError(Exception):
    """Bad or unreadable training data (exit code 3). The message names the file and line."""
    exit_code, exit_prefix = EXIT_BAD_DATA, "data: "  # utils.errors.exit_code_for


class CorpusConfigError(ValueError):
    """Impossible request about the corpus, e.g. an unsupported file type (exit code 2)."""
    exit_code = EXIT_BAD_CONFIG  # utils.errors.exit_code_for


class UnreadableFile(CorpusError):
    """A whole input file that cannot be read: a parquet file pyarrow refuses, or (pretokenizers' rules)
    a .json file the json module refuses. `cause` is the underlying exception."""

    def __init__(self, message: str, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass
class SkipCounter:
    """Counts skipped records per reason, remembers the first `max_logged` locations (logged unless
    quiet), raises `error` at the first one under strict.

    The defaults are the tokenizer trainer's wording ("file:line: reason: detail (run without --strict
    ...)", 5 logged, "invalid UTF-8: byte N of the line"); data_preprocess.readers.skip_counter() makes the
    pretokenizers' (DataError without the hint, 20 logged, "reason (detail)" in the log, the codec's own
    message for invalid UTF-8)."""

    strict: bool = False
    quiet: bool = False  # count and remember, log nothing
    error: type = CorpusError  # what strict raises
    strict_hint: str = STRICT_HINT  # appended to the strict error
    max_logged: int = MAX_LOGGED_SKIPS
    detail_in_parens: bool = False  # log "reason (detail)" instead of "reason: detail"
    codec_messages: bool = False  # invalid UTF-8: the codec's message instead of "byte N of the line"
    logger: logging.Logger = field(default=log, repr=False)
    counts: dict[str, int] = field(default_factory=dict)
    first_locations: list[str] = field(default_factory=list)
    empty_documents: int = 0

    def skip(self, where: str, reason: str, detail: str = "") -> None:
        """One skipped record at `where` ("file:line", "file row N", ...), counted under `reason`."""
        message = f"{reason}: {detail}" if detail else reason
        if self.strict:
            raise self.error(f"{where}: {message}{self.strict_hint}")
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.first_locations) < self.max_logged:
            self.first_locations.append(f"{where}: {message}")
            if self.quiet:
                pass
            elif self.detail_in_parens:
                self.logger.warning("skipping %s: %s%s", where, reason, f" ({detail})" if detail else "")
            else:
                self.logger.warning("skipping %s: %s", where, message)

    def skip_undecodable(self, where: str, e: UnicodeDecodeError) -> None:
        self.skip(where, "invalid UTF-8", str(e) if self.codec_messages else f"byte {e.start} of the line")

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


# ---------------------------------------------------------------- raw records (both tools)

class Record(NamedTuple):
    line: Optional[int]  # 1-based line the record starts on; None for a parquet row or a .json read whole
    index: int           # 0-based: the line of a .txt/.jsonl, the element of a .json array, the parquet row
    value: Any           # a .txt line (str); otherwise the parsed JSON value or the row dict


def iter_raw_records(path: str, skips: SkipCounter, columns: Optional[Sequence[str]] = None,
                     json_file: str = "array_or_lines", unicode_blank_lines: bool = False) -> Iterator[Record]:
    """Every decodable record of one input file, in file order; undecodable lines go through `skips`.

    A .txt record is the line without its "\\n"/"\\r\\n" (blank lines included); blank .jsonl lines are not
    records (`unicode_blank_lines`: also a line of Unicode whitespace only, the pretokenizers' rule; else
    it is malformed JSON). `columns`: the parquet columns to read (those present; None: all).
    `json_file` is how a .json file is read (`_iter_json`). A file that cannot be read at all raises
    UnreadableFile; an unknown extension CorpusConfigError."""
    kind = input_kind(path)
    if kind == "txt":
        return _iter_txt(path, skips)
    if kind == "jsonl":
        return _iter_jsonl(path, skips, unicode_blank_lines)
    if kind == "json":
        return _iter_json(path, skips, json_file)
    if kind == "parquet":
        return _iter_parquet(path, columns)
    raise CorpusConfigError(f"{path}: unsupported file type")


def _iter_txt(path: str, skips: SkipCounter) -> Iterator[Record]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.rstrip(b"\n").rstrip(b"\r").decode("utf-8")
            except UnicodeDecodeError as e:
                skips.skip_undecodable(f"{path}:{lineno}", e)
                continue
            yield Record(lineno, lineno - 1, text)


def _iter_jsonl(path: str, skips: SkipCounter, unicode_blank_lines: bool = False) -> Iterator[Record]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                skips.skip_undecodable(where, e)
                continue
            if unicode_blank_lines and not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                skips.skip(where, "malformed JSON", str(e))
                continue
            yield Record(lineno, lineno - 1, value)


def _iter_json(path: str, skips: SkipCounter, json_file: str = "array_or_lines") -> Iterator[Record]:
    """Stream the elements of a top-level JSON array with bounded memory (one element at a time).

    json_file="array_or_lines" (the tokenizer's rules): a file whose first character is not '[' is read
    as JSON Lines; a syntax error inside the array cannot be resynchronised, so the rest of the file is
    skipped (one counted skip) or raised under strict.
    json_file="array_or_object" (the pretokenizers' rules): a file that does not start with '[' is parsed
    whole, one object being one record; whatever the json module refuses for the whole file (a syntax
    error, invalid UTF-8, data after the array) raises UnreadableFile with the json module's message for
    the whole file, before any record is yielded (a first streaming pass checks the array: memory stays
    one element, the parsing is done twice).
    """
    if json_file not in JSON_FILE_RULES:
        raise ValueError(f"json_file={json_file!r}: one of {JSON_FILE_RULES}")
    whole_file_errors = json_file == "array_or_object"
    with open(path, "rb") as fb:
        head = fb.read(4096)
    if not whole_file_errors and not head.lstrip(b"\xef\xbb\xbf").lstrip().startswith(b"["):
        yield from _iter_jsonl(path, skips)
        return
    if whole_file_errors and not head.lstrip(b" \t\r\n").startswith(b"["):
        data = _load_json(path)
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise UnreadableFile(f"{path}: a .json input must hold an array of records")
        for i, rec in enumerate(data):
            yield Record(None, i, rec)
        return
    if whole_file_errors:  # a first pass, so that a broken file fails before any of its records is read
        for _ in _stream_json_array(path, skips, whole_file_errors):
            pass
    yield from _stream_json_array(path, skips, whole_file_errors)


def _stream_json_array(path: str, skips: SkipCounter, whole_file_errors: bool) -> Iterator[Record]:
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

        index = 0
        try:
            skip_ws()
            pos += 1  # the '['
            skip_ws()
            if pos < len(buf) and buf[pos] == "]":
                pos += 1
            else:
                while True:
                    skip_ws()
                    while True:
                        try:
                            obj, end = dec.raw_decode(buf, pos)
                            if end < len(buf) or eof:
                                break  # a value ending at the buffer end may be a truncated number: read more
                        except json.JSONDecodeError as e:
                            if eof:
                                raise _ArrayBroken("malformed JSON", e.msg) from None
                        more()  # at EOF this sets eof=True and the next attempt is final
                    start_line = line
                    line += buf.count("\n", pos, end)
                    pos = end
                    yield Record(start_line, index, obj)
                    index += 1
                    skip_ws()
                    if pos >= len(buf):
                        raise _ArrayBroken("malformed JSON", "unterminated array")
                    if buf[pos] == "]":
                        pos += 1
                        break
                    if buf[pos] != ",":
                        raise _ArrayBroken("malformed JSON", f"expected ',' or ']' but found {buf[pos]!r}")
                    pos += 1
            if whole_file_errors:
                skip_ws()
                if pos < len(buf):
                    raise _ArrayBroken("malformed JSON", f"{buf[pos]!r} after the array")
        except _ArrayBroken as e:
            reason, detail = e.args[0], (e.args[1] if len(e.args) > 1 else "")
            if whole_file_errors:
                raise UnreadableFile(_json_file_error(path) or f"{path}:{line}: {reason} ({detail})") from None
            if detail:
                skips.skip(f"{path}:{line}", reason, f"{detail} (rest of the file skipped)")
            else:
                skips.skip(f"{path}:{line}", f"{reason} (rest of the file skipped)")


class _ArrayBroken(Exception):
    pass


def _load_json(path: str) -> Any:
    """A whole .json file parsed at once (the pretokenizers' rules), or UnreadableFile in their wording."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UnreadableFile(f"{path}: invalid UTF-8 ({e})", e) from e
    except json.JSONDecodeError as e:
        raise UnreadableFile(f"{path}:{e.lineno}: malformed JSON ({e.msg})", e) from e


def _json_file_error(path: str) -> Optional[str]:
    """What `_load_json` says about a file the streaming reader found broken (None if it parses)."""
    try:
        _load_json(path)
    except UnreadableFile as e:
        return str(e)
    return None


def _iter_parquet(path: str, columns: Optional[Sequence[str]] = None) -> Iterator[Record]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a corrupt file
        raise UnreadableFile(f"{path}: cannot read parquet file: {e}", e) from e
    names = pf.schema_arrow.names
    present = None if columns is None else [c for c in columns if c in names]
    row = 0
    if present == [] and names:  # none of the columns asked for: rows of the file's keys, all null (missing)
        for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=names[:1]):
            for _ in range(batch.num_rows):
                yield Record(None, row, dict.fromkeys(names))
                row += 1
        return
    # Only the needed columns, one record batch at a time, so memory is one batch whatever the file size.
    for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=present or None):
        if present is None:
            rows = batch.to_pylist()
        else:
            cols = {c: batch.column(c).to_pylist() for c in present}
            rows = [{c: cols[c][i] for c in present} for i in range(batch.num_rows)]
        for rec in rows:
            yield Record(None, row, rec)
            row += 1


# ---------------------------------------------------------------- documents

TEXT_FIELDS_HELP = ("JSON / parquet fields of a document: '|' separates alternatives tried in order (the first "
                    "whose fields are all present), ',' joins fields with a newline; e.g. 'text|title,content'. "
                    "The same grammar in every command that reads raw text")


def parse_text_fields(spec: "str | Sequence[str] | Sequence[Sequence[str]]") -> list[list[str]]:
    """The one --text_fields grammar of every command that reads raw text (tokenizer trainer, extend-tokenizer,
    pretokenizers): `"text|title,content"` -> [["text"], ["title", "content"]].

    `|` separates alternatives tried in order (the first whose fields are all present gives the text); `,`
    joins several fields with a newline. In Python a list of names is the fields of one alternative
    (("title", "content") == "title,content"); a list of lists is the parsed form, taken as is.
    ValueError for a spec that names no field."""
    if isinstance(spec, str):
        text = spec
    else:
        items = list(spec)
        if items and all(not isinstance(a, str) for a in items):
            alts = [[str(f).strip() for f in a if str(f).strip()] for a in items]
            if not all(alts):
                raise ValueError(f"empty --text_fields alternative in {spec!r}")
            return alts
        else:
            text = ",".join(items)
    alts = [[f.strip() for f in alt.split(",") if f.strip()] for alt in text.split("|")]
    alts = [a for a in alts if a]
    if not alts:
        raise ValueError(f"empty --text_fields spec: {spec!r}")
    return alts


def text_fields_spec(alternatives: Sequence[Sequence[str]]) -> str:
    """The canonical spelling of parsed --text_fields ("text|title,content")."""
    return "|".join(",".join(a) for a in alternatives)


def document_text(record: Any, alternatives: Sequence[Sequence[str]]) -> tuple[Optional[str], Optional[tuple[str, Any]]]:
    """The text of one JSON / parquet record under parsed --text_fields: (text, None), or (None, (kind, data))
    with kind "not_object" (data: the type name), "missing" (data: the first missing field of the first
    alternative), "non_string" (data: [(field, type name)]), "surrogate" (data: a description). The first
    alternative whose fields are all present and not null is used; its non-string fields make the record
    bad (no fall-through to the next alternative). A bare JSON string is the text when the spec is "text"."""
    if isinstance(record, str) and [list(a) for a in alternatives] == [["text"]]:
        text = record
    elif not isinstance(record, dict):
        return None, ("not_object", type(record).__name__)
    else:
        for fields in alternatives:
            if all(record.get(f) is not None for f in fields):
                bad = [(f, type(record[f]).__name__) for f in fields if not isinstance(record[f], str)]
                if bad:
                    return None, ("non_string", bad)
                text = "\n".join(record[f] for f in fields)
                break
        else:
            first = next(f for f in alternatives[0] if record.get(f) is None)
            return None, ("missing", first)
    pos = _lone_surrogate(text)
    if pos is not None:
        return None, ("surrogate", f"lone surrogate U+{ord(text[pos]):04X} at character {pos}")
    return text, None


def _lone_surrogate(text: str) -> Optional[int]:
    if text.isascii():
        return None
    for i, c in enumerate(text):
        if "\ud800" <= c <= "\udfff":
            return i
    return None


def _record_text(record: Any, alternatives: list[list[str]]) -> tuple[str | None, tuple[str, str] | None]:
    text, why = document_text(record, alternatives)
    if why is None:
        return text, None
    kind, data = why
    if kind == "not_object":
        return None, (f"record is a {data}, not an object", "")
    if kind == "missing":
        return None, ("missing field", repr(data) if len(alternatives) == 1
                      else f"{data!r} (want {text_fields_spec(alternatives)})")
    if kind == "non_string":
        return None, ("non-string field", ", ".join(f"{f!r} is {t}" for f, t in data))
    return None, ("invalid Unicode", data)


class FileFieldCheck:
    """Whether any record of one file had the --text_fields, and the keys of the records that had none:
    a file skipped whole (say, another schema under the default "text") is a warning naming the file and
    its keys, never a silent skip."""

    MAX_KEYS = 20

    def __init__(self, path: str, alternatives: Sequence[Sequence[str]]):
        self.path, self.alternatives = path, alternatives
        self.records = self.matched = 0
        self.keys: set[str] = set()

    def saw(self, record: Any, missing: bool) -> None:
        self.records += 1
        if not missing:
            self.matched += 1
        elif self.matched == 0 and isinstance(record, dict) and len(self.keys) <= self.MAX_KEYS:
            self.keys.update(map(str, record))

    def skipped_whole(self) -> bool:
        return self.records > 0 and self.matched == 0 and bool(self.keys)

    def warning(self) -> str:
        keys = sorted(self.keys)
        shown = ", ".join(keys[:self.MAX_KEYS]) + (", ..." if len(keys) > self.MAX_KEYS else "")
        return (f"{self.path}: skipped whole: none of its {self.records} record(s) has the --text_fields "
                f"{text_fields_spec(self.alternatives)!r}; its records have the keys: {shown} "
                f"(pass e.g. --text_fields='{text_fields_spec(self.alternatives)}|{keys[0]}')")

    def warn(self, logger: logging.Logger) -> None:
        if self.skipped_whole():
            logger.warning("%s", self.warning())


def iter_file_documents(path: str, text_fields: Any, stats: SkipCounter) -> Iterator[tuple[str, int]]:
    """Yield (document, utf8_byte_length) for one file (or a tokenizer.dataset_source.DatasetSource), skipping or
    raising per the policy. `text_fields`:
    the --text_fields grammar (parse_text_fields). A file none of whose records has the fields is a warning
    naming it and its keys (unless `stats` is quiet: a second pass over the same files)."""
    alternatives = parse_text_fields(text_fields)
    columns = sorted({f for a in alternatives for f in a})
    if is_dataset_source(path):  # a Hugging Face dataset (tokenizer/dataset_source.py): records like parquet rows
        kind, records = "parquet", path.records(columns)
    else:
        kind, records = input_kind(path), iter_raw_records(path, stats, columns=columns)
    check = FileFieldCheck(str(path), alternatives)
    try:
        for line, index, rec in records:
            where = f"{path} row {index + 1}" if kind == "parquet" else f"{path}:{line}"
            if kind == "txt":
                text, reason = rec, None
            else:
                text, reason = _record_text(rec, alternatives)
                check.saw(rec, reason is not None and reason[0] == "missing field")
            if reason is not None:
                stats.skip(where, *reason)
                continue
            if not text:
                stats.empty_documents += 1
                continue
            yield text, len(text.encode("utf-8"))
    except OSError as e:
        raise CorpusError(f"{path}: cannot read: {e}") from e
    if not stats.quiet:
        check.warn(stats.logger)


def is_dataset_source(source: Any) -> bool:
    """A tokenizer.dataset_source.DatasetSource (a Hugging Face dataset's split) rather than a file path."""
    return not isinstance(source, (str, os.PathLike)) and hasattr(source, "records")


def source_size(source: Any) -> int:
    """Bytes of a file or a dataset source (progress bars)."""
    return source.size if is_dataset_source(source) else os.path.getsize(source)


def iter_documents(files: Sequence[str], text_fields: Sequence[str], stats: SkipCounter,
                   progress: bool = False, desc: str = "reading") -> Iterator[str]:
    """All documents of all files in order, with a tqdm bar over document bytes."""
    total = sum(source_size(f) for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc=desc, disable=not progress, mininterval=1.0) as bar:
        for path in files:
            for text, nbytes in iter_file_documents(path, text_fields, stats):
                bar.update(nbytes)
                yield text


@dataclass
class CorpusCount:
    documents: int = 0
    bytes: int = 0


def count_documents(files: Sequence[str], text_fields: Sequence[str], stats: SkipCounter,
                    progress: bool = False) -> CorpusCount:
    c = CorpusCount()
    total = sum(source_size(f) for f in files)
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
    quiet = SkipCounter(strict=False, quiet=True)  # skips were already counted and logged in the first pass
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


def command_exit_code(e: BaseException, log: logging.Logger) -> Optional[int]:
    """How a tokenizer command (train_tokenizer, extend_tokenizer) ends after `e`: a named error
    (utils.errors.exit_code_for) or a bad value (ValueError, an existing output dir) is logged in one
    line and gives its code (bad value: 2); None for anything else, which the caller re-raises."""
    from utils.errors import exit_code_for
    named = exit_code_for(e)
    if named is None and not isinstance(e, (ValueError, FileExistsError)):
        return None
    code = named[0] if named else EXIT_BAD_CONFIG
    log.error("%s: %s", "bad data" if code == EXIT_BAD_DATA else "bad configuration", e)
    return code
