"""Hugging Face datasets as input of the SFT and DPO pretokenizers (issue 37 item 11): a saved dataset of the same
records as a .jsonl gives the same pretokenized files, byte for byte (skipped where `datasets` is not installed:
it is optional)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from data_preprocess.pretokenize_dpo_data import pretokenize_dpo
from data_preprocess.pretokenize_sft_data import pretokenize_sft
from tests.conftest import ROOT, run_python
from tokenizer.corpus import CorpusConfigError
from tokenizer.dataset_source import open_dataset_source

datasets = pytest.importorskip("datasets")


def _same_outputs(a, b):
    """The token and label files byte for byte; the sample index equal but for its last column, the record's
    position in its input (a .jsonl's 1-based line, a dataset's 0-based row)."""
    import numpy as np
    names = sorted(n for n in os.listdir(a) if not n.endswith(".json"))
    assert names and names == sorted(n for n in os.listdir(b) if not n.endswith(".json"))
    for n in names:
        if n.endswith(".npy"):
            x, y = np.load(a / n), np.load(b / n)
            assert x.shape == y.shape and (x[:, :-1] == y[:, :-1]).all() and (x[:, -1] == y[:, -1] + 1).all(), n
        else:
            assert (a / n).read_bytes() == (b / n).read_bytes(), n


@pytest.mark.parametrize("kind, src, n, fn", [
    ("sft", os.path.join("data", "sft", "sft_instructions.jsonl"), 24, pretokenize_sft),
    ("dpo", os.path.join("data", "dpo", "dpo_pairs.jsonl"), 16, pretokenize_dpo),
])
def test_a_saved_dataset_pretokenizes_as_its_jsonl(tiny_pretrain_data, tmp_path, kind, src, n, fn):
    with open(os.path.join(ROOT, src), encoding="utf-8") as f:
        lines = [line for _, line in zip(range(n), f)]
    jsonl = tmp_path / f"{kind}.jsonl"
    jsonl.write_text("".join(lines), encoding="utf-8")
    datasets.Dataset.from_list([json.loads(line) for line in lines]).save_to_disk(str(tmp_path / "ds"))
    tok = tiny_pretrain_data["tokenizer_dir"]
    from_file = fn(str(jsonl), tok, 96, str(tmp_path / "from_file"))
    source = open_dataset_source(str(tmp_path / "ds"), "train", None)
    from_ds = fn(None, tok, 96, str(tmp_path / "from_ds"), hf_dataset=source)
    count = "num_samples" if kind == "sft" else "num_pairs"
    assert from_ds[count] == from_file[count] > 0
    assert from_ds["files"][0]["path"] == str(source)
    _same_outputs(tmp_path / "from_file", tmp_path / "from_ds")
    with pytest.raises(CorpusConfigError, match="needs --out_dir"):
        fn(None, tok, 96, None, hf_dataset=source)


@pytest.mark.parametrize("case", ["state_json_is_a_list", "dataset_dict_json_is_a_list", "malformed_data_file",
                                  "mistyped_folder"])
@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_a_bad_dataset_is_one_line_naming_it(tiny_pretrain_data, tmp_path, kind, case):
    """The same bad --hf_dataset inputs as the tokenizer trainer's and the pretraining pretokenizer's
    (tests/tokenizer/test_hf_datasets.py): exit 3 naming the damaged file (2 for a folder that is not there),
    one line, no traceback."""
    from tests.tokenizer.test_hf_datasets import _broken_input, _one_error_line
    flags, named, code = _broken_input(tmp_path, case)
    proc = run_python([sys.executable, "-m", f"data_preprocess.pretokenize_{kind}_data", *flags,
                       f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=64",
                       f"--out_dir={tmp_path / 'out'}", "--num_workers=1"], cwd=ROOT, timeout=300)
    _one_error_line(proc, code, named)
