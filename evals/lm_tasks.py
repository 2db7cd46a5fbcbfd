"""Scoring a language model the way lm-evaluation-harness does: multiple-choice tasks by log-likelihood from local
jsonl files in the common benchmarks' formats (HellaSwag, ARC, PIQA, MMLU-style, generic), and perplexity on
held-out raw files. Used by the `eval_lm.py` command (a checkpoint) and by the trainer (`--eval_tasks`, the
model as it trains).

Owns: the formats (`mc_request`), lm-eval's context/continuation encoding (`encode_pair`), the per-choice
log-likelihood, acc / acc_norm, and the perplexity windows.
Must never: change the model (it runs under no_grad; the caller puts it in eval mode), download anything, or
read a task file outside the paths it is given.
"""
from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Iterator, Optional

LETTERS = "ABCDEFGHIJ"


class TaskFormatError(ValueError):
    """A task record that fits no supported format (exit 3, naming file:line)."""
    exit_code, exit_prefix = 3, "data: "


TARGET_DELIMITER = " "  # lm-eval's target_delimiter: between the context and each choice (all formats but generic)
HELLASWAG_FIELDS = ("activity_label", "ctx_a", "ctx_b", "endings", "label")


def hellaswag_preprocess(text: str) -> str:
    """lm-eval's hellaswag `preprocess`: strip, " [title]" -> ". ", drop WikiHow's "[...]" tags, "  " -> " "."""
    text = text.strip()
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_request(rec: dict) -> tuple[str, list[str], int]:
    """lm-eval's hellaswag prompt: query `activity_label: ctx_a Ctx_b` (str.capitalize, as lm-eval), the endings
    preprocessed, each continuation " " + ending (the target delimiter)."""
    missing = [k for k in HELLASWAG_FIELDS if k not in rec]
    if missing:
        raise TaskFormatError(f"a HellaSwag record (endings) lacks {', '.join(missing)}: lm-eval's prompt is "
                              "activity_label + ': ' + ctx_a + ' ' + ctx_b.capitalize()")
    query = hellaswag_preprocess(rec["activity_label"] + ": " + rec["ctx_a"] + " " + rec["ctx_b"].capitalize())
    return query, [TARGET_DELIMITER + hellaswag_preprocess(e) for e in rec["endings"]], int(rec["label"])


def mc_request(rec: Any) -> tuple[str, list[str], int, str]:
    """(context, choices, gold index, format name) of one multiple-choice record; TaskFormatError otherwise."""
    if not isinstance(rec, dict):
        raise TaskFormatError(f"a record is a {type(rec).__name__}, not an object")
    d = TARGET_DELIMITER
    if "endings" in rec and ("ctx_a" in rec or "ctx" in rec):
        return (*hellaswag_request(rec), "hellaswag")
    if "goal" in rec and "sol1" in rec:
        return f"Question: {rec['goal']}\nAnswer:", [d + rec["sol1"], d + rec["sol2"]], int(rec["label"]), "piqa"
    if "question" in rec and isinstance(rec.get("choices"), dict) and "answerKey" in rec:
        labels, texts = list(rec["choices"]["label"]), list(rec["choices"]["text"])
        key = str(rec["answerKey"])
        # lm-eval: choices.label.index(answerKey) (lettered, or numbered "1".."4"); a numbered key among lettered
        # labels is A..D
        gold = labels.index(key) if key in labels else int(key) - 1
        return f"Question: {rec['question']}\nAnswer:", [d + t for t in texts], gold, "arc"
    if "question" in rec and isinstance(rec.get("choices"), list) and "answer" in rec:
        choices = rec["choices"]
        body = "".join(f"\n{LETTERS[i]}. {c}" for i, c in enumerate(choices))
        ans = rec["answer"]
        gold = LETTERS.index(ans) if isinstance(ans, str) else int(ans)
        return f"{rec['question'].strip()}{body}\nAnswer:", [d + LETTERS[i] for i in range(len(choices))], gold, "mmlu"
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


