"""--rope_scaling: a new model gets the setting; weights from --init_from get it in place of their own (context
extension: a "released" Hugging Face model trained at 16 positions continued at 32 with YaRN), the checkpoints
record it, a resume (also a LoRA run's light checkpoint, whose base is reloaded) continues exactly, DPO's reference
is extended as the policy is, and the export loads in transformers with the same RoPE."""
from __future__ import annotations

import math
import os

import pytest
import torch

from checkpoint.verify import find_latest_valid
from model.config import read_model_config
from tests.conftest import PY, ROOT, run_cmd, run_trainer, toy_dpo_pairs, train_cmd
from tests.trainer.test_end_to_end import _env, losses
from utils.constants import EXIT_BAD_CONFIG
from utils.metrics import dedupe_by_step, read_metrics

RELEASED_LEN, RUN_LEN = 16, 32
YARN = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": RELEASED_LEN, "beta_fast": 32.0,
        "beta_slow": 1.0, "attention_factor": 0.1 * math.log(2.0) + 1.0, "truncate": True}


def released_model(tiny_pretrain_data, out_dir, edit=None, **model) -> str:
    """A tiny model of the run tokenizer's vocabulary "released" as a Hugging Face directory with that tokenizer
    (`model`: ModelConfig fields over dim 32, 2 layers, 4 heads; `edit(model)` before the export)."""
    import json

    from model import ModelConfig, Transformer
    from model.hf_interop import export_hf
    with open(os.path.join(tiny_pretrain_data["tokenizer_dir"], "tokenizer_meta.json")) as f:
        vocab = json.load(f)["vocab_size"]
    torch.manual_seed(0)
    net = Transformer(ModelConfig(**{**dict(vocab_size=vocab, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                            initializer_range=0.1), **model}))
    if edit is not None:
        edit(net)
    return export_hf(net, str(out_dir), tokenizer_dir=tiny_pretrain_data["tokenizer_dir"])


@pytest.fixture(scope="module")
def released(tiny_pretrain_data, tmp_path_factory) -> str:
    """Trained length 16."""
    return released_model(tiny_pretrain_data, tmp_path_factory.mktemp("released") / "hf", max_seq_len=RELEASED_LEN)


def from_weights(tiny_pretrain_run_args, weights, *extra) -> list[str]:
    """The tiny run's flags starting from `weights` (their shape is theirs: the shape flags left out)."""
    args = [a for a in tiny_pretrain_run_args if not a.startswith(("--dim", "--n_layers", "--n_heads", "--multiple"))]
    return [*args, f"--init_from={weights}", *extra]


def _args(tiny_pretrain_run_args, released, *extra) -> list[str]:
    return from_weights(tiny_pretrain_run_args, released, "--checkpoint_interval=2", *extra)


def test_hf_weights_continue_at_twice_their_length_with_yarn_and_resume_exactly(
        tiny_pretrain_run_args, tiny_pretrain_data, released, tmp_path):
    assert tiny_pretrain_data["max_seq_len"] == RUN_LEN
    args = _args(tiny_pretrain_run_args, released, "--rope_scaling=yarn:2")
    full, part = tmp_path / "full", tmp_path / "part"
    log = run_cmd(train_cmd([*args, f"--out_dir={full}", "--max_iters=4"]), env=_env()).stdout
    assert f"[rope] --rope_scaling: plain RoPE at max_seq_len {RELEASED_LEN} -> " in log, log[-3000:]
    saved = read_model_config(find_latest_valid(str(full)))
    assert saved.rope_scaling == YARN and saved.max_seq_len == RUN_LEN
    # the same weights without the flag train on other positions' angles: the first losses differ
    plain = tmp_path / "plain"
    run_cmd(train_cmd([*_args(tiny_pretrain_run_args, released), f"--out_dir={plain}", "--max_iters=1"]), env=_env())
    assert losses(plain)[1] != losses(full)[1]
    # stopped after step 2, resumed from its checkpoint: the uninterrupted run's losses, bit for bit
    run_cmd(train_cmd([*args, f"--out_dir={part}", "--max_iters=2"]), env=_env())
    run_cmd(train_cmd([*args, f"--out_dir={part}", "--max_iters=4"]), env=_env())
    assert losses(part) == losses(full)
    # another setting on resume is refused: the model's RoPE is fixed by its checkpoint
    other = run_trainer(train_cmd([*_args(tiny_pretrain_run_args, released, "--rope_scaling=linear:2"),
                                   f"--out_dir={part}", "--max_iters=6"]), env=_env())
    assert other.returncode == EXIT_BAD_CONFIG and "--rope_scaling='linear:2' (the run used 'yarn:2')" in other.stderr
    # exported, transformers reads the same RoPE: its logits equal ours on a 32-token row
    from transformers import LlamaForCausalLM

    from trainer.weights import model_from_checkpoint
    ours, _ = model_from_checkpoint(find_latest_valid(str(full)))
    run_cmd([PY, os.path.join(ROOT, "export_hf.py"), f"--ckpt={full}", f"--out_dir={tmp_path / 'export'}"])
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "export")).eval()
    x = torch.randint(0, ours.cfg.vocab_size, (1, RUN_LEN))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, ours.eval()(x), atol=1e-5, rtol=0)


