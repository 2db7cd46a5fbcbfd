"""Which raw inputs there are and the bad-input policy, for every command that reads raw text (tokenizer
trainer / extender, the pretokenizers). Reading them is tokenizer/raw_records.py's (record by record) and
tokenizer/documents.py's (records -> documents, the --max_train_bytes sample).

Owns: which files are inputs (.txt one document per line, .json array of objects, .jsonl, .parquet;
`input_kind`, `collect_input_files`; a Hugging Face dataset's split is a source too: `is_dataset_source`), the
bad-input policy (`SkipCounter`: count and log a skip, or raise under strict), the errors bad input raises
(`CorpusError` exit 3, `CorpusConfigError` exit 2) and how a tokenizer command ends on one (`command_exit_code`).
Must never: silently drop input without counting it.
"""
from __future__ import annotations

import glob
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA

log = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".txt", ".json", ".jsonl", ".parquet")
MAX_LOGGED_SKIPS = 5
STRICT_HINT = " (run without --strict to skip and count such records)"


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


def is_dataset_source(source: Any) -> bool:
    """A tokenizer.dataset_source.DatasetSource (a Hugging Face dataset's split) rather than a file path."""
    return not isinstance(source, (str, os.PathLike)) and hasattr(source, "records")


def source_size(source: Any) -> int:
    """Bytes of a file or a dataset source (progress bars)."""
    return source.size if is_dataset_source(source) else os.path.getsize(source)


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
