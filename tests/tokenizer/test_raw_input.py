"""The one raw-input reader (tokenizer/raw_records.py) behind both the tokenizer trainer and the pretokenizers:
the same records and the same count of bad lines through either, each tool keeping its own wording of
skips and errors, its own rules where they always differed (blank lines, .json files that are not one
array), and bounded memory for .json arrays in both."""
import json
import logging
import tracemalloc

import pytest

from data_preprocess import readers as R
from data_preprocess.shard_format import DataError
from tokenizer import corpus as C
from tokenizer import documents as D
from tokenizer import raw_records as RR

BAD_LINES = [b'{"text": "good 1"}', b'{"text": "broken', b'', b'{"text": "bad utf8 \xff"}', b'\xc2\xa0',
             b'[1, 2]', b'{"body": "no text"}', b'{"text": "good 2"}']


def _bad_jsonl(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(b"\n".join(BAD_LINES) + b"\n")
    return p


def _tokenizer_side(path, strict=False):
    stats = C.SkipCounter(strict=strict)
    return [d for d, _ in D.iter_file_documents(str(path), ("text",), stats)], stats


def _pretokenizer_side(path, strict=False):
    skips = R.skip_counter(strict)
    docs = []
    for where, _, rec in R.iter_records(str(path), skips):
        text = rec if R.input_kind(str(path)) == "txt" else R.extract_text(rec, [["text"]], where, skips)
        if text is not None:
            docs.append(text)
    return docs, skips


def test_both_tools_read_the_same_records_and_count_the_same_bad_lines(tmp_path, caplog):
    p = _bad_jsonl(tmp_path)
    with caplog.at_level(logging.WARNING):
        tok_docs, tok = _tokenizer_side(p)
    tok_log = caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        pre_docs, pre = _pretokenizer_side(p)
    pre_log = caplog.text
    assert tok_docs == pre_docs == ["good 1", "good 2"]
    # line-level problems are found by the one reader: the same lines, under the same reasons
    assert tok.counts["invalid UTF-8"] == pre.counts["invalid UTF-8"] == 1
    assert tok.counts["malformed JSON"] == 2 and pre.counts["malformed JSON"] == 1  # + line 5, below
    # record-level reasons keep each tool's names
    assert tok.counts["record is a list, not an object"] == 1 and tok.counts["missing field"] == 1
    assert pre.counts["record is not an object"] == 1 and pre.counts["missing text field"] == 1
    # a line of Unicode whitespace only: malformed JSON for the tokenizer, a blank line for the pretokenizers
    assert tok.total == 5 and pre.total == 4
    assert f"skipping {p}:5: malformed JSON: Expecting value" in tok_log and f"{p}:5" not in pre_log
    # each tool's wording of the same skip
    assert f"skipping {p}:2: malformed JSON: Invalid control character at: line 1" in tok_log
    assert f"skipping {p}:2: malformed JSON (Invalid control character at: line 1" in pre_log
    assert f"skipping {p}:4: invalid UTF-8: byte 19 of the line" in tok_log
    assert f"skipping {p}:4: invalid UTF-8 ('utf-8' codec can't decode byte 0xff in position 19" in pre_log
    assert tok.first_locations[0].startswith(f"{p}:2: malformed JSON: ")


def test_strict_raises_each_tools_error_at_the_same_line(tmp_path):
    p = _bad_jsonl(tmp_path)
    with pytest.raises(C.CorpusError, match=rf"^{p}:2: malformed JSON: .*\(run without --strict to skip"):
        _tokenizer_side(p, strict=True)
    with pytest.raises(DataError, match=rf"^{p}:2: malformed JSON: Invalid control character at: line 1 "
                                        r"column 17 \(char 16\)$"):
        _pretokenizer_side(p, strict=True)


def test_logged_skips_are_limited_per_tool(tmp_path, caplog):
    p = tmp_path / "many.jsonl"
    p.write_text("{broken\n" * 30)
    with caplog.at_level(logging.WARNING):
        _, tok = _tokenizer_side(p)
        n_tok = caplog.text.count("skipping")
        caplog.clear()
        _, pre = _pretokenizer_side(p)
        n_pre = caplog.text.count("skipping")
    assert tok.total == pre.total == 30
    assert (n_tok, n_pre) == (C.MAX_LOGGED_SKIPS, R.MAX_LOGGED_SKIPS) == (5, 20)


def test_txt_blank_lines_are_empty_documents_or_not_records(tmp_path):
    p = tmp_path / "a.txt"
    p.write_bytes(b"one\r\n\ntwo \xff\nthree\n")
    tok_docs, tok = _tokenizer_side(p)
    pre_docs, pre = _pretokenizer_side(p)
    assert tok_docs == pre_docs == ["one", "three"]
    assert tok.empty_documents == 1 and tok.counts == pre.counts == {"invalid UTF-8": 1}


def test_json_array_rules(tmp_path, monkeypatch):
    monkeypatch.setattr(RR, "_JSON_CHUNK", 5)  # many refills inside every element
    recs = [{"text": f"doc {i} 文"} for i in range(20)]
    good = tmp_path / "good.json"
    good.write_text(json.dumps(recs, ensure_ascii=False, indent=1), encoding="utf-8")
    assert _tokenizer_side(good)[0] == _pretokenizer_side(good)[0] == [r["text"] for r in recs]
    where = [w for w, _, _ in R.iter_records(str(good), R.skip_counter())]
    assert where[0] == f"{good}:record 0" and where[-1] == f"{good}:record 19"

    broken = tmp_path / "broken.json"
    broken.write_text('[\n{"text": "one"},\n{"text": oops},\n{"text": "three"}\n]')
    docs, stats = _tokenizer_side(broken)  # the tokenizer: records before it, the rest skipped and counted
    assert docs == ["one"] and stats.first_locations == [
        f"{broken}:3: malformed JSON: Expecting value (rest of the file skipped)"]
    read = []
    with pytest.raises(DataError, match=rf"^{broken}:3: malformed JSON \(Expecting value\)$"):
        for rec in R.iter_records(str(broken), R.skip_counter()):  # the pretokenizers: the file fails, with
            read.append(rec)                                        # json.loads' message, before any record
    assert read == []
    trailing = tmp_path / "trailing.json"
    trailing.write_text('[{"text": "a"}] {"text": "b"}')
    assert _tokenizer_side(trailing)[0] == ["a"]
    with pytest.raises(DataError, match=r"trailing\.json:1: malformed JSON \(Extra data\)"):
        _pretokenizer_side(trailing)

    obj = tmp_path / "obj.json"  # not an array: JSON Lines for the tokenizer, one record for the pretokenizers
    obj.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert _tokenizer_side(obj)[0] == ["a", "b"]
    with pytest.raises(DataError, match=r"obj\.json:2: malformed JSON \(Extra data\)"):
        _pretokenizer_side(obj)
    obj.write_text('{"text": "pretty",\n "n": 1}\n')
    assert list(R.iter_records(str(obj), R.skip_counter())) == [(f"{obj}:record 0", 0, {"text": "pretty", "n": 1})]


def test_parquet_rows_and_unreadable_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2100
    pq.write_table(pa.table({"text": [None if i == 1500 else f"t{i}" for i in range(n)], "x": list(range(n))}),
                   tmp_path / "a.parquet", row_group_size=1000)
    tok_docs, tok = _tokenizer_side(tmp_path / "a.parquet")
    pre_docs, pre = _pretokenizer_side(tmp_path / "a.parquet")
    assert tok_docs == pre_docs and len(tok_docs) == n - 1
    assert tok.first_locations == [f"{tmp_path / 'a.parquet'} row 1501: missing field: 'text'"]  # 1-based
    rows = list(R.iter_records(str(tmp_path / "a.parquet"), R.skip_counter()))
    assert rows[1500][:2] == (f"{tmp_path / 'a.parquet'}:row 1500", 1500) and rows[0][2] == {"text": "t0", "x": 0}

    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not a parquet file")
    with pytest.raises(C.CorpusError, match=rf"^{bad}: cannot read parquet file: "):
        _tokenizer_side(bad)
    with pytest.raises(DataError, match=rf"^{bad}: unreadable parquet \("):
        _pretokenizer_side(bad)


def test_pretokenizer_json_array_memory_is_one_element(tmp_path):
    """The pretokenizers used to parse a .json input whole; through the one reader an array is streamed
    (twice: a check, then the records) and memory does not grow with the file."""
    p = tmp_path / "big.json"
    with open(p, "w") as f:
        f.write("[" + ",\n".join(json.dumps({"text": f"{i:06d}" + "x" * 90}) for i in range(60000)) + "]")
    tracemalloc.start()
    n = sum(1 for _ in R.iter_records(str(p), R.skip_counter()))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert n == 60000
    # ~5.3 MB here (the 1 MB read blocks), the same for a file twice as big; json.loads of the whole
    # file, as the pretokenizers did, peaks at ~27 MB for this one
    assert peak < 8_000_000, f"read a {p.stat().st_size} byte .json with a peak of {peak} bytes"
