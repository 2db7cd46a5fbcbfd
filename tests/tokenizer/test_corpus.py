"""Corpus streaming for tokenizer training: formats, fields, bad-input policy, sampling, CLI exit codes."""
import json
import os
import random
import sys
import tracemalloc

import pytest

from tokenizer import corpus as C
from tokenizer import documents as D
from tokenizer import raw_records as RR
from tokenizer import train_tokenizer
from tests.conftest import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _docs(path, fields=("text",), strict=False):
    stats = C.SkipCounter(strict=strict, quiet=True)
    return [d for d, _ in D.iter_file_documents(str(path), fields, stats)], stats


def test_txt_is_one_document_per_line(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes("first doc\r\n\nsecond 文档\n  third  \n".encode())
    docs, stats = _docs(p)
    assert docs == ["first doc", "second 文档", "  third  "]
    assert stats.empty_documents == 1 and stats.total == 0


def test_jsonl_and_text_fields_joined(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"title": "T1", "content": "body 1"}\n\n{"title": "T2", "content": "b2", "x": 1}\n', encoding="utf-8")
    assert _docs(p, ("title", "content"))[0] == ["T1\nbody 1", "T2\nb2"]


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_json_array_is_streamed(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(RR, "_JSON_CHUNK", chunk)  # tiny chunks force many refills mid-element
    recs = [{"text": f"doc {i} " + "字" * i, "n": 12345 + i} for i in range(50)]
    p = tmp_path / "a.json"
    p.write_text(json.dumps(recs, ensure_ascii=False, indent=2), encoding="utf-8")
    assert _docs(p)[0] == [r["text"] for r in recs]
    (tmp_path / "e.json").write_text(" [ ] ")
    assert _docs(tmp_path / "e.json")[0] == []
    (tmp_path / "l.json").write_text('{"text": "a"}\n{"text": "b"}\n')  # JSON Lines under .json
    assert _docs(tmp_path / "l.json")[0] == ["a", "b"]


def test_parquet_batches_and_fields(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2500  # more than one 1024-row batch
    title = [f"t{i}" for i in range(n)]
    content = [None if i == 7 else f"c{i}" for i in range(n)]
    pq.write_table(pa.table({"title": title, "content": content, "other": list(range(n))}), tmp_path / "a.parquet",
                   row_group_size=1000)
    docs, stats = _docs(tmp_path / "a.parquet", ("title", "content"))
    assert len(docs) == n - 1 and docs[0] == "t0\nc0" and docs[-1] == f"t{n - 1}\nc{n - 1}"
    assert stats.counts["missing field"] == 1 and "a.parquet row 8" in stats.first_locations[0]
    _, stats = _docs(tmp_path / "a.parquet", ("other",))
    assert stats.counts["non-string field"] == n


def _bad_jsonl(tmp_path):
    p = tmp_path / "bad.jsonl"
    lines = [b'{"text": "good 1"}', b'{"text": "broken', b'{"body": "no text"}', b'{"text": 5}',
             b'{"text": "bad utf8 \xff\xfe"}', b'[1, 2]', b'{"text": "\\ud800 lone"}', b'{"text": null}',
             b'{"text": "good 2"}']
    p.write_bytes(b"\n".join(lines) + b"\n")
    return p


def test_bad_records_are_counted_and_located(tmp_path):
    p = _bad_jsonl(tmp_path)
    docs, stats = _docs(p)
    assert docs == ["good 1", "good 2"]
    assert stats.total == 7
    assert stats.counts == {"malformed JSON": 1, "missing field": 2, "non-string field": 1, "invalid UTF-8": 1,
                            "record is a list, not an object": 1, "invalid Unicode": 1}
    assert stats.first_locations[0].startswith(f"{p}:2: malformed JSON")
    assert f"{p}:3: missing field" in stats.first_locations[1]
    assert len(stats.first_locations) == C.MAX_LOGGED_SKIPS


def test_strict_raises_with_file_and_line(tmp_path):
    p = _bad_jsonl(tmp_path)
    with pytest.raises(C.CorpusError, match=rf"{p}:2: malformed JSON"):
        _docs(p, strict=True)
    t = tmp_path / "bad.txt"
    t.write_bytes(b"fine\nnot utf8 \xc3\x28\n")
    assert _docs(t)[1].counts == {"invalid UTF-8": 1}
    with pytest.raises(C.CorpusError, match=rf"{t}:2: invalid UTF-8"):
        _docs(t, strict=True)


def test_malformed_json_array_skips_rest_of_file(tmp_path):
    p = tmp_path / "a.json"
    p.write_text('[\n{"text": "one"},\n{"text": "two"},\n{"text": oops},\n{"text": "four"}\n]')
    docs, stats = _docs(p)
    assert docs == ["one", "two"] and stats.total == 1
    assert stats.first_locations[0].startswith(f"{p}:4: malformed JSON")
    with pytest.raises(C.CorpusError, match=f"{p}:4"):
        _docs(p, strict=True)


def test_find_files_and_errors(tmp_path):
    (tmp_path / "sub").mkdir()
    for name in ["a.txt", "sub/b.jsonl", "sub/c.md", "d.parquet"]:
        (tmp_path / name).write_text("x\n")
    assert [os.path.relpath(f, tmp_path) for f in C.find_files(str(tmp_path))] == ["a.txt", "d.parquet", "sub/b.jsonl"]
    assert [os.path.basename(f) for f in C.find_files(str(tmp_path), recursive=False)] == ["a.txt", "d.parquet"]
    assert [os.path.basename(f) for f in C.find_files(str(tmp_path), "**/*.jsonl")] == ["b.jsonl"]
    with pytest.raises(C.CorpusConfigError, match="c.md: unsupported"):
        C.find_files([str(tmp_path / "sub" / "c.md")])
    with pytest.raises(C.CorpusError, match="no such file"):
        C.find_files(str(tmp_path / "missing.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(C.CorpusError, match="no .* files found"):
        C.find_files(str(tmp_path / "empty"))


def test_empty_corpus_and_small_vocab_errors(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "x"}\n\n')
    for t in ["hf_bbpe", "sp_bbpe"]:
        with pytest.raises(C.CorpusError, match=r"no usable documents.*missing field"):
            train_tokenizer(str(tmp_path), str(tmp_path / f"out_{t}"), 400, t)
        with pytest.raises(C.CorpusError, match=r"no usable documents"):
            train_tokenizer(str(tmp_path), str(tmp_path / f"out_{t}"), 400, t, max_train_bytes=100)
    (tmp_path / "b.txt").write_text("some text\n")
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(str(tmp_path), str(tmp_path / "o"), 262, "hf_bbpe")
    assert not os.path.exists(tmp_path / "o")


def _equal_docs_corpus(tmp_path, n_files=3, per_file=400):
    for k in range(n_files):
        with open(tmp_path / f"f{k}.jsonl", "w") as f:
            for i in range(per_file):
                f.write(json.dumps({"text": f"{k:02d}-{i:05d}" + "x" * 92}) + "\n")  # 100 bytes each
    files = C.find_files(str(tmp_path))
    stats = C.SkipCounter(quiet=True)
    return files, D.count_documents(files, ("text",), stats)


def test_sampling_is_uniform_over_documents(tmp_path):
    files, count = _equal_docs_corpus(tmp_path)
    assert (count.documents, count.bytes) == (1200, 120000)
    hits = {}
    trials = 150
    for seed in range(trials):
        sample = list(D.sample_documents(files, ("text",), 30000, seed, count))
        assert len(sample) == 300 and len(set(sample)) == 300  # exactly k = N * 30000/120000
        for d in sample:
            hits[d[:8]] = hits.get(d[:8], 0) + 1
    assert sample == list(D.sample_documents(files, ("text",), 30000, trials - 1, count))  # seeded
    # Each file holds a third of the documents, so a third of the sample (not the first file first).
    per_file = [sum(v for k, v in hits.items() if k.startswith(f"{f:02d}")) for f in range(3)]
    assert all(abs(x / (300 * trials) - 1 / 3) < 0.01 for x in per_file)
    # Each document is picked with p = 0.25: mean over trials ~ 37.5, no document systematically favoured.
    counts = [hits.get(f"{k:02d}-{i:05d}", 0) for k in range(3) for i in range(400)]
    assert abs(sum(counts) / len(counts) - 37.5) < 1e-9
    first_half = sum(counts[i] for k in range(3) for i in range(k * 400, k * 400 + 200))
    assert abs(first_half / sum(counts) - 0.5) < 0.02
    assert max(counts) < 37.5 + 6 * (150 * 0.25 * 0.75) ** 0.5


def test_sampling_memory_is_bounded(tmp_path):
    files, count = _equal_docs_corpus(tmp_path, n_files=2, per_file=30000)  # 6 MB corpus
    tracemalloc.start()
    n = sum(1 for _ in D.sample_documents(files, ("text",), 3_000_000, 0, count))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 30000
    assert peak < 1_000_000, f"sampling held {peak} bytes for a 6 MB corpus"


def test_train_with_sample_and_fields_json_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    words = "alpha beta gamma 数据 模型 delta".split()
    recs = [{"title": " ".join(rng.choices(words, k=3)), "content": " ".join(rng.choices(words, k=20))}
            for _ in range(600)]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.json").write_text(json.dumps(recs[:300], ensure_ascii=False))
    pq.write_table(pa.Table.from_pylist(recs[300:]), tmp_path / "d" / "b.parquet")
    meta = train_tokenizer(str(tmp_path / "d"), str(tmp_path / "tok"), 320, "hf_bbpe",
                           text_fields=("title", "content"), max_train_bytes=20000, seed=3)
    tr = meta["training"]
    assert tr["corpus_documents"] == 600 and 0 < tr["train_documents"] < 600
    assert tr["corpus_bytes"] > 20000 and tr["skipped"] == 0
    again = train_tokenizer(str(tmp_path / "d"), str(tmp_path / "tok2"), 320, "hf_bbpe",
                            text_fields="title,content", max_train_bytes=20000, seed=3)
    assert again["fingerprint"] == meta["fingerprint"]  # same seed, same sample, same files


def _cli(*args):
    return run_python([sys.executable, "-m", "tokenizer.train_tokenizer", *args], cwd=ROOT, timeout=120)


def test_cli_help_policy_and_exit_codes(tmp_path):
    r = _cli("--help")
    assert r.returncode == 0 and "SKIPPED and COUNTED" in r.stdout and "--strict" in r.stdout
    bad = _bad_jsonl(tmp_path)
    (tmp_path / "good.txt").write_text("\n".join(f"line {i} of text 文本" for i in range(200)) + "\n")
    out = tmp_path / "tok"
    r = _cli(f"--data_dir={bad}", f"--data_dir={tmp_path / 'good.txt'}", f"--output_dir={out}",
             "--vocab_size=300", "--tokenizer_type=sp_bbpe", "--strict", "--quiet")
    assert r.returncode == 3 and f"{bad}:2: malformed JSON" in r.stderr and not out.exists()
    r = _cli(f"--data_dir={tmp_path}", f"--output_dir={out}", "--vocab_size=300", "--tokenizer_type=sp_bbpe",
             "--quiet", "--num_threads=1", "--file_glob=*")
    assert r.returncode == 0, r.stderr
    meta = json.load(open(out / "tokenizer_meta.json"))
    assert meta["training"]["skipped"] == 7 and meta["training"]["train_documents"] == 202
    assert "skipping" in r.stderr and f"{bad}:2" in r.stderr
    r = _cli(f"--data_dir={tmp_path}", f"--output_dir={out}", "--vocab_size=100", "--quiet")
    assert r.returncode == 2 and "too small" in r.stderr
    r = _cli(f"--data_dir={tmp_path / 'nope'}", f"--output_dir={out}", "--vocab_size=300", "--quiet",
             "--overwrite=true")  # (without it: the trained tokenizer there is refused first, exit 2)
    assert r.returncode == 3 and "no such file" in r.stderr


def test_max_train_bytes_accepts_human_sizes():
    import argparse

    from tokenizer.train_tokenizer import parse_byte_size
    assert [parse_byte_size(s) for s in ("2000000000", "2e9", "2G", "500M", "64kB")] == \
        [2_000_000_000, 2_000_000_000, 2_000_000_000, 500_000_000, 64_000]
    for bad in ("abc", "-5", "0", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_byte_size(bad)
