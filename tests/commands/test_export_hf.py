"""export_hf.py: --checkpoint=latest|best|step_N picks the weights; the export directory gets the usual
permissions; --output_dir stays an alias of --out_dir."""
from __future__ import annotations

import os
import stat

import torch
from safetensors.torch import load_file

import export_hf
from model import ModelConfig, Transformer
from checkpoint.plain import SaveRequest, save_checkpoint
from checkpoint.verify import list_checkpoints, sha256_file
from utils.checkpoint_json import read_json, write_json


def _save(run, step, val_loss):
    torch.manual_seed(step)
    m = Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_seq_len=16))
    req = SaveRequest(step=step, rank=0, world_size=1, model_state=m.state_dict(), model_config=m.cfg.to_dict(),
                      optimizer_state=None, extra_state={}, trainer_state={"val_loss": val_loss},
                      run_config={"lora_rank": 0, "tokenizer_dir": ""})
    save_checkpoint(str(run), req, keep_last=10, log=lambda s: None)
    return m.embed_tokens.weight.detach().clone()


def test_export_chooses_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    w = {s: _save(run, s, v) for s, v in ((10, 3.0), (20, 2.0), (30, 2.5))}
    for which, step in (("latest", 30), ("best", 20), ("step_10", 10)):
        out = tmp_path / f"hf_{which}"
        assert export_hf.main([f"--ckpt={run}", f"--checkpoint={which}", f"--out_dir={out}"]) == 0
        assert torch.equal(load_file(str(out / "model.safetensors"))["model.embed_tokens.weight"], w[step])
    old = os.umask(0o022)
    try:
        assert export_hf.main([f"--ckpt={run}", f"--output_dir={tmp_path / 'alias'}"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "alias").st_mode) == 0o755  # not mkdtemp's 0700
    assert export_hf.main([f"--ckpt={run}", "--checkpoint=step_15", f"--out_dir={tmp_path / 'x'}"]) == 2


def test_sample_picks_the_checkpoint_and_the_recorded_tokenizer(tmp_path, monkeypatch, tiny_pretrain_data, capsys):
    import model.generate
    import sample
    from inference.loading import recorded_tokenizer_dir
    run = tmp_path / "run"
    w = {s: _save(run, s, v) for s, v in ((10, 3.0), (20, 2.0))}
    # point the runs' recorded tokenizer at a real one
    for _, p in list_checkpoints(str(run)):
        cfg = read_json(os.path.join(p, "config.json"))
        cfg["tokenizer_dir"] = tiny_pretrain_data["tokenizer_dir"]
        write_json(os.path.join(p, "config.json"), cfg)
        m = read_json(os.path.join(p, "manifest.json"))  # keep the manifest true
        m["config.json"] = {"bytes": os.path.getsize(os.path.join(p, "config.json")),
                            "sha256": sha256_file(os.path.join(p, "config.json"))}
        write_json(os.path.join(p, "manifest.json"), m)
    assert recorded_tokenizer_dir(str(run)) == tiny_pretrain_data["tokenizer_dir"]
    seen = {}

    def fake_generate(mdl, x, max_new_tokens, **kw):
        seen["emb"] = mdl.embed_tokens.weight.detach().clone()
        return x

    monkeypatch.setattr(model.generate, "generate", fake_generate)
    assert sample.main([f"--ckpt={run}", "--checkpoint=best", "--prompt=a", "--device=cpu"]) == 0
    assert torch.equal(seen["emb"], w[20])
    assert sample.main([f"--ckpt={run}", "--checkpoint=step_10", "--prompt=a", "--device=cpu"]) == 0
    assert torch.equal(seen["emb"], w[10])
    assert sample.main([f"--ckpt={run}", "--checkpoint=step_99", "--prompt=a", "--device=cpu"]) == 2
    assert "no checkpoint at step 99" in capsys.readouterr().err


