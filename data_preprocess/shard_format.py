"""On-disk format of pretraining token shards and their JSON sidecars.

Owns: the shard naming scheme, the id dtype rule (uint16 iff vocab_size <= 65536, else uint32),
the sidecar's JSON layout, writing a shard with its sidecar *last* (each file atomically through
utils/publish.py: temp name, fsync, os.replace; `remove_temp_files` drops what an interrupted run
left), and reading/validating the set of shards in a directory. Both the preprocessing commands and the
`dataset/` readers go through this module so the format lives in one place.

Must never: guess a dtype (it is always read from the sidecar), accept a shard whose sidecar
disagrees with the file size, or list a shard that has no sidecar as if it were complete.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

import utils.publish as _publish
from utils.publish import atomic_write_bytes, is_temp_name

FORMAT_VERSION = 1
SHARD_RE = re.compile(r"^(?P<stem>.+)_(?P<k>\d{5})\.json$")


class DataError(Exception):
    """Bad or stale input data. Commands turn it into exit code 3 (EXIT_BAD_DATA)."""
    exit_code, exit_prefix = 3, "data: "  # EXIT_BAD_DATA and the trainer's line: utils.errors.exit_code_for


class StaleIndexError(DataError):
    """An index was built for other shards or another sequence length."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id (ids are < vocab_size)."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 2 ** 16:
        return np.dtype("<u2")
    if vocab_size <= 2 ** 32:
        return np.dtype("<u4")
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32")


def shard_base(stem: str, k: int) -> str:
    return f"{stem}_{k:05d}"


# ----------------------------------------------------------------------------- atomic writes
# utils/publish.py's protocol: `<path>.tmp` (`<stem>.tmp.npy` for a .npy), fsync, os.replace.

def atomic_write_json(path: str, obj: Any) -> None:
    _publish.atomic_write_json(path, obj, indent=1, sort_keys=True, ensure_ascii=True)


def atomic_save_npy(path: str, arr: np.ndarray) -> None:
    # np.save appends ".npy" to names without it: the temp name keeps the suffix (`<stem>.tmp.npy`).
    assert path.endswith(".npy")
    with _publish.atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, arr)


def remove_temp_files(directory: str) -> int:
    """Delete leftovers of an interrupted run (`*.tmp`, `*.tmp.npy`: utils.publish.is_temp_name)."""
    n = 0
    if not os.path.isdir(directory):
        return 0
    for name in os.listdir(directory):
        if is_temp_name(name) and os.path.isfile(os.path.join(directory, name)):
            os.remove(os.path.join(directory, name))
            n += 1
    return n


# ----------------------------------------------------------------------------- writing

def write_shard(out_dir: str, stem: str, k: int, ids: np.ndarray, doc_offsets: np.ndarray,
                meta: dict) -> dict:
    """Write `<stem>_<k>.bin`, `<stem>_<k>.idx.npy` (document start offsets, n_docs+1 int64),
    then the sidecar `<stem>_<k>.json` last: a sidecar present means the shard is complete."""
    base = os.path.join(out_dir, shard_base(stem, k))
    dtype = np.dtype(meta["dtype"])
    ids = np.ascontiguousarray(ids, dtype=dtype)
    data = memoryview(ids).cast("B")
    atomic_write_bytes(base + ".bin", data)
    atomic_save_npy(base + ".idx.npy", np.asarray(doc_offsets, dtype=np.int64))
    sidecar = dict(meta)
    sidecar.update({
        "format_version": FORMAT_VERSION,
        "shard_index": k,
        "num_tokens": int(ids.size),
        "num_bytes": int(ids.nbytes),
        "num_documents": int(len(doc_offsets) - 1),
        "doc_index_file": shard_base(stem, k) + ".idx.npy",
        # checked at load (max_id < vocab_size) and by `python -m data_preprocess.verify` (the whole file)
        "max_id": int(ids.max()) if ids.size else 0,
        "sha256": hashlib.sha256(data).hexdigest(),
    })
    atomic_write_json(base + ".json", sidecar)  # fsyncs out_dir after the rename
    return sidecar


