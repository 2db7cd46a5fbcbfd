"""Validation that does not overlap training: exact-duplicate documents counted (and dropped with --dedup=true)
by the pretraining pretokenizer, recorded in the sidecars and kept right across re-runs; the sample index holds
out whole documents (--split_by=document, index format 2), deterministically, and still reads a format-1 index."""
import json
import logging
import os

import numpy as np
import pytest

from data_preprocess.build_pretrain_sample_index_map import build_index, main as index_main
from data_preprocess.pretokenize_pretrain_data import main as pretok_main, pretokenize_pretrain
from data_preprocess.shard_format import StaleIndexError, list_shards, read_sidecar
from dataset import PretokDatasetWithIndex
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


def _corpus(src, n_docs=400, distinct=77, seed=0):
    """n_docs documents of 2..70 characters (fake encoder: one token per byte), only `distinct` different texts."""
    rng = np.random.default_rng(seed)
    texts = ["".join(rng.choice(list("abcdefgh"), size=int(rng.integers(2, 70)))) for _ in range(distinct)]
    src.mkdir()
    _jsonl(src / "a.jsonl", [texts[int(i)] for i in rng.integers(0, distinct, size=n_docs)])


def _doc_spans(out):
    """[(start, end)] of every document of the stream: from the shards' document offsets."""
    from data_preprocess.build_pretrain_sample_index_map import document_starts
    shards = list_shards(str(out))
    starts = document_starts(shards)
    return list(zip(starts.tolist(), starts[1:].tolist() + [sum(s.num_tokens for s in shards)]))


def _docs_of(starts, L, spans):
    """Documents (their index) any token of the samples at `starts` (L+1 tokens each) belongs to."""
    ends = np.array([e for _, e in spans])
    out = set()
    for s in starts.tolist():
        out.update(range(int(np.searchsorted(ends, s, side="right")), int(np.searchsorted(ends, s + L, side="right")) + 1))
    return out


def test_validation_holds_out_whole_documents(tmp_path):
    src, out, L = tmp_path / "raw", tmp_path / "shards", 16
    _corpus(src)
    s = pretokenize_pretrain(str(src), None, str(out), num_workers=1, progress=False, encode_fn=fake_encode,
                             tokenizer_meta=META, shard_size_tokens=500, dedup=True)  # documents cross shards
    docs = s["documents"]
    assert docs + s["duplicate_documents"] == 400 and docs <= 77
    meta = build_index(str(out), L, val_ratio=0.1, seed=3)
    n = meta["num_samples"]
    assert meta["format_version"] == 2 and meta["split_by"] == "document" and meta["num_val"] == round(0.1 * n)
    assert meta["num_train"] + meta["num_val"] + meta["num_dropped"] == n and meta["documents"] == docs
    idx = out / f"index_L{L}"
    tr, va = np.load(idx / "train.npy"), np.load(idx / "val.npy")
    spans = _doc_spans(out)
    assert len(spans) == docs
    assert not _docs_of(tr, L, spans) & _docs_of(va, L, spans)  # no document has samples on both sides
    stream = np.concatenate([np.fromfile(s.path, dtype=s.dtype) for s in list_shards(str(out))])
    text = lambda d: stream[spans[d][0]:spans[d][1]].tobytes()  # noqa: E731
    assert not {text(d) for d in _docs_of(tr, L, spans)} & {text(d) for d in _docs_of(va, L, spans)}
    # deterministic: the same seed gives the same files, another seed other documents
    build_index(str(out), L, val_ratio=0.1, seed=3)
    assert np.array_equal(np.load(idx / "val.npy"), va) and np.array_equal(np.load(idx / "train.npy"), tr)
    build_index(str(out), L, val_ratio=0.1, seed=4)
    assert not np.array_equal(np.load(idx / "val.npy"), va)
    assert len(PretokDatasetWithIndex(str(out), L, split="val")) == meta["num_val"]
    # by sample (format 1's split, still there): documents land on both sides, and nothing is dropped
    m = build_index(str(out), L, val_ratio=0.1, seed=3, split_by="sample")
    assert m["split_by"] == "sample" and m["num_dropped"] == 0 and m["num_train"] + m["num_val"] == n
    assert _docs_of(np.load(idx / "train.npy"), L, spans) & _docs_of(np.load(idx / "val.npy"), L, spans)


def test_old_index_is_read_and_a_newer_one_refused(tmp_path):
    src, out, L = tmp_path / "raw", tmp_path / "shards", 16
    _corpus(src, n_docs=60, distinct=60)
    pretokenize_pretrain(str(src), None, str(out), num_workers=1, progress=False, encode_fn=fake_encode,
                         tokenizer_meta=META)
    meta = build_index(str(out), L, val_ratio=0.1, split_by="sample")
    path = out / f"index_L{L}" / "index_meta.json"
    old = {k: v for k, v in meta.items() if k not in ("split_by", "num_dropped")}
    path.write_text(json.dumps(dict(old, format_version=1)))  # as format 1 wrote it: still read
    assert len(PretokDatasetWithIndex(str(out), L)) == meta["num_train"]
    path.write_text(json.dumps(dict(meta, format_version=3)))
    with pytest.raises(StaleIndexError, match=r"index format 3, this code reads formats 1, 2; rebuild the index"):
        PretokDatasetWithIndex(str(out), L)


def test_too_few_documents_to_hold_out_is_a_clear_error(tmp_path, caplog):
    src, out, L = tmp_path / "raw", tmp_path / "shards", 8
    src.mkdir()
    _jsonl(src / "a.jsonl", ["x" * 300])  # one document
    pretokenize_pretrain(str(src), None, str(out), num_workers=1, progress=False, encode_fn=fake_encode,
                         tokenizer_meta=META)
    with pytest.raises(ValueError, match="cannot hold out 4 samples by document and keep training samples "
                                         r"\(1 document\(s\) in 1 run\(s\)"):
        build_index(str(out), L, val_ratio=0.1)
    assert index_main([f"--data_dir={out}", f"--max_seq_len={L}", "--val_ratio=0.1"]) == 2
    assert index_main([f"--data_dir={out}", f"--max_seq_len={L}", "--val_ratio=0.1", "--split_by=sample"]) == 0
    assert build_index(str(out), L, val_ratio=0.0)["num_dropped"] == 0  # nothing held out: no documents needed
