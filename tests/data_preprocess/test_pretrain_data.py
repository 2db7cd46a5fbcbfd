"""Pretraining data: pretokenize -> shards -> index -> datasets, with a fake byte encoder
(module-level, so worker processes can unpickle it) and the real tokenizer at the end."""
import json
import os

import numpy as np
import pytest
import torch

from data_preprocess.build_pretrain_sample_index_map import build_index, main as index_main
from data_preprocess.pretokenize_pretrain_data import pretokenize_pretrain
from data_preprocess.shard_format import DataError, StaleIndexError, list_shards, write_shard
from dataset import PretokDataset, PretokDatasetWithIndex, TokenStream

BOS, EOS = 1, 2
META = {"vocab_size": 320, "fingerprint": "fake-bytes-v1", "tokenizer_type": "fake",
        "special_tokens": {"bos": {"token": "<s>", "id": BOS}, "eos": {"token": "</s>", "id": EOS}}}


def fake_encode(texts):
    return [[b + 10 for b in t.encode("utf-8")] for t in texts]


def failing_encode(texts):
    if any("BOOM" in t for t in texts):
        raise RuntimeError("tokenizer exploded")
    return fake_encode(texts)


def _write_jsonl(path, recs):
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")


def _pretok(src, out, **kw):
    kw.setdefault("encode_fn", fake_encode)
    kw.setdefault("tokenizer_meta", META)
    return pretokenize_pretrain(str(src), None, str(out), num_workers=kw.pop("num_workers", 2),
                                progress=False, **kw)


def _expected_stream(texts):
    out = []
    for t in texts:
        if t.strip():
            out += [BOS] + fake_encode([t])[0] + [EOS]
    return out


def test_pretokenize_formats_fields_and_shards(tmp_path):
    src = tmp_path / "raw"
    src.mkdir()
    texts_a = [f"doc {i} " + "é" * i for i in range(30)]
    _write_jsonl(src / "a.jsonl", [{"text": t} for t in texts_a])
    json.dump([{"title": "T", "content": "body one"}, {"text": "plain"}], open(src / "b.json", "w"))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["parquet one", "parquet two"]}), src / "c.parquet")
    s = _pretok(src, tmp_path / "out", text_fields="text|title,content", shard_size_tokens=64)
    assert not s["failed"] and s["documents"] == 34
    shards = list_shards(str(tmp_path / "out"))
    assert all(sh.num_tokens <= 64 for sh in shards) and shards[0].dtype == np.dtype("<u2")
    side = shards[0].sidecar
    assert side["bos_id"] == BOS and side["eos_id"] == EOS and side["vocab_size"] == 320
    assert side["tokenizer_fingerprint"] == "fake-bytes-v1" and side["source"]["path"].endswith("a.jsonl")
    stream = TokenStream(str(tmp_path / "out"))
    want = _expected_stream(texts_a) + _expected_stream(["T\nbody one", "plain"]) \
        + _expected_stream(["parquet one", "parquet two"])
    assert stream.read(0, stream.total_tokens).tolist() == want
    # document offsets: every recorded start in a shard holds <s>
    a_shards = [sh for sh in shards if sh.name.startswith("a_")]
    assert sum(sh.sidecar["num_documents"] for sh in a_shards) == 30
    for sh in a_shards:
        offs = np.load(sh.path[:-4] + ".idx.npy")
        data = np.fromfile(sh.path, dtype=sh.dtype)
        assert offs[-1] == sh.num_tokens and all(data[o] == BOS for o in offs[:-1])


