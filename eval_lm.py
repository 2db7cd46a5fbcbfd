"""Evaluate a model: `python eval_lm.py --ckpt=out/run [--perplexity_files=held_out.jsonl] [--tasks=arc.jsonl,...]`.

Perplexity on held-out raw files (.txt/.jsonl/.json/.parquet, the --text_fields grammar of every command that reads
raw text): each document is `<s> ids </s>`, scored in consecutive windows of at most --max_seq_len predicted tokens
(each window starts without the previous one's context, as nanoGPT's evaluation); ppl = exp(total NLL / tokens).

Multiple choice by log-likelihood, scored as lm-evaluation-harness scores it: per choice, the sum of
log p(continuation tokens | context), where the continuation's tokens are those of `context + continuation`
after the context's own tokens (lm-eval's _encode_pair: trailing spaces of the context move to the continuation),
the context preceded by `<s>`, left-truncated to --max_seq_len; `acc` is the argmax of the log-likelihoods,
`acc_norm` the argmax of log-likelihood / the choice's length in characters (without the " " in front, as
lm-eval). Local jsonl in the common benchmarks' formats (no download), detected per record, with lm-eval's prompts:
  HellaSwag  {"activity_label", "ctx_a", "ctx_b", "endings": [4], "label"}
             "activity_label: ctx_a Ctx_b" (ctx_b.capitalize()) and " " + ending, both through lm-eval's
             hellaswag preprocess (strip, " [title]" -> ". ", "[...]" removed, "  " -> " ")
  ARC        {"question", "choices": {"text", "label"}, "answerKey"}   "Question: q\nAnswer:", " " + text
             (answerKey by its label; a numbered "1".."4" among lettered labels is A..D)
  PIQA       {"goal", "sol1", "sol2", "label"}                "Question: goal\nAnswer:", " " + sol
  MMLU       {"question", "choices": [..], "answer": int|letter}  "q.strip()\nA. ..\nB. ..\nAnswer:", " A" / " B" / ..
  generic    {"context" or "query", "choices": [..], "label" or "gold"}  context as is, choices as is
With --num_fewshot=k, the first k records of the file (left out of the scoring) prefix each context, each as
context + gold continuation followed by a blank line (lm-eval's "\n\n" few-shot delimiter; lm-eval draws its
examples from a few-shot split instead, and MMLU's adds a description line). --loglikelihoods_out writes every
choice's value (jsonl).

Owns: the command, the formats above and their scoring. The numbers equal those of the exported model under
transformers (export_hf.py; tests/commands/test_eval_lm.py) and lm-evaluation-harness's on the export
(scripts/compare_lm_eval.py, docs/eval.md). Exit 2 for a bad flag or a --checkpoint that names nothing (before
torch is imported), 3 for a task file whose records fit no format (one line naming file:line), 5 for a damaged
checkpoint. Must never modify the checkpoint or download anything.
"""
from __future__ import annotations

import json
import os
import sys

from evals.lm_tasks import (LETTERS, TaskFormatError, choice_loglikelihood, encode_pair,  # noqa: F401  (re-exported)
                      evaluate_perplexity, evaluate_task, mc_request, perplexity_windows, read_task)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tokenizer.corpus import TEXT_FIELDS_HELP
    from utils.cli import Parser
    p = Parser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n", 2)[2],
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ckpt", required=True, help="run dir, checkpoint dir or Hugging Face model dir")
    p.add_argument("--checkpoint", default="latest", help="which checkpoint of the run: latest, best or step_N")
    p.add_argument("--tokenizer_dir", default=None, help="default: the tokenizer the run recorded")
    p.add_argument("--perplexity_files", nargs="+", action="extend", default=[], help="held-out raw text files")
    p.add_argument("--text_fields", default="text", help=TEXT_FIELDS_HELP)
    p.add_argument("--tasks", nargs="+", action="extend", default=[],
                   help="multiple-choice jsonl files (HellaSwag / ARC / PIQA / MMLU-style or generic); comma-separated or repeated")
    p.add_argument("--num_fewshot", type=int, default=0)
    p.add_argument("--max_seq_len", type=int, default=0, help="0 = the model's max_seq_len")
    p.add_argument("--out", default=None, help="write the results (JSON) here")
    p.add_argument("--loglikelihoods_out", default=None, help="write every choice's log-likelihood here (jsonl)")
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    tasks = [t for spec in args.tasks for t in spec.split(",") if t]
    import sample
    problem = sample.precheck(args)
    missing = [f for f in tasks + args.perplexity_files if not os.path.exists(f)]
    if problem or missing or not (tasks or args.perplexity_files) or args.num_fewshot < 0 or args.max_seq_len < 0:
        why = problem or (f"{missing[0]}: no such file" if missing else
                          "nothing to evaluate: give --tasks and/or --perplexity_files" if not (tasks or args.perplexity_files)
                          else "--num_fewshot and --max_seq_len must be >= 0")
        print(f"eval_lm.py: {why}", file=sys.stderr)
        return 2

    import torch

    from tokenizer import load_tokenizer, load_tokenizer_meta
    from utils.device import resolve_device
    from utils.errors import report_named
    device = resolve_device(args.device)
    try:
        tok_dir = args.tokenizer_dir or sample.recorded_tokenizer_dir(args.ckpt, args.checkpoint)
        if not tok_dir or not os.path.isdir(tok_dir):
            print(f"eval_lm.py: {sample.no_tokenizer_message(tok_dir, args.tokenizer_dir)}", file=sys.stderr)
            return 2
        tok, meta = load_tokenizer(tok_dir), load_tokenizer_meta(tok_dir)
        model, _ = sample.load_for_inference(args.ckpt, device, args.checkpoint)
        max_len = args.max_seq_len or model.cfg.max_seq_len
        bos, eos = (int(meta["special_tokens"][k]["id"]) for k in ("bos", "eos"))
        results: dict = {"ckpt": args.ckpt, "tasks": [], "perplexity": None}
        lines: list = []
        for path in tasks:
            r = evaluate_task(model, tok, bos, path, max_len, device, args.num_fewshot, lines)
            results["tasks"].append(r)
            print(f"[eval] {r['task']}: acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}  (n={r['n']}, "
                  f"{r['num_fewshot']}-shot)")
        if args.perplexity_files:
            r = evaluate_perplexity(model, tok, bos, eos, args.perplexity_files, args.text_fields, max_len, device)
            results["perplexity"] = r
            print(f"[eval] perplexity {r['ppl']:.4f} over {r['tokens']:,} tokens of {r['documents']} documents")
    except Exception as e:  # noqa: BLE001 - named errors end the command with their code; others re-raise
        code = report_named(e, "eval_lm.py")
        if code is None:
            raise
        return code
    del torch
    if args.out:
        from utils.publish import atomic_write_json
        atomic_write_json(args.out, results)
    if args.loglikelihoods_out:
        from utils.publish import atomic_write_text
        atomic_write_text(args.loglikelihoods_out, "".join(json.dumps(x) + "\n" for x in lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
