"""Validation that does not overlap training: exact-duplicate documents counted (and dropped with --dedup=true)
by the pretraining pretokenizer, recorded in the sidecars and kept right across re-runs."""
import json
import logging
import os

import numpy as np
import pytest

from data_preprocess.pretokenize_pretrain_data import main as pretok_main, pretokenize_pretrain
from data_preprocess.shard_format import list_shards, read_sidecar
from tests.data_preprocess.test_pretrain_data import BOS, EOS, META, fake_encode


def _jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")


def _run(src, out, dedup):
    return pretokenize_pretrain(str(src), None, str(out), num_workers=1, progress=False, encode_fn=fake_encode,
                                tokenizer_meta=META, dedup=dedup)


def _stream(out) -> list[int]:
    return np.concatenate([np.fromfile(s.path, dtype=s.dtype) for s in list_shards(str(out))]).tolist()


def _expected(texts) -> list[int]:
    return sum(([BOS] + fake_encode([t])[0] + [EOS] for t in texts), [])


def _final_sidecar(out, stem):
    names = sorted(n for n in os.listdir(out) if n.startswith(stem + "_") and n.endswith(".json"))
    return read_sidecar(os.path.join(out, names[-1]))


def test_duplicates_are_counted_and_dedup_drops_the_repeats(tmp_path):
    src = tmp_path / "raw"
    src.mkdir()
    _jsonl(src / "a.jsonl", ["alpha", "beta", "alpha", "gamma", "alpha"])
    _jsonl(src / "b.jsonl", ["beta", "delta", "delta"])  # "beta" repeats a document of a.jsonl
    kept = _run(src, tmp_path / "kept", dedup=False)
    assert kept["duplicate_documents"] == 4 and kept["documents"] == 8
    assert _final_sidecar(tmp_path / "kept", "a")["duplicate_documents"] == 2
    assert _final_sidecar(tmp_path / "kept", "b")["duplicate_documents"] == 2
    assert "dedup" not in _final_sidecar(tmp_path / "kept", "a")
    out = tmp_path / "dedup"
    s = _run(src, out, dedup=True)
    assert s["duplicate_documents"] == 4 and s["documents"] == 4
    assert _stream(out) == _expected(["alpha", "beta", "gamma", "delta"])  # the first copy of each, in order
    assert all(sh.sidecar["dedup"] is True for sh in list_shards(str(out)))
    # a re-run skips complete inputs and still reports what their sidecars recorded
    again = _run(src, out, dedup=True)
    assert len(again["skipped_complete"]) == 2 and again["duplicate_documents"] == 4
    # the flag changed: redone, not mixed with shards made the other way
    assert _run(src, tmp_path / "kept", dedup=True)["skipped_complete"] == []
    # a later input redone: the documents of the complete earlier one still count as seen
    _jsonl(src / "b.jsonl", ["beta", "delta", "gamma", "epsilon"])
    s = _run(src, out, dedup=True)
    assert s["skipped_complete"] == [str(src / "a.jsonl")] and s["duplicate_documents"] == 2 + 2
    assert _stream(out) == _expected(["alpha", "beta", "gamma", "delta", "epsilon"])
    # an earlier input redone: the later ones are redone too (which of their documents repeat depends on it)
    _jsonl(src / "a.jsonl", ["alpha", "zeta"])
    s = _run(src, out, dedup=True)
    assert s["skipped_complete"] == [] and s["duplicate_documents"] == 0
    assert _stream(out) == _expected(["alpha", "zeta", "beta", "delta", "gamma", "epsilon"])


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizer.train_tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("tok")
    _jsonl(d / "c.jsonl", [f"hello world {i} the quick brown fox" for i in range(200)])
    train_tokenizer(str(d / "c.jsonl"), str(d / "tok"), vocab_size=300)
    return str(d / "tok")


def test_the_command_prints_the_duplicate_count(tok_dir, tmp_path, caplog):
    src = tmp_path / "raw"
    src.mkdir()
    _jsonl(src / "a.jsonl", ["hello world", "the fox", "hello world", "hello world"])
    flags = [f"--data_dir={src}", f"--tokenizer_dir={tok_dir}", "--num_workers=1", "--no_progress"]
    with caplog.at_level(logging.INFO, logger="pretokenize_pretrain"):
        assert pretok_main([*flags, f"--out_dir={tmp_path / 'a'}"]) == 0
    assert ("2 exact-duplicate document(s) (the same text as an earlier one) are in the shards: they can land on "
            "both sides of the validation split; --dedup=true drops them") in caplog.messages
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pretokenize_pretrain"):
        assert pretok_main([*flags, f"--out_dir={tmp_path / 'b'}", "--dedup=true"]) == 0
    assert "dropped 2 exact-duplicate document(s) (--dedup=true: the first copy of each kept)" in caplog.messages
    assert sum(s.sidecar["num_documents"] for s in list_shards(str(tmp_path / "b"))) == 2
