"""Start-up cost of the commands that load one model (sample.py, eval_lm.py, export_hf.py): they import torch and
transformers' tokenizer, not the machinery only training or sharded checkpoints need. Checked by what a fresh
interpreter has imported after loading the command's modules and a plain checkpoint's weights, never by a clock:
torch._dynamo (~2 s of imports, pulled in by a module-level torch.compiler.disable), torch.distributed.checkpoint
and torch.distributed.tensor (~1-2 s) stay out."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

HEAVY = ("torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.tensor")


@pytest.mark.parametrize("module", ["sample", "eval_lm", "export_hf"])
def test_a_command_that_loads_a_plain_checkpoint_imports_no_training_machinery(module, pretrained):
    code = (f"import sys, json; import {module}; from trainer.weights import load_weights_from; "
            f"load_weights_from({str(pretrained['out'])!r}, lambda m: None); "
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], out.stdout
