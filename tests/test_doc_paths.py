"""Every repository path that README.md and docs/*.md name in backticks exists.

The rule (strict, and the same on every machine: it reads only the checkout, never a run's output):

- Looked at: the words of every inline code span (`...`) outside fenced code blocks, split on whitespace;
  a word's surrounding backticks, quotes, parentheses, commas, semicolons, an unpaired bracket, a final `:` or
  `.` and a `:<line>` suffix are dropped, and so is the `--flag=` of `--flag=path`.
- A word is a repository path when it contains a '/' and either
  (a) its first component is a top-level entry of the repository (`tests/`, `model/kernels.py`, `.ci/run`), or
  (b) it ends in .py, .md, .sh, .json, .txt, .yaml or .yml (a file named from anywhere).
- Not repository paths, never checked: absolute paths, `~` and `..` paths, URLs, placeholders (a word with
  `<`, `>`, `{`, `}` or `...` before any `[`), and paths under what a run writes: a first component out/, runs/, work/,
  demo_out/, checkpoints/, checkpoints_after_spike/, step_*, tensorboard/ or one that .gitignore ignores (a
  top-level entry that .gitignore names is a run's output, not part of the repository, even where it exists).
- Not checked either: a name relative to its context (`config.py` in the row of `parallel/`, `transforms/`),
  which has no '/' or starts with no top-level entry and has none of those endings.
- A repository path exists relative to the repository root; one with `*` is a glob that must match something.
  A pytest node id (`tests/x.py::test_name[param]`) or `file.py::name` also needs `name` defined in that file;
  a dotted reference (`utils/dist.first_error_of_ranks`, a module and a name in it) needs the module's .py file
  and the name in it.
"""
from __future__ import annotations

import fnmatch
import glob
import os
import re

from tests.conftest import ROOT

EXTENSIONS = (".py", ".md", ".sh", ".json", ".txt", ".yaml", ".yml")
RUN_OUTPUT = {"out", "runs", "work", "demo_out", "checkpoints", "checkpoints_after_spike", "tensorboard"}
PLACEHOLDER = re.compile(r"[<>{}]|\.\.\.")


