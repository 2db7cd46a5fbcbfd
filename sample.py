"""Generate text from a trained checkpoint: `python sample.py --ckpt=out/run --prompt="..."`.

`--checkpoint=latest|best|step_N` picks the checkpoint of the run; the tokenizer is the one the run
recorded (its --tokenizer_dir), unless `--tokenizer_dir` is given (required for a Hugging Face dir).

Owns: the command-line wrapper around model.generate (KV cache, temperature / top-k / top-p / min-p
sampling, the repetition penalty, stop at eos or the chat's end of turn) and `build_prompt_ids`. `--chat` wraps
the prompt in the tokenizer's chat template as a user turn (for SFT/DPO models; ChatML for ours). `--prompts_file`:
every prompt of a .jsonl / text file, --batch_size prompts decoded together (left-padded), as JSON lines
(inference/prompt_file.py).
`--speculative=mtp`: a model trained with multi-token prediction drafts the token after next with its first depth
and verifies it in the next forward (model/speculative.py; greedy output unchanged, sampling the same distribution,
the repetition penalty included; it pays only where the drafts are mostly right). The checkpoint, the model and the
recorded tokenizer are loaded by inference/loading.py (shared with eval_lm.py).
Exit 2 for a bad flag or a --checkpoint that names nothing, 5 for a damaged checkpoint (one line naming the file;
docs/errors.md). Flags, a --ckpt that is not there and a --checkpoint that names nothing are answered before torch
is imported. Must never modify the checkpoint, or turn text the user typed (`<|im_end|>`, `</s>`, ...) into special
ids: only the template's own markers are special.
"""
from __future__ import annotations

import os
import sys
from typing import Any, Optional

from inference.loading import load_for_inference, no_tokenizer_message, precheck, recorded_tokenizer_dir


def build_prompt_ids(tok: Any, tokenizer_meta: dict, prompt: str, chat: bool,
                     template_kwargs: Optional[dict] = None, system: str = "") -> list[int]:
    """Model input ids for a prompt, encoded injection-safe.

    chat: the prompt as a user turn and the assistant's header, in the tokenizer's chat template (ours:
    `<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n`) via `encode_chat`, `template_kwargs` its extra
    variables, `system` a system turn before it; else `<s>` (if the tokenizer has one) + the prompt's ids
    (`encode_prompts`). Either way special-token text in the prompt stays ordinary text. ValueError for a prompt that
    cannot be encoded (lone surrogate)."""
    from tokenizer import encode_chat, encode_prompts
    bad = next((i for i, c in enumerate(prompt) if "\ud800" <= c <= "\udfff"), None)
    if bad is not None:  # e.g. undecodable bytes on the command line (surrogateescape)
        raise ValueError(f"the prompt is not valid Unicode: lone surrogate U+{ord(prompt[bad]):04X} "
                         f"at character {bad}")
    if chat:
        turns = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        ids, _ = encode_chat(tok, turns, add_generation_prompt=True, template_kwargs=template_kwargs)
        return list(ids)
    return encode_prompts(tok, tokenizer_meta, [prompt])[0]


