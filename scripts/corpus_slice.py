"""A small slice of the bundled pretraining corpus (data/pretrain/*.jsonl) for quick runs: the first
`docs` documents of each file, each cut to `chars` characters. Used by scripts/kill_trials.py and
scripts/gpu_report.py's CPU dry run."""
from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus_slice(dst: str, docs: int = 60, chars: int = 1500) -> str:
    """Write the slice into `dst` (created if needed), one .jsonl per bundled file; returns `dst`."""
    os.makedirs(dst, exist_ok=True)
    src = os.path.join(ROOT, "data", "pretrain")
    for name in sorted(os.listdir(src)):
        if name.endswith(".jsonl"):
            with open(os.path.join(src, name), encoding="utf-8") as f:
                texts = [json.loads(line)["text"] for _, line in zip(range(docs), f)]
            with open(os.path.join(dst, name), "w", encoding="utf-8") as f:
                f.writelines(json.dumps({"text": t[:chars]}, ensure_ascii=False) + "\n" for t in texts)
    return dst