def _doc_files() -> list[str]:
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _ignored_top_level() -> set[str]:
    """Top-level names that .gitignore ignores (and .git): what exists only on some machines."""
    patterns = []
    with open(os.path.join(ROOT, ".gitignore"), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line and not line.startswith("#") and not line.startswith("!"):
                patterns.append(line.strip("/"))
    # a literal name is ignored whether or not this checkout has it (`.whl/`: made by `make gpu-wheels`)
    names = {".git"} | {p for p in patterns if "/" not in p and not any(c in p for c in "*?[")}
    for name in os.listdir(ROOT):
        if any(fnmatch.fnmatch(name, p) for p in patterns):
            names.add(name)
    return names


def _top_level() -> set[str]:
    return set(os.listdir(ROOT)) - _ignored_top_level() - RUN_OUTPUT


def _code_words(text: str):
    """(line number, word) of every inline code span's words, fenced blocks left out."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    for m in re.finditer(r"`([^`]+)`", text):
        line = text.count("\n", 0, m.start()) + 1
        for w in m.group(1).split():
            yield line, w


def _clean(word: str) -> str:
    word = re.sub(r"^--[\w-]+=", "", word.strip("`(),;'\""))
    word = word.strip("`(),;'\"")
    word = word.lstrip("[") if "]" not in word else word
    word = word[:-1] if word.endswith("]") and "[" not in word else word
    word = re.sub(r":\d+$", "", word).rstrip(":")
    if word.endswith(".") and not word.endswith(".."):
        word = word[:-1]
    return word


def _is_repo_path(path: str, top: set[str]) -> bool:
    base = path.split("[", 1)[0]  # a test id's parameters may be placeholders: `test_x[<case>]`
    if "/" not in base or base.startswith(("/", "~", "..")) or "://" in base or PLACEHOLDER.search(base):
        return False
    first = path.split("/", 1)[0]
    if first in RUN_OUTPUT or first.startswith("step_") or first in _ignored_top_level():
        return False
    return first in top or path.split("::", 1)[0].endswith(EXTENSIONS)


def _defines(path: str, name: str) -> bool:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        text = f.read()
    n = re.escape(name)  # a def, a class, an assignment or an import of it
    return re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{n}\b|^\s*{n}\s*[:=]|^\s*(?:from\s.*)?import\s.*\b{n}\b",
                     text, flags=re.M) is not None


def _problem(path: str) -> str | None:
    """None when `path` names something in the repository, else what is missing."""
    file, *names = path.split("::")
    names = [n.split("[", 1)[0] for n in names]
    if "*" in file:
        return None if glob.glob(os.path.join(ROOT, file), recursive=True) else "no file matches"
    full = os.path.join(ROOT, file)
    if not os.path.exists(full):
        module, dot, attr = file.rpartition(".")
        if dot and "/" not in attr and os.path.isfile(os.path.join(ROOT, module + ".py")) and \
                os.path.splitext(file)[1] not in EXTENSIONS:
            file, names = module + ".py", [attr, *names]
        else:
            return "no such file or directory"
    for n in names:
        if not _defines(file, n):
            return f"{file} does not define {n}"
    return None


def _doc_paths() -> list[tuple[str, int, str]]:
    top = _top_level()
    found = []
    for doc in _doc_files():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            text = f.read()
        for line, word in _code_words(text):
            path = _clean(word)
            if _is_repo_path(path, top):
                found.append((doc, line, path))
    return found


def test_the_rule_tells_repository_paths_from_the_rest():
    top = {"tests", "model", "README.md", ".ci"}
    for path in ("tests/model/", "model/kernels.py", ".ci/run", "docs/x.md", "tests/test_triton_*.py",
                 "tests/a.py::test_b[c]", "tests/a.py::test_b[<case>-<engine>]", "scripts/x.sh"):
        assert _is_repo_path(path, top), path
    for path in ("out/gpu_report/report.md", "demo_out/sft", "<out_dir>/config.json", "/tmp/x.py", "~/.cache/a.json",
                 "../x", "https://example.com/a.md", "checkpoints/step_N", "step_N.tmp/", "train/", "NaN/inf",
                 ".../index_meta.json", "runs/a/metrics.json"):
        assert not _is_repo_path(path, top), path
    assert _clean("(`--data_dir=data/pretrain`),") == "data/pretrain"
    assert _clean("parallel/fsdp.py:") == "parallel/fsdp.py" and _clean("a/b.py:12") == "a/b.py"
    assert _problem("tests/model/test_kernels.py") is None and _problem("tests/model/") is None
    assert _problem("tests/test_triton_*.py") == "no file matches"
    assert _problem("tests/test_doc_paths.py::test_the_rule_tells_repository_paths_from_the_rest") is None
    assert _problem("tests/conftest.py::test_not_here[x]") == "tests/conftest.py does not define test_not_here"
    assert _problem("utils/dist.first_error_of_ranks") is None
    assert _problem("utils/dist.no_such_name") == "utils/dist.py does not define no_such_name"
    assert _problem("utils/no_such_file.py") == "no such file or directory"


def test_paths_named_in_the_docs_exist():
    paths = _doc_paths()
    assert len(paths) > 100  # the rule still finds the docs' paths
    missing = [f"{doc}:{line}: `{path}`: {why}" for doc, line, path in paths if (why := _problem(path))]
    assert not missing, "\n".join(missing)



# --- the docs document the project as it is; git keeps its history -------------------------------------------

README_MAX_LINES = 300
# A commit hash cited as history: 7-40 hex digits (at least one digit and one letter a-f, so neither a number nor
# a word such as "defaced") after "at", "commit", "since", "after", "before", "until" or "from", or alone in
# parentheses: "measured at 1908bc2", "(commit 95d7ba0)", "(d08a8ea)". A report's file name
# (`gpu/report-<rev>-h200.md`) and a `--git-rev` value are not history markers.
_HEX = r"(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}"
HISTORY_HASH = re.compile(rf"\b(?:at|commit|since|after|before|until|from)\s+{_HEX}\b|\(\s*{_HEX}\s*\)", re.I)


def _all_doc_files() -> list[str]:
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return ["README.md"] + docs


def test_the_history_rule_finds_commit_hashes_and_nothing_else():
    for text in ("measured at 1908bc2 on an H200", "(95d7ba0)", "since commit d08a8ea", "after c2ef629a",
                 "the kernel (1.33 ms at 95d7ba0)", "Before the change (commit 9b55b08):"):
        assert HISTORY_HASH.search(text), text
    for text in ("[report](gpu/report-1908bc2-h200.md)", "--git-rev 1908bc2", "at 1024 tokens", "(1234567)",
                 "at defaced", "at step_00000200", "(0.0026 / 0.0099)", "at 16 bytes", "at deadbeef"):
        assert not HISTORY_HASH.search(text), text


def test_the_readme_is_short_and_the_docs_carry_no_commit_history():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme_lines = f.read().count("\n")
    assert readme_lines <= README_MAX_LINES, f"README.md has {readme_lines} lines (at most {README_MAX_LINES})"
    found = []
    for doc in _all_doc_files():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                for m in HISTORY_HASH.finditer(line):
                    found.append(f"{doc}:{n}: {m.group(0)!r}")
    assert not found, "commit hashes cited as history (git keeps it):\n" + "\n".join(found)


def test_docs_gpu_holds_only_the_latest_report():
    reports = sorted(os.listdir(os.path.join(ROOT, "docs", "gpu")))
    assert len(reports) <= 1, f"docs/gpu/ holds {reports}: keep the latest report only (git keeps the others)"
