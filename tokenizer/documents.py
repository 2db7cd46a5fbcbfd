"""Documents from raw records, for every command that reads raw text: the one --text_fields grammar
(`parse_text_fields`), how a record's fields become one document (`document_text`), a file's documents under the
bad-input policy (`iter_file_documents`), and the uniform random document sample behind --max_train_bytes
(`sample_documents`). Must never hold more than one document at a time, or drop one without counting it.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

from tqdm import tqdm

from tokenizer.corpus import CorpusError, SkipCounter, input_kind, is_dataset_source, source_size
from tokenizer.raw_records import iter_raw_records


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