def test_a_lora_runs_light_checkpoint_reloads_its_base_with_the_extended_rope(
        tiny_pretrain_run_args, released, tmp_path):
    args = _args(tiny_pretrain_run_args, released, "--rope_scaling=yarn:2", "--lora_rank=2", "--lora_targets=all")
    full, part = tmp_path / "full", tmp_path / "part"
    run_cmd(train_cmd([*args, f"--out_dir={full}", "--max_iters=4"]), env=_env())
    run_cmd(train_cmd([*args, f"--out_dir={part}", "--max_iters=2"]), env=_env())
    run_cmd(train_cmd([*args, f"--out_dir={part}", "--max_iters=4"]), env=_env())
    assert losses(part) == losses(full)
    from trainer.weights import model_from_checkpoint
    model, _ = model_from_checkpoint(find_latest_valid(str(full)))
    assert model.cfg.rope_scaling == YARN and model.rotary.attention_factor == YARN["attention_factor"]


def test_dpo_extends_its_reference_as_the_policy(tiny_pretrain_run_args, released, tmp_path):
    """At step 1 the policy is its reference: every margin is 0 and the sigmoid loss is ln 2 (a reference left at
    the released RoPE would give other log-probabilities, so other margins)."""
    data = toy_dpo_pairs(tmp_path / "pairs.jsonl")
    args = [a for a in _args(tiny_pretrain_run_args, released, "--rope_scaling=yarn:2")
            if not a.startswith("--data_dir")]
    out = tmp_path / "dpo"
    run_cmd(train_cmd([*args, "--task_type=dpo", f"--data_dir={data}", f"--out_dir={out}", "--max_iters=1",
                       "--dpo_beta=0.5"]), env=_env())
    rec = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))[1]
    assert abs(rec["loss"] - math.log(2)) < 1e-6, rec


def test_a_new_model_takes_the_setting_and_bad_ones_are_one_line(tiny_pretrain_run_args, tmp_path):
    out = tmp_path / "new"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=2",
                       '--rope_scaling={"type": "llama3", "factor": 4, "low_freq_factor": 1, "high_freq_factor": 4}']),
            env=_env())
    assert read_model_config(find_latest_valid(str(out))).rope_scaling == {
        "type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": RUN_LEN}
    for flag, phrase in (("yarn:0.5", "factor must be a finite number >= 1"),
                         ("longrope:2", "rope_scaling longrope: missing short_factor, long_factor"),
                         ('{"type": "llama3", "factor": 8}', "missing low_freq_factor, high_freq_factor")):
        r = run_trainer(train_cmd([*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'bad'}", f"--rope_scaling={flag}"]),
                        env=_env())
        assert r.returncode == EXIT_BAD_CONFIG and f"--rope_scaling={flag!r}: " in r.stderr and phrase in r.stderr
        assert "Traceback" not in r.stderr
