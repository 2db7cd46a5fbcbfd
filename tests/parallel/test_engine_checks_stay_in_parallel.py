"""Issue 34: which engine runs is parallel/'s business. Outside parallel/ no code compares the engine flag,
the mesh sizes or an engine's kind (the trainer describes what its run needs, parallel/config.py's declared
capabilities decide); this test reads every project module and lists any such check with its line."""
from __future__ import annotations

import os
import re

from tests.test_layering import ROOT, project_files

CHECKS = [
    re.compile(r"\.parallel\s*(==|!=|\bin\b)"),                                      # cfg.parallel == "fsdp"
    re.compile(r"(==|!=)\s*[\"'](ddp|fsdp|pipeline)[\"']"),                           # ... == "ddp"
    re.compile(r"\bin\s*\(\s*[\"'](ddp|fsdp)[\"']"),                                  # ... in ("ddp", "fsdp")
    re.compile(r"(pipeline_parallel_size|tensor_parallel_size|dp_replicate_size)\s*(>|<|==|!=|%)"),
    re.compile(r"\.kind\s*(==|!=|\bin\b)\s*\(?\s*[\"'](ddp|fsdp|pipeline)[\"']"),        # engine.kind == "pipeline"
    re.compile(r"isinstance\([^)]*(DDPEngine|FSDPEngine|PipelineParallelEngine)"),
]


_STRING = re.compile(r"([\"'])((?:(?!\1).)*)\1")


def _code_of(line: str) -> str:
    """The line without its comment, every string literal emptied except an engine's name (help texts
    mention the flags; a comparison with "fsdp" is what is looked for)."""
    code = _STRING.sub(lambda m: m.group(0) if m.group(2) in ("ddp", "fsdp", "pipeline") else "''", line)
    return code.split("#", 1)[0]


def engine_checks_outside_parallel(root: str = ROOT) -> list[str]:
    found = []
    for rel in project_files(root):
        if rel.split(os.sep)[0] == "parallel":
            continue
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                code = _code_of(line)
                if any(c.search(code) for c in CHECKS):
                    found.append(f"{rel}:{n}: {line.strip()}")
    return found


def test_no_engine_kind_or_layout_check_outside_parallel():
    assert engine_checks_outside_parallel() == []


def test_the_checker_finds_a_planted_check(tmp_path):
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "x.py").write_text('def f(cfg):\n    return cfg.parallel == "fsdp"\n')
    (tmp_path / "parallel").mkdir()
    (tmp_path / "parallel" / "y.py").write_text('def g(cfg):\n    return cfg.pipeline_parallel_size > 1\n')
    assert engine_checks_outside_parallel(str(tmp_path)) == ['trainer/x.py:2: return cfg.parallel == "fsdp"']
