"""SFT/DPO preprocessing and datasets, plus the pretraining CLI, with a real tiny tokenizer."""
import json
import os
import sys

import numpy as np
import pytest
import torch

from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
from data_preprocess.pretokenize_sft_data import main as sft_main, pretokenize_sft, tokenize_sft_records
from data_preprocess.shard_format import DataError, list_shards
from dataset.dataset_dpo import DPODataset, build_dpo_splits
from dataset.dataset_sft import PackedSFTDataset, SFTDataset, build_sft_splits, packed_collate, pad_collate
from dataset.loader import ResumableLoader
from tokenizer import encode_chat, encode_texts, load_tokenizer, load_tokenizer_meta
from tests.conftest import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizer.train_tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("tok")
    texts = [f"hello world {i} the quick brown fox answers questions 你好 世界" for i in range(300)]
    with open(d / "c.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts)
    train_tokenizer(str(d / "c.jsonl"), str(d / "tok"), vocab_size=300)
    return str(d / "tok")


def _jsonl(path, recs):
    with open(path, "w", encoding="utf-8") as f:
        for r in recs:
            f.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")


def _expected(tok_dir, msgs):
    ids, mask = encode_chat(load_tokenizer(tok_dir), msgs)
    return np.array(ids), np.where(np.array(mask, bool), ids, -100)


def test_sft_label_masking_and_formats(tmp_path, tok_dir):
    src = tmp_path / "sft"
    src.mkdir()
    _jsonl(src / "a.jsonl", [
        {"instruction": "say hi", "input": "to bob", "output": "hi bob", "system": "be brief"},
        {"instruction": "say hi", "input": "", "output": "hi"},
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                           {"from": "human", "value": "q2"}, {"from": "gpt", "value": "a2"}]},
    ])
    meta = pretokenize_sft(str(src), tok_dir, max_seq_len=128, output_dir=str(tmp_path / "out"))
    assert meta["num_samples"] == 3 and meta["labels_dtype"] == "<i4"
    ds = SFTDataset(str(tmp_path / "out"))
    cases = [
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hi\nto bob"},
         {"role": "assistant", "content": "hi bob"}],
        [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}],
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
         {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
    ]
    im_end = load_tokenizer_meta(tok_dir)["special_tokens"]["im_end"]["id"]
    for i, msgs in enumerate(cases):
        ids, labels = _expected(tok_dir, msgs)
        item = ds[i]
        assert item["input_ids"].tolist() == ids[:-1].tolist()
        assert item["labels"].tolist() == labels[1:].tolist()  # shifted, -100 kept (int32 on disk)
        lab = item["labels"]
        assert (lab == -100).sum() > 0 and int(lab.min()) == -100
        assert (lab == im_end).sum() == sum(m["role"] == "assistant" for m in msgs)
    raw = np.fromfile(tmp_path / "out" / "labels.bin", dtype="<i4")
    assert (raw == -100).any() and not (raw == 65436).any()
    # the raw-jsonl path gives the same items
    raw_ds = SFTDataset(tokenize_sft_records(str(src), tok_dir, 128))
    assert all(torch.equal(raw_ds[i]["labels"], ds[i]["labels"]) for i in range(3))
    batch = pad_collate(ds.pad_id)([ds[0], ds[1]])
    n1 = ds[1]["input_ids"].numel()
    assert batch["attention_mask"][1].sum() == n1 and (batch["labels"][1, n1:] == -100).all()
    assert (batch["input_ids"][1, n1:] == load_tokenizer_meta(tok_dir)["special_tokens"]["pad"]["id"]).all()


def test_multi_file_index_overlong_and_bad_records(tmp_path, tok_dir):
    src = tmp_path / "sft"
    src.mkdir()
    long_answer = " ".join(["quick brown fox"] * 40)
    _jsonl(src / "a.jsonl", [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(3)])
    _jsonl(src / "b.jsonl", [
        {"instruction": "long", "output": long_answer},
        "{broken json",
        {"instruction": 3, "output": "x"},
        {"conversations": [{"role": "user", "content": "no answer"}]},
        {"instruction": "b1", "output": "ok"},
    ])
    meta = pretokenize_sft(str(src), tok_dir, max_seq_len=32, output_dir=str(tmp_path / "t"))
    fa, fb = meta["files"]
    assert (fa["file_id"], fa["first_sample"], fa["num_samples"]) == (0, 0, 3)
    assert (fb["file_id"], fb["first_sample"], fb["num_samples"]) == (1, 3, 2)
    assert fb["truncated"] == 1 and sum(fb["skipped"].values()) == 3
    ds = SFTDataset(str(tmp_path / "t"))
    assert [ds.source(i)[1] for i in range(5)] == [1, 2, 3, 1, 5]  # jsonl lines
    assert [os.path.basename(ds.source(i)[0]) for i in range(5)] == ["a.jsonl"] * 3 + ["b.jsonl"] * 2
    assert ds.length(3) == 32 and all(ds.length(i) <= 32 for i in range(5))
    meta = pretokenize_sft(str(src), tok_dir, max_seq_len=32, output_dir=str(tmp_path / "d"), overlong="drop")
    assert meta["files"][1]["dropped_overlong"] == 1 and meta["num_samples"] == 4
    assert sft_main(["--data_dir", str(src), "--tokenizer_dir", tok_dir, "--max_seq_len", "32",
                     "--output_dir", str(tmp_path / "s"), "--strict"]) == 3
    with pytest.raises(DataError, match=r"b\.jsonl:2"):
        pretokenize_sft(str(src), tok_dir, 32, str(tmp_path / "s2"), strict=True)