def _parser():
    from utils.cli import Parser, add_bool
    p = Parser(description=__doc__.splitlines()[0])
    p.add_argument("--ckpt", required=True, help="run dir, checkpoint dir or Hugging Face model dir")
    p.add_argument("--checkpoint", default="latest", help="which checkpoint of the run: latest, best or step_N")
    p.add_argument("--tokenizer_dir", default=None, help="default: the tokenizer the run recorded")
    p.add_argument("--prompt", default="")
    add_bool(p, "chat", False, "render the prompt as a user turn of the chat template")
    p.add_argument("--system", default="", help="--chat: a system turn before the prompt")
    p.add_argument("--tools", default="", help="--chat: a JSON file of function schemas (a list, OpenAI's / "
                   "transformers' shape) offered in the prompt, for a model trained on tool calls; or Python "
                   "functions, module:function[,module:function]: offered, and the model's calls run and their "
                   "results fed back before it answers (GRPO's --tools)")
    p.add_argument("--max_tool_calling_iterations", type=int, default=0,
                   help="--tools functions: calling turns run at most (0 = as many as --max_new_tokens holds)")
    p.add_argument("--chat_template_kwargs", default="", help="--chat: a JSON object of extra variables for the "
                   "tokenizer's chat template (Qwen3's '{\"enable_thinking\": false}')")
    from utils import constants as c
    # the same defaults go into an export's generation_config.json (model/hf_files.generation_config_dict)
    p.add_argument("--max_new_tokens", type=int, default=c.SAMPLE_MAX_NEW_TOKENS)
    p.add_argument("--temperature", type=float, default=c.SAMPLE_TEMPERATURE, help="0 = greedy")
    p.add_argument("--top_k", type=int, default=c.SAMPLE_TOP_K)
    p.add_argument("--top_p", type=float, default=c.SAMPLE_TOP_P)
    p.add_argument("--min_p", type=float, default=None,
                   help="drop tokens less probable than min_p x the most probable one (after top-k / top-p; off)")
    p.add_argument("--repetition_penalty", type=float, default=1.0,
                   help="> 1 discourages tokens already in the prompt or the output (transformers' rule; 1 = off)")
    p.add_argument("--prompts_file", default="", help="a .jsonl of {\"prompt\": ...} records or a text file of one "
                   "prompt per line: JSON lines {index, line, prompt, sample, completion} of every prompt, in batches")
    p.add_argument("--batch_size", type=int, default=8, help="--prompts_file: prompts decoded together (left-padded)")
    p.add_argument("--output", default="", help="--prompts_file: write the JSON lines here (default: stdout)")
    p.add_argument("--num_samples", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--speculative", default="off", choices=("off", "mtp"),
                   help="mtp: the model's first multi-token prediction depth drafts the token after next (two "
                        "tokens per forward where it is right; faster only where most drafts are)")
    return p


def _flag_problem(args) -> Optional[str]:
    """The first sampling flag out of its range (one line), else precheck's verdict on the paths; before torch."""
    if args.min_p is not None and not 0 <= args.min_p <= 1:
        return f"--min_p={args.min_p}: must be in [0, 1]"
    if not 0 < args.repetition_penalty < float("inf"):
        return f"--repetition_penalty={args.repetition_penalty}: must be a finite number > 0"
    if args.system and not args.chat:
        return "--system is a chat turn: give --chat too"
    if args.prompts_file and args.prompt:
        return "--prompt and --prompts_file: give one of them"
    if args.prompts_file and args.speculative != "off":
        return "--speculative=mtp decodes one prompt: drop it with --prompts_file"
    if args.batch_size < 1 or args.num_samples < 1:
        return f"--batch_size={args.batch_size} and --num_samples={args.num_samples} must be >= 1"
    from tokenizer.chat_template import parse_template_kwargs  # (torch-free)
    try:
        args.template_kwargs = parse_template_kwargs(args.chat_template_kwargs)
    except ValueError as e:
        return str(e)
    if args.tools:
        if not args.chat:
            return "--tools are offered in a chat prompt: give --chat too"
        problem = _read_tools(args)
        if problem:
            return problem
        if args.run_tools and (args.prompts_file or args.speculative != "off"):
            return "--tools functions run for one --prompt: drop --prompts_file / --speculative"
    return precheck(args)


