"""Generate text from a trained checkpoint: `python sample.py --ckpt=out/run --prompt="..."`.

Owns: the command-line wrapper around model.generate (KV cache, temperature / top-k / top-p
sampling, stop at </s> or <|im_end|>) and `build_prompt_ids`. `--chat` wraps the prompt in the ChatML
template as a user turn (for SFT/DPO models). Must never modify the checkpoint, or turn text the user
typed (`<|im_end|>`, `</s>`, ...) into special ids: only the template's own markers are special.
"""
from __future__ import annotations

import argparse
import sys

from typing import Any

import torch


def load_for_inference(ckpt_path: str, device: torch.device):
    from train_my_ddp import load_weights_from
    model, info = load_weights_from(ckpt_path, log=lambda m: print(m, file=sys.stderr))
    return model.to(device).eval(), info


def build_prompt_ids(tok: Any, tokenizer_meta: dict, prompt: str, chat: bool) -> list[int]:
    """Model input ids for a prompt, encoded injection-safe.

    chat: `<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n` via `encode_chat`, which inserts
    the marker ids itself; else `<s>` + the prompt's ids (`encode_texts`). Either way special-token text
    in the prompt stays ordinary text. ValueError for a prompt that cannot be encoded (lone surrogate)."""
    from tokenizer import encode_chat, encode_texts
    bad = next((i for i, c in enumerate(prompt) if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:  # e.g. undecodable bytes on the command line (surrogateescape)
        raise ValueError(f"the prompt is not valid Unicode: lone surrogate U+{ord(prompt[bad]):04X} "
                         f"at character {bad}")
    if chat:
        ids, _ = encode_chat(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        return list(ids)
    return [int(tokenizer_meta["special_tokens"]["bos"]["id"])] + encode_texts(tok, [prompt])[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="run dir, checkpoint dir or Hugging Face model dir")
    p.add_argument("--tokenizer_dir", required=True)
    p.add_argument("--prompt", default="")
    p.add_argument("--chat", action="store_true", help="render the prompt as a user turn of the chat template")
    p.add_argument("--max_new_tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=50)
    p.add_argument("--top_p", type=float, default=None)
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)

    from model.generate import generate
    from tokenizer import load_tokenizer, load_tokenizer_meta
    from utils.device import resolve_device

    device = resolve_device(args.device)
    tok = load_tokenizer(args.tokenizer_dir)
    meta = load_tokenizer_meta(args.tokenizer_dir)
    special = meta["special_tokens"]
    try:
        ids = build_prompt_ids(tok, meta, args.prompt, args.chat)
    except ValueError as e:
        print(f"sample.py: --prompt: {e}", file=sys.stderr)
        return 2  # bad configuration (utils.constants.EXIT_BAD_CONFIG)
    model, _ = load_for_inference(args.ckpt, device)
    torch.manual_seed(args.seed)
    x = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    stop_ids = [special["eos"]["id"], special["im_end"]["id"]]
    out = generate(model, x, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k or None, top_p=args.top_p, stop_ids=stop_ids, use_cache=True)
    for row in out.tolist():
        new = [t for t in row[len(ids):] if t not in stop_ids]
        print("---")
        print(args.prompt + tok.decode(new, skip_special_tokens=True) if not args.chat
              else tok.decode(new, skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
