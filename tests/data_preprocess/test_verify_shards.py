"""Token ids outside the vocabulary and damaged shard bytes (issue 33 item 5): shards record their largest id and
sha256 when written; loading refuses a sidecar whose largest id is outside the vocabulary; every sample read is
checked against the vocabulary before it can reach an embedding (named shard and offset, exit 3 from the
trainer, where it was an IndexError traceback on a CPU and a device-side assert on CUDA); and
`python -m data_preprocess.verify` re-reads every shard whole: bit flips inside the valid id range too."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from data_preprocess import verify
from data_preprocess.shard_format import DataError, list_shards
from dataset.dataset_pretrain import PretokDatasetWithIndex
from tests.conftest import run_trainer, train_cmd


@pytest.fixture
def shards(tiny_pretrain_data, tmp_path):
    """A private copy of the tiny corpus's shards and index (the tests damage it)."""
    d = tmp_path / "shards"
    shutil.copytree(tiny_pretrain_data["data_dir"], d)
    return d


def _first_shard(d):
    info = list_shards(str(d))[0]
    return info, info.path, info.path[:-len(".bin")] + ".json"


def test_shards_record_their_largest_id_and_checksum_and_verify_passes(shards, capsys):
    info, _, _ = _first_shard(shards)
    ids = np.fromfile(info.path, dtype=info.dtype)
    assert info.sidecar["max_id"] == int(ids.max()) < info.vocab_size
    assert len(info.sidecar["sha256"]) == 64
    assert verify.main([f"--data_dir={shards}"]) == 0
    assert "shard(s) sound" in capsys.readouterr().out


def test_a_bit_flip_inside_the_id_range_is_found_by_verify(shards, capsys):
    info, path, _ = _first_shard(shards)
    ids = np.fromfile(path, dtype=info.dtype)
    ids[5] = (int(ids[5]) + 1) % info.vocab_size  # still a valid id: only the checksum can tell
    ids.tofile(path)
    list_shards(str(shards))  # loading's cheap checks pass (the size is right)
    assert verify.main([f"--data_dir={shards}"]) == 3
    err = capsys.readouterr().err
    assert f"{path}: sha256" in err and "differs from its sidecar's" in err, err


