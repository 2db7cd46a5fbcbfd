"""Bad and awkward inputs across the data commands: lone surrogates, the input file set, files whose
every record is bad, and very long documents (bounded memory by splitting)."""
import json
import logging
import os

import numpy as np
import pytest

from data_preprocess.pretokenize_pretrain_data import main as pretrain_main, pretokenize_pretrain
from data_preprocess.pretokenize_sft_data import pretokenize_sft
from data_preprocess.shard_format import DataError, list_shards
from dataset import TokenStream
from tokenizer import corpus as C
from tokenizer import documents as D

BOS, EOS = 1, 2
META = {"vocab_size": 320, "fingerprint": "fake-bytes-v1", "tokenizer_type": "fake",
        "special_tokens": {"bos": {"token": "<s>", "id": BOS}, "eos": {"token": "</s>", "id": EOS}}}
SURROGATE_LINE = b'{"text": "a\\ud800b"}'  # the JSON escape: json.loads gives a lone surrogate


def fake_encode(texts):
    return [[b + 10 for b in t.encode("utf-8")] for t in texts]


def fake_decode(ids):
    return bytes(i - 10 for i in ids).decode("utf-8")


def bounded_encode(texts):
    """Fails the input when one encoder call gets more characters than BOUNDED_ENCODE_MAX allows:
    what bounds the tokenizer's memory per call (worker processes inherit the variable)."""
    limit = int(os.environ["BOUNDED_ENCODE_MAX"])
    total = sum(len(t) for t in texts)
    if total > limit:
        raise RuntimeError(f"encoder got {total} characters in one call > {limit}")
    return fake_encode(texts)


def _pretok(src, out, **kw):
    kw.setdefault("encode_fn", fake_encode)
    kw.setdefault("tokenizer_meta", META)
    return pretokenize_pretrain(str(src), None, str(out), num_workers=kw.pop("num_workers", 1),
                                progress=False, **kw)


def _jsonl(path, recs):
    with open(path, "wb") as f:
        for r in recs:
            f.write((r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode()) + b"\n")


def _stream(out):
    s = TokenStream(str(out))
    return s.read(0, s.total_tokens).tolist()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizer.train_tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("tok")
    texts = [f"hello world {i} the quick brown fox answers questions 你好 世界" for i in range(200)]
    _jsonl(d / "c.jsonl", [{"text": t} for t in texts])
    train_tokenizer(str(d / "c.jsonl"), str(d / "tok"), vocab_size=300)
    return str(d / "tok")


# ----------------------------------------------------------------------------- 1. lone surrogates

def test_lone_surrogate_is_a_counted_skip_in_pretokenize(tmp_path, caplog):
    src = tmp_path / "raw"
    src.mkdir()
    _jsonl(src / "bad.jsonl", [{"text": "good one"}, SURROGATE_LINE, {"text": "good two"}])
    with caplog.at_level(logging.WARNING):
        s = _pretok(src, tmp_path / "out")
    assert not s["failed"] and s["documents"] == 2
    assert s["skips"] == {"invalid Unicode": 1}
    assert f"{src / 'bad.jsonl'}:2" in caplog.text and "lone surrogate" in caplog.text
    assert _stream(tmp_path / "out") == [BOS] + fake_encode(["good one"])[0] + [EOS, BOS] \
        + fake_encode(["good two"])[0] + [EOS]
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid Unicode"):
        _pretok(src, tmp_path / "out2", strict=True)


def test_lone_surrogate_is_a_counted_skip_in_sft_and_dpo(tmp_path, tok_dir):
    from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
    from data_preprocess.pretokenize_sft_data import tokenize_sft_records
    from dataset.dataset_dpo import DPODataset
    from dataset.dataset_sft import SFTDataset
    src = tmp_path / "sft"
    src.mkdir()
    _jsonl(src / "a.jsonl", [
        {"instruction": "q", "output": "fine"},
        b'{"instruction": "q", "output": "bad \\udc00 reply"}',
        b'{"conversations": [{"from": "human", "value": "x\\ud83d"}, {"from": "gpt", "value": "y"}]}',
        b'{"instruction": "q", "output": "ok", "system": "\\ud800"}',
        {"instruction": "q2", "output": "fine too"},
    ])
    meta = pretokenize_sft(str(src), tok_dir, 64, str(tmp_path / "out"))
    f = meta["files"][0]
    assert meta["num_samples"] == 2 and sum(f["skipped"].values()) == 3
    assert all(k.startswith("invalid Unicode") for k in f["skipped"])
    with pytest.raises(DataError, match=r"a\.jsonl:2: invalid Unicode"):
        pretokenize_sft(str(src), tok_dir, 64, str(tmp_path / "out2"), strict=True)
    ds = SFTDataset(tokenize_sft_records(str(src), tok_dir, 64))  # raw records: the path the trainer uses for SFT
    assert len(ds) == 2 and [ds.source(i)[1] for i in range(2)] == [1, 5]

    dpo = tmp_path / "dpo"
    dpo.mkdir()
    _jsonl(dpo / "p.jsonl", [
        {"prompt": "which", "chosen": "this", "rejected": "that"},
        b'{"prompt": "which \\ud800", "chosen": "this", "rejected": "that"}',
        b'{"prompt": "which", "chosen": {"role": "assistant", "content": "\\udfff"}, "rejected": "that"}',
    ])
    d = DPODataset(tokenize_dpo_records(str(dpo), tok_dir, 64))
    assert len(d) == 1 and d.sources == [(str(dpo / "p.jsonl"), 1)]
    assert sum(v for k, v in d.stats["skipped"].items() if k.startswith("invalid Unicode")) == 2
    with pytest.raises(DataError, match=r"p\.jsonl:2: invalid Unicode"):
        tokenize_dpo_records(str(dpo), tok_dir, 64, strict=True)


