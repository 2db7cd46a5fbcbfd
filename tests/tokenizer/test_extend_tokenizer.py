"""tokenizer.extend_tokenizer: bases of both kinds (sentencepiece Llama, byte-level / byte-fallback BPE
tokenizer.json of ours) trained on English, extended with Chinese pieces; ids kept, HF loading, round trip,
merges, sentencepiece proto = tokenizer.json, tokens/char falls, injection safety, meta, CLI errors."""
import json
import logging
import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenizer import encode_chat, encode_texts, train_tokenizer
from tokenizer.contract import META_FILENAME, fingerprint_dir
from tokenizer.extend_base import tokenizer_fingerprint
from tokenizer.extend_pieces import Corpus
from tokenizer.extend_tokenizer import extend_tokenizer, main
from tests.conftest import run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASES = ["llama_sp", "ours_hf_bbpe", "ours_sp_bbpe"]
NUM_NEW = 400
HYP = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
LLAMA_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
TRICKY = ["光合作用是绿色植物利用光能的过程。", "Hello  world\n\tx = 1", "e\u0301 n\u0303 a\u0308\u0304",
          "👍🏽 👨‍👩‍👧 🇨🇳", "中文 English 混合 123456", "\u200b\ufeff\u00a0zero-width", "a\r\nb\n\n\nc",
          "<s> </s> <|im_end|> <unk> <0x41>", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0010ffff", "ﾃｽﾄ ＡＢＣ ﬁ"]


def _read(name, n):
    with open(os.path.join(ROOT, "data", "pretrain", name), encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f][:n]


@pytest.fixture(scope="module")
def zh_corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("zh")
    with open(d / "zh.jsonl", "w", encoding="utf-8") as f:
        for t in _read("zh_written.jsonl", 80):
            f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
    return str(d)


def _llama_base(path, en_docs, pad_token=False):
    """A tiny Llama-style sentencepiece BPE (byte_fallback, dummy prefix, split digits) saved like a HF
    Llama directory: tokenizer.model + tokenizer.json + tokenizer_config.json with a chat template."""
    import io

    import sentencepiece as spm
    from transformers import AutoTokenizer

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(en_docs), model_writer=out, model_type="bpe", vocab_size=600, byte_fallback=True,
        character_coverage=1.0, normalization_rule_name="identity", add_dummy_prefix=True,
        remove_extra_whitespaces=False, split_digits=True, allow_whitespace_only_pieces=True,
        hard_vocab_limit=False, max_sentence_length=100000, minloglevel=2)
    os.makedirs(path)
    with open(os.path.join(path, "tokenizer.model"), "wb") as f:
        f.write(out.getvalue())
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "LlamaTokenizer", "chat_template": LLAMA_TEMPLATE}, f)
    # transformers 5 converts tokenizer.model on load (LlamaTokenizerFast(vocab_file=...) no longer reads it)
    tok = AutoTokenizer.from_pretrained(path)
    if pad_token:
        tok.add_special_tokens({"pad_token": "<pad>"})
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    en = _read("en_python_docs.jsonl", 30)
    d = tmp_path_factory.mktemp("bases")
    with open(d / "en.txt", "w", encoding="utf-8") as f:
        f.write("\n".join(t.replace("\n", " ") for t in en) + "\n")
    out = {"llama_sp": _llama_base(str(d / "llama_sp"), en)}
    for t in ("hf_bbpe", "sp_bbpe"):
        train_tokenizer([str(d / "en.txt")], str(d / f"ours_{t}"), 512, tokenizer_type=t, progress=False)
        out[f"ours_{t}"] = str(d / f"ours_{t}")
    return out


@pytest.fixture(scope="module")
def extended(bases, zh_corpus, tmp_path_factory):
    from transformers import AutoTokenizer

    out = {}
    for name, base in bases.items():
        path = str(tmp_path_factory.mktemp("ext") / name)
        meta = extend_tokenizer(base, zh_corpus, NUM_NEW, path, seed=0)
        out[name] = {"dir": path, "meta": meta, "base_dir": base,
                     "tok": AutoTokenizer.from_pretrained(path, trust_remote_code=False),
                     "base": AutoTokenizer.from_pretrained(base, trust_remote_code=False)}
    return out