def test_an_id_outside_the_vocabulary_is_named_with_shard_and_offset(shards, capsys, tiny_pretrain_data,
                                                                    tiny_pretrain_run_args, tmp_path):
    info, path, _ = _first_shard(shards)
    ids = np.fromfile(path, dtype=info.dtype)
    bad = np.iinfo(info.dtype).max
    ids[7::5] = bad  # every sample holds some
    ids.tofile(path)
    assert verify.main([f"--data_dir={shards}"]) == 3
    assert f"{path}: token id {bad} at offset 7 is outside the vocabulary of {info.vocab_size}" in capsys.readouterr().err
    ds = PretokDatasetWithIndex(str(shards), tiny_pretrain_data["max_seq_len"])
    with pytest.raises(DataError, match=rf"{path} at token offset \d+: token id {bad} is outside the vocabulary"):
        ds[0]
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--data_dir")]
    r = run_trainer(train_cmd([*args, f"--data_dir={shards}", f"--out_dir={tmp_path / 'run'}", "--max_iters=2"]),
                    env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 3, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert len(lines) == 1 and "Traceback" not in r.stderr and f"token id {bad} is outside the vocabulary" in lines[0]


def test_a_sidecar_whose_largest_id_is_outside_the_vocabulary_is_refused_at_load(shards):
    _, _, side = _first_shard(shards)
    meta = json.loads(open(side).read())
    meta["max_id"] = meta["vocab_size"]
    with open(side, "w") as f:
        json.dump(meta, f)
    with pytest.raises(DataError, match=rf"{side}: field 'max_id' is {meta['vocab_size']}: the shard holds token ids"):
        list_shards(str(shards))


def test_verify_reads_a_shard_in_chunks_hashing_all_and_naming_a_late_bad_id_at_its_own_offset(shards, capsys,
                                                                                               monkeypatch):
    """The shard read in chunks of 8 tokens (the 16M-token default made small): a sound shard hashes to its
    sidecar's sha256 across chunks, and one id outside the vocabulary in the third chunk is found and named at its
    offset in the shard (not its offset inside the chunk)."""
    from data_preprocess import shard_format
    info, path, _ = _first_shard(shards)
    chunk = 8
    assert info.num_tokens > 4 * chunk
    assert shard_format.verify_shard(info, chunk_tokens=chunk) == []
    ids = np.fromfile(path, dtype=info.dtype)
    at = 2 * chunk + 3
    bad = info.vocab_size + 5
    ids[at] = bad
    ids.tofile(path)
    want = f"{path}: token id {bad} at offset {at} is outside the vocabulary of {info.vocab_size}"
    assert want in shard_format.verify_shard(info, chunk_tokens=chunk)
    # the command, with the chunk size made small the same way
    real = shard_format.verify_shard
    monkeypatch.setattr(shard_format, "verify_shard", lambda i: real(i, chunk_tokens=chunk))
    assert verify.main([f"--data_dir={shards}"]) == 3
    err = capsys.readouterr().err
    assert want in err and f"{path}: sha256" in err, err


def _damage_doc_offsets(shards, how):
    info, _, side = _first_shard(shards)
    idx_path = os.path.join(os.path.dirname(side), json.loads(open(side).read())["doc_index_file"])
    offs = np.load(idx_path)
    assert offs[0] == 0 and offs[-1] == info.num_tokens and offs.size >= 3
    if how == "garbage":
        with open(idx_path, "wb") as f:
            f.write(b"not an npy file")
        return idx_path
    offs = offs.copy()
    if how == "decreasing":
        offs[1] = offs[2] + 1
    elif how == "past_the_end":
        offs[-1] = info.num_tokens + 1
    elif how == "not_from_zero":
        offs[0] = 1
    np.save(idx_path, offs)
    return idx_path


@pytest.mark.parametrize("how", ["decreasing", "past_the_end", "not_from_zero"])
def test_verify_finds_damaged_document_offsets(shards, capsys, how):
    """The .bin and its sha256 are intact; only the document offsets (the .idx.npy) are wrong: verify names
    that file and fails."""
    info, _, _ = _first_shard(shards)
    idx_path = _damage_doc_offsets(shards, how)
    assert verify.main([f"--data_dir={shards}"]) == 3
    err = capsys.readouterr().err
    assert f"verify: error: {idx_path}: document offsets are not increasing from 0 to {info.num_tokens}" in err, err
    assert "sha256" not in err and "token id" not in err, err


def test_verify_names_unreadable_document_offsets(shards, capsys):
    idx_path = _damage_doc_offsets(shards, "garbage")
    assert verify.main([f"--data_dir={shards}"]) == 3
    err = capsys.readouterr().err
    assert f"verify: error: {idx_path}: unreadable document offsets (" in err, err


def test_a_shard_replaced_by_a_directory_of_the_same_size_is_one_line(shards, capsys):
    """A directory where a shard's .bin was, its size (a directory's st_size) what the sidecar says: one line
    naming it, exit 3, no traceback."""
    info, path, side = _first_shard(shards)
    os.remove(path)
    os.mkdir(path)
    meta = json.loads(open(side).read())
    meta["num_tokens"] = os.path.getsize(path) // info.dtype.itemsize  # the sizes agree
    open(side, "w").write(json.dumps(meta))
    assert verify.main([f"--data_dir={shards}"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path}: not a regular file" in err[0], err


def test_verify_on_a_pretokenized_sft_folder_says_what_it_is(tmp_path, capsys):
    """Not "interrupted run?": the folder is SFT data (its sft_meta.json), which verify does not check."""
    d = tmp_path / "sft_L96"
    d.mkdir()
    (d / "input_ids.bin").write_bytes(b"\0" * 8)
    (d / "labels.bin").write_bytes(b"\0" * 16)
    (d / "sft_meta.json").write_text("{}")
    assert verify.main([f"--data_dir={d}"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a pretokenized SFT folder (sft_meta.json)" in err[0] and "interrupted" not in err[0], err


def test_verify_passes_shards_that_split_a_document(tiny_pretrain_data, tmp_path, capsys):
    """The pretokenizer flushes a full shard in the middle of a document: the next shard opens with that
    document's end, so its first document start is past 0. That is the format, not damage (the first shard of an
    input still starts at 0: the not_from_zero case above)."""
    from data_preprocess.pretokenize_pretrain_data import main as pretokenize
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " + "words " * 40}) + "\n" for i in range(12)),
                      encoding="utf-8")
    out = tmp_path / "shards"
    assert pretokenize([f"--data_dir={corpus}", f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}",
                        f"--output_dir={out}", "--shard_size_tokens=97", "--num_workers=1", "--no_progress"]) == 0
    infos = list_shards(str(out))
    firsts = [int(np.load(i.path[:-len(".bin")] + ".idx.npy")[0]) for i in infos]
    assert len(infos) >= 3 and firsts[0] == 0 and any(f > 0 for f in firsts[1:]), firsts
    capsys.readouterr()
    assert verify.main([f"--data_dir={out}"]) == 0, capsys.readouterr().err