def test_lone_surrogate_is_a_counted_skip_in_tokenizer_corpus(tmp_path, caplog):
    (tmp_path / "a.json").write_bytes(b'[{"title": "t", "content": "c"},\n {"title": "\\ud800", "content": "c"}]')
    (tmp_path / "b.JSONL").write_bytes(b'{"title": "t", "content": "x\\udc00"}\n{"title": "u", "content": "v"}\n')
    stats = C.SkipCounter()
    with caplog.at_level(logging.WARNING):
        docs = list(D.iter_documents(C.find_files(str(tmp_path)), ("title", "content"), stats))
    assert docs == ["t\nc", "u\nv"] and stats.counts == {"invalid Unicode": 2}
    assert f"{tmp_path / 'a.json'}:2" in caplog.text and f"{tmp_path / 'b.JSONL'}:1" in caplog.text


# ----------------------------------------------------------------------------- 2. one input file set

def test_pretokenizer_and_tokenizer_read_the_same_files(tmp_path, caplog):
    from data_preprocess.readers import find_input_files
    src = tmp_path / "raw"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("line one\n\nline two\r\n", encoding="utf-8")
    _jsonl(src / "B.JSONL", [{"text": "upper case"}])
    (src / "c.Json").write_text(json.dumps([{"text": "json array"}]), encoding="utf-8")
    (src / "notes.md").write_text("# not data\n")
    (src / ".hidden.jsonl").write_text('{"text": "hidden"}\n')
    _jsonl(src / "sub" / "d.jsonl", [{"text": "nested"}])
    want = ["B.JSONL", "a.txt", "c.Json", "sub/d.jsonl"]
    with caplog.at_level(logging.WARNING):
        tok_files = C.find_files(str(src))
    assert [os.path.relpath(p, src) for p in tok_files] == want
    assert "notes.md" in caplog.text
    caplog.clear()
    assert [os.path.relpath(p, src) for p in find_input_files(str(src))] == want
    with caplog.at_level(logging.WARNING):
        s = _pretok(src, tmp_path / "out")
    assert "notes.md" in caplog.text and s["ignored_files"] == [str(src / "notes.md")]
    assert s["documents"] == 5
    with pytest.raises(DataError, match=r"notes\.md: unsupported file type"):
        find_input_files(str(src / "notes.md"))  # given explicitly: an error, not a silent skip
    with pytest.raises(DataError, match="missing: no such file or directory"):
        find_input_files(str(src / "missing"))
    assert _stream(tmp_path / "out") == sum(([BOS] + ids + [EOS] for ids in fake_encode(
        ["upper case", "line one", "line two", "json array", "nested"])), [])


# ----------------------------------------------------------------------------- 3. nothing usable

def test_all_bad_file_warns_and_no_tokens_exits_3(tmp_path, caplog, tok_dir):
    src = tmp_path / "raw"
    src.mkdir()
    _jsonl(src / "good.jsonl", [{"text": "fine"}])
    _jsonl(src / "allbad.jsonl", [{"other": 1}, b"{broken", {"text": "  "}])
    with caplog.at_level(logging.WARNING):
        s = _pretok(src, tmp_path / "out")
    assert s["documents"] == 1
    warn = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "allbad.jsonl" in r.getMessage()
            and "no usable document" in r.getMessage()]
    assert warn, caplog.text
    os.remove(src / "good.jsonl")
    with pytest.raises(DataError, match="no tokens"):
        _pretok(src, tmp_path / "out_bad")
    with pytest.raises(DataError, match="no tokens"):  # a re-run that finds the (empty) shards complete
        _pretok(src, tmp_path / "out_bad")
    assert pretrain_main(["--data_dir", str(src), "--tokenizer_dir", tok_dir, "--output_dir",
                          str(tmp_path / "out_cli"), "--num_workers=1", "--no_progress"]) == 3


# ----------------------------------------------------------------------------- 4. very long documents

