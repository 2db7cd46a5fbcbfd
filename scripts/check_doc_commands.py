"""Every command the documentation gives a user parses with that command's own flags.

    python scripts/check_doc_commands.py            # one line per command that would not parse; exit 1 if any
    python scripts/check_doc_commands.py --list     # every command checked, and how
    python scripts/check_doc_commands.py FILE ...   # these files instead (.md, .sh, a config .py)

Read: the fenced shell blocks and the inline code spans that start a command (`python ...`, `torchrun ...`,
`make ...`) of README.md and docs/*.md, the lines of scripts/*.sh, and the commented usage lines of config/*.py.
A command of ours is `python <repo file>.py ...`, `python -m <repo module> ...` (also `.venv/bin/python`, `$PY`,
`python3`), `torchrun [its flags] <repo file>.py ...`, `python monitor_process.py [its flags] -- <command>` (both
halves) or `make <target>` (the target must be in the Makefile). Anything else (`pip`, `python -m pytest`, a
module that is not ours) is not looked at.

Each command's words after the program are parsed without running it: train_my_ddp.py's by its own
`utils.configurator.parse_config` over `TrainConfig` (config files included), the monitor's by `monitor.config`,
every other one by running the file as `__main__` until it calls `parse_args`, which returns the namespace and
stops there (the argparse convention every command here follows). A flag that does not exist, a value of the wrong
type or outside its choices, or a required flag missing is a failure, printed with the file it came from.

Placeholders are the documentation's, and are not parsed as values: a word with `...` or `<...>` is dropped; a
value that is a shell variable (`$OUT/run`, `$(( STEPS / 2 ))`) or written in capitals (`N`, `K`) stands for a
value of the flag's type (its default, or the first choice); `a|b` in a value is each alternative; `[--flag=x]`
is the flag. A command named alone in prose (`python eval_lm.py` with nothing after it) only has to exist.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import io
import os
import re
import runpy
import shlex
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHONS = ("python", "python3", ".venv/bin/python", "$PY", "$(VPY)", "${PY}")
SHELL_ENDS = {"|", "||", "&&", ";", "&", "2>&1"}
PLACEHOLDER_VALUE = re.compile(r"^[A-Z][A-Z0-9_]*$|\$")  # N, K, REV; $OUT/run, $(( ... ))


@dataclass
class Command:
    source: str  # file the command came from
    text: str  # as written (continuations joined)
    words: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- reading the documents


def _joined_lines(body: str) -> list[str]:
    """Lines with their backslash continuations joined."""
    out, cur = [], ""
    for ln in body.splitlines():
        s = ln.rstrip()
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        out.append((cur + s).strip())
        cur = ""
    if cur.strip():
        out.append(cur.strip())
    return [ln for ln in out if ln]


def markdown_commands(text: str) -> list[str]:
    """The lines of fenced shell blocks (no language, bash, sh, shell, console) and the inline code spans that
    start with a python, torchrun or make command (an inline span may wrap onto the next line)."""
    lines = []
    for m in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", text, re.S | re.M):
        if m.group(1) in ("", "bash", "sh", "shell", "console"):
            lines += [re.sub(r"^\$ ", "", ln) for ln in _joined_lines(m.group(2))]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    starts = "|".join(re.escape(p) for p in PYTHONS + ("torchrun", "make"))
    lines += [m.group(1).replace("\n", " ") for m in re.finditer(rf"`((?:{starts}) [^`]+)`", prose)]
    return lines


def config_usage_commands(text: str) -> list[str]:
    """The commented usage lines at the top of a config file (`#   python train_my_ddp.py config/x.py ...`)."""
    body = "\n".join(ln[1:] for ln in text.splitlines() if ln.startswith("#"))
    return [ln for ln in _joined_lines(body) if ln.split(" ", 1)[0] in PYTHONS]


def commands_in(path: str, root: str = ROOT) -> list[Command]:
    rel = os.path.relpath(path, root)
    text = open(path, encoding="utf-8").read()
    if path.endswith(".md"):
        lines = markdown_commands(text)
    elif path.endswith(".sh"):
        lines = _joined_lines(text)
    else:
        lines = config_usage_commands(text)
    out = []
    for ln in lines:
        # one word each: a shell expansion ($(( N / 2 )), $(cmd)) and a placeholder with spaces (<HF Llama dir>)
        words_text = re.sub(r"<[^<>\n]*>", "<placeholder>", re.sub(r"\$\(\(?[^()]*\)?\)", "$X", ln))
        try:
            words = shlex.split(words_text, comments=True)
        except ValueError:  # an unbalanced quote in prose: not a command
            continue
        cut = next((i for i, w in enumerate(words) if w in SHELL_ENDS or re.match(r"^\d?>", w)), len(words))
        if words[:cut]:
            out.append(Command(rel, ln, words[:cut]))
    return out


def documentation_files(root: str = ROOT) -> list[str]:
    return ([os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
            + sorted(glob.glob(os.path.join(root, "scripts", "*.sh")))
            + sorted(glob.glob(os.path.join(root, "config", "*.py"))))


def documented_commands(files: Optional[list[str]] = None, root: str = ROOT) -> list[Command]:
    return [c for f in (files or documentation_files(root)) for c in commands_in(f, root)]


# ---------------------------------------------------------------- what a command runs


def program_of(words: list[str], root: str = ROOT) -> tuple[Optional[str], list[str]]:
    """(the repository file a command runs, its arguments), or (None, []) for a command that is not ours.
    `make` gives ("Makefile:<target>", [])."""
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):  # VAR=value before the command
        i += 1
    w = words[i:]
    if not w:
        return None, []
    if w[0] == "make":
        targets = [x for x in w[1:] if not x.startswith("-") and "=" not in x]
        return (f"Makefile:{targets[0]}" if targets else "Makefile:"), []
    if w[0] in PYTHONS:
        rest = w[1:]
    elif w[0] == "torchrun":
        j = 1
        while j < len(w) and w[j].startswith("-"):
            j += 1
        rest = w[j:]
    else:
        return None, []
    if len(rest) >= 2 and rest[0] == "-m":
        mod = rest[1]
        path = mod.replace(".", "/") + ".py"
        if not os.path.isdir(os.path.join(root, mod.split(".")[0])):
            return None, []  # pytest, venv, pip: not ours
        return path, rest[2:]
    if rest and rest[0].endswith(".py") and "..." not in rest[0]:
        return rest[0], rest[1:]
    return None, []


# ---------------------------------------------------------------- parsing without running


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parsed")
        self.parser = parser


@contextlib.contextmanager
def _parse_only(capture_parser_only: bool):
    """While inside: a parser's parse_args raises _Parsed (after parsing, or before it when only the parser is
    wanted) instead of returning, so the command stops right after reading its flags."""
    import utils.cli
    classes = [argparse.ArgumentParser, utils.cli.Parser]
    saved = [c.__dict__["parse_args"] for c in classes]

    def make(orig: Callable):
        def parse_args(self, *a, **k):
            if not capture_parser_only:
                orig(self, *a, **k)  # argparse's errors: SystemExit with the message on stderr
            raise _Parsed(self)
        return parse_args
    for c, orig in zip(classes, saved):
        c.parse_args = make(orig)
    try:
        yield
    finally:
        for c, orig in zip(classes, saved):
            c.parse_args = orig


def _run_until_parsed(path: str, args: list[str], parser_only: bool) -> _Parsed:
    """Run a repo file as __main__ with `args` until it parses them. SystemExit (argparse's error) propagates
    with the message on stderr; a file that never parses is an error of its own."""
    argv, cwd = sys.argv, os.getcwd()
    sys.argv = [path] + args
    try:
        with _parse_only(parser_only), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
    except _Parsed as p:
        return p
    finally:
        sys.argv = argv
        os.chdir(cwd)
    raise RuntimeError(f"{path} ran to its end without calling parse_args")


def _split_flag(word: str) -> tuple[str, Optional[str]]:
    key, eq, val = word.partition("=")
    return key, (val if eq else None)


def _alternatives(args: list[str]) -> list[list[str]]:
    """`--x=a|b` gives one argument list per alternative (a value with | and no space is a choice in prose)."""
    for i, w in enumerate(args):
        key, val = _split_flag(w)
        if w.startswith("--") and val and "|" in val and "$" not in val:
            return [a for alt in val.split("|") for a in _alternatives(args[:i] + [f"{key}={alt}"] + args[i + 1:])]
    return [args]


def _cleaned(args: list[str]) -> list[str]:
    out = []
    for a in args:
        if "..." in a or a.startswith("<") or a.endswith(">"):
            continue
        a = a.strip("[]")
        if a:
            out.append(a)
    return out


def _stand_in(action: Optional[argparse.Action]) -> str:
    """A value of the flag's type for a placeholder: its first choice, its default, or a number / a word."""
    if action is None:
        return "x"
    if action.choices:
        return str(next(iter(action.choices)))
    if action.default not in (None, "", argparse.SUPPRESS) and not isinstance(action.default, bool):
        return str(action.default)
    return "1" if action.type in (int, float) else "true" if action.nargs == "?" else "x"


def _placeholders(args: list[str]) -> list[str]:
    """The flags (`--key`) of `args` whose value is a placeholder."""
    return [key for key, val in map(_split_flag, args) if key.startswith("--") and val is not None
            and PLACEHOLDER_VALUE.search(val)]


def _with_stand_ins(args: list[str], stand_in: Callable[[str], str]) -> list[str]:
    """`args` with each placeholder value replaced by `stand_in(--key)`."""
    keys, out = set(_placeholders(args)), []
    for a in args:
        key = _split_flag(a)[0]
        out.append(f"{key}={stand_in(key)}" if key in keys else a)
    return out


def _argparse_args(path: str, args: list[str]) -> list[str]:
    """`args` with each placeholder value replaced by a stand-in of its flag's type (the parser read first)."""
    if not _placeholders(args):
        return args
    actions = _run_until_parsed(path, [], parser_only=True).parser._option_string_actions
    # the flag as written, or in the snake_case utils.cli reads
    return _with_stand_ins(args, lambda key: _stand_in(actions.get(key) or actions.get(
        "--" + key[2:].replace("-", "_"))))


def _trainer_args(args: list[str]) -> list[str]:
    from trainer.config import TrainConfig
    from utils.configurator import _aliases_for, _field_types
    aliases, defaults = _aliases_for(_field_types(TrainConfig)), TrainConfig()

    def stand_in(key: str) -> str:
        name = key[2:].replace("-", "_")
        value = getattr(defaults, aliases.get(name, name), "x")
        return str(value).lower() if isinstance(value, bool) else str(value)
    return _with_stand_ins(args, stand_in)


@functools.lru_cache(maxsize=None)
def make_targets(root: str = ROOT) -> frozenset[str]:
    text = open(os.path.join(root, "Makefile"), encoding="utf-8").read()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+):(?!=)", text, re.M))


