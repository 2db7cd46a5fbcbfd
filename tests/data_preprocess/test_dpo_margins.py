"""A DPO pair's optional "margin" (Llama 2's reward-model margin, TRL's RewardTrainer column): read from the records
(absent, null or NaN = none; anything else but a finite number a counted skip naming file:line), kept beside the pairs
(values.npy, only where a record carried one), the same from a pretokenized folder as from the raw records, in the
batches that ask for it, and a damaged values file refused naming it."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from data_preprocess.pretokenize_dpo_data import pretokenize_dpo, tokenize_dpo_records
from data_preprocess.shard_format import DataError
from dataset.dataset_dpo import DPODataset, build_dpo_splits, dpo_collate

BAD = "'margin' must be a finite number (or absent / null)"


def _write(path, lines) -> None:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines))


def _pair(i: int, **kw) -> dict:
    return {"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}", **kw}


@pytest.fixture()
def with_margins(tmp_path):
    src = tmp_path / "prefs"
    src.mkdir()
    _write(src / "p.jsonl", [
        _pair(1, margin=2.5),                                                    # 1
        _pair(2),                                                                # 2 none
        _pair(3, margin=None),                                                   # 3 none (null)
        _pair(4, margin=-1),                                                     # 4 an integer
        _pair(5, margin="big"),                                                  # 5 skipped
        _pair(6, margin=True),                                                   # 6 skipped
        b'{"prompt": "q", "chosen": "a", "rejected": "b", "margin": 1e400}',     # 7 skipped (inf)
        b'{"prompt": "q", "chosen": "a", "rejected": "b", "margin": NaN}',       # 8 none (pandas' missing value)
    ])
    _write(src / "q.jsonl", [_pair(9), _pair(10)])  # a file without any margin
    return src


def test_margins_are_kept_beside_the_pairs_and_read_as_from_the_records(tmp_path, with_margins, tiny_pretrain_data):
    tok = tiny_pretrain_data["tokenizer_dir"]
    out = tmp_path / "out"
    meta = pretokenize_dpo(str(with_margins), tok, 48, str(out))
    p, q = meta["files"]
    assert p["skipped"] == {BAD: 3} and p["num_pairs"] == 5 and q["num_pairs"] == 2
    assert meta["values_columns"] == ["margin"] and meta["num_with_margin"] == 2 == p["num_with_margin"]
    assert "num_with_margin" not in q
    assert sorted(os.listdir(out)) == ["dpo_meta.json", "input_ids.bin", "labels.bin", "pairs.npy", "values.npy"]
    want = [2.5, 0.0, 0.0, -1.0, 0.0, 0.0, 0.0]
    pre, raw = DPODataset(str(out), 48), DPODataset(tokenize_dpo_records(str(with_margins), tok, 48), 48)
    for ds in (pre, raw):
        assert [r for _, r in ds.sources] == [1, 2, 3, 4, 8, 1, 2] and ds.num_with_margin == 2
        assert [float(ds[i]["margin"]) for i in range(len(ds))] == want
    # the reward model's batches carry them (float32); DPO's do not
    items = [pre[i] for i in range(len(pre))]
    assert dpo_collate(0, margins=True)(items)["margin"].tolist() == want
    assert dpo_collate(0, margins=True)(items)["margin"].dtype == torch.float32
    assert "margin" not in dpo_collate(0)(items)
    train, _, collate = build_dpo_splits(str(out), 48, val_ratio=0.0, margins=True)
    assert collate([train[i] for i in range(len(train))])["margin"].tolist() == want
    with pytest.raises(DataError, match=r"p\.jsonl:5: 'margin' must be a finite number"):
        pretokenize_dpo(str(with_margins), tok, 48, str(tmp_path / "strict"), strict=True)


def test_pairs_without_margins_write_no_values_and_a_rewrite_drops_a_stale_one(tmp_path, with_margins,
                                                                             tiny_pretrain_data):
    tok = tiny_pretrain_data["tokenizer_dir"]
    out = tmp_path / "out"
    pretokenize_dpo(str(with_margins), tok, 48, str(out))
    assert (out / "values.npy").exists()
    plain = tmp_path / "plain"
    plain.mkdir()
    _write(plain / "p.jsonl", [_pair(1), _pair(2, margin=None)])
    meta = pretokenize_dpo(str(plain), tok, 48, str(out))  # the same folder rewritten
    assert "values_columns" not in meta and "num_with_margin" not in meta
    assert sorted(os.listdir(out)) == ["dpo_meta.json", "input_ids.bin", "labels.bin", "pairs.npy"]
    ds = DPODataset(str(out), 48)
    assert ds.values is None and ds.num_with_margin == 0 and "margin" not in ds[0]
    assert DPODataset(tokenize_dpo_records(str(plain), tok, 48), 48).values is None
    assert dpo_collate(0, margins=True)([ds[0], ds[1]])["margin"].tolist() == [0.0, 0.0]


def test_a_damaged_values_file_is_refused_naming_it(tmp_path, with_margins, tiny_pretrain_data):
    out = tmp_path / "out"
    pretokenize_dpo(str(with_margins), tiny_pretrain_data["tokenizer_dir"], 48, str(out))
    good = np.load(out / "values.npy")
    vpath = str(out / "values.npy")
    bad_row = good.copy()
    bad_row[3, 0] = np.inf
    for arr, msg in ((good[:-1], r"expected float64 \[7, 1\]"), (good.astype(np.float32), "expected float64"),
                     (bad_row, r"row 3 \[inf\] is not finite")):
        np.save(vpath, arr)
        with pytest.raises(DataError, match=msg) as e:
            DPODataset(str(out), 48)
        assert vpath in str(e.value)
    os.remove(vpath)
    with pytest.raises(DataError, match="unreadable"):
        DPODataset(str(out), 48)
    np.save(vpath, good)
    meta_path = out / "dpo_meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps(dict(meta, values_columns=["margin", "weight"])))
    with pytest.raises(DataError, match="values_columns"):
        DPODataset(str(out), 48)
