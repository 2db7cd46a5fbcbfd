"""Issue 15 item 4: pretokenized DPO pairs (`data_preprocess.pretokenize_dpo_data`) read exactly like
the raw records, bad records counted with file:line, the SFT/DPO pretokenizers' `--num_workers`
(same files byte for byte with 1 and 2 workers, worker exceptions collected with their file), and
the trainer on a pretokenized DPO folder (same losses as from the raw .jsonl; another tokenizer refused).
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch

from data_preprocess.pretokenize_dpo_data import pretokenize_dpo, tokenize_dpo_records
from data_preprocess.pretokenize_sft_data import pretokenize_sft, tokenize_sft_records
from data_preprocess.shard_format import DataError
from dataset.dataset_dpo import DPODataset, build_dpo_splits
from tests.conftest import ROOT, run_cmd, run_python
from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA
from utils.metrics import dedupe_by_step, read_metrics

PY = sys.executable
DPO_PAIRS = os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl")


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=ROOT)


def _jsonl(path, recs) -> None:
    with open(path, "wb") as f:
        for r in recs:
            f.write((r if isinstance(r, bytes) else json.dumps(r, ensure_ascii=False).encode()) + b"\n")


def _first_lines(src: str, n: int) -> list[bytes]:
    with open(src, "rb") as f:
        return [line.rstrip(b"\n") for _, line in zip(range(n), f)]


def _files(d) -> dict[str, bytes]:
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def _same_items(a, b) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype == torch.long and torch.equal(x[k], y[k]), (i, k)


@pytest.fixture(scope="module")
def dpo_src(tmp_path_factory):
    """A folder with 40 real pairs, a multi-turn pair, a long pair (truncated at L=48) and a .json array."""
    d = tmp_path_factory.mktemp("dpo_src") / "prefs"
    d.mkdir()
    extra = [
        {"conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                           {"from": "human", "value": "q2"}],
         "chosen": {"role": "assistant", "content": "good"}, "rejected": [{"role": "assistant", "content": "bad"}],
         "system": "be brief"},
        {"prompt": "tell a long story", "chosen": "once upon a time " * 30, "rejected": "no"},
    ]
    with open(d / "a.jsonl", "wb") as f:
        f.write(b"\n".join(_first_lines(DPO_PAIRS, 40)) + b"\n")
        for r in extra:
            f.write(json.dumps(r).encode() + b"\n")
    with open(d / "b.json", "w", encoding="utf-8") as f:
        json.dump([{"prompt": "2+2?", "chosen": "4", "rejected": "5"}], f)
    return d


def test_pretokenized_dpo_equals_raw(tmp_path, dpo_src, tiny_pretrain_data):
    tok = tiny_pretrain_data["tokenizer_dir"]
    meta = pretokenize_dpo(str(dpo_src), tok, 48, str(tmp_path / "out"))
    from tokenizer import load_tokenizer_meta
    tmeta = load_tokenizer_meta(tok)
    assert meta["format_version"] == 1 and meta["kind"] == "dpo" and meta["dtype"] == "<u2"
    assert meta["vocab_size"] == tmeta["vocab_size"] and meta["tokenizer_fingerprint"] == tmeta["fingerprint"]
    a, b = meta["files"]
    # with this byte-level toy tokenizer many pairs exceed L=48: both policies' branches are exercised
    assert a["num_pairs"] + a["dropped_overlong"] == 42 and b["num_pairs"] == 1 and meta["num_pairs"] == a["num_pairs"] + 1
    assert a["truncated"] >= 1 and a["dropped_overlong"] >= 1 and a["skipped"] == {}
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["dpo_meta.json", "input_ids.bin", "labels.bin", "pairs.npy"]
    labels = np.fromfile(out / "labels.bin", dtype="<i4")
    assert labels.size == meta["num_tokens"] and (labels == -100).any()
    assert int((labels != -100).sum()) == meta["num_target_tokens"]

    raw, pre = DPODataset(tokenize_dpo_records(str(dpo_src), tok, 48)), DPODataset(str(out), 48)
    _same_items(raw, pre)
    assert raw.sources == pre.sources and raw.sources[-1] == (str(dpo_src / "b.json"), 0)
    assert raw.stats == pre.stats and raw.pad_id == pre.pad_id
    long = pre[pre.sources.index((str(dpo_src / "a.jsonl"), 42))]  # the long story: truncated to 48 positions
    assert long["chosen_input_ids"].numel() == 48 and (long["chosen_labels"] != -100).any()
    # the trainer's view: same split, same padded batches
    (tr_a, va_a, col_a), (tr_b, va_b, col_b) = (build_dpo_splits(tokenize_dpo_records(p, tok, 48), 48, val_ratio=0.1,
                                                                 seed=3) for p in (str(dpo_src), str(out)))
    _same_items(tr_a, tr_b)
    _same_items(va_a, va_b)
    ba, bb = col_a([tr_a[i] for i in range(8)]), col_b([tr_b[i] for i in range(8)])
    assert all(torch.equal(ba[k], bb[k]) for k in ba) and ba.keys() == bb.keys()
    # a longer max_seq_len than the folder was made for reads the same items; a shorter one is refused
    _same_items(pre, DPODataset(str(out), 96))
    with pytest.raises(DataError, match="max_seq_len=48"):
        DPODataset(str(out), 32)


def test_dpo_bad_records_counted_and_strict(tmp_path, tiny_pretrain_data):
    tok = tiny_pretrain_data["tokenizer_dir"]
    src = tmp_path / "bad"
    src.mkdir()
    _jsonl(src / "p.jsonl", [
        {"prompt": "which", "chosen": "this", "rejected": "that"},           # 1 ok
        b'{"prompt": "broken',                                                 # 2 malformed JSON
        b'[1, 2]',                                                             # 3 not an object
        {"prompt": "which", "chosen": "this"},                                 # 4 no rejected
        b'{"prompt": "x \\ud800", "chosen": "this", "rejected": "that"}',     # 5 lone surrogate
        {"prompt": "which", "chosen": 7, "rejected": "that"},                  # 6 non-string reply
        b'\xff\xfe',                                                           # 7 invalid UTF-8
        {"prompt": "again", "chosen": "yes", "rejected": "no"},               # 8 ok
    ])
    meta = pretokenize_dpo(str(src), tok, 48, str(tmp_path / "out"))
    skipped = meta["files"][0]["skipped"]
    assert meta["num_pairs"] == 2 and sum(skipped.values()) == 6, skipped
    assert skipped["malformed JSON"] == 1 and skipped["invalid UTF-8"] == 1
    assert skipped["invalid Unicode: lone surrogate in 'prompt'"] == 1
    assert DPODataset(str(tmp_path / "out")).sources == [(str(src / "p.jsonl"), 1), (str(src / "p.jsonl"), 8)]
    raw = DPODataset(tokenize_dpo_records(str(src), tok, 48))
    assert raw.stats == DPODataset(str(tmp_path / "out")).stats  # same policy raw
    with pytest.raises(DataError, match=r"p\.jsonl:2: malformed JSON"):
        pretokenize_dpo(str(src), tok, 48, str(tmp_path / "out2"), strict=True)

    cmd = [PY, "-m", "data_preprocess.pretokenize_dpo_data", f"--data_dir={src}", f"--tokenizer_dir={tok}",
           "--max_seq_len=48", "--num_workers=1"]
    strict = run_python([*cmd, "--strict", "--num_workers=2", f"--out_dir={tmp_path / 's'}"], cwd=ROOT, env=_env())
    assert strict.returncode == EXIT_BAD_DATA and "p.jsonl:2: malformed JSON" in strict.stderr, strict.stderr
    only_bad = tmp_path / "only_bad.jsonl"
    _jsonl(only_bad, [{"prompt": "x"}, b"nope"])
    r = run_python([PY, "-m", "data_preprocess.pretokenize_dpo_data", f"--data_dir={only_bad}",
                    f"--tokenizer_dir={tok}", "--max_seq_len=48", f"--out_dir={tmp_path / 'o'}"], cwd=ROOT, env=_env())
    assert r.returncode == EXIT_BAD_DATA and "no usable DPO pair" in r.stderr and "Traceback" not in r.stderr
    r = run_python([*cmd[:4], f"--tokenizer_dir={tmp_path / 'nope'}", "--max_seq_len=48"], cwd=ROOT, env=_env())
    assert r.returncode == EXIT_BAD_CONFIG and "Traceback" not in r.stderr, r.stderr
    # default output folder, named for the input and L, printed; run from another working directory
    r = run_cmd([*cmd[:3], f"--data_dir={src / 'p.jsonl'}", f"--tokenizer_dir={tok}", "--max_seq_len=48"],
                cwd=str(tmp_path), env=_env())
    want = tmp_path / "out" / "dpo_tokenized" / "p_L48"
    assert str(want) in r.stdout and (want / "dpo_meta.json").is_file()
    # a pretokenized SFT folder given to DPO is named as such
    os.makedirs(tmp_path / "sftlike")
    (tmp_path / "sftlike" / "sft_meta.json").write_text("{}")
    from dataset.dataset_sft import SFTDataset
    for read in (lambda p: tokenize_dpo_records(p, tok, 48), DPODataset):  # the trainer's path, and the reader
        with pytest.raises(DataError, match="pretokenized SFT"):
            read(str(tmp_path / "sftlike"))
    for read in (lambda p: tokenize_sft_records(p, tok, 48), SFTDataset):  # and the other way round
        with pytest.raises(DataError, match="pretokenized DPO"):
            read(str(tmp_path / "out"))


def test_one_and_two_workers_write_identical_files(tmp_path, tiny_pretrain_data):
    """More records than one worker batch (64 conversations), so 2 workers really split the work."""
    tok = tiny_pretrain_data["tokenizer_dir"]
    sft_src = os.path.join(ROOT, "data", "sft")
    a = pretokenize_sft(sft_src, tok, 64, str(tmp_path / "sft1"), num_workers=1)
    b = pretokenize_sft(sft_src, tok, 64, str(tmp_path / "sft2"), num_workers=2)
    assert a["num_samples"] > 2 * 64 and _files(tmp_path / "sft1") == _files(tmp_path / "sft2")
    assert {k: v for k, v in a.items() if k != "out_dir"} == {k: v for k, v in b.items() if k != "out_dir"}
    # and the in-memory reader the trainer uses on raw records gives the same samples
    from dataset.dataset_sft import SFTDataset
    raw, pre = SFTDataset(tokenize_sft_records(sft_src, tok, 64)), SFTDataset(str(tmp_path / "sft2"))
    _same_items(raw, pre)

    a = pretokenize_dpo(DPO_PAIRS, tok, 64, str(tmp_path / "dpo1"), num_workers=1)
    b = pretokenize_dpo(DPO_PAIRS, tok, 64, str(tmp_path / "dpo2"), num_workers=2)
    assert a["num_pairs"] > 64 and _files(tmp_path / "dpo1") == _files(tmp_path / "dpo2")
    # the CLI with 2 workers writes the same bytes again
    run_cmd([PY, "-m", "data_preprocess.pretokenize_dpo_data", f"--data_dir={DPO_PAIRS}", f"--tokenizer_dir={tok}",
             "--max_seq_len=64", "--num_workers=2", f"--out_dir={tmp_path / 'dpo3'}"], env=_env())
    assert _files(tmp_path / "dpo1") == _files(tmp_path / "dpo3")


def _boom_encode(msgs):
    """A stand-in encoder (module level: picklable for the workers) that fails on 'BOOM'."""
    text = "\n".join(m["content"] for m in msgs)
    if "BOOM" in text:
        raise RuntimeError("tokenizer exploded")
    ids = [1] + [5 + ord(c) % 100 for c in text] + [2]
    return ids, [False] + [True] * (len(ids) - 1)


@pytest.mark.parametrize("workers", [1, 2])
def test_worker_exceptions_are_collected_with_their_file(tmp_path, tiny_pretrain_data, workers):
    tok = tiny_pretrain_data["tokenizer_dir"]
    src = tmp_path / "src"
    src.mkdir()
    _jsonl(src / "a.jsonl", [{"instruction": "q", "output": "fine"}] * 3)
    _jsonl(src / "b.jsonl", [{"instruction": "q", "output": "fine"}, {"instruction": "q", "output": "BOOM"}])
    _jsonl(src / "c.jsonl", [{"instruction": "BOOM", "output": "x"}])
    with pytest.raises(DataError) as e:
        pretokenize_sft(str(src), tok, 64, str(tmp_path / "o"), num_workers=workers, encode_fn=_boom_encode)
    msg = str(e.value)
    assert "2 input file(s) failed" in msg and "a.jsonl" not in msg
    assert f"worker failed on {src / 'b.jsonl'}:1 .. 2: RuntimeError: tokenizer exploded" in msg
    assert f"worker failed on {src / 'c.jsonl'}:1: RuntimeError: tokenizer exploded" in msg
    assert not (tmp_path / "o" / "sft_meta.json").exists()
    dpo = tmp_path / "dpo.jsonl"
    _jsonl(dpo, [{"prompt": "q", "chosen": "BOOM", "rejected": "no"}])
    with pytest.raises(DataError, match=r"dpo\.jsonl:1: RuntimeError: tokenizer exploded"):
        pretokenize_dpo(str(dpo), tok, 64, str(tmp_path / "d"), num_workers=workers, encode_fn=_boom_encode)


def test_trainer_reads_pretokenized_dpo_like_raw(tiny_pretrain_run_args, tiny_pretrain_data, tmp_path):
    """2-step pretrain -> 2-step DPO from the raw .jsonl and from its pretokenized folder: the same
    batches, so the same losses; a folder made with another tokenizer is refused (exit 3)."""
    train = os.path.join(ROOT, "train_my_ddp.py")
    base = tmp_path / "pretrain"
    run_cmd([PY, train, *tiny_pretrain_run_args, f"--out_dir={base}", "--max_iters=2"], env=_env())
    tok = tiny_pretrain_data["tokenizer_dir"]
    toy = tmp_path / "toy_prefs.jsonl"
    toy.write_bytes(b"\n".join(_first_lines(DPO_PAIRS, 24)) + b"\n")
    pre = tmp_path / "toy_pretok"
    run_cmd([PY, "-m", "data_preprocess.pretokenize_dpo_data", f"--data_dir={toy}", f"--tokenizer_dir={tok}",
             "--max_seq_len=96", f"--out_dir={pre}", "--num_workers=1"], env=_env())
    common = [f"--tokenizer_dir={tok}", "--max_seq_len=96", "--device=cpu", "--progress=false",
              "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--eval_iters=2", "--warmup_iters=1",
              "--seed=3", "--val_ratio=0.1", "--task_type=dpo", "--max_iters=2", "--batch_size=4",
              "--learning_rate=3e-3", "--checkpoint_interval=100", f"--init_from={base}"]
    losses = {}
    for name, data in (("raw", toy), ("pretok", pre)):
        run_cmd([PY, train, *common, f"--data_dir={data}", f"--out_dir={tmp_path / name}"], env=_env())
        recs = dedupe_by_step(read_metrics(os.path.join(tmp_path / name, "metrics.jsonl")))
        losses[name] = [(s, recs[s]["loss"]) for s in sorted(recs)]
    assert [s for s, _ in losses["raw"]] == [1, 2] and all(np.isfinite(v) for _, v in losses["raw"])
    assert losses["raw"] == losses["pretok"]

    other = tmp_path / "other_tok"
    shutil.copytree(pre, other)
    meta = json.loads((other / "dpo_meta.json").read_text())
    meta["tokenizer_fingerprint"] = "0" * 64
    (other / "dpo_meta.json").write_text(json.dumps(meta))
    r = run_python([PY, train, *common, f"--data_dir={other}", f"--out_dir={tmp_path / 'refused'}"], cwd=ROOT, env=_env())
    assert r.returncode == EXIT_BAD_DATA and "tokenized with another tokenizer" in r.stderr, r.stderr[-2000:]
