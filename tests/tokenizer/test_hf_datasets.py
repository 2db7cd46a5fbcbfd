"""Hugging Face `datasets` as input (issue 37 item 11): the tokenizer trainer and the pretraining pretokenizer read
a save_to_disk folder (Dataset or DatasetDict split; pyarrow alone, `datasets` not needed) or local files through
datasets.load_dataset (streamed), with the same --text_fields grammar as files: the same documents, so the same
tokenizer and the same token shards as from the equivalent .jsonl. Offline, on datasets the tests build."""
import json
import logging
import os
import sys

import pytest

from tests.conftest import ROOT, run_python
from tokenizer import corpus as C
from tokenizer import documents as D
from tokenizer.dataset_source import open_dataset_source

datasets = pytest.importorskip("datasets")

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu 数据 模型".split()


def _records(n=80):
    out = []
    for i in range(n):
        body = " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(12))
        out.append({"text": body} if i % 3 else {"title": f"title {i}", "content": body})
    return out


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hfds")
    recs = _records()
    with open(d / "c.jsonl", "w", encoding="utf-8") as f:
        for r in recs:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    cols = {k: [r.get(k) for r in recs] for k in ("text", "title", "content")}
    ds = datasets.Dataset.from_dict(cols)
    ds.save_to_disk(str(d / "ds"))
    datasets.DatasetDict({"train": ds, "test": ds.select(range(5))}).save_to_disk(str(d / "dd"))
    datasets.Dataset.from_dict({"title": ["a", "b"], "body": ["c", "d"]}).save_to_disk(str(d / "titles"))
    return d


def _py(*args):
    return run_python([sys.executable, "-m", *args], cwd=ROOT, timeout=300)


def _bins(d):
    return b"".join((d / n).read_bytes() for n in sorted(os.listdir(d)) if n.endswith(".bin"))


def test_tokenizer_and_pretokenizer_read_a_dataset_as_the_same_jsonl(inputs, tmp_path):
    spec = "--text_fields=text|title,content"
    toks = {}
    for name, src in (("jsonl", [f"--data_dir={inputs / 'c.jsonl'}"]), ("saved", [f"--hf_dataset={inputs / 'ds'}"]),
                      ("load_dataset", ["--hf_dataset=json", f"--hf_data_files={inputs / 'c.jsonl'}"])):
        out = tmp_path / f"tok_{name}"
        proc = _py("tokenizer.train_tokenizer", *src, f"--out_dir={out}", "--vocab_size=320", spec, "--quiet")
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        toks[name] = json.loads((out / "tokenizer_meta.json").read_text())
        assert (toks[name]["training"]["corpus_documents"], toks[name]["training"]["skipped"]) == (80, 0), name
    assert toks["saved"]["fingerprint"] == toks["load_dataset"]["fingerprint"] == toks["jsonl"]["fingerprint"]
    assert toks["saved"]["training"]["files"] == [f"hf:{inputs / 'ds'}[train]"]

    tok = tmp_path / "tok_jsonl"
    shards = {}
    for name, src in (("jsonl", [f"--data_dir={inputs / 'c.jsonl'}"]),
                      ("dict_split", [f"--hf_dataset={inputs / 'dd'}", "--hf_split=train"]),
                      ("load_dataset", ["--hf_dataset=json", f"--hf_data_files={inputs / 'c.jsonl'}"])):
        out = tmp_path / f"shards_{name}"
        proc = _py("data_preprocess.pretokenize_pretrain_data", *src, f"--tokenizer_dir={tok}", f"--out_dir={out}",
                   spec, "--num_workers=1", "--quiet")
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        shards[name] = _bins(out)
    assert shards["dict_split"] == shards["load_dataset"] == shards["jsonl"] and len(shards["jsonl"]) > 0
    side = json.loads((tmp_path / "shards_dict_split" / "hf_dd_train_00000.json").read_text())
    assert side["num_documents"] == 80 and side["source"]["path"] == f"hf:{inputs / 'dd'}[train]"
    again = _py("data_preprocess.pretokenize_pretrain_data", f"--hf_dataset={inputs / 'dd'}", f"--tokenizer_dir={tok}",
                f"--out_dir={tmp_path / 'shards_dict_split'}", spec, "--num_workers=1", "--quiet")
    assert again.returncode == 0 and "(1 already complete)" in again.stderr, again.stderr[-2000:]
    bad = _py("data_preprocess.pretokenize_pretrain_data", f"--hf_dataset={inputs / 'dd'}", "--hf_split=validation",
              f"--tokenizer_dir={tok}", f"--out_dir={tmp_path / 'x'}", "--quiet")
    assert bad.returncode == 2 and "no split 'validation' (it has train, test)" in bad.stderr, bad.stderr[-2000:]
    bad = _py("tokenizer.train_tokenizer", f"--out_dir={tmp_path / 'y'}", "--vocab_size=320")
    assert bad.returncode == 2 and "no input: give --data_dir and/or --hf_dataset" in bad.stderr, bad.stderr[-2000:]


