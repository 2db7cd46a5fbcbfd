"""A run resumed after its --data_dir gained a shard (the index rebuilt over more samples; issue 33 item 8): the
saved data position would name other samples. Without --allow_data_change it is one line saying what changed
(exit 2; it blamed the global batch before); with it the run goes on from its checkpoint (weights, optimizer,
step) and reads the new data from its start."""
from __future__ import annotations

import json
import os
import shutil

from tests.conftest import PY, child_env, run_cmd, run_trainer, train_cmd
from utils.metrics import read_metrics


_env = child_env  # tests/conftest.py: one thread per process, unbuffered output


def test_a_data_dir_that_gained_a_shard(tiny_pretrain_data, tiny_pretrain_run_args, tmp_path):
    data = tmp_path / "shards"
    shutil.copytree(tiny_pretrain_data["data_dir"], data)
    args = [a for a in tiny_pretrain_run_args if not a.startswith("--data_dir")] + [f"--data_dir={data}"]
    out = tmp_path / "run"
    run_cmd(train_cmd([*args, f"--out_dir={out}", "--max_iters=3"]), env=_env())
    # a new source's shard (a copy of the first under another stem), then the index rebuilt
    first = sorted(p for p in os.listdir(data) if p.endswith("_00000.json"))[0][:-len("_00000.json")]
    for ext in (".bin", ".idx.npy", ".json"):
        shutil.copy(data / f"{first}_00000{ext}", data / f"more_00000{ext}")
    side = data / "more_00000.json"
    meta = json.loads(side.read_text())
    meta["doc_index_file"] = "more_00000.idx.npy"
    side.write_text(json.dumps(meta))
    shutil.rmtree(data / f"index_L{tiny_pretrain_data['max_seq_len']}")
    run_cmd([PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={data}",
             f"--max_seq_len={tiny_pretrain_data['max_seq_len']}", "--val_ratio=0.1"])

    refused = run_trainer(train_cmd([*args, f"--out_dir={out}", "--max_iters=6"]), env=_env())
    assert refused.returncode == 2, refused.stderr[-2000:]
    line = [ln for ln in refused.stderr.splitlines() if "error:" in ln]
    assert len(line) == 1 and "the training data changed since" in line[0] and "global batch" not in line[0], line
    assert "--allow_data_change=true" in line[0]
    assert max(r["step"] for r in read_metrics(str(out / "metrics.jsonl"))) == 3  # nothing trained

    ok = run_trainer(train_cmd([*args, f"--out_dir={out}", "--max_iters=6", "--allow_data_change=true"]), env=_env())
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "[resume] continuing" in ok.stdout and "reading the new data from its start" in ok.stdout, ok.stdout[-2000:]
    steps = sorted({r["step"] for r in read_metrics(str(out / "metrics.jsonl")) if "loss" in r})
    assert steps == [1, 2, 3, 4, 5, 6]  # continued at step 4, not started over
