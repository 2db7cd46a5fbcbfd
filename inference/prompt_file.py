"""`sample.py --prompts_file`: completions for many prompts, decoded in batches of prompts of any lengths.

Owns: `read_prompts` (a .jsonl of {"prompt": str} records, or a text file of one prompt per line) and `sample_file`
(the prompts in batches of --batch_size, each --num_samples times, left-padded with their attention mask through
model/generate.py `generate`: the pads are masked out of every attention and each row's positions count from its
first real token, so a prompt's greedy completion is the one `--prompt` gives it alone, up to rounding; JSON lines
{"index", "line", "prompt", "sample", "completion"} written in the file's order: the completion is the new text only).
Bad input: a .jsonl line that is not JSON, not an object, or without a string "prompt" is a DataError naming the
file and line (exit 3); so is a file without any prompt. Blank lines are skipped in both formats.
Must never: reorder or drop a prompt, or decode a completion past its stop token.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Iterator, TextIO

from data_preprocess.shard_format import DataError


def read_prompts(path: str) -> list[tuple[int, str]]:
    """[(line number, prompt)] of a .jsonl file ({"prompt": str} per line) or of a text file (a prompt per line)."""
    jsonl = path.lower().endswith(".jsonl")
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                if not jsonl:
                    out.append((n, line.rstrip("\r\n")))
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
                if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                    raise DataError(f'{path}:{n}: a record must be an object with a string "prompt"')
                out.append((n, rec["prompt"]))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror})") from None
    if not out:
        raise DataError(f"{path}: no prompt in it")
    return out


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def sample_file(model: Any, prompts: list[tuple[int, str]], encode: Callable[[str], list[int]],
                decode: Callable[[list[int]], str], out: TextIO, *, batch_size: int, num_samples: int,
                stop_ids: list[int], **knobs) -> int:
    """Write every prompt's `num_samples` completions to `out` as JSON lines (`knobs`: model/generate.py generate's
    sampling arguments); returns how many lines were written."""
    from model.decode import left_pad
    from model.generate import generate
    device = next(model.parameters()).device
    written = 0
    for index_base, chunk in enumerate(_batches(prompts, batch_size)):
        ids = [encode(text) for _, text in chunk]
        x, mask = left_pad([r for r in ids for _ in range(num_samples)], device)
        T = x.shape[1]
        gen = generate(model, x, attention_mask=mask, stop_ids=stop_ids, **knobs)
        for r, row in enumerate(gen[:, T:].tolist()):
            k, s = divmod(r, num_samples)
            new = []
            for t in row:  # up to the stop token (a finished row repeats it)
                if t in stop_ids:
                    break
                new.append(t)
            text = decode(new)
            out.write(json.dumps({"index": index_base * batch_size + k, "line": chunk[k][0], "prompt": chunk[k][1],
                                  "sample": s, "completion": text}, ensure_ascii=False) + "\n")
            written += 1
    out.flush()
    return written
