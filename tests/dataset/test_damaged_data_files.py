"""Damaged data files (issue 33 item 6): a shard sidecar, index_meta.json, train.npy, tokenizer_meta.json,
sft_meta.json / samples.npy of the wrong shape or type is a DataError (TokenizerMetaError for the tokenizer's
meta) naming the file and the field, exit 3 through utils.errors.exit_code_for; never a TypeError,
AttributeError, EOFError or IndexError traceback. The trainer's own line is checked for four of them."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from data_preprocess.shard_format import DataError
from utils.errors import exit_code_for


@pytest.fixture
def data_copy(tiny_pretrain_data, tmp_path) -> dict:
    """A private copy of the tiny pretraining shards + index and of the tokenizer directory."""
    d = dict(tiny_pretrain_data)
    shutil.copytree(d["data_dir"], tmp_path / "shards")
    shutil.copytree(d["tokenizer_dir"], tmp_path / "tok")
    d.update(data_dir=str(tmp_path / "shards"), tokenizer_dir=str(tmp_path / "tok"))
    d["sidecar"] = os.path.join(d["data_dir"], sorted(n for n in os.listdir(d["data_dir"]) if n.endswith(".json"))[0])
    d["index"] = os.path.join(d["data_dir"], f"index_L{d['max_seq_len']}")
    return d


def _edit_json(path: str, change) -> None:
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    obj = change(obj)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def _set(key, value):
    def change(obj):
        obj[key] = value
        return obj
    return change


def _damage(d: dict, case: str) -> tuple[str, str]:
    """Damage the copy; returns (the file the message must name, the words it must hold)."""
    side, idx = d["sidecar"], d["index"]
    meta, train = os.path.join(idx, "index_meta.json"), os.path.join(idx, "train.npy")
    if case == "sidecar_dtype_bogus":
        _edit_json(side, _set("dtype", "bogus"))
        return side, "field 'dtype' is \"bogus\", not a token id dtype"
    if case == "sidecar_num_tokens_null":
        _edit_json(side, _set("num_tokens", None))
        return side, "field 'num_tokens' is null, not an integer"
    if case == "sidecar_num_tokens_not_an_integer":
        _edit_json(side, _set("num_tokens", "57366x"))
        return side, "field 'num_tokens' is \"57366x\", not an integer"
    if case == "sidecar_vocab_size_float":
        _edit_json(side, _set("vocab_size", 384.5))
        return side, "field 'vocab_size' is 384.5, not an integer"
    if case == "sidecar_a_json_string":  # "dtype" etc. inside the string: the old `key in meta` passed it
        with open(side, "w", encoding="utf-8") as f:
            json.dump("dtype num_tokens vocab_size bos_id eos_id", f)
        return side, "the shard sidecar holds a JSON str, not an object"
    if case == "index_meta_a_list":
        _edit_json(meta, lambda obj: [obj])
        return meta, "the index meta holds a JSON list, not an object"
    if case == "index_meta_truncated":
        with open(meta, "r+b") as f:
            f.truncate(40)
        return meta, "unreadable index meta"
    if case == "index_meta_num_train_string":
        _edit_json(meta, _set("num_train", "5"))
        return meta, "field 'num_train' is \"5\", not an integer"
    if case == "index_meta_shard_without_tokens":
        _edit_json(meta, lambda obj: dict(obj, shards=[{"name": r["name"], "bytes": r["bytes"]} for r in obj["shards"]]))
        return meta, "field 'shards[0].tokens' is missing"
    if case == "train_npy_negative_offset":
        starts = np.load(train)
        starts[0] = -5
        np.save(train, starts)
        return train, "offset -5 at position 0 is negative"
    if case == "train_npy_empty":
        open(train, "wb").close()
        return train, "unreadable sample index"
    if case == "tokenizer_meta_a_list":
        _edit_json(os.path.join(d["tokenizer_dir"], "tokenizer_meta.json"), lambda obj: [obj])
        return os.path.join(d["tokenizer_dir"], "tokenizer_meta.json"), "holds a JSON list, not an object"
    if case == "tokenizer_meta_without_special_tokens":
        _edit_json(os.path.join(d["tokenizer_dir"], "tokenizer_meta.json"),
                   lambda obj: {k: v for k, v in obj.items() if k != "special_tokens"})
        return os.path.join(d["tokenizer_dir"], "tokenizer_meta.json"), "field 'special_tokens' is null, not an object"
    if case == "tokenizer_meta_vocab_size_null":
        _edit_json(os.path.join(d["tokenizer_dir"], "tokenizer_meta.json"), _set("vocab_size", None))
        return os.path.join(d["tokenizer_dir"], "tokenizer_meta.json"), "field 'vocab_size' is null, not an integer"
    raise AssertionError(case)


CASES = ["sidecar_dtype_bogus", "sidecar_num_tokens_null", "sidecar_num_tokens_not_an_integer",
         "sidecar_vocab_size_float", "sidecar_a_json_string", "index_meta_a_list", "index_meta_truncated",
         "index_meta_num_train_string", "index_meta_shard_without_tokens", "train_npy_negative_offset",
         "train_npy_empty", "tokenizer_meta_a_list", "tokenizer_meta_without_special_tokens",
         "tokenizer_meta_vocab_size_null"]


@pytest.mark.parametrize("case", CASES)
def test_damaged_data_file_is_one_data_error_naming_file_and_field(data_copy, case):
    from dataset import PretokDatasetWithIndex
    from tokenizer import load_tokenizer_meta
    path, words = _damage(data_copy, case)
    with pytest.raises(Exception) as e:
        if case.startswith("tokenizer_meta"):
            load_tokenizer_meta(data_copy["tokenizer_dir"])
        else:
            PretokDatasetWithIndex(data_copy["data_dir"], data_copy["max_seq_len"], split="train")
    named = exit_code_for(e.value)
    assert named is not None, f"{type(e.value).__name__}: {e.value}"  # not a traceback
    code, line = named
    assert code == 3 and line.startswith("data: ") and "\n" not in line
    assert f"{path}: " in line and words in line, line


def test_a_negative_offset_inside_the_index_is_named_when_read(data_copy):
    """The index is written sorted, so load checks its first and last offsets; a damaged one in the middle
    is named by the read (file and position), not an IndexError from the token stream."""
    from dataset import PretokDatasetWithIndex
    train = os.path.join(data_copy["index"], "train.npy")
    starts = np.load(train)
    starts[3] = -64
    np.save(train, starts)
    ds = PretokDatasetWithIndex(data_copy["data_dir"], data_copy["max_seq_len"], split="train")
    assert ds[2]["input_ids"].shape == (data_copy["max_seq_len"],)
    with pytest.raises(DataError, match=f"{train}: offset -64 at position 3 is outside the"):
        ds[3]


@pytest.mark.parametrize("case", ["sidecar_dtype_bogus", "index_meta_a_list", "train_npy_negative_offset",
                                  "tokenizer_meta_a_list"])
def test_the_trainer_exits_3_with_one_line(tiny_pretrain_run_args, data_copy, tmp_path, capsys, case):
    import train_my_ddp as T
    path, words = _damage(data_copy, case)
    args = [a for a in tiny_pretrain_run_args if not a.startswith(("--data_dir=", "--tokenizer_dir="))]
    code = T.main([*args, f"--data_dir={data_copy['data_dir']}", f"--tokenizer_dir={data_copy['tokenizer_dir']}",
                   f"--out_dir={tmp_path / 'run'}", "--max_iters=2"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1 and path in lines[0] and words in lines[0], err


def test_sft_meta_and_samples_of_the_wrong_shape_are_data_errors(tmp_path):
    """A pretokenized SFT folder (written here by hand in its documented layout): sft_meta.json that is a
    list, "dtype": "bogus", a samples.npy row pointing before the tokens or past them."""
    from dataset.dataset_sft import SFTDataset
    d = tmp_path / "sft"
    d.mkdir()
    ids = np.arange(40, dtype="<u2")
    ids.tofile(d / "input_ids.bin")
    np.full(40, -100, dtype="<i4").tofile(d / "labels.bin")
    rows = np.array([[0, 10, 0, 1], [10, 30, 0, 2]], dtype=np.int64)
    meta = {"dtype": "<u2", "num_tokens": 40, "max_seq_len": 32, "pad_id": 3, "num_samples": 2,
            "files": [{"path": "a.jsonl"}]}

    def write(m, r):
        (d / "sft_meta.json").write_text(json.dumps(m))
        np.save(d / "samples.npy", r)

    write(meta, rows)
    assert SFTDataset(str(d))[1]["input_ids"].tolist() == list(range(10, 39))  # the layout is right
    for m, r, words in (([meta], rows, "sft_meta.json: the sft_meta.json holds a JSON list, not an object"),
                        (dict(meta, dtype="bogus"), rows, "sft_meta.json: field 'dtype' is \"bogus\""),
                        (dict(meta, num_samples=None), rows, "sft_meta.json: field 'num_samples' is null"),
                        (meta, np.array([[-4, 10, 0, 1], [10, 30, 0, 2]]), "samples.npy: row 0 [-4, 10, 0, 1] points"),
                        (meta, np.array([[0, 10, 0, 1], [10, 31, 0, 2]]), "samples.npy: row 1 [10, 31, 0, 2] points"),
                        (meta, rows[:1], "samples.npy: expected int64 [2, 4]")):
        write(m, r)
        with pytest.raises(DataError) as e:
            SFTDataset(str(d))
        assert words in str(e.value) and exit_code_for(e.value)[0] == 3
