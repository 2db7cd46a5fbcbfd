"""Generate text from a trained checkpoint: `python sample.py --ckpt=out/run --prompt="..."`.

`--checkpoint=latest|best|step_N` picks the checkpoint of the run; the tokenizer is the one the run
recorded (its --tokenizer_dir), unless `--tokenizer_dir` is given (required for a Hugging Face dir).

Owns: the command-line wrapper around model.generate (KV cache, temperature / top-k / top-p
sampling, stop at </s> or <|im_end|>) and `build_prompt_ids`. `--chat` wraps the prompt in the ChatML
template as a user turn (for SFT/DPO models). Must never modify the checkpoint, or turn text the user
typed (`<|im_end|>`, `</s>`, ...) into special ids: only the template's own markers are special.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

import torch


def load_for_inference(ckpt_path: str, device: torch.device, which: str = "latest"):
    """(model in eval mode on `device`, info) from a HF directory, or a run's `which` checkpoint."""
    from train_my_ddp import _is_hf_dir, load_weights_from
    from utils.run_config import select_checkpoint
    log = lambda m: print(m, file=sys.stderr)  # noqa: E731
    path = ckpt_path if _is_hf_dir(ckpt_path) else select_checkpoint(ckpt_path, which, log=log)
    model, info = load_weights_from(path, log=log)
    return model.to(device).eval(), info


def recorded_tokenizer_dir(ckpt_path: str, which: str = "latest") -> Optional[str]:
    """The --tokenizer_dir the run trained with (from the checkpoint's config.json), or a HF dir's own."""
    from train_my_ddp import _is_hf_dir
    from utils import checkpoint as ckpt
    from utils.run_config import select_checkpoint
    if _is_hf_dir(ckpt_path):
        return ckpt_path if os.path.exists(os.path.join(ckpt_path, "tokenizer_meta.json")) else None
    found = select_checkpoint(ckpt_path, which, log=lambda m: None)
    cfg_path = os.path.join(found, "config.json")
    tok = ckpt.read_json(cfg_path).get("tokenizer_dir") if os.path.exists(cfg_path) else None
    return tok or None


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
    from utils.cli import Parser, add_bool
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="run dir, checkpoint dir or Hugging Face model dir")
    p.add_argument("--checkpoint", default="latest", help="which checkpoint of the run: latest, best or step_N")
    p.add_argument("--tokenizer_dir", default=None, help="default: the tokenizer the run recorded")
    p.add_argument("--prompt", default="")
    add_bool(p, "chat", False, "render the prompt as a user turn of the chat template")
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
    from utils.checkpoint import CheckpointError
    from utils.device import resolve_device

    device = resolve_device(args.device)
    try:
        tok_dir = args.tokenizer_dir or recorded_tokenizer_dir(args.ckpt, args.checkpoint)
    except CheckpointError as e:
        print(f"sample.py: {e}", file=sys.stderr)
        return 2
    if not tok_dir or not os.path.isdir(tok_dir):
        print(f"sample.py: no tokenizer: the run recorded {tok_dir!r}; pass --tokenizer_dir", file=sys.stderr)
        return 2
    tok = load_tokenizer(tok_dir)
    meta = load_tokenizer_meta(tok_dir)
    special = meta["special_tokens"]
    try:
        ids = build_prompt_ids(tok, meta, args.prompt, args.chat)
    except ValueError as e:
        print(f"sample.py: --prompt: {e}", file=sys.stderr)
        return 2  # bad configuration (utils.constants.EXIT_BAD_CONFIG)
    model, _ = load_for_inference(args.ckpt, device, args.checkpoint)
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
