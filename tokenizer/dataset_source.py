"""A Hugging Face `datasets` dataset as a raw-text input of the tokenizer trainer and the pretokenizer, read
record by record with the same --text_fields grammar as files (tokenizer.corpus).

Owns: `DatasetSource` (one split of a dataset: what it is called in messages, its size for progress bars, its
identity for the pretokenizer's sidecars, its records) and `open_dataset_source(spec, split, data_files)`:
  - a `save_to_disk` folder (a Dataset: state.json + data-*.arrow; a DatasetDict: dataset_dict.json and one
    folder per split) is read with pyarrow alone, one record batch at a time: `datasets` need not be installed;
  - anything else goes to `datasets.load_dataset(spec, data_files=..., split=..., streaming=True)`: a builder
    with local files ("json", "parquet", "csv", "text" and --hf_data_files), a local folder of data files, or a
    hub name where the network allows (streaming: nothing is downloaded whole or cached). `datasets` is an
    optional package (it pulls pandas): without it this is one line naming `pip install datasets`, exit 2.
Must never: hold more than one record batch in memory (save_to_disk folders), write a cache, or guess a split
that is not there (the available ones are named).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any, Iterator, Optional, Sequence

from tokenizer.corpus import CorpusConfigError, CorpusError, Record

DATASETS_HINT = ("the `datasets` package is not installed (optional: it pulls pandas): pip install datasets; "
                 "a save_to_disk folder is read without it")


class DatasetSource:
    """One split of a Hugging Face dataset, as an input next to files (tokenizer.corpus.iter_file_documents and
    data_preprocess.readers.iter_records accept it where they take a path)."""

    def __init__(self, spec: str, split: str, arrow_files: Optional[list[str]] = None,
                 data_files: Optional[list[str]] = None, fingerprint: str = ""):
        self.spec, self.split, self.arrow_files, self.data_files = spec, split, arrow_files, data_files
        self.fingerprint = fingerprint

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
        ds = _load_dataset(self.spec, self.split, self.data_files)
        for i, rec in enumerate(ds):
            yield Record(None, i, rec)

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


def _read_json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CorpusError(f"{path}: cannot read ({e})") from e


def _saved_split(folder: str) -> tuple[list[str], str]:
    state = _read_json(os.path.join(folder, "state.json"))
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
        splits = _read_json(os.path.join(spec, "dataset_dict.json")).get("splits") or []
        if split not in splits:
            raise CorpusConfigError(f"--hf_dataset={spec}: no split {split!r} (it has {', '.join(map(str, splits))}); "
                                    "pass --hf_split")
        arrow, fp = _saved_split(os.path.join(spec, split))
        return DatasetSource(spec, split, arrow_files=arrow, fingerprint=fp)
    missing = [f for f in files if not any(c in f for c in "*?[") and "://" not in f and not os.path.exists(f)]
    if missing:
        raise CorpusConfigError(f"--hf_data_files: {missing[0]}: no such file")
    ds = _load_dataset(spec, split, files or None)  # checked now: a bad name or split is told before any work
    del ds
    fp = f"load_dataset({spec!r}, split={split!r})"
    return DatasetSource(spec, split, data_files=files or None, fingerprint=fp)


def _load_dataset(spec: str, split: str, data_files: Optional[list[str]]):
    try:
        import datasets
    except ImportError:
        raise CorpusConfigError(f"--hf_dataset={spec}: {DATASETS_HINT}") from None
    try:
        return datasets.load_dataset(spec, data_files=data_files, split=split, streaming=True)
    except Exception as e:  # noqa: BLE001 - datasets raises many types (not found, bad split, no network)
        msg = " ".join(str(e).split())[:400]
        raise CorpusConfigError(f"--hf_dataset={spec}: cannot load split {split!r} with datasets.load_dataset "
                                f"({type(e).__name__}: {msg})") from None


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
