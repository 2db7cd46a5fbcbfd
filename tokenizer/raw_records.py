"""The one raw-input reader (tokenizer trainer/extender and the pretokenizers): one input file, record by record,
with its line or row (`iter_raw_records`). data_preprocess/readers.py reads through here: where the two tools used
to differ (message wording, blank JSON Lines, a .json file that is not an array), a parameter keeps each tool's
behaviour. Undecodable records go through the bad-input policy (tokenizer/corpus.py's SkipCounter).
Must never: read a whole file into memory (except, under the pretokenizers' rules, a .json file that is not an
array, or a broken one to word its error), hold more than one record (or one parquet batch, or one JSON array
element) at a time, or silently drop input without counting it.
"""
from __future__ import annotations

import json
from typing import Any, Iterator, NamedTuple, Optional, Sequence

from tokenizer.corpus import CorpusConfigError, SkipCounter, UnreadableFile, input_kind

PARQUET_BATCH_ROWS = 1024
_JSON_CHUNK = 1 << 20
JSON_FILE_RULES = ("array_or_lines", "array_or_object")


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
