"""The error a run stops with, and how any error is printed: one line.

Owns: `TrainingError` (a message with its documented exit code, utils/constants.py) and `one_line`,
the one formatting of an error message for stderr (whitespace collapsed, an embedded traceback cut,
at most 500 characters).
Must never: import torch or anything heavy (the pre-checks print through it before torch loads).
"""
from __future__ import annotations


class TrainingError(Exception):
    """An error that ends a run with `code` (an EXIT_* of utils/constants.py) and one line on stderr."""

    def __init__(self, msg: str, code: int) -> None:
        super().__init__(msg)
        self.code = code


def one_line(e: "BaseException | str") -> str:
    """An error's message on one line (never a traceback: DCP's CheckpointException embeds one)."""
    text = " ".join(str(e).split()) or (type(e).__name__ if isinstance(e, BaseException) else "error")
    return text.split(" Traceback (most recent call last)")[0][:500]