def _read_tools(args) -> str:
    """--tools: the file's function schemas, or the functions' (`args.run_tools`, name -> grpo_tools.Tool), into the
    template's `tools` variable; a problem's line, or ''."""
    import json

    from data_preprocess.sft_format import record_tools
    from trainer.tasks.grpo_flags import FUNCTION_SPEC
    args.run_tools = None
    if not os.path.exists(args.tools) and all(FUNCTION_SPEC.fullmatch(s.strip()) for s in args.tools.split(",")):
        from trainer.tasks.grpo_tools import ToolsError, load_tools
        try:
            args.run_tools = load_tools(args.tools)
        except ToolsError as e:
            return str(e)
        args.template_kwargs = {**args.template_kwargs, "tools": [t.schema for t in args.run_tools.values()]}
        return ""
    try:
        with open(args.tools, encoding="utf-8") as f:
            offered = record_tools({"tools": json.load(f)})
    except (OSError, ValueError) as e:
        return f"--tools={args.tools}: {e}"
    if not offered:
        return f"--tools={args.tools}: no function schemas (a JSON list of them)"
    args.template_kwargs = {**args.template_kwargs, "tools": offered}
    return ""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    problem = _flag_problem(args)
    if problem:
        print(f"sample.py: {problem}", file=sys.stderr)
        return 2  # bad configuration (utils.constants.EXIT_BAD_CONFIG)

    import torch

    from model.generate import generate
    from tokenizer.chat import chat_stop_ids
    from tokenizer.loading import load_tokenizer_and_meta
    from utils.device import resolve_device
    from utils.errors import report_named

    def fail(e: BaseException) -> Optional[int]:
        """A named error's exit code, its line printed (utils.errors.exit_code_for: e.g. 5 for a damaged
        checkpoint file, which the message names, 2 for a choice that names nothing); None: a crash."""
        return report_named(e, "sample.py")

    device = resolve_device(args.device)
    try:
        tok_dir = args.tokenizer_dir or recorded_tokenizer_dir(args.ckpt, args.checkpoint)
    except Exception as e:  # noqa: BLE001 - named errors end the command with their code; others re-raise
        code = fail(e)
        if code is None:
            raise
        return code
    if not tok_dir or not os.path.isdir(tok_dir):
        print(f"sample.py: {no_tokenizer_message(tok_dir, args.tokenizer_dir)}", file=sys.stderr)
        return 2
    try:  # one line naming the file: 3 for a changed tokenizer file or a damaged meta, 2 for a directory that
        tok, meta = load_tokenizer_and_meta(tok_dir)  # does not load (remote code, a malformed tokenizer.json)
    except Exception as e:  # noqa: BLE001 - named errors end the command with their code; others re-raise
        code = fail(e)
        if code is None:
            raise
        return code
    special = meta["special_tokens"]
    prompts = None
    try:
        if args.prompts_file:
            from inference.prompt_file import read_prompts
            prompts = read_prompts(args.prompts_file)
            ids = []
        else:
            ids = build_prompt_ids(tok, meta, args.prompt, args.chat, args.template_kwargs, args.system)
    except ValueError as e:
        print(f"sample.py: --prompt: {e}", file=sys.stderr)
        return 2  # bad configuration (utils.constants.EXIT_BAD_CONFIG)
    except Exception as e:  # noqa: BLE001 - a bad prompts file: one line naming the file and line (exit 3)
        code = fail(e)
        if code is None:
            raise
        return code
    try:
        model, _ = load_for_inference(args.ckpt, device, args.checkpoint,
                                      mtp_layers=1 if args.speculative == "mtp" else 0)  # (a Hub model's MTP layer)
    except Exception as e:  # noqa: BLE001 - named errors end the command with their code; others re-raise
        code = fail(e)
        if code is None:
            raise
        return code
    from model.speculative import generate_mtp, why_not
    cannot = why_not(model)
    if args.speculative == "mtp" and cannot:
        print(f"sample.py: --speculative=mtp: {cannot}", file=sys.stderr)
        return 2  # bad configuration (utils.constants.EXIT_BAD_CONFIG)
    if args.speculative == "off" and not cannot:
        print(f"sample.py: the model has {len(model.mtp.depths)} multi-token prediction depth(s): --speculative=mtp "
              "drafts with the first", file=sys.stderr)
    torch.manual_seed(args.seed)
    stop_ids = chat_stop_ids(tok, special)
    knobs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None,
                 top_p=args.top_p, min_p=args.min_p, stop_ids=stop_ids)
    if prompts is not None:
        return _sample_file(args, model, tok, meta, prompts, knobs, fail)
    if getattr(args, "run_tools", None):
        return _sample_with_tools(args, model, tok, special, ids, stop_ids, device)
    x = torch.tensor([ids] * args.num_samples, dtype=torch.long, device=device)
    if args.speculative == "mtp":
        out, stats = generate_mtp(model, x, repetition_penalty=args.repetition_penalty, **knobs)
        print(f"sample.py: {stats.summary()}", file=sys.stderr)
    else:
        out = generate(model, x, use_cache=True, repetition_penalty=args.repetition_penalty, **knobs)
    for row in out.tolist():
        new = [t for t in row[len(ids):] if t not in stop_ids]
        print("---")
        print(args.prompt + tok.decode(new, skip_special_tokens=True) if not args.chat
              else tok.decode(new, skip_special_tokens=True))
    return 0