def test_split_long_text_pieces():
    from data_preprocess.readers import split_long_text
    text = ("word " * 30 + "\n") * 5 + "中" * 250 + " tail"
    pieces = list(split_long_text(text, 100))
    assert "".join(pieces) == text and all(0 < len(p) <= 100 for p in pieces)
    # cuts go before a whitespace run when one lies in the second half of the window (newline preferred)
    assert all(p[0].isspace() for p in pieces[1:5])
    assert list(split_long_text("short", 100)) == ["short"] and list(split_long_text("x" * 50, 0)) == ["x" * 50]
    pair = "a" * 99 + "\ud83d\ude00" + "b" * 10  # a surrogate pair held as two code units is never cut
    assert [len(p) for p in split_long_text(pair, 100)] == [99, 12]


def test_long_document_is_split_counted_and_round_trips(tmp_path, monkeypatch, caplog):
    src = tmp_path / "raw"
    src.mkdir()
    long_text = " ".join(f"w{i}" for i in range(400)) + "\n" + "长" * 500 + "😀" * 50
    _jsonl(src / "a.jsonl", [{"text": "short one"}, {"text": long_text}, {"text": "short two"}])
    monkeypatch.setenv("BOUNDED_ENCODE_MAX", "200")
    with caplog.at_level(logging.INFO):
        s = _pretok(src, tmp_path / "out", max_doc_chars=200, encode_fn=bounded_encode, num_workers=2)
    assert not s["failed"], s["failed"]
    assert s["documents"] == 3 and s["split_documents"] == 1
    assert "a.jsonl:2" in caplog.text and "split" in caplog.text
    stream = _stream(tmp_path / "out")
    docs = []
    for piece in np.split(np.asarray(stream), np.flatnonzero(np.asarray(stream) == BOS)[1:]):
        assert piece[0] == BOS and piece[-1] == EOS and not ((piece[1:-1] == BOS) | (piece[1:-1] == EOS)).any()
        docs.append(fake_decode(piece[1:-1].tolist()))
    assert docs == ["short one", long_text, "short two"]
    assert list_shards(str(tmp_path / "out"))[0].sidecar["max_doc_chars"] == 200


def test_max_doc_chars_negative_is_a_config_error(tmp_path):
    assert pretrain_main(["--data_dir", str(tmp_path), "--tokenizer_dir", str(tmp_path), "--max_doc_chars=-1",
                          "--no_progress"]) == 2


def test_long_document_without_limit_reaches_encoder_whole(tmp_path, monkeypatch):
    """The control for the test above: max_doc_chars=0 (no limit) hands the encoder the whole
    document in one call, which is what needed 11.4 GB for a 50M-character line."""
    src = tmp_path / "raw"
    src.mkdir()
    _jsonl(src / "a.jsonl", [{"text": "x " * 300}])
    monkeypatch.setenv("BOUNDED_ENCODE_MAX", "200")
    with pytest.raises(DataError, match="encoder got 600 characters"):
        _pretok(src, tmp_path / "out", max_doc_chars=0, encode_fn=bounded_encode)


def test_split_pieces_round_trip_with_real_tokenizer(tok_dir):
    from data_preprocess.readers import split_long_text
    from tokenizer import encode_texts, load_tokenizer
    tok = load_tokenizer(tok_dir)
    text = "the quick brown fox 你好世界\n\n  answers   questions " * 40 + "😀" * 30
    ids = sum(encode_texts(tok, list(split_long_text(text, 97))), [])
    assert tok.decode(ids) == text


def test_sft_and_dpo_name_ignored_and_all_bad_files(tmp_path, tok_dir, caplog):
    from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
    from dataset.dataset_dpo import DPODataset
    src = tmp_path / "sft"
    src.mkdir()
    _jsonl(src / "A.JSONL", [{"instruction": "q", "output": "fine"}])
    _jsonl(src / "allbad.jsonl", [{"instruction": "q"}, b"{broken"])
    (src / "plain.txt").write_text("a line of text\n")  # not a record format: named, never read
    with caplog.at_level(logging.WARNING):
        meta = pretokenize_sft(str(src), tok_dir, 64, str(tmp_path / "out"))
    assert [os.path.basename(f["path"]) for f in meta["files"]] == ["A.JSONL", "allbad.jsonl"]
    assert meta["num_samples"] == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("plain.txt" in m and "not SFT inputs" in m for m in warnings), warnings
    assert any("allbad.jsonl" in m and "no usable SFT sample" in m for m in warnings), warnings
    with pytest.raises(DataError, match=r"plain\.txt: not a SFT input"):
        pretokenize_sft(str(src / "plain.txt"), tok_dir, 64, str(tmp_path / "out2"))
    dpo = tmp_path / "dpo"
    dpo.mkdir()
    _jsonl(dpo / "ok.jsonl", [{"prompt": "which", "chosen": "this", "rejected": "that"}])
    _jsonl(dpo / "bad.jsonl", [{"prompt": "which", "chosen": "this"}])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert len(DPODataset(tokenize_dpo_records(str(dpo), tok_dir, 64))) == 1
    assert any("bad.jsonl" in r.getMessage() and "no usable DPO pair" in r.getMessage() for r in caplog.records)