def test_packing_positions_and_boundaries(tmp_path, tok_dir):
    src = tmp_path / "sft"
    src.mkdir()
    _jsonl(src / "a.jsonl", [{"instruction": f"q{i}", "output": "answer " * (i % 3 + 1)} for i in range(9)])
    pretokenize_sft(str(src), tok_dir, 48, str(tmp_path / "t"))
    ds = SFTDataset(str(tmp_path / "t"))
    packed = PackedSFTDataset(ds, 64)
    assert len(packed) < len(ds)
    seen = 0
    for r in range(len(packed)):
        row = packed[r]
        docs = [d for d in row["doc_ids"].unique().tolist() if d >= 0]
        for d in docs:
            sel = row["doc_ids"] == d
            item = ds[seen]
            assert torch.equal(row["input_ids"][sel], item["input_ids"])
            assert torch.equal(row["labels"][sel], item["labels"])
            assert row["position_ids"][sel].tolist() == list(range(int(sel.sum())))
            seen += 1
        pad = row["doc_ids"] == -1
        assert (row["labels"][pad] == -100).all() and (row["attention_mask"][pad] == 0).all()
    assert seen == len(ds)
    batch = packed_collate([packed[0], packed[1]])
    cu = batch["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == 128 and 64 in cu and batch["cu_seqlens"].dtype == torch.int32
    train, val, collate = build_sft_splits(str(tmp_path / "t"), 48, val_ratio=0.2, seed=1)
    assert len(train) + len(val) == 9 and len(val) == 2
    b = next(ResumableLoader(train, 2, seed=0, collate_fn=collate))
    assert set(b) == {"input_ids", "labels", "attention_mask"}


def test_dpo_labels_only_on_final_reply(tmp_path, tok_dir):
    src = tmp_path / "dpo"
    src.mkdir()
    _jsonl(src / "p.jsonl", [
        {"prompt": "which fox", "chosen": "the quick one", "rejected": "no"},
        {"conversations": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                           {"role": "user", "content": "q2"}],
         "chosen": {"role": "assistant", "content": "good"}, "rejected": "bad answer"},
        {"prompt": "missing rejected", "chosen": "x"},
    ])
    ds = DPODataset(tokenize_dpo_records(str(src), tok_dir, 64))
    assert len(ds) == 2 and ds.stats["skipped"]
    tok = load_tokenizer(tok_dir)
    item = ds[1]
    prompt = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
              {"role": "user", "content": "q2"}]
    for side, reply in (("chosen", "good"), ("rejected", "bad answer")):
        ids, _ = encode_chat(tok, prompt + [{"role": "assistant", "content": reply}])
        assert item[f"{side}_input_ids"].tolist() == ids[:-1]
        targets = [t for t in item[f"{side}_labels"].tolist() if t != -100]
        im_end = load_tokenizer_meta(tok_dir)["special_tokens"]["im_end"]["id"]
        assert targets == encode_texts(tok, [reply])[0] + [im_end]  # a1 (earlier assistant turn) is not a target
    batch = dpo_collate_check(ds)
    assert batch["chosen_input_ids"].shape == batch["rejected_input_ids"].shape
    train, val, collate = build_dpo_splits(tokenize_dpo_records(str(src), tok_dir, 64), 64, val_ratio=0.5)
    assert len(train) == 1 and len(val) == 1


def dpo_collate_check(ds):
    from dataset.dataset_dpo import dpo_collate
    b = dpo_collate(ds.pad_id)([ds[0], ds[1]])
    for side in ("chosen", "rejected"):
        m = b[f"{side}_attention_mask"]
        assert (b[f"{side}_labels"][m == 0] == -100).all() and (b[f"{side}_input_ids"][m == 0] == ds.pad_id).all()
    return b


def test_pretrain_cli_end_to_end_with_real_tokenizer(tmp_path, tok_dir):
    src = tmp_path / "raw"
    src.mkdir()
    texts = [f"the quick brown fox {i} 你好" for i in range(40)]
    _jsonl(src / "a.jsonl", [{"text": t} for t in texts[:30]])
    (tmp_path / "more").mkdir()
    _jsonl(tmp_path / "more" / "b.jsonl", [{"text": t} for t in texts[30:]])
    env = dict(os.environ, PYTHONPATH=ROOT)
    # --data_dir takes several paths (a folder and a file), as train_tokenizer does; with no --out_dir the shards go
    # under out/ in the working directory, named for the inputs, never beside them
    r = run_python([sys.executable, "-m", "data_preprocess.pretokenize_pretrain_data", "--data_dir", str(src),
                    str(tmp_path / "more" / "b.jsonl"), f"--tokenizer_dir={tok_dir}", "--num_workers=2",
                    "--shard_size_tokens=200", "--no_progress"], cwd=str(tmp_path), env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = str(tmp_path / "out" / "pretrain_tokenized" / "raw_and_1_more")
    assert sorted(os.listdir(tmp_path)) == ["more", "out", "raw"]
    shards = list_shards(out)
    meta = load_tokenizer_meta(tok_dir)
    assert shards[0].fingerprint == meta["fingerprint"] and shards[0].vocab_size == meta["vocab_size"]
    stream = np.concatenate([np.fromfile(s.path, dtype=s.dtype) for s in shards]).tolist()
    bos, eos = meta["special_tokens"]["bos"]["id"], meta["special_tokens"]["eos"]["id"]
    want = []
    for ids in encode_texts(load_tokenizer(tok_dir), texts):
        want += [bos] + ids + [eos]
    assert stream == want
    r = run_python([sys.executable, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={out}",
                    "--max_seq_len=16", "--val_samples=3"], cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    from dataset import PretokDatasetWithIndex
    ds = PretokDatasetWithIndex(out, 16, split="val")
    assert len(ds) == 3 and ds[0]["input_ids"].shape == (16,)