def choice_chars(continuation: str, fmt: str) -> int:
    """acc_norm's divisor: the choice's length in characters without the target delimiter (lm-eval divides by
    len(doc_to_choice), the choice before " " is put in front); the generic format's choices have none."""
    return len(continuation) - (0 if fmt == "generic" else len(TARGET_DELIMITER))


def score_requests(model: Any, tok: Any, bos: int, reqs: list, max_len: int, device: Any,
                   out_lines: Optional[list] = None, task: str = "") -> dict:
    """acc and acc_norm of `model` over (context, choices, gold, format) requests."""
    n = correct = correct_norm = 0
    for i, (context, choices, gold, fmt) in enumerate(reqs):
        lls = []
        for choice in choices:
            ctx, cont = encode_pair(tok, context, choice)
            lls.append(choice_loglikelihood(model, [bos] + ctx + cont, len(cont), max_len, device))
        norm = [ll / max(1, choice_chars(c, fmt)) for ll, c in zip(lls, choices)]
        n += 1
        correct += int(max(range(len(lls)), key=lls.__getitem__) == gold)
        correct_norm += int(max(range(len(norm)), key=norm.__getitem__) == gold)
        if out_lines is not None:
            out_lines.append({"task": task, "index": i, "format": fmt, "gold": gold, "loglikelihoods": lls})
    return {"n": n, "acc": correct / max(1, n), "acc_norm": correct_norm / max(1, n)}


FEWSHOT_DELIMITER = "\n\n"


def fewshot_requests(reqs: list, num_fewshot: int) -> list:
    """The requests scored with `num_fewshot` examples: the first num_fewshot records are left out of the scoring
    and prefix every other context, each as `context + gold continuation` followed by FEWSHOT_DELIMITER (lm-eval's
    default few-shot format: examples joined by the delimiter, which also ends them; no description)."""
    shots, rest = reqs[:num_fewshot], reqs[num_fewshot:]
    prefix = "".join(c + ch[g] + FEWSHOT_DELIMITER for c, ch, g, _ in shots)
    return [(prefix + c, ch, g, fmt) for c, ch, g, fmt in rest]


def evaluate_task(model: Any, tok: Any, bos: int, path: str, max_len: int, device: Any, num_fewshot: int = 0,
                  out_lines: Optional[list] = None) -> dict:
    reqs = fewshot_requests(read_task(path), num_fewshot)
    res = score_requests(model, tok, bos, reqs, max_len, device, out_lines, os.path.basename(path))
    return {"task": os.path.basename(path), **res, "num_fewshot": num_fewshot}


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


class TaskEvaluator:
    """The trainer's `--eval_tasks`: multiple-choice task files scored on the model as it trains (rank 0, at
    every evaluation), logged as `val_<task>_acc` / `val_<task>_acc_norm` beside the validation loss. The files
    are read and checked when the run starts (TaskFormatError, exit 3, naming file:line); `limit` > 0 scores
    only each file's first `limit` records (an evaluation of thousands of records per step is the user's choice)."""

    def __init__(self, paths: list[str], tokenizer_dir: str, max_len: int, limit: int = 0) -> None:
        from tokenizer.loading import load_tokenizer, load_tokenizer_meta
        self.tok = load_tokenizer(tokenizer_dir)
        self.bos = int(load_tokenizer_meta(tokenizer_dir)["special_tokens"]["bos"]["id"])
        self.max_len, self.limit = int(max_len), int(limit)
        self.tasks = {}
        for path in paths:
            name = os.path.splitext(os.path.basename(path))[0]
            reqs = read_task(path)
            self.tasks[name] = (path, reqs[:self.limit] if self.limit > 0 else reqs)

    def run(self, model: Any, device: Any) -> dict:
        """{val_<task>_acc, val_<task>_acc_norm} of `model` (put in eval mode and back; no gradients)."""
        was = model.training
        model.eval()
        out = {}
        try:
            for name, (path, reqs) in self.tasks.items():
                res = score_requests(model, self.tok, self.bos, reqs, self.max_len, device)
                out[f"val_{name}_acc"], out[f"val_{name}_acc_norm"] = res["acc"], res["acc_norm"]
        finally:
            model.train(was)
        return out
