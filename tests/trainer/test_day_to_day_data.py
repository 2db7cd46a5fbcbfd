"""Day-to-day use on one's own data: what the trainer read of raw SFT / DPO records is said at start (records,
samples, truncated, dropped and skipped by reason, tokens); a validation split too small to mean anything is
warned about; --eval_data_dir (TRL's eval_dataset) is validation instead of a split of --data_dir, for SFT, DPO
and pretraining, and the pre-check refuses one that does not exist."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from data_preprocess.shard_format import write_shard
from trainer.config import TrainConfig
from trainer.precheck import precheck
from trainer.task import build_data
from utils.constants import EXIT_BAD_DATA


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from tokenizer.train_tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("tok")
    texts = [f"hello world {i} the quick brown fox answers questions" for i in range(300)]
    with open(d / "c.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    train_tokenizer(str(d / "c.jsonl"), str(d / "tok"), vocab_size=300)
    return str(d / "tok")


def _tok_meta(tok_dir: str) -> dict:
    from tokenizer import load_tokenizer_meta
    return load_tokenizer_meta(tok_dir)


def _sft_lines(n_ok: int) -> list[str]:
    """n_ok short records, 5 whose reply is cut at max_seq_len=32, 2 whose prompt leaves no target once cut
    (dropped, counted as over-long), one bad JSON line and one record without an output."""
    recs = [{"instruction": f"say hello {i}", "output": "hello world"} for i in range(n_ok)]
    recs += [{"instruction": "tell", "output": " ".join(["the quick brown fox"] * 20)} for _ in range(5)]
    recs += [{"instruction": " ".join(["questions answers"] * 40), "output": "ok"} for _ in range(2)]
    lines = [json.dumps(r) for r in recs] + ['{"instruction": "broken', json.dumps({"instruction": "no output"})]
    return lines


def _write(path, lines) -> str:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _cfg(tok_dir: str, **kw) -> TrainConfig:
    base = dict(task_type="sft", tokenizer_dir=tok_dir, max_seq_len=32, batch_size=2, seed=3)
    return TrainConfig(**{**base, **kw})


def test_raw_sft_read_is_said_and_a_tiny_validation_split_is_warned(tok_dir, tmp_path):
    data = _write(tmp_path / "sft.jsonl", _sft_lines(31))  # 40 lines, 36 samples: --val_ratio=0.05 holds out 2
    lines: list[str] = []
    _, make_val = build_data(_cfg(tok_dir, data_dir=data), 0, 1, _tok_meta(tok_dir), log=lines.append)
    read = [ln for ln in lines if ln.startswith(f"[data] sft train {data}: ")]
    assert len(read) == 1, lines
    assert re.fullmatch(r"\[data\] sft train \S+: 40 records -> 36 SFT samples \(5 truncated to 33 tokens\), dropped 2 "
                        r"\(over-long 2, no target left 0\), skipped 2 \(malformed JSON 1, missing field 'output' 1\), "
                        r"\d+ tokens", read[0]), read[0]
    assert "[data] sft: 34 training / 2 validation SFT samples (validation: --val_ratio=0.05 of --data_dir)" in lines
    warn = [ln for ln in lines if ln.startswith("[warning] data:")]
    assert warn == [f"[warning] data: only 2 validation SFT samples (--val_ratio=0.05 of --data_dir): a val_loss over "
                    "fewer than 20 is noise; give a separate validation file with "
                    "--eval_data_dir=<records> (or a larger --val_ratio)"]
    assert make_val() is not None


def test_eval_data_dir_is_validation_for_sft_and_dpo(tok_dir, tmp_path):
    data = _write(tmp_path / "sft.jsonl", _sft_lines(31))
    held = _write(tmp_path / "held.jsonl", [json.dumps({"instruction": f"hi {i}", "output": "hello"})
                                             for i in range(25)])
    lines: list[str] = []
    train, make_val = build_data(_cfg(tok_dir, data_dir=data, eval_data_dir=held), 0, 1, _tok_meta(tok_dir),
                                 log=lines.append)
    assert train.num_samples == 36  # every sample of --data_dir trains: --val_ratio is unused
    assert f"[data] sft: 36 training / 25 validation SFT samples (validation: --eval_data_dir={held})" in lines
    assert any(ln.startswith(f"[data] sft validation {held}: 25 records -> 25 SFT samples") for ln in lines), lines
    assert not [ln for ln in lines if ln.startswith("[warning]")]
    val = make_val()
    seen = sum(int(b["input_ids"].shape[0]) for b, _ in zip(val, range(13)))
    assert seen >= 25
    # DPO: pairs from another file
    pair = {"prompt": "say hello", "chosen": "hello world", "rejected": "fox"}
    d_train = _write(tmp_path / "dpo.jsonl", [json.dumps(pair)] * 30)
    d_held = _write(tmp_path / "dpo_held.jsonl", [json.dumps(pair)] * 4)
    lines = []
    train, _ = build_data(_cfg(tok_dir, task_type="dpo", data_dir=d_train, eval_data_dir=d_held), 0, 1,
                          _tok_meta(tok_dir), log=lines.append)
    assert train.num_samples == 30
    assert f"[data] dpo: 30 training / 4 validation DPO pairs (validation: --eval_data_dir={d_held})" in lines
    assert any(ln.startswith("[warning] data: only 4 validation DPO pairs") for ln in lines), lines


def _shards(d, n_tokens: int, seed: int) -> None:
    d.mkdir()
    ids = np.random.default_rng(seed).integers(3, 300, size=n_tokens)
    write_shard(str(d), "c", 0, ids, np.array([0, n_tokens]),
                {"dtype": "<u2", "vocab_size": 300, "bos_id": 1, "eos_id": 2, "tokenizer_fingerprint": "fp",
                 "final": True})


def test_eval_data_dir_is_validation_for_pretraining(tmp_path):
    from data_preprocess.build_pretrain_sample_index_map import build_index
    _shards(tmp_path / "train", 33 * 16 + 1, 0)
    build_index(str(tmp_path / "train"), 16, val_ratio=0.1, split_by="sample")  # one document: split by sample
    _shards(tmp_path / "held", 16 * 30 + 1, 1)  # no index: every sample of it is read
    lines: list[str] = []
    cfg = TrainConfig(data_dir=str(tmp_path / "train"), eval_data_dir=str(tmp_path / "held"), tokenizer_dir="t",
                      max_seq_len=16, batch_size=2)
    train, make_val = build_data(cfg, 0, 1, {"vocab_size": 300, "fingerprint": "fp"}, log=lines.append)
    assert f"[data] pretrain: 30 training / 30 validation samples (validation: --eval_data_dir={tmp_path / 'held'})" \
        in lines
    first = next(iter(make_val()))["input_ids"][0]
    held = np.fromfile(tmp_path / "held" / "c_00000.bin", dtype="<u2")
    assert first.tolist() == held[:16].tolist()
    # without it, the index's val split; a few samples are warned about
    lines = []
    build_data(TrainConfig(data_dir=str(tmp_path / "train"), tokenizer_dir="t", max_seq_len=16, batch_size=2), 0, 1,
               {"vocab_size": 300, "fingerprint": "fp"}, log=lines.append)
    assert any(ln.startswith("[warning] data: only 3 validation samples (the val split of the index of --data_dir, "
                             "by sample)") for ln in lines), lines
    # shards of another tokenizer are refused for validation as for training
    with pytest.raises(Exception, match="another tokenizer"):
        build_data(cfg, 0, 1, {"vocab_size": 300, "fingerprint": "other"})


def test_precheck_refuses_a_missing_eval_data_dir(tok_dir, tmp_path, capsys):
    data = _write(tmp_path / "sft.jsonl", _sft_lines(31))
    argv = ["--task_type=sft", f"--data_dir={data}", f"--tokenizer_dir={tok_dir}", f"--out_dir={tmp_path / 'run'}",
            f"--init_from={tmp_path}", f"--eval_data_dir={tmp_path / 'nope.jsonl'}"]
    with pytest.raises(SystemExit) as e:
        precheck(argv, "t", "train_my_ddp.py")
    assert e.value.code == EXIT_BAD_DATA
    assert capsys.readouterr().err.strip() == \
        f"[rank 0] error: data: --eval_data_dir={tmp_path / 'nope.jsonl'}: no such file or directory"
    assert not (tmp_path / "run").exists()


def test_precheck_refuses_a_missing_ref_model_for_grpo_as_for_dpo(tok_dir, tmp_path, capsys):
    prompts = _write(tmp_path / "p.jsonl", [json.dumps({"prompt": "1+1=", "answer": "2"})])
    argv = ["--task_type=grpo", f"--data_dir={prompts}", f"--tokenizer_dir={tok_dir}", f"--out_dir={tmp_path / 'run'}",
            f"--init_from={tmp_path}", "--beta=0.1", f"--ref_model={tmp_path / 'no_ref'}"]
    with pytest.raises(SystemExit) as e:
        precheck(argv, "t", "train_my_ddp.py")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--ref_model" in err and str(tmp_path / "no_ref") in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()