def check(program: str, args: list[str], root: str = ROOT) -> Optional[str]:
    """None when the command parses, else why not (one line)."""
    if program.startswith("Makefile:"):
        target = program.split(":", 1)[1]
        return None if not target or target in make_targets(root) else f"no target {target!r} in the Makefile"
    if not os.path.isfile(os.path.join(root, program)):
        return f"{program}: no such file"
    args = _cleaned(args)
    if not args:
        return None  # named in prose
    for alt in _alternatives(args):
        why = _check_one(program, alt, root)
        if why:
            return why
    return None


def _check_one(program: str, args: list[str], root: str) -> Optional[str]:
    if program == "train_my_ddp.py":
        from utils.configurator import ConfigError, parse_config
        from trainer.config import TrainConfig
        cwd = os.getcwd()
        os.chdir(root)  # a config file is named relative to the repository
        try:
            parse_config(TrainConfig(), _trainer_args(args))
        except ConfigError as e:
            return str(e)
        finally:
            os.chdir(cwd)
        return None
    if program == "monitor_process.py":
        from monitor.config import parse_args
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                _, inner = parse_args(args)
        except SystemExit:
            return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else "monitor: bad flags"
        prog, rest = program_of(inner, root)
        return check(prog, rest, root) if prog else None
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        with contextlib.redirect_stderr(err):
            _run_until_parsed(program, _argparse_args(program, args), parser_only=False)
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines()
        return lines[-1] if lines else f"exit {e.code}"
    finally:
        os.chdir(cwd)
    return None


def check_all(commands: list[Command], root: str = ROOT) -> list[tuple[Command, str, Optional[str]]]:
    """(command, program, why it fails or None) for every command of ours."""
    if root not in sys.path:
        sys.path.insert(0, root)
    out = []
    for c in commands:
        prog, args = program_of(c.words, root)
        if prog:
            out.append((c, prog, check(prog, args, root)))
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true", help="print every command checked, not only the failures")
    p.add_argument("files", nargs="*", help="check these files (.md, .sh, config .py) instead of the documentation")
    a = p.parse_args(argv)
    results = check_all(documented_commands([os.path.abspath(f) for f in a.files]))
    bad = [r for r in results if r[2]]
    for c, prog, why in results:
        if why or a.list:
            print(f"{c.source}: {'FAIL' if why else 'ok'} [{prog}] {c.text[:160]}" + (f"\n    {why}" if why else ""))
    print(f"{len(results)} documented commands of ours, {len(bad)} that do not parse")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