# ----------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class ShardInfo:
    name: str        # file name of the .bin
    path: str        # absolute path of the .bin
    num_tokens: int
    num_bytes: int
    dtype: np.dtype
    vocab_size: int
    fingerprint: str
    sidecar: dict


# ----------------------------------------------------------------------------- JSON files of the data
# Every sidecar and index file is read through these: a value of the wrong type ("num_tokens": null,
# "dtype": "bogus", a file that holds a list or a string) is a DataError naming the file and the field,
# never a TypeError / KeyError traceback deeper in (docs/errors.md, "Damaged data files").

def read_json_object(path: str, what: str) -> dict:
    """The JSON object in `path` (`what` names it in the message: "shard sidecar", "index meta", ...)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise DataError(f"{path}: unreadable {what} ({' '.join(str(e).split())[:200]})") from e
    if not isinstance(obj, dict):
        raise DataError(f"{path}: the {what} holds a JSON {type(obj).__name__}, not an object")
    return obj


def int_field(path: str, meta: dict, key: str, minimum: int = 0, label: Optional[str] = None) -> int:
    """meta[key] as an int >= minimum (a JSON integer: not null, a string, a float or a bool); `label`
    names the field in the message when it is nested (default: key)."""
    label = label or key
    if key not in meta:
        raise DataError(f"{path}: field '{label}' is missing")
    v = meta[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise DataError(f"{path}: field '{label}' is {json.dumps(v)[:40]}, not an integer")
    if v < minimum:
        raise DataError(f"{path}: field '{label}' is {v}, must be >= {minimum}")
    return v


def token_dtype_field(path: str, meta: dict, key: str = "dtype") -> np.dtype:
    """meta[key] as the dtype of token ids: an unsigned integer of 2 or 4 bytes ("<u2", "<u4")."""
    if key not in meta:
        raise DataError(f"{path}: field '{key}' is missing")
    v = meta[key]
    try:
        dt = np.dtype(v) if isinstance(v, str) else None
    except TypeError:
        dt = None
    if dt is None or dt.kind != "u" or dt.itemsize not in (2, 4):
        raise DataError(f"{path}: field '{key}' is {json.dumps(v)[:40]}, not a token id dtype (\"<u2\" or \"<u4\")")
    return dt


def read_sidecar(json_path: str) -> dict:
    """A shard's sidecar, its fields checked for type: dtype, num_tokens, vocab_size, bos_id (null: no bos), eos_id
    (and shard_index, final, tokenizer_fingerprint when present)."""
    meta = read_json_object(json_path, "shard sidecar")
    token_dtype_field(json_path, meta)
    int_field(json_path, meta, "num_tokens")
    vocab = int_field(json_path, meta, "vocab_size", minimum=1)
    if vocab > 2 ** 32:
        raise DataError(f"{json_path}: field 'vocab_size' is {vocab}, more ids than uint32 holds")
    for key in ("bos_id", "eos_id"):
        if key == "bos_id" and meta.get(key, 0) is None:  # documents without a bos (`ids </s>`)
            continue
        if int_field(json_path, meta, key) >= vocab:
            raise DataError(f"{json_path}: field '{key}' is {meta[key]}, outside the vocabulary of {vocab}")
    if "shard_index" in meta:
        int_field(json_path, meta, "shard_index")
    if "final" in meta and not isinstance(meta["final"], bool):
        raise DataError(f"{json_path}: field 'final' is {json.dumps(meta['final'])[:40]}, not true or false")
    if not isinstance(meta.get("tokenizer_fingerprint", ""), str):
        raise DataError(f"{json_path}: field 'tokenizer_fingerprint' is not a string")
    if "max_id" in meta and int_field(json_path, meta, "max_id") >= vocab:
        raise DataError(f"{json_path}: field 'max_id' is {meta['max_id']}: the shard holds token ids outside the "
                        f"vocabulary of {vocab} (re-tokenize it, or check --tokenizer_dir)")
    if "sha256" in meta and not (isinstance(meta["sha256"], str) and re.fullmatch(r"[0-9a-f]{64}", meta["sha256"])):
        raise DataError(f"{json_path}: field 'sha256' is {json.dumps(meta['sha256'])[:40]}, not a sha256 hex digest")
    return meta


def check_shard(json_path: str, meta: Optional[dict] = None) -> ShardInfo:
    """Validate one shard against its sidecar (dtype, size, vocab) and describe it."""
    meta = meta if meta is not None else read_sidecar(json_path)
    bin_path = json_path[:-len(".json")] + ".bin"
    dtype = token_dtype_field(json_path, meta)
    if dtype != dtype_for_vocab(int(meta["vocab_size"])):
        raise DataError(f"{json_path}: dtype {dtype} does not match vocab_size {meta['vocab_size']}")
    if not os.path.exists(bin_path):
        raise DataError(f"{bin_path}: missing although its sidecar exists")
    if not os.path.isfile(bin_path):  # a directory's size can equal the sidecar's byte count
        raise DataError(f"{bin_path}: not a regular file (a shard's tokens are one file)")
    size = os.path.getsize(bin_path)
    want = int(meta["num_tokens"]) * dtype.itemsize
    if size != want:
        raise DataError(f"{bin_path}: file has {size} bytes but its sidecar says "
                        f"{meta['num_tokens']} tokens x {dtype.itemsize} B = {want} bytes")
    return ShardInfo(name=os.path.basename(bin_path), path=os.path.abspath(bin_path),
                     num_tokens=int(meta["num_tokens"]), num_bytes=size, dtype=dtype,
                     vocab_size=int(meta["vocab_size"]),
                     fingerprint=str(meta.get("tokenizer_fingerprint", "")), sidecar=meta)


def list_shards(shard_dir: str) -> list[ShardInfo]:
    """All complete shards of a directory in name order, validated and mutually consistent.

    A `.bin` without a sidecar is an interrupted write: that is an error here (re-run the
    pretokenizer, which redoes it), never a silently shorter corpus."""
    if not os.path.isdir(shard_dir):
        why = "it is a file" if os.path.exists(shard_dir) else "it does not exist"
        raise DataError(f"{shard_dir}: not a directory of token shards: {why}")
    names = sorted(os.listdir(shard_dir))
    chat = [n for n in ("sft_meta.json", "dpo_meta.json") if n in names]  # data_preprocess/chat_tokens.py's
    if chat:
        raise DataError(f"{shard_dir}: a pretokenized {chat[0][:3].upper()} folder ({chat[0]}), not pretraining token "
                        "shards; the trainer checks such a folder when it loads it (its meta file, sizes and ids)")
    shards: list[ShardInfo] = []
    for name in names:
        if SHARD_RE.match(name):
            shards.append(check_shard(os.path.join(shard_dir, name)))
    with_sidecar = {s.name for s in shards}
    orphans = [n for n in names if n.endswith(".bin") and n not in with_sidecar]
    if orphans:
        raise DataError(f"{shard_dir}: shard(s) without sidecar (interrupted run? re-run the "
                        f"pretokenizer): {orphans[:5]}")
    if not shards:
        raise DataError(f"{shard_dir}: no token shards (<stem>_<k:05d>.bin + .json) found")
    first = shards[0]
    for s in shards[1:]:
        if (s.dtype, s.vocab_size, s.fingerprint) != (first.dtype, first.vocab_size, first.fingerprint):
            raise DataError(f"{shard_dir}: shards disagree: {first.name} has dtype={first.dtype} "
                            f"vocab={first.vocab_size} tokenizer={first.fingerprint[:12]} but {s.name} has "
                            f"dtype={s.dtype} vocab={s.vocab_size} tokenizer={s.fingerprint[:12]}")
    _check_sources_complete(shard_dir, shards)
    return shards


def _check_sources_complete(shard_dir: str, shards: list[ShardInfo]) -> None:
    by_stem: dict[str, list[ShardInfo]] = {}
    for s in shards:
        by_stem.setdefault(s.name.rsplit("_", 1)[0], []).append(s)
    for stem, group in by_stem.items():
        ks = sorted(int(g.sidecar.get("shard_index", -1)) for g in group)
        finals = [g for g in group if g.sidecar.get("final")]
        if ks != list(range(len(group))) or len(finals) != 1 or int(finals[0].sidecar["shard_index"]) != ks[-1]:
            raise DataError(f"{shard_dir}: shards of '{stem}' are incomplete (indices {ks[:10]}, "
                            f"final shard {'present' if finals else 'missing'}); re-run the pretokenizer")


def shards_fingerprint(shards: list[ShardInfo]) -> str:
    """Hash of the names, sizes and token counts: what an index depends on."""
    h = hashlib.sha256()
    for s in shards:
        h.update(f"{s.name}\0{s.num_bytes}\0{s.num_tokens}\0{s.fingerprint}\n".encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- token ids against the vocabulary

def check_ids(ids: np.ndarray, vocab_size: int, where) -> None:
    """Raise DataError when a token id of `ids` is >= vocab_size (an embedding lookup would fail: an IndexError
    on a CPU, a device-side assert that kills the process on CUDA). `where(i)` names the shard and offset of
    ids[i] for the message. One vectorised max: nothing measurable next to a training step."""
    if ids.size and int(ids.max()) >= vocab_size:
        i = int(np.argmax(ids >= vocab_size))
        raise DataError(f"{where(i)}: token id {int(ids[i])} is outside the vocabulary of {vocab_size} "
                        "(a damaged shard, or shards of another tokenizer; `python -m data_preprocess.verify` "
                        "checks every shard)")


def verify_shard(info: ShardInfo, chunk_tokens: int = 1 << 24) -> list[str]:
    """Problems of one shard read whole: its sha256 against the sidecar's (shards written before checksums were
    recorded have none to compare), every id against the vocabulary (the first one outside is named with its
    offset), the document offsets (increasing, within the shard). [] when sound."""
    problems = []
    h = hashlib.sha256()
    bad_at = None
    with open(info.path, "rb") as f:
        done = 0
        while True:
            raw = f.read(chunk_tokens * info.dtype.itemsize)
            if not raw:
                break
            h.update(raw)
            ids = np.frombuffer(raw, dtype=info.dtype)
            if bad_at is None and ids.size and int(ids.max()) >= info.vocab_size:
                i = int(np.argmax(ids >= info.vocab_size))
                bad_at = (done + i, int(ids[i]))
            done += ids.size
    want = info.sidecar.get("sha256")
    if want and h.hexdigest() != want:
        problems.append(f"{info.path}: sha256 {h.hexdigest()[:16]}... differs from its sidecar's {want[:16]}... "
                        "(the file changed after it was written: bit flips, or an edit)")
    if bad_at is not None:
        problems.append(f"{info.path}: token id {bad_at[1]} at offset {bad_at[0]} is outside the vocabulary of "
                        f"{info.vocab_size}")
    idx_name = info.sidecar.get("doc_index_file")
    if isinstance(idx_name, str):
        idx_path = os.path.join(os.path.dirname(info.path), os.path.basename(idx_name))
        try:
            offs = np.load(idx_path)
            # a shard after its input's first may open with the end of a document the one before it began
            # (the writer flushes full shards mid-document): its first start is then past 0
            m = SHARD_RE.match(info.name[:-len(".bin")] + ".json")
            first = 0 if m is None or int(m.group("k")) == 0 else None
            if offs.ndim != 1 or offs.size < 1 or offs[-1] != info.num_tokens or \
                    (offs[0] != first if first is not None else not 0 <= offs[0] <= info.num_tokens) or \
                    (offs.size > 1 and bool(np.any(np.diff(offs) < 0))):
                problems.append(f"{idx_path}: document offsets are not increasing from "
                                f"{first if first is not None else 'a start in the shard'} to {info.num_tokens}")
        except (OSError, ValueError, EOFError) as e:
            problems.append(f"{idx_path}: unreadable document offsets ({type(e).__name__})")
    return problems