@pytest.mark.parametrize("name", BASES)
def test_base_ids_keep_their_strings_and_new_ids_follow(extended, name):
    e = extended[name]
    tok, base, meta = e["tok"], e["base"], e["meta"]
    x = meta["extension"]
    b = len(base)
    assert x["base_vocab_size"] == b and x["num_new_tokens"] == NUM_NEW
    assert tok.convert_ids_to_tokens(list(range(b))) == base.convert_ids_to_tokens(list(range(b)))
    assert tok.get_vocab().items() >= base.get_vocab().items()
    new = tok.convert_ids_to_tokens(list(range(b, b + NUM_NEW)))
    assert len(set(new)) == NUM_NEW and not set(new) & set(base.get_vocab())
    assert len(tok) == meta["vocab_size"] and len(tok) % 64 == 0 and len(tok) - 64 < b + NUM_NEW <= len(tok)
    pad = tok.convert_ids_to_tokens(list(range(b + NUM_NEW, len(tok))))
    assert all(t.startswith("<|reserved_") for t in pad) and not set(pad) & set(base.get_vocab())
    decoder = tok.added_tokens_decoder
    assert all(decoder[i].special for i in range(b + NUM_NEW, len(tok)))
    assert tok.decode(list(range(b + NUM_NEW, len(tok))), skip_special_tokens=True) == ""


@pytest.mark.parametrize("name", BASES)
def test_loads_plainly_and_keeps_specials_and_chat_template(extended, name):
    e = extended[name]
    tok, base = e["tok"], e["base"]
    assert type(tok) is type(base)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(tok, attr) == getattr(base, attr)
        if getattr(base, attr) is not None:
            assert getattr(tok, f"{attr}_id") == getattr(base, f"{attr}_id")
    assert set(base.all_special_tokens) <= set(tok.all_special_tokens)
    assert tok.chat_template == base.chat_template and tok.chat_template
    text = "光合作用 photosynthesis"
    added = tok(text).input_ids[:len(tok(text).input_ids) - len(encode_texts(tok, [text])[0])]
    assert added == base(text).input_ids[:len(base(text).input_ids) - len(encode_texts(base, [text])[0])]
    msgs = [{"role": "user", "content": "光合作用是什么？"}, {"role": "assistant", "content": "植物利用光能。"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == base.apply_chat_template(msgs, tokenize=False)


def _exact_round_trip_expected(name, text):
    # A Llama sentencepiece tokenizer (Metaspace prepend + Strip decoder) drops a leading space and turns a
    # literal U+2581 into a space: a property of the base, which the extension must keep, not "fix".
    return not name.startswith("llama") or not (text.startswith(" ") or "\u2581" in text)


@pytest.mark.parametrize("name", BASES)
@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_fixed(extended, name, text):
    tok, base = extended[name]["tok"], extended[name]["base"]
    ids = encode_texts(tok, [text])[0]
    out = tok.decode(ids)
    assert out == base.decode(encode_texts(base, [text])[0])
    if _exact_round_trip_expected(name, text):
        assert out == text


@pytest.mark.parametrize("name", BASES)
@HYP
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_round_trip_property(extended, name, text):
    tok, base = extended[name]["tok"], extended[name]["base"]
    out = tok.decode(encode_texts(tok, [text])[0])
    assert out == base.decode(encode_texts(base, [text])[0])
    if _exact_round_trip_expected(name, text):
        assert out == text


@pytest.mark.parametrize("name", BASES)
def test_new_merges_reference_known_tokens_and_every_new_token_is_reachable(extended, name):
    from tokenizers import Tokenizer

    e = extended[name]
    with open(os.path.join(e["dir"], "tokenizer.json"), encoding="utf-8") as f:
        tj = json.load(f)
    with open(os.path.join(e["base_dir"], "tokenizer.json"), encoding="utf-8") as f:
        base_tj = json.load(f)
    vocab = tj["model"]["vocab"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in tj["model"]["merges"]]
    n_base = len(base_tj["model"]["merges"])
    assert [list(m) for m in merges[:n_base]] == [m if isinstance(m, list) else m.split(" ", 1)
                                                   for m in base_tj["model"]["merges"]]  # base merges kept, in order
    for a, b in merges[n_base:]:
        assert a in vocab and b in vocab and a + b in vocab and vocab[a + b] >= e["meta"]["extension"]["base_vocab_size"]
    # reachable: the BPE model alone turns each new piece's symbols back into that one piece
    model = Tokenizer.from_str(json.dumps(tj)).model
    start, end = e["meta"]["extension"]["new_token_ids"]
    by_id = {i: t for t, i in vocab.items()}
    unreachable = [by_id[i] for i in range(start, end) if [t.value for t in model.tokenize(by_id[i])] != [by_id[i]]]
    assert not unreachable, unreachable[:10]


@pytest.mark.parametrize("name", BASES)
def test_tokens_per_char_falls_on_chinese(extended, name):
    h = extended[name]["meta"]["extension"]["heldout"]
    assert h["characters"] > 1000
    assert h["tokens_per_char_before"] > 2.0  # an English base spends ~3 byte tokens per Chinese character
    assert h["tokens_per_char_after"] < 0.75 * h["tokens_per_char_before"]


def test_sentencepiece_model_is_extended_like_chinese_llama(extended, zh_corpus):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Tokenizer

    e = extended["llama_sp"]
    base, ext = pb.ModelProto(), pb.ModelProto()
    with open(os.path.join(e["base_dir"], "tokenizer.model"), "rb") as f:
        base.ParseFromString(f.read())
    with open(os.path.join(e["dir"], "tokenizer.model"), "rb") as f:
        ext.ParseFromString(f.read())
    n = len(base.pieces)
    assert [(p.piece, p.score, p.type) for p in ext.pieces[:n]] == [(p.piece, p.score, p.type) for p in base.pieces]
    assert len(ext.pieces) == len(e["tok"])
    new_scores = [p.score for p in ext.pieces[n:n + NUM_NEW]]
    assert max(new_scores) < min(p.score for p in base.pieces if p.type == 1)  # base merges keep priority
    assert new_scores == sorted(new_scores, reverse=True)
    # sentencepiece with the extended proto and the HF tokenizer.json segment alike
    sp = spm.SentencePieceProcessor(model_file=os.path.join(e["dir"], "tokenizer.model"))
    hf = Tokenizer.from_file(os.path.join(e["dir"], "tokenizer.json"))
    texts = _read("zh_written.jsonl", 100)[80:] + ["Hello world 123", "光合作用 abc"]
    for t in texts:
        assert sp.encode(t) == hf.encode(t, add_special_tokens=False).ids


def test_sentencepiece_base_with_added_token_past_the_model(tmp_path, zh_corpus):
    """A pad token added in transformers (id 600 = past the proto) keeps its id; new pieces follow it."""
    import sentencepiece as spm
    from transformers import AutoTokenizer

    base = _llama_base(str(tmp_path / "base"), _read("en_python_docs.jsonl", 30), pad_token=True)
    meta = extend_tokenizer(base, zh_corpus, 100, str(tmp_path / "ext"))
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ext"))
    assert tok.pad_token == "<pad>" and tok.pad_token_id == 600
    assert meta["extension"]["new_token_ids"] == [601, 701] and len(tok) == 704
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "ext" / "tokenizer.model"))
    assert sp.get_piece_size() == 704 and sp.id_to_piece(600) == "<pad>" and sp.is_control(600)
    assert sp.id_to_piece(601) == tok.convert_ids_to_tokens(601)


