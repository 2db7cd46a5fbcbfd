"""Continued pretraining of a released Llama on an extended tokenizer, end to end on CPU:
`--init_from=<HF dir> --tokenizer_dir=<extended>` grows the model, the --trainable / LoRA options train
what they say (and the log line counts it), light checkpoints of a grown model resume bit-exactly,
and export_hf.py hands back an HF model + tokenizer and PEFT adapters with equal logits.

Fixtures, no downloads (see tests/model/test_resize.py): the extended tokenizer is one of ours; the
"released" model is a tiny model of ours exported with model.hf_interop.export_hf together with its
own tokenizer, the extended one's first 320 ids.
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from trainer.weights import load_weights_from
from tests.conftest import PY, ROOT, run_cmd, run_trainer, run_python
from tests.model.test_resize import BASE_VOCAB, prefix_tokenizer, tiny_model, write_corpus
from tests.trainer.test_end_to_end import _env, final_weights, losses, train_cmd
from checkpoint.verify import find_latest_valid
from utils.checkpoint_json import read_json

NEW_VOCAB = 640


@pytest.fixture(scope="module")
def cpt(tmp_path_factory) -> dict:
    from model.hf_interop import export_hf
    d = tmp_path_factory.mktemp("cpt")
    corpus = write_corpus(d / "corpus")
    ext, shards, seq = d / "ext", d / "shards", 32
    run_cmd([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--output_dir={ext}",
             "--vocab_size=600", "--tokenizer_type=hf_bbpe"])
    base_tok = prefix_tokenizer(str(ext), BASE_VOCAB, str(d / "base_tok"))
    hf = export_hf(tiny_model(BASE_VOCAB), str(d / "released"), tokenizer_dir=base_tok)
    run_cmd([PY, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={corpus}", f"--tokenizer_dir={ext}",
             f"--output_dir={shards}", "--num_workers=1", "--no_progress"])
    run_cmd([PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}",
             f"--max_seq_len={seq}", "--val_ratio=0.1"])
    args = [f"--init_from={hf}", f"--data_dir={shards}", f"--tokenizer_dir={ext}", f"--max_seq_len={seq}",
            "--batch_size=4", "--learning_rate=1e-2", "--warmup_iters=1", "--eval_interval=0", "--eval_iters=2",
            "--log_interval=1", "--checkpoint_interval=3", "--progress=false", "--peak_flops=1e11",
            "--device=cpu", "--seed=7", "--weight_decay=0"]
    return {"hf": hf, "ext": str(ext), "base_tok": base_tok, "args": args, "dir": d}


LORA = ["--lora_rank=2", "--lora_targets=all", "--lora_train_embeddings=true", "--max_iters=6"]


@pytest.fixture(scope="module")
def lora_run(cpt) -> str:
    out = cpt["dir"] / "lora_ref"
    log = run_cmd(train_cmd([*cpt["args"], *LORA, f"--out_dir={out}"]), env=_env()).stdout
    return {"out": str(out), "log": log}


def test_grown_model_trains_only_what_the_flags_say(cpt, tmp_path):
    dim = 32
    runs = {}
    for name, flags in (("full", []), ("emb", ["--trainable=embeddings"])):
        out = tmp_path / name
        runs[name] = (out, run_cmd(train_cmd([*cpt["args"], *flags, "--max_iters=4", f"--out_dir={out}"]),
                                   env=_env()).stdout)
    full_log, emb_log = runs["full"][1], runs["emb"][1]
    assert f"[init] vocabulary {BASE_VOCAB} -> {NEW_VOCAB}" in full_log
    m = tiny_model(BASE_VOCAB)
    total = sum(p.numel() for p in m.parameters()) + 2 * (NEW_VOCAB - BASE_VOCAB) * dim
    assert f"[trainable] full fine-tuning: {total:,} trainable of {total:,} parameters (100.00%)" in full_log
    n_emb = 2 * NEW_VOCAB * dim
    assert (f"[trainable] embedding and LM head only: {n_emb:,} trainable of {total:,} parameters "
            f"({100 * n_emb / total:.2f}%)") in emb_log
    # embeddings only: a light checkpoint of exactly the two tensors, the base referenced with its tokenizer
    w = final_weights(runs["emb"][0])
    assert sorted(w) == ["embed_tokens.weight", "lm_head.weight"] and w["lm_head.weight"].shape == (NEW_VOCAB, dim)
    state = read_json(os.path.join(find_latest_valid(str(runs["emb"][0])), "trainer_state.json"))
    assert state["lora_base"]["tokenizer_dir"] == os.path.abspath(cpt["ext"])
    # the loss on the corpus falls in both (4 steps of a random tiny model: full by > 0.1 nat)
    full, emb = losses(runs["full"][0]), losses(runs["emb"][0])
    assert full[4] < full[1] - 0.1 and emb[4] < emb[1], (full, emb)


def test_lora_with_embeddings_on_grown_vocab_resumes_exactly(cpt, lora_run, tmp_path):
    ref = lora_run["out"]
    assert "[lora] rank 2 on all + embedding and LM head:" in lora_run["log"]
    w = final_weights(ref)
    assert all("lora_" in k for k in w if k not in ("embed_tokens.weight", "lm_head.weight"))
    assert w["embed_tokens.weight"].shape == (NEW_VOCAB, 32)
    crashed, once = tmp_path / "crashed", tmp_path / "fired"
    proc = run_trainer(train_cmd([*cpt["args"], *LORA, f"--out_dir={crashed}"]),
                       env=_env(MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists()
    run_cmd(train_cmd([f"--out_dir={crashed}", "--init_from=resume"]), env=_env())
    assert losses(crashed) == losses(ref) and len(losses(ref)) == 6
    a, b = final_weights(ref), final_weights(crashed)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_lora_with_frozen_embeddings_on_grown_vocab_resumes(cpt, tmp_path):
    """Frozen new rows are re-derived from the base + tokenizer on resume; the fingerprint proves it."""
    out = tmp_path / "frozen"
    flags = ["--lora_rank=2", "--lora_targets=q_proj,v_proj"]
    run_cmd(train_cmd([*cpt["args"], *flags, "--max_iters=3", f"--out_dir={out}"]), env=_env())
    assert all("lora_" in k for k in final_weights(out))
    log = run_cmd(train_cmd([f"--out_dir={out}", "--init_from=resume", "--max_iters=4"]), env=_env()).stdout
    assert "[resume] at step 3" in log and sorted(losses(out)) == [1, 2, 3, 4]


def test_export_grown_model_and_tokenizer_to_hf_and_peft(cpt, lora_run, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours, _ = load_weights_from(lora_run["out"], log=lambda m: None)  # adapters merged
    ours.eval()
    text = "def main(): 中文的文本, the model"
    hf_dir = tmp_path / "hf"
    run_cmd([sys.executable, "export_hf.py", f"--ckpt={lora_run['out']}", f"--output_dir={hf_dir}"])
    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    assert len(tok) == NEW_VOCAB and hf.config.vocab_size == NEW_VOCAB
    assert hf.get_input_embeddings().weight.shape == (NEW_VOCAB, 32)
    x = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    assert int(x.max()) >= BASE_VOCAB  # the text uses new pieces
    with torch.no_grad():
        want = ours(x)
        torch.testing.assert_close(hf(x).logits, want, rtol=1e-4, atol=1e-4)
        gen = hf.generate(x, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
        ids = x.clone()  # our greedy decoding, step by step
        for _ in range(5):
            ids = torch.cat([ids, ours(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert gen.tolist() == ids.tolist()
    assert isinstance(tok.decode(gen[0]), str)
    # PEFT: the base grown to the tokenizer + adapters with the embedding and LM head as modules_to_save
    base_dir, ad_dir = tmp_path / "hf_base", tmp_path / "adapters"
    run_cmd([sys.executable, "export_hf.py", f"--ckpt={lora_run['out']}", f"--output_dir={base_dir}",
             f"--adapters_output_dir={ad_dir}"])
    cfg = json.load(open(ad_dir / "adapter_config.json"))
    assert sorted(cfg["modules_to_save"]) == ["embed_tokens", "lm_head"]
    base = AutoModelForCausalLM.from_pretrained(str(base_dir)).eval()
    assert base.config.vocab_size == NEW_VOCAB
    # the exported base is the released model grown as at the start: its old rows are the released ones
    from model.hf_interop import import_hf
    released = import_hf(cpt["hf"])
    assert torch.equal(base.get_input_embeddings().weight[:BASE_VOCAB], released.embed_tokens.weight)
    assert torch.equal(base.lm_head.weight[:BASE_VOCAB], released.lm_head.weight)
    with torch.no_grad():
        base_logits = base(x).logits
        pm = PeftModel.from_pretrained(base, str(ad_dir)).eval()
        torch.testing.assert_close(pm(input_ids=x).logits, want, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(base_logits, want, atol=1e-3)  # the adapters (and trained rows) matter


def test_a_tokenizer_that_does_not_extend_the_model_is_a_clear_error(cpt, tiny_pretrain_data, tmp_path):
    """exit 2, one line, before any training: never a silent resize."""
    from model.hf_interop import export_hf
    bare = export_hf(tiny_model(BASE_VOCAB), str(tmp_path / "no_tok"))  # no tokenizer files
    cases = [([f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}"], "in the tokenizer but"),
             ([f"--init_from={bare}"], "holds no tokenizer files")]
    for i, (flags, msg) in enumerate(cases):
        proc = run_trainer(train_cmd([*cpt["args"], *flags, "--max_iters=1", f"--out_dir={tmp_path / str(i)}"]),
                           env=_env())
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and msg in err[0], proc.stderr[-2000:]
        assert err[0].startswith("[rank 0] error: --init_from=")


def test_trainable_flags_are_validated():
    from trainer.config import TrainConfig, TrainingError, trains_embeddings
    from trainer.validation import validate_config
    base = dict(data_dir="d", tokenizer_dir="t")
    for bad, msg in ((dict(trainable="head"), "--trainable='head' (all | embeddings)"),
                     (dict(lora_train_embeddings=True), "--lora_train_embeddings=true needs --lora_rank>0")):
        with pytest.raises(TrainingError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("|", r"\|")) as e:
            validate_config(TrainConfig(**base, **bad))
        assert e.value.code == 2
    validate_config(TrainConfig(**base, trainable="embeddings", lora_rank=4))
    assert trains_embeddings(TrainConfig(trainable="embeddings"))
    assert trains_embeddings({"lora_rank": 2, "lora_train_embeddings": True})
    assert not trains_embeddings({"lora_rank": 0, "lora_train_embeddings": True}) and not trains_embeddings({})


def test_export_refuses_a_tokenizer_larger_than_the_model(cpt, tiny_pretrain_run_args, tmp_path):
    """A model exported with a tokenizer whose ids go past its embedding: exit 2, one line."""
    out = tmp_path / "run"
    run_cmd(train_cmd([*tiny_pretrain_run_args, "--max_iters=1", f"--out_dir={out}"]), env=_env())
    proc = run_python([sys.executable, "export_hf.py", f"--ckpt={out}", f"--output_dir={tmp_path / 'hf'}",
                       f"--tokenizer_dir={cpt['ext']}"], cwd=ROOT)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(err) == 1 and f"has {NEW_VOCAB} tokens, more than the model's" in err[0], \
        proc.stderr[-2000:]
    assert not (tmp_path / "hf").exists()


def test_an_adopted_tokenizer_trains_the_released_model_at_its_own_vocabulary(cpt, tmp_path):
    """The released model's own tokenizer made ours (`extend_tokenizer --num_new_tokens=0`, no corpus): the data
    pretokenizes with it and the model trains at its own vocabulary (no growth: every id is the base's). The base
    names no eos: pretokenizing says so in one line until the adoption names one; it names no bos either, and keeps
    none (as Qwen2's): its documents are `ids <eos>`."""
    from model.config import read_model_config
    adopted, shards, out = tmp_path / "adopted", tmp_path / "shards", tmp_path / "run"
    adopt = [PY, "-m", "tokenizer.extend_tokenizer", f"--base_tokenizer_dir={cpt['base_tok']}", "--num_new_tokens=0",
             f"--out_dir={adopted}", "--overwrite=true"]
    pretokenize = [PY, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={cpt['dir'] / 'corpus'}",
                   f"--tokenizer_dir={adopted}", f"--output_dir={shards}", "--num_workers=1", "--no_progress"]
    run_cmd(adopt)
    r = run_python(pretokenize)
    assert r.returncode == 2 and "the tokenizer has no eos token, which the shards' document layout" in r.stderr
    assert "--eos_token=..." in r.stderr and "Traceback" not in r.stderr
    run_cmd([*adopt, "--eos_token=\u010a"])  # "Ċ", the byte-level newline
    run_cmd(pretokenize)
    sidecar = json.loads(next(p for p in shards.iterdir() if p.suffix == ".json" and p.stem[-1].isdigit()).read_text())
    assert sidecar["bos_id"] is None and sidecar["document_layout"] == "ids </s>"
    run_cmd([PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}",
             "--max_seq_len=32", "--val_ratio=0.1"])
    args = [a for a in cpt["args"] if not a.startswith(("--data_dir", "--tokenizer_dir"))]
    log = run_cmd(train_cmd([*args, f"--data_dir={shards}", f"--tokenizer_dir={adopted}", f"--out_dir={out}",
                             "--max_iters=4"]), env=_env()).stdout
    assert "[init] imported Hugging Face model" in log and "[init] vocabulary" not in log
    assert read_model_config(find_latest_valid(str(out))).vocab_size == BASE_VOCAB
    ls = losses(out)
    assert ls[4] < ls[1], ls
    # SFT pads its batches: without a pad token the trainer says so in one line before loading anything
    r = run_trainer(train_cmd([*args, "--task_type=sft", f"--data_dir={ROOT}/data/sft", f"--tokenizer_dir={adopted}",
                               f"--out_dir={tmp_path / 'sft'}", "--max_iters=1"]), env=_env())
    assert r.returncode == 2 and f"--tokenizer_dir={adopted}: the tokenizer has no pad token, which --task_type=sft " \
        "needs" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
