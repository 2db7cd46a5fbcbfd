"""dataset/ only reads pretokenized data (issue 34): no tokenizer, chat template or record reader is imported
by the SFT / DPO readers; raw records reach them through data_preprocess's in-memory `ChatTokens`."""
import json
import subprocess
import sys

import numpy as np
import pytest

from data_preprocess.chat_tokens import DPO, SFT, ChatTokens
from data_preprocess.shard_format import DataError
from tests.conftest import ROOT


def test_sft_and_dpo_readers_import_no_tokenizer():
    code = ("import sys, dataset, dataset.dataset_sft, dataset.dataset_dpo, dataset.chat_dataset\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('tokenizer', 'transformers', 'tokenizers')\n"
            "       or m in ('data_preprocess.sft_format', 'data_preprocess.readers',\n"
            "                'data_preprocess.pretokenize_sft_data', 'data_preprocess.pretokenize_dpo_data')]\n"
            "print(sorted(bad))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


def _tokens(kind, n_rows):
    """`n_rows` rows of 3-token branches over ids 0, 1, 2, ... (labels equal to the ids)."""
    spans = [[3 * (kind.branches * i + b), 3] for i in range(n_rows) for b in range(kind.branches)]
    index = np.array([sum(spans[kind.branches * i:kind.branches * (i + 1)], []) + [0, i + 1] for i in range(n_rows)],
                     dtype=np.int64).reshape(-1, kind.cols)
    n = 3 * kind.branches * n_rows
    meta = {"pad_id": 0, "max_seq_len": 8, kind.count_key: n_rows, "files": [
        {"path": "a.jsonl", "dropped_overlong": 0, "truncated": 0, "skipped": {}}]}
    return ChatTokens(kind, "raw/a.jsonl", meta, np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int32), index)


def test_in_memory_tokens_are_read_like_a_folder(tmp_path):
    from dataset.dataset_dpo import DPODataset
    from dataset.dataset_sft import SFTDataset
    sft = SFTDataset(_tokens(SFT, 2))
    assert sft[1]["input_ids"].tolist() == [3, 4] and sft[1]["labels"].tolist() == [4, 5]
    assert sft.source(1) == ("a.jsonl", 2) and sft.length(0) == 2
    dpo = DPODataset(_tokens(DPO, 2))
    assert dpo[1]["chosen_input_ids"].tolist() == [6, 7] and dpo[1]["rejected_labels"].tolist() == [10, 11]
    assert dpo.sources == [("a.jsonl", 1), ("a.jsonl", 2)]
    with pytest.raises(DataError, match="DPO pairs given where SFT samples are read"):
        SFTDataset(_tokens(DPO, 1))
    with pytest.raises(DataError, match="raw/a.jsonl: no SFT samples"):
        SFTDataset(_tokens(SFT, 0))
    (tmp_path / "a.jsonl").write_text(json.dumps({"instruction": "q", "output": "a"}) + "\n")
    for ds, name in ((SFTDataset, "sft"), (DPODataset, "dpo")):  # raw records: the reader names who tokenizes them
        with pytest.raises(DataError, match=f"no {name}_meta.json; raw records are tokenized by "
                                            f"data_preprocess.pretokenize_{name}_data first"):
            ds(str(tmp_path))