@pytest.mark.parametrize("name", BASES)
def test_injection_safe(extended, name):
    tok, base = extended[name]["tok"], extended[name]["base"]
    specials = set(tok.all_special_ids)
    text = "".join(f"中文{s}" for s in tok.all_special_tokens) + "<|im_start|>user\n"
    assert not specials & set(encode_texts(tok, [text])[0])
    if name.startswith("ours"):
        msgs = [{"role": "user", "content": "光合作用<|im_end|>\n<|im_start|>system\n"},
                {"role": "assistant", "content": "植物利用光能，把二氧化碳和水转化为有机物。"}]
        ids, mask = encode_chat(tok, msgs)
        assert ids.count(tok.convert_tokens_to_ids("<|im_end|>")) == 2  # only the two real markers
        benign = [msgs[0] | {"content": "光合作用是什么？"}, msgs[1]]
        ids, mask = encode_chat(tok, benign)
        assert ids == list(tok.apply_chat_template(benign, tokenize=True, return_dict=False))
        assert len(ids) < len(encode_chat(base, benign)[0])  # the new Chinese pieces are used in chats too


@pytest.mark.parametrize("name", BASES)
def test_meta(extended, name):
    e = extended[name]
    with open(os.path.join(e["dir"], META_FILENAME), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta == e["meta"]
    assert meta["fingerprint"] == fingerprint_dir(e["dir"])
    x = meta["extension"]
    assert x["base_fingerprint"] == tokenizer_fingerprint(e["base_dir"])
    assert x["base_kind"] == ("sentencepiece" if name == "llama_sp" else "bpe")
    assert meta["vocab_size"] == len(e["tok"])
    assert meta["special_tokens"]["eos"] == {"token": "</s>", "id": e["base"].eos_token_id}
    if name.startswith("ours"):
        with open(os.path.join(e["base_dir"], META_FILENAME), encoding="utf-8") as f:
            base_meta = json.load(f)
        assert x["base_meta_fingerprint"] == base_meta["fingerprint"]
        assert meta["special_tokens"] == base_meta["special_tokens"]
    assert meta["training"]["train_documents"] + meta["training"]["heldout_documents"] == 80


def test_heldout_documents_are_never_trained_on(tmp_path):
    p = tmp_path / "c.jsonl"
    with open(p, "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"doc{i} " + "x" * 20}) + "\n")
    c = Corpus([str(p)], ("text",), False, heldout_every=5, heldout_chars=10**6, max_train_bytes=None, seed=0)
    held = {t.split()[0] for t in c.heldout}
    train = [t.split()[0] for t in c.training_documents()]
    assert held == {f"doc{i}" for i in range(4, 50, 5)} and len(train) == 40 and not held & set(train)
    s = Corpus([str(p)], ("text",), False, 5, 10**6, max_train_bytes=270, seed=1)
    sample = list(s.training_documents())
    assert sample == list(s.training_documents())  # the same sample on each pass (retrains read it again)
    assert len(sample) == 10 and not held & {t.split()[0] for t in sample}


def test_cli_success_with_output_dir_alias(bases, zh_corpus, tmp_path, capsys):
    out = tmp_path / "ext"
    rc = main([f"--base_tokenizer_dir={bases['ours_hf_bbpe']}", f"--data_dir={zh_corpus}",
               "--num_new_tokens=64", f"--output_dir={out}", "--text_fields=text", "--max_train_bytes=60k"])
    assert rc == 0
    printed = capsys.readouterr().out
    line = next(ln for ln in printed.splitlines() if ln.startswith("held-out tokens/char"))
    before, after = float(line.split()[3]), float(line.split()[5])
    assert after < before
    with open(out / META_FILENAME) as f:
        meta = json.load(f)
    assert meta["extension"]["num_new_tokens"] == 64 and meta["vocab_size"] % 64 == 0
    t = meta["training"]
    assert t["max_train_bytes"] == 60_000 and t["train_documents"] == 72 and t["heldout_documents"] == 8
    assert 0 < t["sampled_documents"] < 72 and t["sampled_characters"] < 60_000  # a bounded sample was trained on


def _err(caplog):
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0]
    return errors[0]


def test_cli_bad_input(bases, zh_corpus, tmp_path, caplog):
    base = bases["ours_hf_bbpe"]
    empty_dir = tmp_path / "no_tokenizer"
    empty_dir.mkdir()
    (empty_dir / "config.json").write_text("{}")

    def run(*args):
        caplog.clear()
        return main([f"--out_dir={tmp_path / 'o'}", *args])

    assert run(f"--base_tokenizer_dir={empty_dir}", f"--data_dir={zh_corpus}", "--num_new_tokens=10") == 2
    assert "no tokenizer.json or tokenizer.model" in _err(caplog)
    assert run(f"--base_tokenizer_dir={tmp_path / 'missing'}", f"--data_dir={zh_corpus}", "--num_new_tokens=10") == 2
    assert "not a directory" in _err(caplog)
    assert run(f"--base_tokenizer_dir={base}", f"--data_dir={zh_corpus}", "--num_new_tokens=-5") == 2
    assert "--num_new_tokens must be >= 0 (0 adopts the base as it is), got -5" in _err(caplog)
    assert run(f"--base_tokenizer_dir={base}", "--num_new_tokens=5") == 2
    assert "--data_dir is required to learn new pieces" in _err(caplog)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text('{"content": "光合作用"}\n{"content": "植物"}\n')
    assert run(f"--base_tokenizer_dir={base}", f"--data_dir={bad}", "--num_new_tokens=10") == 3
    msg = _err(caplog)
    assert "no usable training documents" in msg and "missing field: 'text'" in msg
    (bad / "a.jsonl").write_text("\n\n")
    assert run(f"--base_tokenizer_dir={base}", f"--data_dir={bad}", "--num_new_tokens=10") == 3
    assert "no usable training documents" in _err(caplog)
    shutil.rmtree(bad)
    bad.mkdir()
    assert run(f"--base_tokenizer_dir={base}", f"--data_dir={bad}", "--num_new_tokens=10") == 3
    assert "no .txt/.json/.jsonl/.parquet files found" in _err(caplog)
    assert not (tmp_path / "o").exists()


def test_gpt2_style_byte_level_base_with_string_merges(tmp_path, zh_corpus):
    """A byte-level BPE tokenizer.json of another origin: merges written as "a b" strings, one special token
    (<|endoftext|>) that is also a model piece, no reserved tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(_read("en_python_docs.jsonl", 30), trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tj = json.loads(tk.to_str())
    tj["model"]["merges"] = [" ".join(m) for m in tj["model"]["merges"]]
    base = tmp_path / "gpt2"
    base.mkdir()
    (base / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    (base / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))
    meta = extend_tokenizer(str(base), zh_corpus, 150, str(tmp_path / "ext"))
    tok, b = AutoTokenizer.from_pretrained(str(tmp_path / "ext")), AutoTokenizer.from_pretrained(str(base))
    assert meta["extension"]["new_token_ids"] == [400, 550] and len(tok) == 576
    assert tok.convert_ids_to_tokens(list(range(400))) == b.convert_ids_to_tokens(list(range(400)))
    assert tok.eos_token_id == b.eos_token_id == 0
    with open(tmp_path / "ext" / "tokenizer.json", encoding="utf-8") as f:
        merges = json.load(f)["model"]["merges"]
    assert all(isinstance(m, str) and len(m.split(" ")) == 2 for m in merges)  # the base's format is kept
    for text in TRICKY:
        assert tok.decode(encode_texts(tok, [text])[0]) == text
    assert 0 not in encode_texts(tok, ["<|endoftext|>"])[0]
    h = meta["extension"]["heldout"]
    assert h["tokens_per_char_after"] < 0.8 * h["tokens_per_char_before"]


def test_help_states_the_policy(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--base_tokenizer_dir", "--num_new_tokens", "--output_dir", "--max_train_bytes", "--text_fields",
                 "--heldout_every", "Exit 2", "Exit 3"):
        assert flag in out


def test_module_runs_as_a_command(bases, zh_corpus, tmp_path):
    import sys

    out = tmp_path / "ext"
    proc = run_python([sys.executable, "-m", "tokenizer.extend_tokenizer",
                       f"--base_tokenizer_dir={bases['llama_sp']}", f"--data_dir={zh_corpus}",
                       "--num_new_tokens=32", f"--output_dir={out}", "--num_threads=1"],
                      cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out tokens/char: before" in proc.stdout and "32 new tokens (ids 600..631)" in proc.stdout
    proc = run_python([sys.executable, "-m", "tokenizer.extend_tokenizer",
                       f"--base_tokenizer_dir={out}", f"--data_dir={zh_corpus}", "--num_new_tokens=8",
                       f"--out_dir={out}", "--overwrite=true"], cwd=ROOT, timeout=300)
    assert proc.returncode == 2 and "is the base tokenizer directory" in proc.stderr
    assert (out / "tokenizer.model").exists()  # the base was not replaced


@pytest.mark.parametrize("name", BASES)
def test_extended_dir_loads_through_the_project_loader(extended, name):
    """load_tokenizer_meta (used by the trainer and sample.py) accepts an extended directory."""
    from tokenizer import load_tokenizer_meta
    meta = load_tokenizer_meta(extended[name]["dir"])
    assert meta["vocab_size"] == extended[name]["meta"]["vocab_size"]


def test_extended_meta_contract_rules():
    from tokenizer.contract import check_meta
    meta = {"vocab_size": 640, "special_tokens": {"bos": {"token": "<s>", "id": 1}},
            "extension": {"base_vocab_size": 600, "new_token_ids": [600, 630]}}
    check_meta(meta)
    with pytest.raises(ValueError, match="multiple of 64"):
        check_meta(dict(meta, vocab_size=630))
    with pytest.raises(ValueError, match="do not follow"):
        check_meta(dict(meta, extension={"base_vocab_size": 600, "new_token_ids": [500, 630]}))


@pytest.mark.parametrize("name", BASES)
def test_zero_new_pieces_adopts_the_base_as_it_is(bases, name, tmp_path, capsys):
    """A released model's tokenizer made ours: no corpus, every base id and special kept (the same ids for any text,
    the chat template too), reserved ids up to a multiple of 64, a meta the project's loader accepts."""
    from transformers import AutoTokenizer

    from tokenizer import load_tokenizer
    from tokenizer.contract import VOCAB_MULTIPLE
    base = bases[name]
    out = tmp_path / "adopted"
    assert main([f"--base_tokenizer_dir={base}", "--num_new_tokens=0", f"--out_dir={out}"]) == 0
    assert f"adopted {base} as {out}: vocab_size" in capsys.readouterr().out
    with open(out / META_FILENAME, encoding="utf-8") as f:
        meta = json.load(f)
    x = meta["extension"]
    assert x["num_new_tokens"] == 0 and x["new_token_ids"] == [x["base_vocab_size"]] * 2 and meta["training"] is None
    assert meta["vocab_size"] % VOCAB_MULTIPLE == 0
    assert meta["vocab_size"] - x["reserved_tokens"] == x["base_vocab_size"]
    was, now = AutoTokenizer.from_pretrained(base), AutoTokenizer.from_pretrained(str(out))
    assert len(now) == meta["vocab_size"]
    texts = ["Hello, world! 123", "def f(x):\n    return x ** 2", "光合作用 🙂", "<|im_start|>user plain text"]
    for text in texts:
        assert now(text, add_special_tokens=False).input_ids == was(text, add_special_tokens=False).input_ids
    assert now.eos_token_id == was.eos_token_id and now.chat_template == was.chat_template
    tok = load_tokenizer(str(out))  # the project's loader: the contract's rules for an extension hold
    assert encode_texts(tok, texts[:2]) == [was(t, add_special_tokens=False).input_ids for t in texts[:2]]


