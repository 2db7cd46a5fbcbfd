"""Evaluate a model: `python eval_lm.py --ckpt=out/run [--perplexity_files=held_out.jsonl] [--tasks=arc.jsonl,...]`.

Perplexity on held-out raw files (.txt/.jsonl/.json/.parquet, the --text_fields grammar of every command that reads
raw text): each document is `<s> ids </s>`, scored in consecutive windows of at most --max_seq_len predicted tokens
(each window starts without the previous one's context, as nanoGPT's evaluation); ppl = exp(total NLL / tokens).

Multiple choice by log-likelihood, scored as lm-evaluation-harness scores it: per choice, the sum of
log p(continuation tokens | context), where the continuation's tokens are those of `context + continuation`
after the context's own tokens (lm-eval's _encode_pair: trailing spaces of the context move to the continuation),
the context preceded by `<s>`, left-truncated to --max_seq_len; `acc` is the argmax of the log-likelihoods,
`acc_norm` the argmax of log-likelihood / the continuation's length in characters. Local jsonl in the common
benchmarks' formats (no download), detected per record:
  HellaSwag  {"ctx", "endings": [4], "label"}                 context ctx, choices " " + ending
  ARC        {"question", "choices": {"text", "label"}, "answerKey"}   "Question: q\\nAnswer:", " " + text
  PIQA       {"goal", "sol1", "sol2", "label"}                "Question: goal\\nAnswer:", " " + sol
  MMLU       {"question", "choices": [..], "answer": int}     "q\\nA. ..\\nB. ..\\nAnswer:", " A" / " B" / ...
  generic    {"context", "choices": [..], "label" or "gold"}  context as is, choices as is
With --num_fewshot=k, the first k records of the file (left out of the scoring) prefix each context, separated by
a blank line, as lm-eval's default few-shot format. --loglikelihoods_out writes every choice's value (jsonl).

Owns: the command, the formats above and their scoring. The numbers equal those of the exported model under
transformers (export_hf.py; tests/commands/test_eval_lm.py), so they line up with lm-evaluation-harness on the
export. Exit 2 for a bad flag or a --checkpoint that names nothing (before torch is imported), 3 for a task file
whose records fit no format (one line naming file:line), 5 for a damaged checkpoint. Must never modify the
checkpoint or download anything.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Iterator, Optional

LETTERS = "ABCDEFGHIJ"


class TaskFormatError(ValueError):
    """A task record that fits no supported format (exit 3, naming file:line)."""
    exit_code, exit_prefix = 3, "data: "


def mc_request(rec: Any) -> tuple[str, list[str], int, str]:
    """(context, choices, gold index, format name) of one multiple-choice record; TaskFormatError otherwise."""
    if not isinstance(rec, dict):
        raise TaskFormatError(f"a record is a {type(rec).__name__}, not an object")
    if "ctx" in rec and "endings" in rec:
        return rec["ctx"], [" " + e for e in rec["endings"]], int(rec["label"]), "hellaswag"
    if "goal" in rec and "sol1" in rec:
        return f"Question: {rec['goal']}\nAnswer:", [" " + rec["sol1"], " " + rec["sol2"]], int(rec["label"]), "piqa"
    if "question" in rec and isinstance(rec.get("choices"), dict) and "answerKey" in rec:
        labels, texts = list(rec["choices"]["label"]), list(rec["choices"]["text"])
        key = str(rec["answerKey"])
        gold = labels.index(key) if key in labels else int(key) - 1  # ARC: letters, a few numbered "1".."4"
        return f"Question: {rec['question']}\nAnswer:", [" " + t for t in texts], gold, "arc"
    if "question" in rec and isinstance(rec.get("choices"), list) and "answer" in rec:
        choices = rec["choices"]
        body = "".join(f"\n{LETTERS[i]}. {c}" for i, c in enumerate(choices))
        ans = rec["answer"]
        gold = LETTERS.index(ans) if isinstance(ans, str) else int(ans)
        return f"{rec['question'].strip()}{body}\nAnswer:", [f" {LETTERS[i]}" for i in range(len(choices))], gold, "mmlu"
    if ("context" in rec or "query" in rec) and isinstance(rec.get("choices"), list):
        gold = rec.get("label", rec.get("gold"))
        return rec.get("context", rec.get("query")), list(rec["choices"]), int(gold), "generic"
    raise TaskFormatError(f"fits no multiple-choice format (keys: {', '.join(sorted(map(str, rec)))}); "
                          "see python eval_lm.py --help")


def read_task(path: str) -> list[tuple[str, list[str], int, str]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                req = mc_request(json.loads(line))
            except (ValueError, KeyError, TypeError, IndexError) as e:
                msg = e.args[0] if isinstance(e, TaskFormatError) else f"{type(e).__name__}: {e}"
                raise TaskFormatError(f"{path}:{lineno}: {msg}") from None
            if not (0 <= req[2] < len(req[1])):
                raise TaskFormatError(f"{path}:{lineno}: gold index {req[2]} outside its {len(req[1])} choices")
            out.append(req)
    return out


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's _encode_pair: (context ids, continuation ids), the continuation's being those of
    the whole text after the context's own; no special tokens (the caller prepends <s>)."""
    from tokenizer import encode_texts
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation = context[-n_spaces:] + continuation
        context = context[:-n_spaces]
    whole, ctx = encode_texts(tok, [context + continuation, context])
    return ctx, whole[len(ctx):]