def test_bad_records_skipped_counted_or_strict(tmp_path):
    src = tmp_path / "raw"
    src.mkdir()
    with open(src / "bad.jsonl", "wb") as f:
        f.write(b'{"text": "good one"}\n{not json\n{"text": 5}\n{"other": "x"}\n'
                b'{"text": "\xff\xfe bad utf8"}\n{"text": ""}\n[1,2]\n{"text": "good two"}\n')
    (src / "empty.jsonl").write_text("")
    s = _pretok(src, tmp_path / "out")
    assert s["documents"] == 2
    assert s["skips"] == {"malformed JSON": 1, "non-string text field": 1, "missing text field": 1,
                          "invalid UTF-8": 1, "empty_document": 1, "record is not an object": 1}
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        _pretok(src, tmp_path / "out2", strict=True)


@pytest.fixture(params=["in-process", "workers"])
def tokenize_where(request, monkeypatch):
    """Small inputs are tokenized in this process; SMALL_INPUT_BYTES=0 puts them on the worker pool."""
    from data_preprocess import pretrain_workers
    if request.param == "workers":
        monkeypatch.setattr(pretrain_workers, "SMALL_INPUT_BYTES", 0)
    return request.param


def test_worker_exception_surfaced_with_file(tmp_path, tokenize_where):
    src = tmp_path / "raw"
    src.mkdir()
    _write_jsonl(src / "ok.jsonl", [{"text": "fine"}] * 5)
    _write_jsonl(src / "x_bad.jsonl", [{"text": "fine"}, {"text": "BOOM here"}])
    with pytest.raises(DataError) as ei:
        _pretok(src, tmp_path / "out", encode_fn=failing_encode)
    msg = str(ei.value)
    assert "x_bad.jsonl" in msg and "tokenizer exploded" in msg and "ok.jsonl:" not in msg
    names = os.listdir(tmp_path / "out")
    assert any(n.startswith("ok_") for n in names) and not any(n.startswith("x_bad_") for n in names)
    # the CLI path exits 3 (bad data) on the same failure
    from data_preprocess import pretokenize_pretrain_data as mod
    assert mod.main(["--data_dir", str(src), "--tokenizer_dir", str(tmp_path / "nope"),
                     "--no_progress"]) != 0


def test_rerun_skips_complete_and_redoes_partial(tmp_path):
    src = tmp_path / "raw"
    src.mkdir()
    _write_jsonl(src / "a.jsonl", [{"text": f"alpha {i}"} for i in range(20)])
    _write_jsonl(src / "b.jsonl", [{"text": f"beta {i}"} for i in range(20)])
    out = tmp_path / "out"
    _pretok(src, out, shard_size_tokens=50)
    before = TokenStream(str(out)).read(0, TokenStream(str(out)).total_tokens).tolist()
    # simulate a crash while writing b: its last sidecar is gone, a temp file is left behind
    last_b = sorted(n for n in os.listdir(out) if n.startswith("b_") and n.endswith(".json"))[-1]
    os.remove(out / last_b)
    (out / "b_00000.bin.tmp").write_bytes(b"junk")
    with pytest.raises(DataError, match="without sidecar"):
        list_shards(str(out))
    s = _pretok(src, out, shard_size_tokens=50)
    assert s["skipped_complete"] == [str(src / "a.jsonl")] and list(s["files"]) == [str(src / "b.jsonl")]
    after = TokenStream(str(out))
    assert after.read(0, after.total_tokens).tolist() == before
    assert not any(n.endswith(".tmp") for n in os.listdir(out))


@pytest.fixture(scope="module")
def real_tok_dir(tmp_path_factory):
    from tokenizer.train_tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("tok")
    _write_jsonl(d / "c.jsonl", [{"text": f"hello world {i} the quick brown fox 你好 世界"} for i in range(200)])
    train_tokenizer(str(d / "c.jsonl"), str(d / "tok"), vocab_size=300)
    return str(d / "tok")


def _files(d):
    return {n: (d / n).read_bytes() for n in sorted(os.listdir(d))}


