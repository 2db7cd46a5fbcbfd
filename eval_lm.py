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
context + gold continuation followed by a blank line (lm-eval's "\\n\\n" few-shot delimiter; lm-eval draws its
examples from a few-shot split instead, and MMLU's adds a description line). --loglikelihoods_out writes every
choice's value (jsonl).

A reward model (--task_type=reward's, or a Hugging Face *ForSequenceClassification): --preferences=pairs.jsonl (DPO's
{"prompt" | "conversations", "chosen", "rejected"} records, rendered as the trainer renders them) reports the share of
pairs whose chosen reply scores higher (RewardBench's accuracy) and the mean margin (evals/preferences.py); a reward
model takes no --tasks or --perplexity_files, a language model no --preferences.

Scoring is batched: every request (one per choice, one per perplexity window) sorted longest first, --batch_size
per forward, right-padded (the model is causal: a row's padding never changes its log-likelihood; the values equal
one-forward-per-request scoring up to float32 rounding). A progress bar (requests/s) goes to stderr. On the CPU,
unless --threads or OMP_NUM_THREADS fixes the count, the batches run on the usable cores or on one thread, whichever
is measured faster now (utils/threads.py: on cores other processes hold, spinning threads collapse), as the trainer.

Owns: the command, the formats above and their scoring. The numbers equal those of the exported model under
transformers (export_hf.py; tests/commands/test_eval_lm.py) and lm-evaluation-harness's on the export
(scripts/compare_lm_eval.py, docs/eval.md). Each mistake is one line and an exit code, told before torch and
the model are loaded: 2 for a bad flag, a --checkpoint that names nothing, a task path that is no .jsonl/.json
file (missing, a directory, .arrow, unreadable), a --num_fewshot that leaves a file nothing to score, an --out /
--loglikelihoods_out that cannot be written (a missing parent directory is created); 3 for a task file that cannot
be scored (invalid UTF-8 or JSON, a record that fits no format, a field of the wrong type, a non-integer label, an
empty choice, no records: naming file:line). After the load, before any forward: 2 for a choice longer than
--max_seq_len (file:line), 5 for a damaged checkpoint. Must never modify the checkpoint or download anything.
"""
from __future__ import annotations

import json
import os
import sys

from evals.lm_tasks import (DEFAULT_BATCH_SIZE, LETTERS, TaskConfigError, TaskFormatError,  # noqa: F401  (re-exported)
                            check_fewshot, choice_loglikelihood, encode_pair, encode_requests, evaluate_perplexity,
                            evaluate_task, fewshot_requests, loglikelihoods, mc_request, perplexity_requests,
                            perplexity_result, perplexity_windows, read_task, read_task_lines, tally,
                            task_file_problem, unreadable)


def output_problem(flag: str, path: str) -> str | None:
    """Why the results cannot be written at `path` (checked before anything is loaded), or None. A missing parent
    directory is created here (as `mkdir -p`); one that cannot be (a path under a regular file, no permission),
    or a directory where the file belongs, or a directory that refuses a new file, is the problem."""
    if os.path.isdir(path):
        return f"{flag}={path}: is a directory; give a file name"
    parent = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        return f"{flag}={path}: cannot create its directory {parent}: {e.strerror or e}"
    import tempfile
    try:  # the writers publish through a temp file in the same directory (utils/publish.py): try one
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".eval_lm_probe.", suffix=".tmp")
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"{flag}={path}: cannot write in {parent}: {e.strerror or e}"
    return None


def input_problem(path: str) -> str | None:
    """Why a --perplexity_files path cannot be read (missing, a directory, an unsupported type, unreadable), or
    None: told before the model is loaded."""
    from tokenizer.corpus import SUPPORTED_EXTENSIONS, input_kind
    if not os.path.exists(path):
        return f"{path}: no such file"
    if os.path.isdir(path):
        return f"{path}: is a directory; give the held-out files themselves"
    if input_kind(path) is None:
        return f"{path}: unsupported file type (supported: {', '.join(SUPPORTED_EXTENSIONS)})"
    return unreadable(path)


LOADING, SCORING = "[eval] loading the tokenizer and the model", "[eval] scoring"


def progress_bar():
    """The progress on stderr, shown before torch is imported: LOADING until the requests are counted, then
    SCORING over every request (one per choice, one per perplexity window) with their rate (req/s)."""
    from tqdm import tqdm
    return tqdm(desc=LOADING, unit="req", file=sys.stderr, mininterval=0.5, smoothing=0.1, dynamic_ncols=True)


def start_scoring(bar, total: int) -> None:
    bar.set_description(SCORING, refresh=False)
    bar.reset(total=total)  # the rate counts from here, the loading left out


def _preference_accuracy(model, path: str, tok_dir: str, max_len: int, batch_size: int, device) -> dict:
    """evals/preferences.py's result for the pairs of `path`, read as the trainer reads DPO records."""
    from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
    from dataset.dataset_dpo import DPODataset, dpo_collate
    from evals.preferences import score_preferences
    pairs = DPODataset(tokenize_dpo_records(path, tok_dir, max_len), max_len)
    return score_preferences(model, pairs, dpo_collate(pairs.pad_id), path, max_len, batch_size, device)


def main(argv: list[str] | None = None) -> int:
    import argparse

    from tokenizer.documents import TEXT_FIELDS_HELP
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
    p.add_argument("--preferences", nargs="+", action="extend", default=[],
                   help="a reward model's accuracy on preference pairs ({prompt | conversations, chosen, rejected} "
                        "records, DPO's): the share whose chosen reply scores higher (evals/preferences.py)")
    p.add_argument("--num_fewshot", type=int, default=0)
    p.add_argument("--max_seq_len", type=int, default=0, help="0 = the model's max_seq_len")
    p.add_argument("--batch_size", type=int, default=DEFAULT_BATCH_SIZE,
                   help="log-likelihood requests (choices, perplexity windows) per forward, padded to the longest")
    p.add_argument("--out", default=None, help="write the results (JSON) here (a missing directory is created)")
    p.add_argument("--loglikelihoods_out", default=None, help="write every choice's log-likelihood here (jsonl)")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads (0 = automatic: the usable cores, or 1 while that is measured faster)")
    args = p.parse_args(argv)
    tasks = [t for spec in args.tasks for t in spec.split(",") if t]
    from inference.loading import precheck
    problem = precheck(args)
    if not problem and not (tasks or args.perplexity_files or args.preferences):
        problem = "nothing to evaluate: give --tasks and/or --perplexity_files (a language model), or --preferences"
    if not problem and args.preferences and (tasks or args.perplexity_files):
        problem = ("--preferences measures a reward model, --tasks / --perplexity_files a language model: one kind "
                   "per run")
    if not problem and (args.num_fewshot < 0 or args.max_seq_len < 0 or args.batch_size < 1
                        or args.threads < 0):
        problem = "--num_fewshot, --max_seq_len and --threads must be >= 0, --batch_size >= 1"
    for path in tasks:
        problem = problem or task_file_problem(path)
    for path in args.perplexity_files + args.preferences:
        problem = problem or input_problem(path)
    for flag, path in (("--out", args.out), ("--loglikelihoods_out", args.loglikelihoods_out)):
        if path and not problem:
            problem = output_problem(flag, path)
    if problem:
        print(f"eval_lm.py: {problem}", file=sys.stderr)
        return 2
    try:  # every task file read and checked before torch and the model (exit 3 file:line, 2 too few records)
        read = []  # (path, requests, each request's file:line), in the order given (a file given twice: twice)
        for path in tasks:
            reqs, lines = read_task_lines(path)
            check_fewshot(path, len(reqs), args.num_fewshot)
            read.append((path, fewshot_requests(reqs, args.num_fewshot),
                         [f"{path}:{n}" for n in lines[args.num_fewshot:]]))
    except (TaskFormatError, TaskConfigError) as e:
        from utils.errors import report_named
        return report_named(e, "eval_lm.py")
    if tasks:
        print(f"[eval] {len(tasks)} task file(s) checked: {sum(len(r) for _, r, _ in read)} records",
              file=sys.stderr, flush=True)
    with progress_bar() as bar:
        return _load_and_score(args, read, bar)


def _load_and_score(args, read: list, bar) -> int:
    """Load the tokenizer and the model, encode every request, score them (`bar` advancing), print the results,
    write --out / --loglikelihoods_out; the exit code."""
    import torch

    from inference.loading import load_for_inference, no_tokenizer_message, recorded_tokenizer_dir

    from tokenizer.loading import load_tokenizer_and_meta
    from utils.device import resolve_device
    from utils.errors import report_named
    from utils.threads import plan_threads
    device = resolve_device(args.device)
    threads = plan_threads(args.threads, cpu=device.type == "cpu")
    torch.set_num_threads(threads.start)
    if threads.warning:
        bar.write(f"[eval] warning: threads: {threads.warning}", file=sys.stderr)
    try:
        tok_dir = args.tokenizer_dir or recorded_tokenizer_dir(args.ckpt, args.checkpoint)
        if not tok_dir or not os.path.isdir(tok_dir):
            bar.close()
            print(f"eval_lm.py: {no_tokenizer_message(tok_dir, args.tokenizer_dir)}", file=sys.stderr)
            return 2
        tok, meta = load_tokenizer_and_meta(tok_dir)  # one line naming the file when it does not load
        bos, eos = (int(meta["special_tokens"][k]["id"]) for k in ("bos", "eos"))
        model, _ = load_for_inference(args.ckpt, device, args.checkpoint, reward=bool(args.preferences))
        max_len = args.max_seq_len or model.cfg.max_seq_len
        results: dict = {"ckpt": args.ckpt, "tasks": [], "perplexity": None, "preferences": []}
        for path in args.preferences:  # (a reward model: nothing else is asked of it)
            r = _preference_accuracy(model, path, tok_dir, max_len, args.batch_size, device)
            results["preferences"].append(r)
            bar.write(f"[eval] {os.path.basename(path)}: reward accuracy {r['acc']:.4f}  margin {r['margin']:.4f}  "
                      f"(n={r['n']}; skipped {r['skipped']}, dropped {r['dropped']})", file=sys.stdout)
        encoded = [encode_requests(tok, bos, reqs, max_len, where) for _, reqs, where in read]
        ppl = perplexity_requests(tok, bos, eos, args.perplexity_files, args.text_fields, max_len) \
            if args.perplexity_files else None
        start_scoring(bar, sum(len(item) for enc in encoded for item in enc) + (len(ppl[0]) if ppl else 0))
        lines: list = []
        for (path, reqs, _), enc in zip(read, encoded):
            flat = [r for item in enc for r in item]
            values = loglikelihoods(model, flat, max_len, device, args.batch_size, bar, threads.tuner)
            lls, k = [], 0
            for item in enc:
                lls.append(values[k:k + len(item)])
                k += len(item)
            r = {"task": os.path.basename(path), **tally(reqs, lls, lines, os.path.basename(path)),
                 "num_fewshot": args.num_fewshot}
            results["tasks"].append(r)
            bar.write(f"[eval] {r['task']}: acc {r['acc']:.4f}  acc_norm {r['acc_norm']:.4f}  (n={r['n']}, "
                      f"{r['num_fewshot']}-shot)", file=sys.stdout)
        if ppl:
            reqs, docs, skipped = ppl
            values = loglikelihoods(model, reqs, max_len, device, args.batch_size, bar, threads.tuner)
            r = perplexity_result(reqs, values, docs, skipped)
            results["perplexity"] = r
            bar.write(f"[eval] perplexity {r['ppl']:.4f} over {r['tokens']:,} tokens of {r['documents']} "
                      "documents", file=sys.stdout)
    except Exception as e:  # noqa: BLE001 - named errors end the command with their code; others re-raise
        bar.close()  # the line below the bar, not on it
        code = report_named(e, "eval_lm.py")
        if code is None:
            raise
        return code
    del torch
    for _, old, new, r_old, r_new in threads.tuner.changes if threads.tuner else ():
        bar.write(f"[eval] threads {old} -> {new}: {r_new:,.0f} tokens/s measured against {r_old:,.0f}",
                  file=sys.stderr)
    bar.close()
    from utils.publish import atomic_write_json, atomic_write_text
    try:  # checked writable up front; a disk that filled or a directory removed since is still one line
        if args.out:
            atomic_write_json(args.out, results)
        if args.loglikelihoods_out:
            atomic_write_text(args.loglikelihoods_out, "".join(json.dumps(x) + "\n" for x in lines))
    except OSError as e:
        import errno

        from utils.constants import EXIT_BAD_CONFIG, EXIT_DISK_FULL
        print(f"eval_lm.py: cannot write the results: {e}", file=sys.stderr)
        return EXIT_DISK_FULL if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else EXIT_BAD_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
