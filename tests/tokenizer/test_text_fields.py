"""--text_fields: one grammar ('|' alternatives, ',' joined fields) in every command that reads raw text (the
tokenizer trainer, the extend-tokenizer command, the pretraining pretokenizer), and a file none of whose records
has the fields is a warning naming it and its keys, in each of them."""
import json
import os
import sys

import pytest

from data_preprocess import readers as R
from tests.conftest import ROOT, run_python
from tokenizer import corpus as C
from tokenizer import documents as D

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _corpus(d, other_schema_keys=("title", "content")):
    """a.jsonl: 40 records with "text"; b.jsonl: 30 records with the other schema's keys only."""
    d.mkdir()
    with open(d / "a.jsonl", "w", encoding="utf-8") as f:
        for i in range(40):
            f.write(json.dumps({"text": " ".join(WORDS[(i + k) % 12] for k in range(15)), "id": i}) + "\n")
    with open(d / "b.jsonl", "w", encoding="utf-8") as f:
        for i in range(30):
            rec = {k: " ".join(WORDS[(i * 3 + k + j) % 12] for k in range(10)) for j, k in enumerate(other_schema_keys)}
            f.write(json.dumps(rec) + "\n")
    return d


def _py(*args):
    return run_python([sys.executable, "-m", *args], cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def base_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    corpus = _corpus(d / "c")
    out = d / "tok"
    proc = _py("tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--out_dir={out}", "--vocab_size=320",
               "--progress=false")
    assert proc.returncode == 0, proc.stderr
    return str(out)


def _record_text(record, fields):
    """(text, None) or (None, (reason, detail)) of one record, in the tokenizer trainer's wording."""
    return D._record_text(record, D.parse_text_fields(fields))


def test_the_grammar_is_one_function():
    assert R.parse_text_fields is D.parse_text_fields
    assert D.parse_text_fields("text|title,content") == [["text"], ["title", "content"]]
    assert D.parse_text_fields(" title , content ") == [["title", "content"]]
    assert D.parse_text_fields(("title", "content")) == [["title", "content"]]  # a list of names: joined
    assert D.parse_text_fields([["text"], ["title", "content"]]) == [["text"], ["title", "content"]]
    with pytest.raises(ValueError, match="empty --text_fields"):
        D.parse_text_fields("|,")
    alts = D.parse_text_fields("text|title,content")
    assert _record_text({"title": "T", "content": "B"}, alts) == ("T\nB", None)
    assert _record_text({"text": "x", "title": "T", "content": "B"}, alts) == ("x", None)  # first alternative wins
    assert _record_text({"title": "T"}, alts)[1][0] == "missing field"


def test_alternatives_mean_the_same_in_every_command(tmp_path, base_tok):
    """'text|title,content' reads all 70 records in each command (the tokenizer trainer and the extend command
    read a field named 'text|title' and exited 3)."""
    corpus = _corpus(tmp_path / "c")
    spec = "--text_fields=text|title,content"
    tok = tmp_path / "tok"
    proc = _py("tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--out_dir={tok}", "--vocab_size=320",
               spec, "--progress=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tr = json.loads((tok / "tokenizer_meta.json").read_text())["training"]
    assert (tr["corpus_documents"], tr["skipped"], tr["text_fields"]) == (70, 0, "text|title,content")

    ext = tmp_path / "ext"
    proc = _py("tokenizer.extend_tokenizer", f"--base_tokenizer_dir={base_tok}", f"--data_dir={corpus}",
               "--num_new_tokens=8", f"--out_dir={ext}", spec, "--heldout_every=0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    tr = json.loads((ext / "tokenizer_meta.json").read_text())["training"]
    assert (tr["train_documents"], tr["skipped"]) == (70, 0)

    shards = tmp_path / "shards"
    proc = _py("data_preprocess.pretokenize_pretrain_data", f"--data_dir={corpus}", f"--tokenizer_dir={tok}",
               f"--out_dir={shards}", spec, "--num_workers=1", "--progress=false")
    assert proc.returncode == 0, proc.stderr[-2000:]
    docs = sum(json.loads((shards / n).read_text())["num_documents"] for n in os.listdir(shards)
               if n.endswith(".json"))
    assert docs == 70


def test_a_file_of_another_schema_is_a_warning_naming_it_and_its_keys(tmp_path, base_tok):
    """Default fields ("text"): b.jsonl (title/body records) is skipped whole; each command still succeeds on
    a.jsonl and says so in a warning that names b.jsonl and its keys (the tokenizer run said nothing)."""
    corpus = _corpus(tmp_path / "c", other_schema_keys=("title", "body"))
    b = corpus / "b.jsonl"
    want = f"{b}: skipped whole: none of its 30 record(s) has the --text_fields 'text'; its records have the keys: body, title"
    tok = tmp_path / "tok"
    runs = {
        "train_tokenizer": _py("tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--out_dir={tok}",
                               "--vocab_size=320", "--progress=false", "--max_train_bytes=1M"),
        "extend_tokenizer": _py("tokenizer.extend_tokenizer", f"--base_tokenizer_dir={base_tok}",
                                f"--data_dir={corpus}", "--num_new_tokens=8", f"--out_dir={tmp_path / 'ext'}"),
    }
    runs["pretokenize"] = _py("data_preprocess.pretokenize_pretrain_data", f"--data_dir={corpus}",
                              f"--tokenizer_dir={tok}", f"--out_dir={tmp_path / 'shards'}", "--num_workers=1",
                              "--progress=false")
    for name, proc in runs.items():
        assert proc.returncode == 0, (name, proc.stderr[-2000:])
        assert proc.stderr.count(want) == 1, (name, proc.stderr[-3000:])  # once, also with two passes
        assert " WARNING " in next(line for line in proc.stderr.splitlines() if want in line), name
    # a file where some records have the fields is not "skipped whole": its skips are counted as before
    (corpus / "b.jsonl").write_text(json.dumps({"text": "alpha beta"}) + "\n" + json.dumps({"title": "x"}) + "\n")
    proc = _py("tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--out_dir={tmp_path / 'tok2'}",
               "--vocab_size=320", "--progress=false")
    assert proc.returncode == 0 and "skipped whole" not in proc.stderr and "missing field" in proc.stderr


def test_parquet_of_another_schema_names_its_columns(tmp_path, caplog):
    import logging

    import pyarrow as pa
    import pyarrow.parquet as pq
    p = tmp_path / "x.parquet"
    pq.write_table(pa.table({"question": ["q1", "q2"], "answer": ["a1", "a2"]}), p)
    with caplog.at_level(logging.WARNING):
        docs = list(D.iter_file_documents(str(p), "text|title,content", C.SkipCounter()))
    assert docs == []
    assert (f"{p}: skipped whole: none of its 2 record(s) has the --text_fields 'text|title,content'; "
            "its records have the keys: answer, question") in caplog.text