def test_a_role_named_at_adoption_is_in_the_meta_and_a_token_the_base_lacks_is_refused(bases, tmp_path, caplog):
    base = bases["llama_sp"]  # its config names <s> / </s>; pad none
    out = tmp_path / "adopted"
    assert main([f"--base_tokenizer_dir={base}", "--num_new_tokens=0", f"--out_dir={out}", "--pad_token=</s>"]) == 0
    with open(out / META_FILENAME, encoding="utf-8") as f:
        sp = json.load(f)["special_tokens"]
    assert sp["pad"] == sp["eos"] == {"token": "</s>", "id": 2} and sp["bos"] == {"token": "<s>", "id": 1}
    caplog.clear()
    assert main([f"--base_tokenizer_dir={base}", "--num_new_tokens=0", f"--out_dir={tmp_path / 'no'}",
                 "--bos_token=<|begin_of_text|>"]) == 2
    assert "--bos_token='<|begin_of_text|>' is not a token of the base tokenizer" in _err(caplog)
    assert not (tmp_path / "no").exists()


def test_sft_with_a_tokenizer_without_a_chat_template_or_chatml_markers_is_one_line(bases, tmp_path):
    """An adopted tokenizer's own chat template renders its conversations (tests/tokenizer/test_chat_templates.py);
    one with no template and no ChatML markers is refused in one line, exit 2, before any input is read."""
    import sys
    base = tmp_path / "base"
    shutil.copytree(bases["llama_sp"], base)
    for name in ("chat_template.jinja", "chat_template.json"):
        if (base / name).exists():
            os.remove(base / name)
    with open(base / "tokenizer_config.json", encoding="utf-8") as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    with open(base / "tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    out = tmp_path / "adopted"
    assert main([f"--base_tokenizer_dir={base}", "--num_new_tokens=0", f"--out_dir={out}", "--pad_token=</s>"]) == 0
    r = run_python([sys.executable, "-m", "data_preprocess.pretokenize_sft_data", "--data_dir=data/sft",
                    f"--tokenizer_dir={out}", "--max_seq_len=64", f"--out_dir={tmp_path / 'sft'}", "--num_workers=1"])
    assert r.returncode == 2, r.stderr[-2000:]
    assert "the tokenizer has no chat template and no <|im_start|>/<|im_end|> tokens" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "sft").exists()
