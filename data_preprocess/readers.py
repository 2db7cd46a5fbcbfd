"""Reading raw records from .jsonl, .json (a top-level array) and .parquet files.

Owns: finding input files, decoding them record by record with a location ("file:line" for
jsonl, "file:record N" for json arrays / parquet), the bad-record policy (counted, logged skip
by default; an error naming file and line under strict=True), and extracting the text of a
pretraining document from configurable fields.

Must never: tokenize, silently drop a record without counting it, or guess at a text from a
non-string field.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

from data_preprocess.shard_format import DataError

log = logging.getLogger(__name__)

INPUT_EXTENSIONS = (".jsonl", ".json", ".parquet")
MAX_LOGGED_SKIPS = 20  # per file: enough to diagnose, not enough to flood the log


@dataclass
class SkipCounter:
    """Counts skipped records per reason; logs the first few with their location."""
    strict: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    logged: int = 0

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        if self.strict:
            raise DataError(f"{where}: {reason}{': ' + detail if detail else ''}")
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if self.logged < MAX_LOGGED_SKIPS:
            log.warning("skipping %s: %s%s", where, reason, f" ({detail})" if detail else "")
            self.logged += 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def find_input_files(data_dir_or_files: str | Sequence[str], exclude_dir: Optional[str] = None) -> list[str]:
    """Sorted input files under a directory (recursively) or an explicit list."""
    if isinstance(data_dir_or_files, (list, tuple)):
        files = [os.path.abspath(p) for p in data_dir_or_files]
    elif os.path.isfile(data_dir_or_files):
        files = [os.path.abspath(data_dir_or_files)]
    elif os.path.isdir(data_dir_or_files):
        files = []
        excl = os.path.abspath(exclude_dir) if exclude_dir else None
        for root, dirs, names in os.walk(data_dir_or_files):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")
                             and (excl is None or os.path.abspath(os.path.join(root, d)) != excl))
            files += [os.path.abspath(os.path.join(root, n)) for n in names
                      if n.endswith(INPUT_EXTENSIONS) and not n.startswith(".")]
    else:
        raise DataError(f"{data_dir_or_files}: no such file or directory")
    files = sorted(files)
    for p in files:
        if not p.endswith(INPUT_EXTENSIONS):
            raise DataError(f"{p}: unsupported input type (want {', '.join(INPUT_EXTENSIONS)})")
    return files


def iter_records(path: str, skips: SkipCounter) -> Iterator[tuple[str, int, Any]]:
    """Yield (location, position, record) for every decodable record of a file; position is the
    1-based line of a .jsonl, the 0-based record/row index of a .json array or .parquet.

    Undecodable lines (invalid UTF-8, malformed JSON) go through `skips` (error if strict).
    An empty file yields nothing and is logged; the caller counts documents."""
    if os.path.getsize(path) == 0:
        log.warning("%s: empty file", path)
        return
    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    skips.skip("invalid UTF-8", where, str(e))
                    continue
                if not line.strip():
                    continue  # blank lines are not records
                try:
                    yield where, lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    skips.skip("malformed JSON", where, str(e))
    elif path.endswith(".json"):
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: invalid UTF-8 ({e})") from e
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg})") from e
        if isinstance(data, dict):
            data = [data]
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json input must hold an array of records")
        for i, rec in enumerate(data):
            yield f"{path}:record {i}", i, rec
    elif path.endswith(".parquet"):
        import pyarrow.parquet as pq
        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: unreadable parquet ({e})") from e
        row = 0
        for batch in pf.iter_batches(batch_size=4096):
            for rec in batch.to_pylist():
                yield f"{path}:row {row}", row, rec
                row += 1
    else:
        raise DataError(f"{path}: unsupported input type")


def parse_text_fields(spec: str | Sequence[str]) -> list[list[str]]:
    """`"text|title,content"` -> [["text"], ["title", "content"]].

    `|` separates alternatives tried in order; `,` joins several fields with a newline.
    A sequence is a list of alternatives: ("text", "title,content") == "text|title,content"."""
    if not isinstance(spec, str):
        spec = "|".join(spec)
    alts = [[f.strip() for f in alt.split(",") if f.strip()] for alt in spec.split("|")]
    alts = [a for a in alts if a]
    if not alts:
        raise ValueError(f"empty --text_fields spec: {spec!r}")
    return alts


def extract_text(rec: Any, alternatives: list[list[str]], where: str, skips: SkipCounter) -> Optional[str]:
    """The document text of a record, or None (counted skip) when no alternative applies."""
    if not isinstance(rec, dict):
        skips.skip("record is not an object", where, type(rec).__name__)
        return None
    for fields in alternatives:
        if all(f in rec and rec[f] is not None for f in fields):
            vals = [rec[f] for f in fields]
            bad = [f for f, v in zip(fields, vals) if not isinstance(v, str)]
            if bad:
                skips.skip("non-string text field", where, ", ".join(f"{b}={type(rec[b]).__name__}" for b in bad))
                return None
            return "\n".join(vals)
    skips.skip("missing text field", where, "want " + " | ".join(",".join(a) for a in alternatives))
    return None