def _chat_run(tmp_path):
    """A tiny model trained in the test to answer 'hi' with 'hello there<|im_end|>', saved as a run with a
    real tokenizer (the chat markers included)."""
    import json

    from tokenizer import encode_chat, load_tokenizer, load_tokenizer_meta
    from tokenizer.train_tokenizer import train_tokenizer
    with open(tmp_path / "c.jsonl", "w", encoding="utf-8") as f:
        for i in range(100):
            f.write(json.dumps({"text": f"hello there {i} user assistant hi"}) + "\n")
    tok_dir = str(tmp_path / "tok")
    train_tokenizer(str(tmp_path / "c.jsonl"), tok_dir, vocab_size=300)
    tok, meta = load_tokenizer(tok_dir), load_tokenizer_meta(tok_dir)
    ids, _ = encode_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}])
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=meta["vocab_size"], dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                max_seq_len=64))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.tensor([ids])
    for _ in range(60):  # memorise the one conversation
        loss = torch.nn.functional.cross_entropy(m(x[:, :-1])[0], x[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    run = tmp_path / "run"
    req = SaveRequest(step=1, rank=0, world_size=1, model_state=m.state_dict(), model_config=m.cfg.to_dict(),
                      optimizer_state=None, extra_state={}, trainer_state={},
                      run_config={"lora_rank": 0, "tokenizer_dir": tok_dir})
    save_checkpoint(str(run), req, keep_last=1, log=lambda s: None)
    return run, tok_dir, tok, meta


def _sample_py_generation(run, prompt, stop_ids):
    """sample.py's generation (its defaults) on the run's checkpoint: the new ids, up to the first stop id."""
    from inference.loading import load_for_inference
    from model.generate import generate
    from utils import constants as c
    model, _ = load_for_inference(str(run), torch.device("cpu"))
    out = generate(model, torch.tensor([prompt]), max_new_tokens=c.SAMPLE_MAX_NEW_TOKENS,
                   temperature=c.SAMPLE_TEMPERATURE, top_k=c.SAMPLE_TOP_K, top_p=c.SAMPLE_TOP_P,
                   stop_ids=stop_ids)[0, len(prompt):].tolist()
    first = min((out.index(s) for s in stop_ids if s in out), default=len(out) - 1)
    return out[:first + 1]


def test_exported_chat_model_generates_and_stops_where_sample_py_does(tmp_path, capsys):
    """generation_config.json: HF generate with the export's own defaults (sampling, temperature, top-k, both
    end ids) emits what sample.py prints and stops at <|im_end|>, as sample.py does; every exported file 0644."""
    import json

    from transformers import GenerationConfig, LlamaForCausalLM

    import sample
    from utils import constants as c
    run, tok_dir, tok, meta = _chat_run(tmp_path)
    st = {k: v["id"] for k, v in meta["special_tokens"].items()}
    out = tmp_path / "hf"
    old = os.umask(0o022)
    try:
        assert export_hf.main([f"--ckpt={run}", f"--out_dir={out}"]) == 0
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(os.stat(p).st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes  # safetensors wrote 0600
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [st["eos"], st["im_end"]]
    assert (gen["temperature"], gen["top_k"], gen["do_sample"]) == (c.SAMPLE_TEMPERATURE, c.SAMPLE_TOP_K, True)
    assert GenerationConfig.from_pretrained(str(out)).eos_token_id == [st["eos"], st["im_end"]]

    capsys.readouterr()
    assert sample.main([f"--ckpt={run}", "--chat", "--prompt=hi", "--seed=3", "--device=cpu"]) == 0
    printed = capsys.readouterr().out.split("---\n", 1)[1].rstrip("\n")
    assert printed == "hello there"  # the model learned its answer; sample.py stopped at <|im_end|>

    hf = LlamaForCausalLM.from_pretrained(str(out)).eval()
    prompt = sample.build_prompt_ids(tok, meta, "hi", chat=True)
    for seed in (3, 4):
        torch.manual_seed(seed)
        with torch.no_grad():  # nothing but the prompt: every setting comes from generation_config.json
            new = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        new = new[0, len(prompt):].tolist()
        assert new[-1] == st["im_end"] and st["im_end"] not in new[:-1], new  # stopped at the first <|im_end|>
        assert tok.decode(new[:-1], skip_special_tokens=True) == printed
        torch.manual_seed(seed)
        assert _sample_py_generation(run, prompt, [st["eos"], st["im_end"]]) == new  # the same draws


def test_a_tokenizer_file_that_changed_is_named_by_export_and_sample(tmp_path, tiny_pretrain_data, capsys):
    """tokenizer_meta.json lists the sha256 of each tokenizer file (issue 33 item 13): a truncated tokenizer.json
    was exported without a word (exit 0) and broke sample.py with a traceback; now both name the file, exit 3.
    An exported directory (the tokenizer's files beside the model's) still loads: only listed files count."""
    import json
    import shutil

    import sample
    from tokenizer.loading import load_tokenizer
    tok = tmp_path / "tok"
    shutil.copytree(tiny_pretrain_data["tokenizer_dir"], tok)
    meta = json.loads((tok / "tokenizer_meta.json").read_text())
    assert "tokenizer.json" in meta["files"] and "tokenizer_meta.json" not in meta["files"]
    run = tmp_path / "run"
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=meta["vocab_size"], dim=16, n_layers=1, n_heads=2, hidden_dim=32,
                                max_seq_len=16))
    save_checkpoint(str(run), SaveRequest(
        step=1, rank=0, world_size=1, model_state=m.state_dict(), model_config=m.cfg.to_dict(), optimizer_state=None,
        extra_state={}, trainer_state={}, run_config={"lora_rank": 0, "tokenizer_dir": str(tok)}),
        keep_last=1, log=lambda s: None)
    assert export_hf.main([f"--ckpt={run}", f"--out_dir={tmp_path / 'hf'}"]) == 0
    assert len(load_tokenizer(str(tmp_path / "hf"))) == meta["vocab_size"]  # beside config.json and the weights
    data = (tok / "tokenizer.json").read_bytes()
    (tok / "tokenizer.json").write_bytes(data[: len(data) // 2])
    capsys.readouterr()
    assert export_hf.main([f"--ckpt={run}", f"--out_dir={tmp_path / 'hf2'}"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tok / 'tokenizer.json'}: changed since tokenizer_meta.json was written" in err[0], err
    assert not (tmp_path / "hf2").exists()
    assert sample.main([f"--ckpt={run}", "--prompt=hi", "--max_new_tokens=2", "--device=cpu"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.json: changed since tokenizer_meta.json was written" in err[0], err
