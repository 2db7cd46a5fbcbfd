"""A Hugging Face `datasets` dataset as a raw-text input of the tokenizer trainer and the pretokenizer, read
record by record with the same --text_fields grammar as files (tokenizer.documents).

Owns: `DatasetSource` (one split of a dataset: what it is called in messages, its size for progress bars, its
identity for the pretokenizer's sidecars, its records) and `open_dataset_source(spec, split, data_files)`:
  - a `save_to_disk` folder (a Dataset: state.json + data-*.arrow; a DatasetDict: dataset_dict.json and one
    folder per split) is read with pyarrow alone, one record batch at a time: `datasets` need not be installed;
  - anything else goes to `datasets.load_dataset(spec, data_files=..., split=..., streaming=True)`: a builder
    with local files ("json", "parquet", "csv", "text" and --hf_data_files), a local folder of data files, or a
    hub name where the network allows (streaming: nothing is downloaded whole or cached). `datasets` is an
    optional package (it pulls pandas): without it this is one line naming `pip install datasets`, exit 2.
    --hf_data_files are read one file at a time, so a file the builder cannot read is named (CorpusError,
    exit 3), as a damaged file given with --data_dir is.
A spec that is a path (absolute, ./ or ../, or more than one '/': never a hub name) and is not there is one
line saying so (exit 2), before `datasets` is asked; a save_to_disk folder whose state.json or
dataset_dict.json is not the JSON object `datasets` writes is damaged data naming the file (exit 3).
Must never: hold more than one record batch in memory (save_to_disk folders), write a cache, or guess a split
that is not there (the available ones are named).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from typing import Any, Iterator, Optional, Sequence

from tokenizer.corpus import CorpusConfigError, CorpusError
from tokenizer.raw_records import Record

DATASETS_HINT = ("the `datasets` package is not installed (optional: it pulls pandas): pip install datasets; "
                 "a save_to_disk folder is read without it")


class DatasetSource:
    """One split of a Hugging Face dataset, as an input next to files (tokenizer.documents.iter_file_documents and
    data_preprocess.readers.iter_records accept it where they take a path)."""

    def __init__(self, spec: str, split: str, arrow_files: Optional[list[str]] = None,
                 data_files: Optional[list[str]] = None, fingerprint: str = "",
                 resolved_files: Optional[list[str]] = None):
        self.spec, self.split, self.arrow_files, self.data_files = spec, split, arrow_files, data_files
        self.fingerprint = fingerprint
        # the files --hf_data_files resolve to (globs expanded, datasets' order): read one at a time
        self.resolved_files = resolved_files

    @property
    def name(self) -> str:
        """How messages name it: `hf:<spec>[<split>]` (locations add ` row N`)."""
        return f"hf:{self.spec}[{self.split}]"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DatasetSource({self.name})"

    @property
    def stem(self) -> str:
        """A file-name stem for its token shards (the pretokenizer)."""
        base = os.path.basename(os.path.normpath(self.spec)) or "dataset"
        return "hf_" + re.sub(r"[^A-Za-z0-9._-]+", "_", f"{base}_{self.split}")

    @property
    def size(self) -> int:
        """Bytes on disk of what it reads (progress bars); 0 when unknown (a hub stream)."""
        files = self.arrow_files or [f for f in (self.data_files or []) if os.path.isfile(f)]
        return sum(os.path.getsize(f) for f in files)

    def identity(self) -> dict[str, Any]:
        """What the pretokenizer records as the source of its shards: a re-run redoes them when it changed."""
        files = self.arrow_files or [f for f in (self.data_files or []) if os.path.isfile(f)]
        return {"path": self.name, "fingerprint": self.fingerprint,
                "files": [{"path": os.path.abspath(f), "size": os.path.getsize(f),
                           "mtime_ns": os.stat(f).st_mtime_ns} for f in files]}

    def records(self, columns: Optional[Sequence[str]] = None) -> Iterator[Record]:
        """Every record as a dict (only `columns` that exist, when given), with its 0-based row index."""
        if self.arrow_files is not None:
            yield from self._arrow_records(columns)
            return
        row = 0
        with _quiet_builders():  # a read error is raised below, naming the file: the builder's own log is a repeat
            for path in self.resolved_files or [None]:  # None: the whole stream (a hub name, a folder)
                ds = _load_dataset(self.spec, self.split, self.data_files if path is None else [path])
                it, first = iter(ds), row
                while True:
                    try:
                        rec = next(it)
                    except StopIteration:
                        break
                    except Exception as e:  # noqa: BLE001 - pyarrow / the builders raise many types for bad data
                        msg = " ".join(str(e).split())[:300]
                        raise CorpusError(f"{path or self.name}: datasets.load_dataset({self.spec!r}) cannot read it "
                                          f"after {row - first} record(s) ({type(e).__name__}: {msg})") from None
                    yield Record(None, row, rec)
                    row += 1

    def _arrow_records(self, columns: Optional[Sequence[str]]) -> Iterator[Record]:
        import pyarrow as pa
        row = 0
        for path in self.arrow_files or []:
            try:
                with pa.memory_map(path) as src:
                    reader = pa.ipc.open_stream(src)
                    names = reader.schema.names
                    keep = None if columns is None else [c for c in columns if c in names]
                    for batch in reader:
                        if keep == []:  # none of the fields: rows of the dataset's keys, all null (missing)
                            for _ in range(batch.num_rows):
                                yield Record(None, row, dict.fromkeys(names))
                                row += 1
                            continue
                        for rec in (batch if keep is None else batch.select(keep)).to_pylist():
                            yield Record(None, row, rec)
                            row += 1
            except (OSError, pa.ArrowInvalid) as e:
                raise CorpusError(f"{path}: cannot read the dataset's arrow file ({e})") from e


@contextlib.contextmanager
def _quiet_builders() -> Iterator[None]:
    """The `datasets` builders' own ERROR lines ("Failed to load JSON from file ...") held back while a source is
    read (set once, not per record: setLevel clears every logger's cache): the exception that follows is
    reported once, naming the file."""
    logger = logging.getLogger("datasets.packaged_modules")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CorpusError(f"{path}: cannot read ({e})") from e


def _read_json_object(path: str) -> dict[str, Any]:
    """A save_to_disk folder's state.json / dataset_dict.json: a JSON object, else CorpusError naming it."""
    data = _read_json(path)
    if not isinstance(data, dict):
        raise CorpusError(f"{path}: not a save_to_disk dataset file (a JSON {type(data).__name__}, not an object)")
    return data


def _is_path(spec: str) -> bool:
    """A spec only a path can be: absolute, ./ ../ ~, or more than one '/' (a hub name is `name` or `owner/name`)."""
    return (os.path.isabs(spec) or spec.startswith(("./", "../", "~", "." + os.sep, ".." + os.sep))
            or spec.count("/") > 1 or spec.endswith(("/", os.sep)) or (os.sep != "/" and os.sep in spec))


def _saved_split(folder: str) -> tuple[list[str], str]:
    state = _read_json_object(os.path.join(folder, "state.json"))
    files = [os.path.join(folder, d["filename"]) for d in state.get("_data_files") or []
             if isinstance(d, dict) and isinstance(d.get("filename"), str)]
    missing = [f for f in files if not os.path.isfile(f)]
    if not files or missing:
        raise CorpusError(f"{folder}/state.json: names no arrow file, or one that is not there "
                          f"({', '.join(missing[:3]) or 'none listed'})")
    return files, str(state.get("_fingerprint") or "")


def open_dataset_source(spec: str, split: str = "train", data_files: Optional[Sequence[str]] = None) -> DatasetSource:
    """The `split` of --hf_dataset=`spec` (module docstring). CorpusConfigError (exit 2) for a split that is not
    there, a load_dataset call that fails, or no `datasets` package where it is needed; CorpusError (exit 3)
    for a damaged save_to_disk folder."""
    files = [f for f in (data_files or []) if f]
    if os.path.isfile(os.path.join(spec, "state.json")) and not files:  # save_to_disk(Dataset)
        arrow, fp = _saved_split(spec)
        return DatasetSource(spec, split, arrow_files=arrow, fingerprint=fp)
    if os.path.isfile(os.path.join(spec, "dataset_dict.json")) and not files:  # save_to_disk(DatasetDict)
        dict_file = os.path.join(spec, "dataset_dict.json")
        splits = _read_json_object(dict_file).get("splits")
        if not isinstance(splits, list) or not all(isinstance(x, str) for x in splits):
            raise CorpusError(f"{dict_file}: field 'splits' is not a list of split names ({splits!r:.80})")
        if split not in splits:
            raise CorpusConfigError(f"--hf_dataset={spec}: no split {split!r} (it has {', '.join(map(str, splits))}); "
                                    "pass --hf_split")
        arrow, fp = _saved_split(os.path.join(spec, split))
        return DatasetSource(spec, split, arrow_files=arrow, fingerprint=fp)
    if not os.path.exists(spec) and _is_path(spec):
        raise CorpusConfigError(f"--hf_dataset={spec}: no such folder (want a save_to_disk folder, a folder of data "
                                "files, a hub name, or a builder such as json with --hf_data_files)")
    missing = [f for f in files if not any(c in f for c in "*?[") and "://" not in f and not os.path.exists(f)]
    if missing:
        raise CorpusConfigError(f"--hf_data_files: {missing[0]}: no such file")
    ds = _load_dataset(spec, split, files or None)  # checked now: a bad name or split is told before any work
    del ds
    fp = f"load_dataset({spec!r}, split={split!r})"
    return DatasetSource(spec, split, data_files=files or None, fingerprint=fp,
                         resolved_files=_resolved_data_files(spec, split, files) if files else None)


def _resolved_data_files(spec: str, split: str, files: list[str]) -> Optional[list[str]]:
    """The files --hf_data_files name (globs expanded) in the order `datasets` reads them; None when they are
    not a plain list of local files (then the source is read as one stream)."""
    import datasets
    try:
        found = datasets.load_dataset_builder(spec, data_files=files).config.data_files
        resolved = [str(f) for f in (found or {}).get(split) or []]
    except Exception:  # noqa: BLE001 - load_dataset accepted these files: read them as one stream then
        return None
    return resolved if resolved and all(os.path.isfile(f) for f in resolved) else None


def _load_dataset(spec: str, split: str, data_files: Optional[list[str]]):
    try:
        import datasets
    except ImportError:
        if os.path.isdir(spec):  # a folder, but not one save_to_disk wrote
            raise CorpusConfigError(f"--hf_dataset={spec}: not a save_to_disk folder (no state.json or "
                                    f"dataset_dict.json); as a folder of data files it needs {DATASETS_HINT}") from None
        if not os.path.exists(spec):  # `owner/name` may be a mistyped relative folder as well as a hub name
            raise CorpusConfigError(f"--hf_dataset={spec}: no such folder; as a hub name or builder it needs "
                                    f"{DATASETS_HINT}") from None
        raise CorpusConfigError(f"--hf_dataset={spec}: {DATASETS_HINT}") from None
    try:
        return datasets.load_dataset(spec, data_files=data_files, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - datasets raises many types (not found, bad split, no network)
        msg = " ".join(str(e).split())[:400]
        bad_split = "split" in msg.lower() and split in msg  # it read the folder: the split is what is missing
        what = ("not a dataset: no state.json or dataset_dict.json (save_to_disk), and datasets.load_dataset cannot "
                "read it as a folder of data files" if os.path.isdir(spec) and not data_files and not bad_split
                else f"cannot load split {split!r} with datasets.load_dataset")
        raise CorpusConfigError(f"--hf_dataset={spec}: {what} ({type(e).__name__}: {msg})") from None


def add_hf_dataset_flags(p: Any) -> None:
    """--hf_dataset / --hf_split / --hf_data_files, the same in every command that reads raw text."""
    p.add_argument("--hf_dataset", default=None,
                   help="a Hugging Face dataset as input (with or instead of --data_dir): a save_to_disk folder "
                        "(read with pyarrow; `datasets` not needed), or what datasets.load_dataset takes, streamed: "
                        "a builder with --hf_data_files (json, parquet, csv, text), a local folder, a hub name")
    p.add_argument("--hf_split", default="train", help="--hf_dataset: which split")
    p.add_argument("--hf_data_files", nargs="+", action="extend", default=None,
                   help="--hf_dataset=<builder>: its data_files (local paths or globs); repeatable")


def hf_dataset_from_args(args: Any) -> Optional[DatasetSource]:
    """The DatasetSource the flags name, or None without --hf_dataset (CorpusConfigError: exit 2)."""
    if not getattr(args, "hf_dataset", None):
        if getattr(args, "hf_data_files", None):
            raise CorpusConfigError("--hf_data_files needs --hf_dataset=<builder> (e.g. json, parquet, csv, text)")
        return None
    return open_dataset_source(args.hf_dataset, args.hf_split, args.hf_data_files)
