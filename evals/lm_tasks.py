"""Scoring a language model the way lm-evaluation-harness does: multiple-choice tasks by log-likelihood from local
jsonl files in the common benchmarks' formats (HellaSwag, ARC, PIQA, MMLU-style, generic), and perplexity on
held-out raw files. Used by the `eval_lm.py` command (a checkpoint) and by the trainer (`--eval_tasks`, the
model as it trains).

Owns: the formats (`mc_request`) and the checks of a task file (`task_file_problem`: the path; `read_task_lines`:
every record, exit 3 naming file:line for content that cannot be scored, exit 2 for a path that is no task file),
lm-eval's context/continuation encoding (`encode_pair`, `encode_requests`), the per-choice log-likelihood (one
forward per request: `choice_loglikelihood`; batched and right-padded: `loglikelihoods`, equal up to float32
rounding), acc / acc_norm (`tally`), and the perplexity windows.
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
    """A task file whose content cannot be scored: invalid UTF-8 or JSON, a record that fits no supported format,
    a field of the wrong type, a non-integer or out-of-range label, an empty choice, no records (exit 3, naming
    file:line)."""
    exit_code, exit_prefix = 3, "data: "


class TaskConfigError(ValueError):
    """A task path that is no task file (missing, a directory, not .jsonl/.json, unreadable), a --num_fewshot
    that leaves nothing to score, a continuation longer than the max sequence length (exit 2, naming the file)."""
    exit_code = 2  # EXIT_BAD_CONFIG, read by utils.errors.exit_code_for


TASK_EXTENSIONS = (".jsonl", ".json")  # one JSON object per line (datasets' to_json writes .json as JSON lines)
DEFAULT_BATCH_SIZE = 16  # log-likelihood requests per forward (eval_lm.py --batch_size)
TARGET_DELIMITER = " "  # lm-eval's target_delimiter: between the context and each choice (all formats but generic)
HELLASWAG_FIELDS = ("activity_label", "ctx_a", "ctx_b", "endings", "label")
_SURROGATE = re.compile("[\ud800-\udfff]")


def task_file_problem(path: str) -> Optional[str]:
    """Why `path` is no task file this module reads (missing, a directory, another extension, unreadable), or
    None. Reads nothing but the file's first byte: the pre-checks' test, before any model is loaded."""
    if not os.path.exists(path):
        return f"{path}: no such file"
    if os.path.isdir(path):
        return f"{path}: is a directory, not a task file (one .jsonl file of records per task)"
    ext = os.path.splitext(path)[1].lower()
    if ext not in TASK_EXTENSIONS:
        hint = (" (export the dataset as JSON lines, e.g. datasets' Dataset.to_json)"
                if ext in (".arrow", ".parquet", ".csv", ".tsv", ".gz", ".zip") else "")
        return (f"{path}: a task file is {' or '.join(TASK_EXTENSIONS)} (one JSON object per line), "
                f"not {ext or 'a file without extension'}{hint}")
    return unreadable(path)


def unreadable(path: str) -> Optional[str]:
    """`path: cannot read: <why>` when its first byte cannot be read (permissions, a broken mount), else None."""
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        return f"{path}: cannot read: {e.strerror or e}"
    return None


def _text(value: Any, what: str) -> str:
    """A string field of a record, or TaskFormatError naming the field."""
    if not isinstance(value, str):
        raise TaskFormatError(f"{what} is {_kind(value)}, not a string")
    if _SURROGATE.search(value):
        raise TaskFormatError(f"{what} holds a lone surrogate (\\u{ord(_SURROGATE.search(value).group()):04x}), "
                              "which no tokenizer encodes")
    return value


def _texts(value: Any, what: str, nonempty: bool = True) -> list[str]:
    """A list of strings (the choices); with `nonempty`, none may be "" (its log-likelihood would be 0: it would
    win every item)."""
    if not isinstance(value, list):
        raise TaskFormatError(f"{what} is {_kind(value)}, not a list of strings")
    out = [_text(v, f"{what}[{i}]") for i, v in enumerate(value)]
    empty = [i for i, v in enumerate(out) if not v] if nonempty else []
    if empty:
        raise TaskFormatError(f"{what}[{empty[0]}] is an empty string: a choice must have text to score")
    return out


def _label(value: Any, what: str) -> int:
    """An integer label: an int, an integral float (1.0), or a string of digits ("3", HellaSwag's); anything else
    (0.5, true, null, "B") is refused rather than rounded."""
    if isinstance(value, bool) or value is None:
        raise TaskFormatError(f"{what} is {_kind(value)}, not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    raise TaskFormatError(f"{what} is {_kind(value)}, not an integer")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    shown = json.dumps(value, ensure_ascii=False) if isinstance(value, (bool, int, float, str)) else ""
    name = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)
    return f"{name} {shown[:40]}" if shown else name


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
    label, ctx_a, ctx_b = (_text(rec[k], k) for k in ("activity_label", "ctx_a", "ctx_b"))
    endings = _texts(rec["endings"], "endings", nonempty=False)  # each is scored as " " + ending: never empty
    query = hellaswag_preprocess(label + ": " + ctx_a + " " + ctx_b.capitalize())
    return query, [TARGET_DELIMITER + hellaswag_preprocess(e) for e in endings], _label(rec["label"], "label")


def mc_request(rec: Any) -> tuple[str, list[str], int, str]:
    """(context, choices, gold index, format name) of one multiple-choice record; TaskFormatError otherwise
    (a field of the wrong type, an empty choice, a label that is no integer or names no choice)."""
    if not isinstance(rec, dict):
        raise TaskFormatError(f"a record is {_kind(rec)}, not an object")
    d = TARGET_DELIMITER
    if "endings" in rec and ("ctx_a" in rec or "ctx" in rec):
        req = (*hellaswag_request(rec), "hellaswag")
    elif "goal" in rec and "sol1" in rec:
        if "sol2" not in rec or "label" not in rec:
            raise TaskFormatError(f"a PIQA record (goal, sol1) lacks {'sol2' if 'sol2' not in rec else 'label'}")
        sols = [_text(rec[k], k) for k in ("sol1", "sol2")]
        goal = _text(rec["goal"], "goal")
        req = (f"Question: {goal}\nAnswer:", [d + s for s in sols], _label(rec["label"], "label"), "piqa")
    elif "question" in rec and isinstance(rec.get("choices"), dict) and "answerKey" in rec:
        labels = _texts(rec["choices"].get("label"), "choices.label")
        texts = _texts(rec["choices"].get("text"), "choices.text", nonempty=False)  # scored as " " + text
        if len(labels) != len(texts):
            raise TaskFormatError(f"choices.label has {len(labels)} entries, choices.text {len(texts)}")
        key = rec["answerKey"]
        key = str(key) if isinstance(key, int) and not isinstance(key, bool) else _text(key, "answerKey")
        # lm-eval: choices.label.index(answerKey) (lettered, or numbered "1".."4"); a numbered key among lettered
        # labels is A..D
        if key in labels:
            gold = labels.index(key)
        elif key.isdigit():
            gold = int(key) - 1
        else:
            raise TaskFormatError(f"answerKey {key!r} is none of the labels {labels}")
        req = (f"Question: {_text(rec['question'], 'question')}\nAnswer:", [d + t for t in texts], gold, "arc")
    elif "question" in rec and isinstance(rec.get("choices"), list) and "answer" in rec:
        choices = _texts(rec["choices"], "choices", nonempty=False)  # listed in the prompt; scored as " A", ...
        if len(choices) > len(LETTERS):
            raise TaskFormatError(f"an MMLU-style record has {len(choices)} choices; at most {len(LETTERS)} (A..J)")
        body = "".join(f"\n{LETTERS[i]}. {c}" for i, c in enumerate(choices))
        ans = rec["answer"]
        if isinstance(ans, str) and not ans.strip().isdigit():
            if ans not in LETTERS[:len(choices)] or not ans:
                raise TaskFormatError(f"answer {ans!r} is no letter of the {len(choices)} choices "
                                      f"({LETTERS[:len(choices)]})")
            gold = LETTERS.index(ans)
        else:
            gold = _label(ans, "answer")
        question = _text(rec["question"], "question")
        req = (f"{question.strip()}{body}\nAnswer:", [d + LETTERS[i] for i in range(len(choices))], gold, "mmlu")
    elif ("context" in rec or "query" in rec) and "choices" in rec:
        key = "context" if "context" in rec else "query"
        gkey = "label" if "label" in rec else "gold"
        if gkey not in rec:
            raise TaskFormatError("a generic record (context/query + choices) lacks its label (or gold)")
        req = (_text(rec[key], key), _texts(rec["choices"], "choices"), _label(rec[gkey], gkey), "generic")
    else:
        raise TaskFormatError(f"fits no multiple-choice format (keys: {', '.join(sorted(map(str, rec)))}); "
                              "see python eval_lm.py --help")
    if not 0 <= req[2] < len(req[1]):
        raise TaskFormatError(f"gold index {req[2]} outside its {len(req[1])} choices")
    return req


def read_task_lines(path: str) -> tuple[list[tuple[str, list[str], int, str]], list[int]]:
    """(the records' requests, the line of each) of a task file: one JSON object per line, blank lines skipped.
    TaskConfigError (exit 2) for a path that is no task file, TaskFormatError (exit 3, file:line) for content
    that cannot be scored, an empty file included."""
    problem = task_file_problem(path)
    if problem:
        raise TaskConfigError(problem)
    out, lines = [], []
    try:
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    raise TaskFormatError(f"{path}:{lineno}: invalid UTF-8 (byte {e.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    req = mc_request(json.loads(line))
                except (ValueError, KeyError, TypeError, IndexError, RecursionError) as e:
                    msg = e.args[0] if isinstance(e, TaskFormatError) else f"{type(e).__name__}: {e}"
                    raise TaskFormatError(f"{path}:{lineno}: {msg}") from None
                out.append(req)
                lines.append(lineno)
    except OSError as e:
        raise TaskConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    if not out:
        raise TaskFormatError(f"{path}: no records (an empty task file): nothing to score")
    return out, lines


def read_task(path: str) -> list[tuple[str, list[str], int, str]]:
    """The (context, choices, gold, format) requests of a task file (read_task_lines without the lines)."""
    return read_task_lines(path)[0]


def check_fewshot(path: str, n_records: int, num_fewshot: int) -> None:
    """TaskConfigError (exit 2) when --num_fewshot leaves no record of the file to score."""
    if num_fewshot >= n_records:
        raise TaskConfigError(f"{path}: --num_fewshot={num_fewshot} leaves nothing to score: the file has "
                              f"{n_records} record(s) and the first {num_fewshot} are the few-shot examples")


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
    """sum log p(ids[-n_cont:] | everything before), the input left-truncated to max_len tokens (lm-eval): one
    request, one forward (the unbatched reference that `loglikelihoods` equals)."""
    import torch
    inp = ids[:-1][-max_len:]
    x = torch.tensor([inp], dtype=torch.long, device=device)
    with torch.no_grad():
        logp = torch.log_softmax(model(x)[0].float(), dim=-1)
    targets = torch.tensor(ids[-n_cont:], dtype=torch.long, device=device)
    return float(logp[-n_cont:].gather(1, targets[:, None]).sum())


def loglikelihoods(model: Any, requests: list[tuple[list[int], int]], max_len: int, device: Any,
                   batch_size: int = DEFAULT_BATCH_SIZE, progress: Any = None, tuner: Any = None) -> list[float]:
    """choice_loglikelihood of every (ids, n) request, batched: the inputs (ids[:-1] left-truncated to max_len)
    sorted longest first (as lm-eval's Collator), `batch_size` per forward, right-padded to the batch's longest.
    The model is causal, so a row's real positions never see its padding; each row's sum is taken over its own
    last n real positions (the LM head runs on those alone: logits_to_keep as a mask), so the values equal the
    unbatched ones up to float32 rounding (matrix products of other shapes). Returned in the requests' order;
    `progress.update(k)` after each batch (a tqdm bar).
    `tuner` (utils/threads.ThreadTuner): the CPU thread count of each batch, chosen by measuring (the values
    differ by float32 rounding between counts, as between batch sizes)."""
    import time

    import torch
    inputs = [ids[:-1][-max_len:] for ids, _ in requests]
    for (ids, n), inp in zip(requests, inputs):
        if not 1 <= n <= len(inp):
            raise ValueError(f"a request scores {n} of its {len(inp)} input tokens")
    order = sorted(range(len(requests)), key=lambda i: -len(inputs[i]))
    out = [0.0] * len(requests)
    with torch.no_grad():
        for start in range(0, len(order), max(1, int(batch_size))):
            rows = order[start:start + max(1, int(batch_size))]
            if tuner is not None and tuner.threads_for_next_step() != torch.get_num_threads():
                torch.set_num_threads(tuner.threads_for_next_step())
            t0 = time.perf_counter()
            width = len(inputs[rows[0]])
            x = torch.zeros((len(rows), width), dtype=torch.long)
            keep = torch.zeros((len(rows), width), dtype=torch.bool)
            targets = []
            for r, i in enumerate(rows):
                (ids, n), length = requests[i], len(inputs[i])
                x[r, :length] = torch.tensor(inputs[i], dtype=torch.long)
                keep[r, length - n:length] = True
                targets.extend(ids[-n:])
            # the LM head on the scored positions only ([sum n, V], row by row): a multiple-choice context's
            # positions and the padding need no logits
            logits = model(x.to(device), logits_to_keep=keep.to(device))
            nll = torch.nn.functional.cross_entropy(logits.float(), torch.tensor(targets, device=logits.device),
                                                    reduction="none")
            sums = [-part.sum() for part in nll.split([requests[i][1] for i in rows])]
            for i, v in zip(rows, torch.stack(sums).tolist()):  # one device-to-host copy per batch
                out[i] = v
            if tuner is not None:
                tuner.record(time.perf_counter() - t0, sum(len(inputs[i]) for i in rows))
            if progress is not None:
                progress.update(len(rows))
    return out


def choice_chars(continuation: str, fmt: str) -> int:
    """acc_norm's divisor: the choice's length in characters without the target delimiter (lm-eval divides by
    len(doc_to_choice), the choice before " " is put in front); the generic format's choices have none."""
    return len(continuation) - (0 if fmt == "generic" else len(TARGET_DELIMITER))


def encode_requests(tok: Any, bos: int, reqs: list, max_len: int, where: Optional[list[str]] = None
                    ) -> list[list[tuple[list[int], int]]]:
    """Per record, per choice, the (ids, n_cont) request: `<s> + context + continuation` ids (encode_pair) and
    the continuation's token count. `where` (each record's "file:line") names a record whose continuation is no
    token (TaskFormatError, exit 3) or longer than max_len (TaskConfigError, exit 2): checked here, before any
    forward."""
    out = []
    for i, (context, choices, _, _) in enumerate(reqs):
        item = []
        for j, choice in enumerate(choices):
            ctx, cont = encode_pair(tok, context, choice)
            at = where[i] if where else f"record {i + 1}"
            if not cont:
                raise TaskFormatError(f"{at}: choice {j} ({choice!r}) encodes to no token: nothing to score")
            if len(cont) > max_len:
                raise TaskConfigError(f"{at}: choice {j} is {len(cont)} tokens, more than the {max_len} a forward "
                                      "holds (raise --max_seq_len or shorten the choice)")
            item.append(([bos] + ctx + cont, len(cont)))
        out.append(item)
    return out


def tally(reqs: list, lls: list[list[float]], out_lines: Optional[list] = None, task: str = "") -> dict:
    """acc and acc_norm of the per-choice log-likelihoods `lls` of (context, choices, gold, format) requests."""
    n = correct = correct_norm = 0
    for i, ((_, choices, gold, fmt), item) in enumerate(zip(reqs, lls)):
        norm = [ll / max(1, choice_chars(c, fmt)) for ll, c in zip(item, choices)]
        n += 1
        correct += int(max(range(len(item)), key=item.__getitem__) == gold)
        correct_norm += int(max(range(len(norm)), key=norm.__getitem__) == gold)
        if out_lines is not None:
            out_lines.append({"task": task, "index": i, "format": fmt, "gold": gold, "loglikelihoods": list(item)})
    return {"n": n, "acc": correct / max(1, n), "acc_norm": correct_norm / max(1, n)}


def score_encoded(model: Any, encoded: list[list[tuple[list[int], int]]], max_len: int, device: Any,
                  batch_size: int = DEFAULT_BATCH_SIZE, progress: Any = None) -> list[list[float]]:
    """The log-likelihoods of encode_requests' output, per record and choice, in batches (loglikelihoods)."""
    flat = [r for item in encoded for r in item]
    values = loglikelihoods(model, flat, max_len, device, batch_size, progress)
    out, k = [], 0
    for item in encoded:
        out.append(values[k:k + len(item)])
        k += len(item)
    return out


def score_requests(model: Any, tok: Any, bos: int, reqs: list, max_len: int, device: Any,
                   out_lines: Optional[list] = None, task: str = "", batch_size: int = DEFAULT_BATCH_SIZE,
                   progress: Any = None, where: Optional[list[str]] = None) -> dict:
    """acc and acc_norm of `model` over (context, choices, gold, format) requests, scored in batches."""
    encoded = encode_requests(tok, bos, reqs, max_len, where)
    return tally(reqs, score_encoded(model, encoded, max_len, device, batch_size, progress), out_lines, task)


FEWSHOT_DELIMITER = "\n\n"


def fewshot_requests(reqs: list, num_fewshot: int) -> list:
    """The requests scored with `num_fewshot` examples: the first num_fewshot records are left out of the scoring
    and prefix every other context, each as `context + gold continuation` followed by FEWSHOT_DELIMITER (lm-eval's
    default few-shot format: examples joined by the delimiter, which also ends them; no description)."""
    shots, rest = reqs[:num_fewshot], reqs[num_fewshot:]
    prefix = "".join(c + ch[g] + FEWSHOT_DELIMITER for c, ch, g, _ in shots)
    return [(prefix + c, ch, g, fmt) for c, ch, g, fmt in rest]


def evaluate_task(model: Any, tok: Any, bos: int, path: str, max_len: int, device: Any, num_fewshot: int = 0,
                  out_lines: Optional[list] = None, batch_size: int = DEFAULT_BATCH_SIZE, progress: Any = None) -> dict:
    reqs, lines = read_task_lines(path)
    check_fewshot(path, len(reqs), num_fewshot)
    where = [f"{path}:{ln}" for ln in lines[num_fewshot:]]
    res = score_requests(model, tok, bos, fewshot_requests(reqs, num_fewshot), max_len, device, out_lines,
                         os.path.basename(path), batch_size, progress, where)
    return {"task": os.path.basename(path), **res, "num_fewshot": num_fewshot}


def perplexity_windows(ids: list[int], max_len: int) -> Iterator[list[int]]:
    """Consecutive windows of ids, each predicting at most max_len tokens (the first token is never predicted)."""
    for start in range(0, len(ids) - 1, max_len):
        yield ids[start:start + max_len + 1]


def perplexity_requests(tok: Any, bos: int, eos: int, files: list[str], text_fields: str, max_len: int
                        ) -> tuple[list[tuple[list[int], int]], int, int]:
    """(the (window, tokens predicted) requests of every document's windows, documents, skipped records)."""
    from tokenizer import encode_texts
    from tokenizer.corpus import SkipCounter
    from tokenizer.documents import iter_file_documents
    reqs, docs = [], 0
    stats = SkipCounter()
    for path in files:
        for text, _ in iter_file_documents(path, text_fields, stats):
            ids = [bos] + encode_texts(tok, [text])[0] + [eos]
            docs += 1
            reqs.extend((w, len(w) - 1) for w in perplexity_windows(ids, max_len))
    return reqs, docs, stats.total


def perplexity_result(reqs: list[tuple[list[int], int]], lls: list[float], docs: int, skipped: int) -> dict:
    nll = 0.0
    for ll in lls:  # summed in the windows' order, whatever order they were scored in
        nll -= ll
    tokens = sum(n for _, n in reqs)
    return {"documents": docs, "tokens": tokens, "nll": nll, "ppl": math.exp(nll / tokens) if tokens else float("nan"),
            "skipped": skipped}


def evaluate_perplexity(model: Any, tok: Any, bos: int, eos: int, files: list[str], text_fields: str, max_len: int,
                        device: Any, batch_size: int = DEFAULT_BATCH_SIZE, progress: Any = None) -> dict:
    reqs, docs, skipped = perplexity_requests(tok, bos, eos, files, text_fields, max_len)
    return perplexity_result(reqs, loglikelihoods(model, reqs, max_len, device, batch_size, progress), docs, skipped)


class TaskEvaluator:
    """The trainer's `--eval_tasks`: multiple-choice task files scored on the model as it trains (rank 0, at
    every evaluation), logged as `val_<task>_acc` / `val_<task>_acc_norm` beside the validation loss. The files
    are read, checked and encoded when the run starts (TaskFormatError exit 3 / TaskConfigError exit 2, naming
    file:line; the trainer's pre-check reads them too, before torch); `limit` > 0 scores only each file's first
    `limit` records (an evaluation of thousands of records per step is the user's choice). `batch_size`
    requests per forward (the trainer passes its --batch_size: a batch that fits training fits a no-grad
    forward)."""

    def __init__(self, paths: list[str], tokenizer_dir: str, max_len: int, limit: int = 0,
                 batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        from tokenizer.loading import load_tokenizer, load_tokenizer_meta
        self.tok = load_tokenizer(tokenizer_dir)
        self.bos = int(load_tokenizer_meta(tokenizer_dir)["special_tokens"]["bos"]["id"])
        self.max_len, self.limit, self.batch_size = int(max_len), int(limit), max(1, int(batch_size))
        self.tasks = {}
        for path in paths:
            name = os.path.splitext(os.path.basename(path))[0]
            reqs, lines = read_task_lines(path)
            if self.limit > 0:
                reqs, lines = reqs[:self.limit], lines[:self.limit]
            encoded = encode_requests(self.tok, self.bos, reqs, self.max_len, [f"{path}:{ln}" for ln in lines])
            self.tasks[name] = (path, reqs, encoded)

    def run(self, model: Any, device: Any) -> dict:
        """{val_<task>_acc, val_<task>_acc_norm} of `model` (put in eval mode and back; no gradients)."""
        was = model.training
        model.eval()
        out = {}
        try:
            for name, (path, reqs, encoded) in self.tasks.items():
                res = tally(reqs, score_encoded(model, encoded, self.max_len, device, self.batch_size))
                out[f"val_{name}_acc"], out[f"val_{name}_acc_norm"] = res["acc"], res["acc_norm"]
        finally:
            model.train(was)
        return out