def choice_loglikelihood(model: Any, ids: list[int], n_cont: int, max_len: int, device: Any) -> float:
    """sum log p(ids[-n_cont:] | everything before), the input left-truncated to max_len tokens (lm-eval)."""
    import torch
    inp = ids[:-1][-max_len:]
    x = torch.tensor([inp], dtype=torch.long, device=device)
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0].float(), dim=-1)
    targets = torch.tensor(ids[-n_cont:], dtype=torch.long, device=device)
    return float(logp[-n_cont:].gather(1, targets[:, None]).sum())


def evaluate_task(model: Any, tok: Any, bos: int, path: str, max_len: int, device: Any, num_fewshot: int = 0,
                  out_lines: Optional[list] = None) -> dict:
    reqs = read_task(path)
    shots, reqs = reqs[:num_fewshot], reqs[num_fewshot:]
    prefix = "".join(f"{c}{ch[g]}\n\n" for c, ch, g, _ in shots)
    n = correct = correct_norm = 0
    for i, (context, choices, gold, fmt) in enumerate(reqs):
        lls = []
        for choice in choices:
            ctx, cont = encode_pair(tok, prefix + context, choice)
            lls.append(choice_loglikelihood(model, [bos] + ctx + cont, len(cont), max_len, device))
        norm = [ll / max(1, len(c)) for ll, c in zip(lls, choices)]
        n += 1
        correct += int(max(range(len(lls)), key=lls.__getitem__) == gold)
        correct_norm += int(max(range(len(norm)), key=norm.__getitem__) == gold)
        if out_lines is not None:
            out_lines.append({"task": os.path.basename(path), "index": i, "format": fmt, "gold": gold,
                              "loglikelihoods": lls})
    return {"task": os.path.basename(path), "n": n, "acc": correct / max(1, n), "acc_norm": correct_norm / max(1, n),
            "num_fewshot": num_fewshot}


def perplexity_windows(ids: list[int], max_len: int) -> Iterator[list[int]]:
    """Consecutive windows of ids, each predicting at most max_len tokens (the first token is never predicted)."""
    for start in range(0, len(ids) - 1, max_len):
        yield ids[start:start + max_len + 1]


def evaluate_perplexity(model: Any, tok: Any, bos: int, eos: int, files: list[str], text_fields: str, max_len: int,
                        device: Any) -> dict:
    import torch

    from tokenizer import encode_texts
    from tokenizer.corpus import SkipCounter, iter_file_documents
    nll, tokens, docs = 0.0, 0, 0
    stats = SkipCounter()
    for path in files:
        for text, _ in iter_file_documents(path, text_fields, stats):
            ids = [bos] + encode_texts(tok, [text])[0] + [eos]
            docs += 1
            for w in perplexity_windows(ids, max_len):
                x = torch.tensor([w[:-1]], dtype=torch.long, device=device)
                with torch.no_grad():
                    logp = torch.log_softmax(model(x)[0].float(), dim=-1)
                y = torch.tensor(w[1:], dtype=torch.long, device=device)
                nll -= float(logp.gather(1, y[:, None]).sum())
                tokens += len(w) - 1
    return {"documents": docs, "tokens": tokens, "nll": nll, "ppl": math.exp(nll / tokens) if tokens else float("nan"),
            "skipped": stats.total}


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
    from utils.errors import exit_code_for
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
        named = exit_code_for(e, prefixed=False)
        if named is None:
            raise
        print(f"eval_lm.py: {named[1]}", file=sys.stderr)
        return named[0]
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