def _sample_with_tools(args, model, tok, special: dict, ids: list, stop_ids: list, device) -> int:
    """--tools functions: the completions decoded as GRPO's rollouts are (trainer/tasks/grpo_rollout.py), each call
    the model writes run and its results fed back (trainer/tasks/grpo_tools.py); each printed whole, special tokens,
    calls and results included."""
    import torch

    from trainer.tasks.grpo_rollout import completion_lengths, sample_groups
    from trainer.tasks.grpo_tools import ToolRunner, ToolsError
    try:
        runner = ToolRunner(tok, args.run_tools, [args.template_kwargs["tools"]], stop_ids, args.template_kwargs,
                            args.max_tool_calling_iterations)
    except ToolsError as e:
        print(f"sample.py: {e}", file=sys.stderr)
        return 2  # bad configuration (utils.constants.EXIT_BAD_CONFIG)
    pad = int(special["pad"]["id"]) if "pad" in special else stop_ids[0]
    toks, mask, _ = sample_groups(
        model, [ids], args.num_samples, args.max_new_tokens, temperature=args.temperature,
        top_p=1.0 if args.top_p is None else args.top_p, top_k=args.top_k or 0, min_p=args.min_p or 0.0,
        repetition_penalty=args.repetition_penalty, stop_ids=stop_ids,
        pad_id=pad, generators=[torch.Generator(device=device).manual_seed(args.seed)], turn_end=runner.turn_end)[0]
    for row, n in zip(toks.tolist(), completion_lengths(mask).tolist()):
        print("---")
        print(tok.decode(row[:n], skip_special_tokens=False))
    calls = sum(t.calls for t in runner.rows.values())
    print(f"sample.py: {calls} tool call(s) run, {sum(t.failures for t in runner.rows.values())} failed",
          file=sys.stderr)
    return 0


def _sample_file(args, model, tok, meta: dict, prompts: list, knobs: dict, fail) -> int:
    """--prompts_file: every prompt's completions as JSON lines (inference/prompt_file.py), to --output or stdout."""
    from inference.prompt_file import sample_file

    def encode(text: str) -> list[int]:
        return build_prompt_ids(tok, meta, text, args.chat, args.template_kwargs, args.system)
    try:
        out = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
    except OSError as e:
        print(f"sample.py: --output={args.output}: {e.strerror}", file=sys.stderr)
        return 2  # bad configuration (utils.constants.EXIT_BAD_CONFIG)
    try:
        n = sample_file(model, prompts, encode, lambda new: tok.decode(new, skip_special_tokens=True), out,
                        batch_size=args.batch_size, num_samples=args.num_samples,
                        repetition_penalty=args.repetition_penalty, **knobs)
    except ValueError as e:
        print(f"sample.py: --prompts_file={args.prompts_file}: {e}", file=sys.stderr)
        return 3  # a prompt that cannot be encoded (utils.constants.EXIT_BAD_DATA)
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"sample.py: {n} completions of {len(prompts)} prompts" + (f" in {args.output}" if args.output else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
