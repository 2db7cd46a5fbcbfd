"""Every shipped config/*.py parses against TrainConfig (no unknown key, right types) and passes the
trainer's validation given the data flags its header names, so the examples stay valid."""
from __future__ import annotations

import os

import pytest

from trainer import config as T
from trainer.validation import validate_config
from utils.configurator import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "config")) if f.endswith(".py"))


def test_the_expected_examples_ship():
    assert {"demo.py", "pretrain_124m_1gpu.py", "pretrain_1b_8gpu_zero1.py", "sft.py", "dpo.py",
            "lora_continued_pretrain.py"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_parses_and_validates(name):
    path = os.path.join(ROOT, "config", name)
    text = open(path, encoding="utf-8").read()
    assert text.startswith("#") and "train_my_ddp.py" in text, f"{name}: the header says how to run it"
    extra = ["--data_dir=x", "--tokenizer_dir=y"]
    if "task_type" in text:
        extra.append("--init_from=out/some_run")
    cfg = parse_config(T.TrainConfig(), [path, *extra])
    validate_config(cfg)
    defaults = T.TrainConfig()
    assert cfg != defaults  # the file was applied
    # the command line wins over the file
    assert parse_config(T.TrainConfig(), [path, *extra, "--max_iters=7"]).max_iters == 7
