"""The pinned locks: every package exact, every pin inside its hand-written range, and, where the suite runs in the
project's own venv (`make test`), the venv holding exactly what the locks say (so a pin changed by hand, or a
package upgraded in place, is caught before a fresh clone meets it)."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
LOCKS = ("requirements.txt", "requirements-dev.txt")


def _lines(name):
    for lineno, raw in enumerate((ROOT / name).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            yield lineno, line


def _pins(name) -> dict[str, Requirement]:
    return {re.sub(r"[-_.]+", "-", Requirement(line).name).lower(): Requirement(line)
            for _, line in _lines(name) if not line.startswith("-r ")}


@pytest.mark.parametrize("name", LOCKS)
def test_every_lock_line_is_one_exact_version(name):
    for lineno, line in _lines(name):
        if line.startswith("-r "):
            assert name == "requirements-dev.txt" and line == "-r requirements.txt", (name, lineno)
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and "*" not in specs[0].version, f"{name}:{lineno}"
        assert "+" not in specs[0].version, f"{name}:{lineno}: a local build label ties the lock to one machine"


def test_the_two_locks_do_not_pin_a_package_twice():
    demo, dev = _pins("requirements.txt"), _pins("requirements-dev.txt")
    assert not set(demo) & set(dev)
    assert {"torch", "transformers", "numpy"} <= set(demo)
    assert {"pytest", "triton", "torchao", "tensorboard", "datasets"} <= set(dev)


@pytest.mark.parametrize("src, lock", [("requirements.in", "requirements.txt"),
                                       ("requirements-dev.in", "requirements-dev.txt")])
def test_each_pin_is_inside_its_hand_written_range(src, lock):
    pins = {**_pins("requirements.txt"), **_pins(lock)}
    for lineno, line in _lines(src):
        want = Requirement(line)
        key = re.sub(r"[-_.]+", "-", want.name).lower()
        assert key in pins, f"{src}:{lineno}: {want.name} is not in {lock}"
        pinned = next(iter(pins[key].specifier)).version
        assert want.specifier.contains(pinned, prereleases=True), f"{src}:{lineno}: {pinned} is outside {want}"
        assert str(want.marker or "") == str(pins[key].marker or ""), f"{src}:{lineno}: the marker differs"


def test_triton_is_the_version_torchs_cuda_build_requires():
    """torch 2.13.0's CUDA wheel requires triton==3.7.1: a GPU machine installing the lock must not meet a conflict."""
    assert next(iter(_pins("requirements.txt")["torch"].specifier)).version == "2.13.0"
    assert next(iter(_pins("requirements-dev.txt")["triton"].specifier)).version == "3.7.1"


@pytest.mark.skipif(Path(sys.prefix).resolve() != (ROOT / ".venv").resolve(),
                    reason="the suite runs outside the project's .venv (a GPU machine's own torch)")
def test_the_venv_holds_exactly_the_locked_versions():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import lock_requirements
    finally:
        sys.path.pop(0)
    assert lock_requirements.main(["--check"]) == 0, "run `make lock-check`: the venv and the locks differ"
