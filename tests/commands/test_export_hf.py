"""export_hf.py: --checkpoint=latest|best|step_N picks the weights; the export directory gets the usual
permissions; --output_dir stays an alias of --out_dir."""
from __future__ import annotations

import os
import stat

import torch
from safetensors.torch import load_file

import export_hf
from model import ModelConfig, Transformer
from utils import checkpoint as ckpt


def _save(run, step, val_loss):
    torch.manual_seed(step)
    m = Transformer(ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, hidden_dim=32, max_seq_len=16))
    req = ckpt.SaveRequest(step=step, rank=0, world_size=1, model_state=m.state_dict(), model_config=m.cfg.to_dict(),
                           optimizer_state=None, extra_state={}, trainer_state={"val_loss": val_loss},
                           run_config={"lora_rank": 0, "tokenizer_dir": ""})
    ckpt.save_checkpoint(str(run), req, keep_last=10, log=lambda s: None)
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
    run = tmp_path / "run"
    w = {s: _save(run, s, v) for s, v in ((10, 3.0), (20, 2.0))}
    # point the runs' recorded tokenizer at a real one
    for _, p in ckpt.list_checkpoints(str(run)):
        cfg = ckpt.read_json(os.path.join(p, "config.json"))
        cfg["tokenizer_dir"] = tiny_pretrain_data["tokenizer_dir"]
        ckpt.write_json(os.path.join(p, "config.json"), cfg)
        m = ckpt.read_json(os.path.join(p, "manifest.json"))  # keep the manifest true
        m["config.json"] = {"bytes": os.path.getsize(os.path.join(p, "config.json")),
                            "sha256": ckpt._sha256(os.path.join(p, "config.json"))}
        ckpt.write_json(os.path.join(p, "manifest.json"), m)
    assert sample.recorded_tokenizer_dir(str(run)) == tiny_pretrain_data["tokenizer_dir"]
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
