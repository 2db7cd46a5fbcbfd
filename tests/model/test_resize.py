"""model/resize.py: growing a model to an extended tokenizer (base ids unchanged, new rows = mean of
the base rows of their pieces, specials/reserved = mean of all rows, old rows bit for bit) and the
clear error for a tokenizer that is not an extension of the model's.

Fixtures, no downloads: an "extended" tokenizer E is one of ours trained on a few KB of the bundled
corpus; the model's own ("base") tokenizer B is E's first K ids (vocab and merges cut at K, no added
tokens), so every base id keeps its string in E and E's later ids are the new ones, exactly the
relationship tokenizer.extend_tokenizer produces. The last test also runs tokenizer.extend_tokenizer
itself on both kinds of base (skipped where that module is absent).
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.conftest import PY, ROOT, run_cmd

BASE_VOCAB = 320  # ids of the base tokenizer (256 bytes + 64 merges)


def write_corpus(path, n_docs: int = 20, chars: int = 800) -> str:
    os.makedirs(path, exist_ok=True)
    src = os.path.join(ROOT, "data", "pretrain")
    for name in sorted(os.listdir(src)):
        if name.endswith(".jsonl"):
            with open(os.path.join(src, name), encoding="utf-8") as f:
                docs = [json.loads(line)["text"] for _, line in zip(range(n_docs), f)]
            with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                for d in docs:
                    f.write(json.dumps({"text": d[:chars]}, ensure_ascii=False) + "\n")
    return str(path)


def prefix_tokenizer(ext_dir: str, k: int, out_dir: str) -> str:
    """The first k ids of a byte-level BPE tokenizer.json as a tokenizer of its own (no specials)."""
    with open(os.path.join(ext_dir, "tokenizer.json"), encoding="utf-8") as f:
        d = json.load(f)
    vocab = {s: i for s, i in d["model"]["vocab"].items() if i < k}
    assert len(vocab) == k
    d["model"]["vocab"] = vocab
    d["model"]["merges"] = [m for m in d["model"]["merges"]
                            if (m if isinstance(m, str) else "".join(m)).replace(" ", "") in vocab]
    d["added_tokens"] = []
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(d, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                   "model_max_length": 1000000000}, f)
    return out_dir


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("resize_tok")
    corpus = write_corpus(base / "corpus")
    ext = base / "ext"
    run_cmd([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--output_dir={ext}",
             "--vocab_size=600", "--tokenizer_type=hf_bbpe"])
    return {"ext": str(ext), "base": prefix_tokenizer(str(ext), BASE_VOCAB, str(base / "base")),
            "corpus": corpus}


def tiny_model(vocab: int, tie: bool = False, seed: int = 0):
    from model import ModelConfig, Transformer
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_seq_len=64,
                                   tie_embeddings=tie, initializer_range=0.1))


def test_grow_rows_is_the_mean_of_the_pieces():
    from model.resize import grow_rows
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    out = grow_rows(w, [[0, 2], [], [3]])
    assert out.shape == (7, 3) and torch.equal(out[:4], w)
    assert out[4].tolist() == [3.0, 4.0, 5.0] and out[5].tolist() == [4.5, 5.5, 6.5] and torch.equal(out[6], w[3])


@pytest.mark.parametrize("tie", [False, True])
def test_resize_keeps_old_rows_and_inits_new_rows_from_base_pieces(tokenizers, tie):
    from model.resize import resize_to_tokenizer
    from tokenizer import load_tokenizer
    base_tok, ext_tok = load_tokenizer(tokenizers["base"]), load_tokenizer(tokenizers["ext"])
    assert len(base_tok) == BASE_VOCAB and len(ext_tok) == 640
    m = tiny_model(BASE_VOCAB, tie).eval()
    emb0, head0 = m.embed_tokens.weight.detach().clone(), m.lm_head.weight.detach().clone()
    x = torch.randint(0, BASE_VOCAB, (2, 16))
    with torch.no_grad():
        before = m(x)
    info = resize_to_tokenizer(m, tokenizers["base"], tokenizers["ext"])
    learned = json.load(open(os.path.join(tokenizers["ext"], "tokenizer_meta.json")))["learned_vocab_size"]
    assert info == {"old_vocab": BASE_VOCAB, "new_vocab": 640, "from_pieces": learned - BASE_VOCAB,
                    "mean_of_all": 640 - learned, "checked": BASE_VOCAB}
    emb, head = m.embed_tokens.weight.detach(), m.lm_head.weight.detach()
    assert emb.shape == (640, 32) and head.shape == (640, 32) and m.cfg.vocab_size == 640
    assert torch.equal(emb[:BASE_VOCAB], emb0) and torch.equal(head[:BASE_VOCAB], head0)  # old rows bit for bit
    assert (m.lm_head.weight is m.embed_tokens.weight) == tie
    with torch.no_grad():  # base-vocabulary text: the same logits on the old ids
        assert torch.equal(m(x)[..., :BASE_VOCAB], before)
    # new learned pieces: the mean of the rows of the base pieces of their text (checked independently
    # on the pieces that are whole UTF-8 text: the base tokenizer encodes that text)
    checked = 0
    for i in range(BASE_VOCAB, learned):
        text = ext_tok.decode([i])
        if "\ufffd" in text:
            continue
        ids = base_tok.encode(text, add_special_tokens=False)
        assert len(ids) >= 2  # not a base piece itself
        torch.testing.assert_close(emb[i], emb0[ids].mean(0), rtol=0, atol=1e-6)
        torch.testing.assert_close(head[i], head0[ids].mean(0), rtol=0, atol=1e-6)
        checked += 1
    assert checked >= 50, checked
    # specials and reserved padding: the mean of all base rows
    for i in range(learned, 640):
        torch.testing.assert_close(emb[i], emb0.mean(0), rtol=0, atol=1e-6)
        torch.testing.assert_close(head[i], head0.mean(0), rtol=0, atol=1e-6)


def test_partial_utf8_pieces_split_by_the_base_bpe(tokenizers):
    """A piece that is part of a Chinese character (bytes, no text) still gets its base byte pieces."""
    from model.resize import new_token_pieces
    from tokenizer import load_tokenizer
    base_tok, ext_tok = load_tokenizer(tokenizers["base"]), load_tokenizer(tokenizers["ext"])
    pieces = new_token_pieces(base_tok, ext_tok, BASE_VOCAB)
    partial = [i for i in range(BASE_VOCAB, 594) if "\ufffd" in ext_tok.decode([i])]
    assert partial
    for i in partial:
        p = pieces[i - BASE_VOCAB]
        assert p and "".join(base_tok.convert_ids_to_tokens(p)) == ext_tok.convert_ids_to_tokens(i)


def test_a_tokenizer_that_is_not_an_extension_is_refused(tokenizers, tmp_path):
    from model.resize import VocabMismatch, resize_to_tokenizer
    # another tokenizer (trained on other text): id strings differ
    other = tmp_path / "other"
    corpus = write_corpus(tmp_path / "c2", n_docs=8, chars=300)
    run_cmd([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--output_dir={other}",
             "--vocab_size=400", "--tokenizer_type=hf_bbpe"])
    m = tiny_model(BASE_VOCAB)
    with pytest.raises(VocabMismatch, match=r"token id \d+ is .* in the tokenizer but .* in the model's own"):
        resize_to_tokenizer(m, tokenizers["base"], str(other))
    # a tokenizer smaller than the model's
    small = prefix_tokenizer(tokenizers["ext"], 300, str(tmp_path / "small"))
    with pytest.raises(VocabMismatch, match="fewer than the model's vocabulary"):
        resize_to_tokenizer(m, tokenizers["base"], small)
    # nothing to split new tokens with
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(VocabMismatch, match="holds no tokenizer files"):
        resize_to_tokenizer(m, str(bare), tokenizers["ext"])
    # a model tokenizer that cannot be read
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(VocabMismatch, match="cannot load the model's own tokenizer"):
        resize_to_tokenizer(m, str(broken), tokenizers["ext"])
    assert m.cfg.vocab_size == BASE_VOCAB and m.embed_tokens.weight.shape[0] == BASE_VOCAB


@pytest.mark.parametrize("kind", ["hf_bbpe", "sp_bbpe"])
def test_grows_to_a_tokenizer_made_by_extend_tokenizer(tmp_path, kind):
    """Both kinds of base (byte-level BPE; sentencepiece-style BPE with byte fallback), extended by
    tokenizer.extend_tokenizer with Chinese pieces: old rows kept, new rows from the base pieces."""
    pytest.importorskip("tokenizer.extend_tokenizer")
    from model.hf_interop import export_hf, import_hf
    from model.resize import new_token_pieces, resize_to_tokenizer
    from tokenizer import load_tokenizer, load_tokenizer_meta
    corpus = write_corpus(tmp_path / "corpus")
    english = tmp_path / "en"
    english.mkdir()
    shutil.copy(os.path.join(corpus, "en_python_docs.jsonl"), english)
    run_cmd([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={english}", f"--output_dir={tmp_path / 'tok'}",
             "--vocab_size=400", f"--tokenizer_type={kind}"])
    v = load_tokenizer_meta(str(tmp_path / "tok"))["vocab_size"]
    hf = export_hf(tiny_model(v), str(tmp_path / "released"), tokenizer_dir=str(tmp_path / "tok"))
    ext = str(tmp_path / "ext")
    run_cmd([PY, "-m", "tokenizer.extend_tokenizer", f"--base_tokenizer_dir={hf}", f"--data_dir={corpus}",
             "--num_new_tokens=100", f"--out_dir={ext}"])
    m = import_hf(hf)
    emb0 = m.embed_tokens.weight.detach().clone()
    info = resize_to_tokenizer(m, hf, ext)
    n = load_tokenizer_meta(ext)["vocab_size"]
    assert info["old_vocab"] == v and info["new_vocab"] == n == m.embed_tokens.weight.shape[0]
    assert info["from_pieces"] == 100 and info["mean_of_all"] == n - v - 100
    emb = m.embed_tokens.weight.detach()
    assert torch.equal(emb[:v], emb0)
    base_tok, ext_tok = load_tokenizer(hf), load_tokenizer(ext)
    pieces = new_token_pieces(base_tok, ext_tok, v)
    zh = 0
    for i in range(v, v + 100):
        p = pieces[i - v]
        assert p and all(j < v for j in p)
        torch.testing.assert_close(emb[i], emb0[p].mean(0), rtol=0, atol=1e-6)
        text = ext_tok.decode([i])
        if any("\u4e00" <= ch <= "\u9fff" for ch in text):  # a Chinese piece: its base pieces spell its text
            zh += 1
            assert base_tok.decode(p).strip() == text.strip(), (i, text, base_tok.convert_ids_to_tokens(p))
    assert zh >= 20, zh
