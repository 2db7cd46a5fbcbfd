"""The error a run stops with, how any error is printed (one line), and which exit code it ends a command with.

Owns: `TrainingError` (a message with its documented exit code, utils/constants.py), `one_line`, the one
formatting of an error message for stderr (whitespace collapsed, an embedded traceback cut, at most 500
characters), and `exit_code_for`, the one mapping from an exception to its exit code and line: every
error class a command can name declares `exit_code` (and, for the trainer's line, `exit_prefix`) itself,
so this module imports none of them.
Must never: import torch or anything heavy (the pre-checks print through it before torch loads), or
any package above utils/.
"""
from __future__ import annotations

import pickle
import sys
from typing import Optional

from utils.constants import EXIT_BAD_CHECKPOINT


class TrainingError(Exception):
    """An error that ends a run with `code` (an EXIT_* of utils/constants.py) and one line on stderr."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code

    @property
    def exit_code(self) -> int:
        return self.code


def one_line(e: "BaseException | str") -> str:
    """An error's message on one line (never a traceback: DCP's CheckpointException embeds one)."""
    text = " ".join(str(e).split()) or (type(e).__name__ if isinstance(e, BaseException) else "error")
    return text.split(" Traceback (most recent call last)")[0][:500]


class CheckpointError(RuntimeError):
    """A checkpoint (or the record of a run) that cannot be used; the trainer exits 5 on it.
    The message names the file (or the directory) at fault, on one line."""
    exit_code, exit_prefix, exit_prefix_unless = 5, "checkpoint: ", "checkpoint "  # utils.errors.exit_code_for


class DamagedCheckpointError(CheckpointError):
    """A checkpoint directory that fails verification (incomplete, truncated, corrupted, malformed).
    Raised where a command was pointed at that one checkpoint; a search for the newest one skips it."""


class CheckpointMismatchError(Exception):
    """An intact checkpoint whose tensors do not fit the model this configuration builds (other names
    or shapes): a configuration problem (the trainer exits 2), not a damaged file."""
    exit_code = 2  # EXIT_BAD_CONFIG, read by utils.errors.exit_code_for


class _DamagedCheckpointFile:
    """The exit attributes of classes of other packages that cannot carry them: a file that will not
    unpickle or is no safetensors file is a damaged checkpoint (their messages name the file)."""
    exit_code = EXIT_BAD_CHECKPOINT
    exit_prefix = "checkpoint: "
    exit_prefix_unless = "checkpoint "


def _declared(e: BaseException) -> object:
    """Where `e`'s exit attributes are declared: its class (or instance), or the stand-in above."""
    if isinstance(e, pickle.UnpicklingError):
        return _DamagedCheckpointFile
    safetensors = sys.modules.get("safetensors")  # never imported here: without it no SafetensorError exists
    if safetensors is not None and isinstance(e, getattr(safetensors, "SafetensorError", ())):
        return _DamagedCheckpointFile
    return e


def report_named(e: BaseException, prog: str) -> Optional[int]:
    """sample.py / export_hf.py / eval_lm.py: a named error's exit code, its line (`<prog>: message`) printed on
    stderr; None for any other error (the caller re-raises it: a crash)."""
    named = exit_code_for(e, prefixed=False)
    if named is None:
        return None
    print(f"{prog}: {named[1]}", file=sys.stderr)
    return named[0]


def exit_code_for(e: BaseException, prefixed: bool = True) -> Optional[tuple[int, str]]:
    """(exit code, one-line message) for an error a command can name, None for any other (the caller's
    fallback; the trainer re-raises it: a crash, exit 1, retried by the supervisor).

    The code is the exception's `exit_code`: a class attribute (ConfigError 2, DataError 3,
    CheckpointError 5, ... docs/errors.md) or TrainingError's own. `prefixed` (the trainer's line): the
    message starts with the class's `exit_prefix` ("data: ", "checkpoint: "), left out when the message
    already starts with its `exit_prefix_unless` (a checkpoint error that begins "checkpoint <dir>")."""
    src = _declared(e)
    code = getattr(src, "exit_code", None)
    if code is None:
        return None
    msg = one_line(e)
    prefix = getattr(src, "exit_prefix", "")
    unless = getattr(src, "exit_prefix_unless", None)
    if prefixed and prefix and not (unless and msg.startswith(unless)):
        msg = prefix + msg
    return int(code), msg
