"""No project module (tests/, bench/, scripts/, docs/, data/ and the rest of test_layering's SKIP_DIRS aside) is
longer than MAX_LINES: a module longer than that does more than one job and is split by responsibility, never by
importing another module's private names to make a split work (`private_imports`: a name a second module needs is
public in the module that owns it)."""
from __future__ import annotations

import ast
import os

from tests.test_layering import ROOT, project_files

MAX_LINES = 500


def line_count(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for _ in f)


def oversized(root: str = ROOT, limit: int = MAX_LINES, exempt: frozenset = frozenset()) -> list[str]:
    """'path: N lines' for every project module over `limit` lines that is not `exempt`, sorted."""
    found = []
    for rel in sorted(project_files(root)):
        posix = rel.replace(os.sep, "/")
        n = line_count(os.path.join(root, rel))
        if n > limit and posix not in exempt:
            found.append(f"{posix}: {n} lines (over {limit}: split it by responsibility)")
    return found


def test_no_project_module_is_over_500_lines():
    assert oversized() == []


def test_the_checker_sees_an_oversized_module(tmp_path):
    """A module of limit + 1 lines is reported with its count; one of exactly the limit is not, nor one under
    tests/ or bench/, nor an exempt one."""
    (tmp_path / "model").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "bench").mkdir()
    (tmp_path / "model" / "big.py").write_text("x = 1\n" * 11)
    (tmp_path / "model" / "fits.py").write_text("x = 1\n" * 10)
    (tmp_path / "tests" / "test_big.py").write_text("x = 1\n" * 50)
    (tmp_path / "bench" / "big_bench.py").write_text("x = 1\n" * 50)
    (tmp_path / "cmd.py").write_text("x = 1\n" * 12)
    assert oversized(str(tmp_path), limit=10) == [
        "cmd.py: 12 lines (over 10: split it by responsibility)",
        "model/big.py: 11 lines (over 10: split it by responsibility)"]
    assert oversized(str(tmp_path), limit=10, exempt=frozenset({"model/big.py"})) == [
        "cmd.py: 12 lines (over 10: split it by responsibility)"]


def private_imports(root: str = ROOT, exempt: frozenset = frozenset()) -> list[str]:
    """'path:line: from M import _name' for every import of a private name from another project module (lazy
    imports included; torch's and other third-party modules' are theirs to judge)."""
    found = []
    for rel in sorted(project_files(root)):
        posix = rel.replace(os.sep, "/")
        if posix in exempt:
            continue
        own = posix[:-3].replace("/", ".")
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=rel)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            mod_path = os.path.join(root, *node.module.split("."))
            if node.module == own or not (os.path.exists(mod_path + ".py") or os.path.isdir(mod_path)):
                continue  # itself, or not a project module
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    found.append(f"{posix}:{node.lineno}: from {node.module} import {a.name}")
    return found


def test_no_module_imports_another_modules_private_names():
    assert private_imports() == []


def test_the_checker_sees_a_private_import(tmp_path):
    """A lazy import of another project module's `_name` is reported; its public names, its own module's and a
    third-party module's private names are not."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "a.py").write_text("_x = 1\ny = 2\n")
    (tmp_path / "model" / "b.py").write_text(
        "from model.a import y\nfrom torch._C import _x\n\ndef f():\n    from model.a import _x\n    return _x\n")
    assert private_imports(str(tmp_path)) == ["model/b.py:5: from model.a import _x"]
