"""Every command README.md, docs/, scripts/*.sh and the config files give a user parses with that command's own
flags (scripts/check_doc_commands.py; its docstring has the rule and the placeholders it understands).

The check runs in a fresh interpreter: it runs each command file as __main__ up to its parse_args, which must not
touch this worker's state."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import ROOT

SCRIPT = os.path.join(ROOT, "scripts", "check_doc_commands.py")


def _check(*files: str) -> tuple[int, list[tuple[str, str, str, str]], str]:
    """(exit code, [(source, ok|FAIL, program, why)], output)."""
    r = subprocess.run([sys.executable, SCRIPT, "--list", *files], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    rows, lines = [], r.stdout.splitlines()
    for i, ln in enumerate(lines):
        m = re.match(r"^(\S+): (ok|FAIL) \[([^\]]+)\] ", ln)
        if m:
            why = lines[i + 1].strip() if m.group(2) == "FAIL" and i + 1 < len(lines) else ""
            rows.append((m.group(1), m.group(2), m.group(3), why))
    return r.returncode, rows, r.stdout + r.stderr


def test_every_documented_command_parses():
    code, rows, out = _check()
    assert code == 0 and rows and all(ok == "ok" for _, ok, _, _ in rows), out
    programs = {p for _, _, p, _ in rows}
    # the pipeline the README walks through is among what was read (an extraction that finds nothing passes nothing)
    assert {"train_my_ddp.py", "tokenizer/train_tokenizer.py", "data_preprocess/pretokenize_pretrain_data.py",
            "data_preprocess/build_pretrain_sample_index_map.py", "export_hf.py", "sample.py", "eval_lm.py",
            "monitor_process.py", "Makefile:demo", "Makefile:test"} <= programs, sorted(programs)
    sources = {s for s, _, _, _ in rows}
    assert {"README.md", "scripts/walkthrough.sh", "scripts/continued_pretraining.sh", "config/moe_demo.py"} <= sources
    assert sum(p == "train_my_ddp.py" for _, _, p, _ in rows) >= 20


DOC = """# a page

```bash
python train_my_ddp.py --max_iter=5
python train_my_ddp.py --batch_size=eight
python train_my_ddp.py config/demo.py --batch_size=N --out_dir=$OUT/x --init_from=<HF Llama dir> ...same flags...
python -m data_preprocess.pretokenize_sft_data --data_dir=d --tokenizer_dir=t --max_seq_len=64 --overlong=truncate|cut
python -m data_preprocess.pretokenize_sft_data --data_dir=d --tokenizer_dir=t --max_seq_len=64 [--overlong=truncate|drop]
python -m data_preprocess.build_pretrain_sample_index_map --data_dir=d
torchrun --standalone --nproc_per_node=2 train_my_ddp.py --dim=64 \\
    --n_layers=2   # a comment
python monitor_process.py --max_restarts=2 -- torchrun --nproc_per_node=2 train_my_ddp.py --dimm=3
python monitor_process.py --max_restart=2 -- python train_my_ddp.py
make tset
pip install foo
```

Prose names `python export_hf.py --ckpt=c --out_dir=o --checkpoint=latest` and `python sample.py --ckpt=c
--temprature=0.8`, `python eval_lm.py` alone, and `python bench/no_such_bench.py --x=1`.
"""

SH = """#!/usr/bin/env bash
STEPS=${STEPS:-200}
$PY train_my_ddp.py --max_iters=$(( STEPS / 2 > 0 ? STEPS / 2 : 1 )) --eval_interval=$STEPS --dtype=$DTYPE
$PY -m tokenizer.extend_tokenizer --base_tokenizer_dir=$OUT/b --data_dir=d --num_new_tokens=$N --out_dir=o --overwrite
"""


def test_the_check_tells_a_broken_command_from_a_placeholder(tmp_path):
    """Each wrong command is named with why; the placeholders (capitals, shell variables and arithmetic, <...>,
    ..., [--optional], a|b) stand for values of the flag's type; prose naming a command alone passes; what is not
    ours (pip) is not read."""
    (tmp_path / "page.md").write_text(DOC)
    (tmp_path / "run.sh").write_text(SH)
    code, rows, out = _check(str(tmp_path / "page.md"), str(tmp_path / "run.sh"))
    assert code == 1, out
    verdicts = [(ok, prog, why) for _, ok, prog, why in rows]
    expected = [
        ("FAIL", "train_my_ddp.py", "max_iters"),  # the hint names the real flag
        ("FAIL", "train_my_ddp.py", "batch_size"),
        ("ok", "train_my_ddp.py", ""),
        ("FAIL", "data_preprocess/pretokenize_sft_data.py", "cut"),  # each alternative of a|b is parsed
        ("ok", "data_preprocess/pretokenize_sft_data.py", ""),
        ("FAIL", "data_preprocess/build_pretrain_sample_index_map.py", "--max_seq_len"),  # a required flag missing
        ("ok", "train_my_ddp.py", ""),  # torchrun's flags are torchrun's; the continuation line is read
        ("FAIL", "monitor_process.py", "dimm"),  # the command under the monitor is checked too
        ("FAIL", "monitor_process.py", "max_restarts"),
        ("FAIL", "Makefile:tset", "tset"),
        ("ok", "export_hf.py", ""),
        ("FAIL", "sample.py", "temperature"),  # an inline span wrapped onto the next line
        ("ok", "eval_lm.py", ""),
        ("FAIL", "bench/no_such_bench.py", "no such file"),
        ("ok", "train_my_ddp.py", ""),
        ("ok", "tokenizer/extend_tokenizer.py", ""),
    ]
    assert [(ok, prog) for ok, prog, _ in verdicts] == [(ok, prog) for ok, prog, _ in expected], out
    for (ok, prog, why), (_, _, word) in zip(verdicts, expected):
        assert word in why, (prog, why)
