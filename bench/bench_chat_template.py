"""Chat rendering benchmark: prints figures and ratios, asserts nothing.

`tokenizer.encode_chat` (ids and the assistant mask) per conversation of the bundled SFT sample, for a byte-level
tokenizer with ChatML's markers whose template is (a) ours, encoded directly (tokenizer/chat.py), (b) the same
ChatML written another way, so it goes through the template path (tokenizer/chat_template.py: two renders, one more
per reply for its generation prompt, the injection-safe encode), (c) Qwen2.5's template; each beside transformers'
`apply_chat_template(tokenize=True)` on the same tokenizer (ids only: no mask, not injection-safe). Best of
`--repeats` passes.

Usage: .venv/bin/python bench/bench_chat_template.py [--conversations=200] [--repeats=3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _best(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    from transformers import PreTrainedTokenizerFast

    from data_preprocess.sft_format import sft_messages
    from tests.tokenizer.test_chat_templates import FAMILIES, QWEN25, _backend
    from tokenizer import encode_chat
    from tokenizer.contract import CHATML_TEMPLATE
    with open(os.path.join(ROOT, "data", "sft", "sft_conversations.jsonl"), encoding="utf-8") as f:
        convs = [sft_messages(json.loads(line)) for line in f][:args.conversations]
    backend = _backend(FAMILIES["qwen2.5"][5])
    print(f"{len(convs)} conversations, best of {args.repeats}; us per conversation")
    for name, template in (("ChatML, ours (direct)", CHATML_TEMPLATE),
                           ("ChatML, as another template", CHATML_TEMPLATE.replace("{%- for", "{%- for ")),
                           ("Qwen2.5's template", QWEN25)):
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
        tok.chat_template = template
        encode_chat(tok, convs[0])  # (built and cached once per tokenizer)
        ours = _best(lambda: [encode_chat(tok, c) for c in convs], args.repeats) / len(convs)
        ref = _best(lambda: [tok.apply_chat_template(c, tokenize=True) for c in convs], args.repeats) / len(convs)
        print(f"  {name:30s} encode_chat {ours * 1e6:6.0f}  apply_chat_template {ref * 1e6:6.0f}  "
              f"ratio {ours / ref:.2f}x")


if __name__ == "__main__":
    main()