def test_same_bytes_in_process_and_in_workers_with_real_tokenizer(tmp_path, real_tok_dir, monkeypatch):
    """One worker, two workers on a small input (both in this process) and two worker processes
    (forced) write the same files byte for byte, equal to <s> encode_texts(load_tokenizer) </s>:
    what every worker wrote when each loaded the tokenizer itself."""
    from data_preprocess import pretrain_workers
    from data_preprocess.pretrain_workers import SMALL_INPUT_BYTES
    from tokenizer import encode_texts, load_tokenizer, load_tokenizer_meta
    src = tmp_path / "raw"
    src.mkdir()
    texts = [f"doc {i}: the quick brown fox 你好 <s> </s> <|im_end|> " + "世界 " * (i % 7) for i in range(600)]
    _write_jsonl(src / "a.jsonl", [{"text": t} for t in texts[:300]] + [{"text": ""}, "{bad"])
    (src / "b.txt").write_text("\n".join(texts[300:]) + "\n", encoding="utf-8")
    long_doc = "hello world " * 200 + "你好" * 300  # split in pieces by max_doc_chars=500
    _write_jsonl(src / "c.jsonl", [{"text": long_doc}])
    runs = {}
    for name, workers, small in (("one", 1, SMALL_INPUT_BYTES), ("two_small", 2, SMALL_INPUT_BYTES),
                                 ("two_pool", 2, 0)):
        monkeypatch.setattr(pretrain_workers, "SMALL_INPUT_BYTES", small)
        s = pretokenize_pretrain(str(src), real_tok_dir, str(tmp_path / name), num_workers=workers, progress=False,
                                 shard_size_tokens=500, max_doc_chars=500)
        assert s["documents"] == 601 and s["split_documents"] == 1 and s["skips"]["malformed JSON"] == 1
        runs[name] = _files(tmp_path / name)
    assert len(runs["one"]) > 3 * 3  # several shards per input: boundaries inside documents too
    assert runs["one"] == runs["two_small"] == runs["two_pool"]
    meta = load_tokenizer_meta(real_tok_dir)
    bos, eos = meta["special_tokens"]["bos"]["id"], meta["special_tokens"]["eos"]["id"]
    want = []
    for ids in encode_texts(load_tokenizer(real_tok_dir), texts):
        want += [bos] + ids + [eos]
    stream = TokenStream(str(tmp_path / "one"))
    got = stream.read(0, stream.total_tokens).tolist()
    assert got[:len(want)] == want and got[len(want)] == bos and got[-1] == eos


