"""Generate text from a trained checkpoint: `python sample.py --ckpt=out/run --prompt="..."`.

Owns: the command-line wrapper around model.generate (KV cache, temperature / top-k / top-p
sampling, stop at </s> or <|im_end|>). `--chat` wraps the prompt in the tokenizer's chat template
(for SFT/DPO models). Must never modify the checkpoint.
"""
from __future__ import annotations

import argparse
import sys

import torch


def load_for_inference(ckpt_path: str, device: torch.device):
    from train_my_ddp import load_weights_from
    model, info = load_weights_from(ckpt_path, log=lambda m: print(m, file=sys.stderr))
    return model.to(device).eval(), info


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
    from tokenizer import encode_texts, load_tokenizer, load_tokenizer_meta
    from utils.device import resolve_device

    device = resolve_device(args.device)
    tok = load_tokenizer(args.tokenizer_dir)
    meta = load_tokenizer_meta(args.tokenizer_dir)
    special = meta["special_tokens"]
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=True,
                                      add_generation_prompt=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    else:
        ids = [special["bos"]["id"]] + encode_texts(tok, [args.prompt])[0]
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