def test_a_saved_dataset_is_read_without_the_datasets_package(inputs, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    src = open_dataset_source(str(inputs / "ds"))
    docs = [d for d, _ in D.iter_file_documents(src, "text|title,content", C.SkipCounter())]
    want = [r.get("text") or f"{r['title']}\n{r['content']}" for r in _records()]
    assert docs == want
    with pytest.raises(C.CorpusConfigError, match="pip install datasets"):
        open_dataset_source("json", data_files=[str(inputs / "c.jsonl")])
    # the one grammar's whole-file warning names the dataset and its columns
    only_titles = inputs / "titles"
    with caplog.at_level(logging.WARNING):
        assert list(D.iter_file_documents(open_dataset_source(str(only_titles)), "text", C.SkipCounter())) == []
    assert (f"hf:{only_titles}[train]: skipped whole: none of its 2 record(s) has the --text_fields 'text'; "
            "its records have the keys: body, title") in caplog.text


def test_the_split_asked_for_is_the_one_read(inputs, tmp_path):
    """--hf_split picks the rows: of a saved DatasetDict (train 80 rows, test its first 5) and of a local folder
    that datasets.load_dataset splits by file name (train.jsonl, test.jsonl)."""
    def texts(src):
        return [r.value["text"] for r in src.records(["text"])]

    want = [r.get("text") for r in _records()]
    assert texts(open_dataset_source(str(inputs / "dd"), "test")) == want[:5]
    assert texts(open_dataset_source(str(inputs / "dd"), "train")) == want
    folder = tmp_path / "by_name"
    folder.mkdir()
    for split, n in (("train", 3), ("test", 2)):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{split} {i}"}) + "\n" for i in range(n)))
    assert texts(open_dataset_source(str(folder), "test")) == ["test 0", "test 1"]
    assert texts(open_dataset_source(str(folder), "train")) == ["train 0", "train 1", "train 2"]
    with pytest.raises(C.CorpusConfigError, match="cannot load split 'validation'"):
        open_dataset_source(str(folder), "validation")


# ------------------------------------------------------------------ damaged, mistyped or empty datasets: one line

def _broken_input(d, case):
    """(flags, what the error line names, exit code) for one kind of bad --hf_dataset, built under `d`."""
    if case == "state_json_is_a_list":  # save_to_disk(Dataset) whose state.json is a JSON list
        datasets.Dataset.from_dict({"text": ["a b"]}).save_to_disk(str(d / "ds"))
        (d / "ds" / "state.json").write_text("[1, 2]")
        return [f"--hf_dataset={d / 'ds'}"], str(d / "ds" / "state.json"), 3
    if case == "dataset_dict_json_is_a_list":
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a b"]})}).save_to_disk(str(d / "dd"))
        (d / "dd" / "dataset_dict.json").write_text('["train"]')
        return [f"--hf_dataset={d / 'dd'}"], str(d / "dd" / "dataset_dict.json"), 3
    if case == "malformed_data_file":  # read through datasets.load_dataset("json"): pyarrow refuses it
        good, bad = d / "good.jsonl", d / "bad.jsonl"
        good.write_text('{"text": "fine text"}\n')
        bad.write_text('{"text": "a"}\n{broken\n')
        return ["--hf_dataset=json", f"--hf_data_files={good}", f"--hf_data_files={bad}"], str(bad), 3
    if case == "mistyped_folder":
        return [f"--hf_dataset={d / 'no_such_dir' / 'ds'}"], f"{d / 'no_such_dir' / 'ds'}: no such folder", 2
    assert case == "no_usable_document"
    datasets.Dataset.from_dict({"text": ["", None]}).save_to_disk(str(d / "empty"))
    return [f"--hf_dataset={d / 'empty'}"], f"hf:{d / 'empty'}[train]", 3


def _one_error_line(proc, code, named):
    """Exit `code`, no traceback, and exactly one ERROR line (the last one on stderr) naming `named`."""
    err = proc.stderr
    assert proc.returncode == code and "Traceback" not in err, (proc.returncode, err[-3000:])
    errors = [line for line in err.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and named in errors[0] and err.rstrip().splitlines()[-1] == errors[0], err[-3000:]
    assert "None" not in errors[0], errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def small_tok(inputs):
    from tokenizer.train_tokenizer import train_tokenizer
    out = inputs / "small_tok"
    train_tokenizer(str(inputs / "c.jsonl"), str(out), vocab_size=300)
    return out


@pytest.mark.parametrize("case", ["state_json_is_a_list", "dataset_dict_json_is_a_list", "malformed_data_file",
                                  "mistyped_folder", "no_usable_document"])
def test_a_bad_dataset_is_one_line_naming_it_in_the_trainer_and_the_pretokenizer(small_tok, tmp_path, case):
    flags, named, code = _broken_input(tmp_path, case)
    proc = _py("tokenizer.train_tokenizer", *flags, f"--out_dir={tmp_path / 'tok'}", "--vocab_size=300", "--quiet")
    _one_error_line(proc, code, named)
    proc = _py("data_preprocess.pretokenize_pretrain_data", *flags, f"--tokenizer_dir={small_tok}",
               f"--out_dir={tmp_path / 'shards'}", "--num_workers=1", "--quiet")
    line = _one_error_line(proc, code, named)
    if case == "no_usable_document":
        assert f"hf:{tmp_path / 'empty'}[train]: no tokens" in line


def test_a_mistyped_folder_is_no_such_folder_without_the_datasets_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now raises ImportError
    for spec in (str(tmp_path / "no_such_dir"), "./no_such_dir/ds", "no_such_dir/ds"):
        with pytest.raises(C.CorpusConfigError, match="no such folder") as e:
            open_dataset_source(spec)
        assert str(e.value).startswith(f"--hf_dataset={spec}: no such folder"), e.value
    (tmp_path / "plain").mkdir()  # a folder, but no save_to_disk folder
    with pytest.raises(C.CorpusConfigError, match="not a save_to_disk folder"):
        open_dataset_source(str(tmp_path / "plain"))