def test_worker_start_up_imports_neither_transformers_nor_torch(real_tok_dir):
    """A worker rebuilds the parent's backend from JSON: starting one costs tens of milliseconds, not
    the seconds of importing transformers + torch (what made small inputs slow with --num_workers>1)."""
    import subprocess
    import sys
    from data_preprocess.worker_tokenizer import backend_json
    from tokenizer import encode_texts, load_tokenizer
    tok = load_tokenizer(real_tok_dir)
    code = ("import sys, json\n"
            "from data_preprocess import pretrain_workers as m, sft_format as f\n"
            "backend = sys.stdin.read()\n"
            "m.init_worker(backend, None)\n"
            "flat, lengths = m.tokenize_batch(['the quick <s> fox', '你好 <|im_end|>'])\n"
            "f._init_chat_worker(backend, None)\n"
            "ids, mask = f._WORKER_ENCODE([{'role': 'user', 'content': 'hi'}])\n"
            "print(json.dumps([flat.tolist(), lengths.tolist(), sorted(k for k in ('torch', 'transformers') "
            "if k in sys.modules)]))\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = subprocess.run([sys.executable, "-c", code], input=backend_json(tok), cwd=root, capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr
    flat, lengths, imported = json.loads(r.stdout.strip().splitlines()[-1])
    assert imported == []
    assert flat == sum(encode_texts(tok, ["the quick <s> fox", "你好 <|im_end|>"]), []) and len(lengths) == 2


def _fake_shards(d, lengths, vocab=320, seed=0):
    """Shards of random ids written straight through the shard format (no tokenizer)."""
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = "<u2" if vocab <= 65536 else "<u4"
    allids = []
    for k, n in enumerate(lengths):
        ids = rng.integers(0, vocab, size=n)
        allids.append(ids)
        write_shard(str(d), "corpus", k, ids, np.array([0, n]),
                    {"dtype": dtype, "vocab_size": vocab, "bos_id": 1, "eos_id": 2,
                     "tokenizer_fingerprint": "fp", "final": k == len(lengths) - 1})
    return np.concatenate(allids)


def test_exact_multiple_shard_boundaries_lose_no_sample(tmp_path):
    L = 8
    stream = _fake_shards(tmp_path / "s", [2 * L, 3 * L, L, 2 * L + 1])  # exact multiples of L, then +1
    total = stream.size
    meta = build_index(str(tmp_path / "s"), L, val_ratio=0.0)
    assert meta["num_train"] == (total - 1) // L == 8  # 65 tokens -> 8 samples covering every token
    ds = PretokDatasetWithIndex(str(tmp_path / "s"), L)
    got = np.concatenate([ds[i]["input_ids"].numpy() for i in range(len(ds))] + [ds[len(ds) - 1]["labels"][-1:].numpy()])
    assert np.array_equal(got, stream[: len(ds) * L + 1])
    assert ds[5]["input_ids"].dtype == torch.long and ds[5]["input_ids"].shape == (L,)
    assert torch.equal(ds[5]["labels"][:-1], ds[5]["input_ids"][1:])
    raw = PretokDataset(str(tmp_path / "s"), L)
    assert len(raw) == len(ds) and all(torch.equal(raw[i]["labels"], ds[i]["labels"]) for i in range(len(ds)))


def test_uint32_path_for_large_vocab(tmp_path):
    stream = _fake_shards(tmp_path / "s", [40, 41], vocab=100_000, seed=3)
    assert stream.max() > 65535
    shards = list_shards(str(tmp_path / "s"))
    assert shards[0].dtype == np.dtype("<u4") and os.path.getsize(shards[0].path) == 160
    build_index(str(tmp_path / "s"), 10, val_samples=2)
    ds = PretokDatasetWithIndex(str(tmp_path / "s"), 10)
    vals = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    assert int(vals.max()) > 65535 and set(vals.tolist()) <= set(stream.tolist())
    # and the pretokenizer picks uint32 from the vocab size, never a hard-coded uint16
    src = tmp_path / "raw"
    src.mkdir()
    _write_jsonl(src / "a.jsonl", [{"text": "hi"}])
    _pretok(src, tmp_path / "out", tokenizer_meta=dict(META, vocab_size=70_000))
    assert list_shards(str(tmp_path / "out"))[0].dtype == np.dtype("<u4")


def test_val_split_disjoint_and_stale_index_errors(tmp_path):
    d = tmp_path / "s"
    _fake_shards(d, [500, 300])
    meta = build_index(str(d), 16, val_ratio=0.1, seed=5, split_by="sample")
    tr, va = np.load(d / "index_L16" / "train.npy"), np.load(d / "index_L16" / "val.npy")
    assert len(va) == meta["num_val"] == 5 and len(tr) + len(va) == (800 - 1) // 16
    assert not set(tr.tolist()) & set(va.tolist())
    assert len(PretokDatasetWithIndex(str(d), 16, split="val")) == 5
    with pytest.raises(StaleIndexError, match="max_seq_len=32"):
        PretokDatasetWithIndex(str(d), 32)
    _fake_shards(d, [500, 301])  # a shard changed size
    with pytest.raises(StaleIndexError, match="corpus_00001.bin"):
        PretokDatasetWithIndex(str(d), 16)
    # a sidecar that disagrees with its file size is a clear error
    with open(d / "corpus_00000.bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match=r"corpus_00000\.bin: file has 1002 bytes"):
        list_shards(str(d))
    assert index_main(["--data_dir", str(d), "--max_seq_len", "16"]) == 3
