"""eval_lm.py against lm-evaluation-harness itself, on the same exported model and the same local task files.

    python scripts/compare_lm_eval.py --lm_eval_python=/tmp/lmeval-venv/bin/python [--num_fewshot=0,2]

Builds a tiny model with this project's code (a byte-level BPE tokenizer trained on a slice of the bundled corpus,
a Transformer with random weights, a checkpoint, `export_hf.py`), writes small HellaSwag / ARC / PIQA / MMLU /
generic jsonl files (the raw fields of each benchmark; WikiHow brackets, numbered ARC keys, contexts with a
trailing space), and scores them with `eval_lm.py` here and with lm-eval's `HFLM` in the other interpreter, which
runs lm-eval's own task configs (hellaswag.yaml with its utils.process_docs, arc_easy.yaml, piqa.yaml, mmlu's
_default_template_yaml; generic: a config written here with target_delimiter "") pointed at the local files
(`dataset_path: json`, `data_files`). Few-shot: the first k records of a file are lm-eval's few-shot split
(sampler first_n), the rest its test split, as eval_lm.py splits them.

Prints, per task and k: n, both accuracies (acc / acc_norm), whether every (context, continuation) request is
the same string, and the max per-choice |loglik difference|. Exit 1 where a request, an accuracy or a
log-likelihood (beyond --tol) differs. lm-eval lives in its own virtual environment, never in this project's:
    python3 -m venv /tmp/lmeval-venv && /tmp/lmeval-venv/bin/pip install "lm-eval[hf]==0.4.13" torch==2.13.0 \\
        transformers==5.24.0
Nothing is downloaded (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set for the lm-eval run).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MAX_LEN = 96  # both sides: left-truncation of the longer few-shot contexts is part of what is compared

WORDS = ("the man woman dog cat child team player car house garden kitchen water ball rope roof snow grill "
         "knife bread paint wall floor window door tree road bike boat river hill chair table shirt box").split()
VERBS = "runs sits holds takes puts cuts opens paints cleans throws pulls climbs washes turns lifts".split()

LM_EVAL_DRIVER = r'''
import json, sys
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
cfg = json.load(open(sys.argv[1]))
out = simple_evaluate(model="hf", model_args=cfg["model_args"], tasks=cfg["tasks"], num_fewshot=cfg["num_fewshot"],
                      batch_size=1, device="cpu", log_samples=True, bootstrap_iters=0,
                      task_manager=TaskManager(include_path=cfg["include_path"]))
res = {"results": out["results"], "samples": {}}
for task, samples in out["samples"].items():
    rows = []
    for s in samples:
        args = s["arguments"]
        if isinstance(args, dict):
            args = [[a["arg_0"], a["arg_1"]] for a in args.values()]
        rows.append({"doc_id": s["doc_id"], "requests": [list(a[:2]) for a in args],
                     "loglikelihoods": [float(r[0][0]) if isinstance(r[0], (list, tuple)) else float(r[0])
                                        for r in s["resps"]]})
    res["samples"][task] = rows
json.dump(res, open(sys.argv[2], "w"))
'''


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS + VERBS) for _ in range(n))


def task_records(n: int = 10) -> dict[str, list[dict]]:
    """Deterministic records in each benchmark's raw jsonl fields."""
    rng = random.Random(0)
    hs, arc, piqa, mmlu, gen = [], [], [], [], []
    for i in range(n):
        wikihow = i % 3 == 1
        ctx_a = (f"[header] How to {rng.choice(VERBS)} a {rng.choice(WORDS)} [title] {_phrase(rng, 4).capitalize()}."
                 if wikihow else f"The {rng.choice(WORDS)} {rng.choice(VERBS)} the {_phrase(rng, 3)}.")
        ctx_b = "" if i % 4 == 3 else (f"[step] {_phrase(rng, 3).upper()}" if wikihow else _phrase(rng, 2))
        endings = [_phrase(rng, 3 + j) + (" [substeps] " + _phrase(rng, 2) if wikihow and j == 1 else "")
                   + ("  " + _phrase(rng, 1) + "." if j == 2 else ".") for j in range(4)]
        hs.append({"ind": i, "activity_label": _phrase(rng, 2).title(), "ctx_a": ctx_a, "ctx_b": ctx_b,
                   "ctx": f"{ctx_a} {ctx_b}", "endings": endings, "label": str(rng.randrange(4))})
        k = 3 + i % 3
        labels = [str(j + 1) for j in range(k)] if i % 3 == 2 else list("ABCDE"[:k])
        arc.append({"id": f"q{i}", "question": f"Which {rng.choice(WORDS)} {rng.choice(VERBS)} the {_phrase(rng, 2)}?",
                    "choices": {"text": [_phrase(rng, 2 + j % 2) for j in range(k)], "label": labels},
                    "answerKey": labels[rng.randrange(k)]})
        piqa.append({"goal": f"How do I {rng.choice(VERBS)} a {_phrase(rng, 2)}?", "sol1": _phrase(rng, 6),
                     "sol2": _phrase(rng, 7), "label": rng.randrange(2)})
        mmlu.append({"question": f"  What {rng.choice(VERBS)} the {_phrase(rng, 3)}? ", "subject": "misc",
                     "choices": [_phrase(rng, 1 + j % 2) for j in range(4)], "answer": rng.randrange(4)})
        gen.append({"context": f"The {_phrase(rng, 3)}" + (" " if i % 2 else ""),
                    "choices": [(" " if i % 2 == 0 else "") + _phrase(rng, 1 + j) for j in range(3)],
                    "label": rng.randrange(3)})
    return {"hellaswag": hs, "arc": arc, "piqa": piqa, "mmlu": mmlu, "generic": gen}


def build_model(work: str) -> tuple[str, str]:
    """(run dir, exported HF dir) of a tiny random model with a tokenizer trained here."""
    import torch

    import export_hf
    from model import ModelConfig, Transformer
    from scripts.corpus_slice import write_corpus_slice
    from tokenizer.train_tokenizer import train_tokenizer
    from checkpoint.plain import SaveRequest, save_checkpoint
    corpus = write_corpus_slice(os.path.join(work, "corpus"), docs=40, chars=1500)
    tok_dir = os.path.join(work, "tok")
    train_tokenizer(corpus, tok_dir, vocab_size=512)
    meta = json.load(open(os.path.join(tok_dir, "tokenizer_meta.json")))
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=meta["vocab_size"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                                hidden_dim=128, max_seq_len=256, initializer_range=0.2))
    run = os.path.join(work, "run")
    req = SaveRequest(step=1, rank=0, world_size=1, model_state=m.state_dict(), model_config=m.cfg.to_dict(),
                      optimizer_state=None, extra_state={}, trainer_state={},
                      run_config={"lora_rank": 0, "tokenizer_dir": tok_dir})
    save_checkpoint(run, req, keep_last=1, log=lambda s: None)
    hf = os.path.join(work, "hf")
    assert export_hf.main([f"--ckpt={run}", f"--out_dir={hf}"]) == 0
    return run, hf


def lm_eval_configs(lm_eval_python: str, tasks_dir: str, data: dict[str, tuple[str, str]]) -> list[str]:
    """Task YAMLs that include lm-eval's own configs, pointed at local files; their names."""
    pkg = subprocess.run([lm_eval_python, "-c", "import lm_eval, os; print(os.path.dirname(lm_eval.__file__))"],
                         check=True, capture_output=True, text=True).stdout.strip()
    base = {"hellaswag": "hellaswag/hellaswag.yaml", "arc": "arc/arc_easy.yaml", "piqa": "piqa/piqa.yaml",
            "mmlu": "mmlu/default/_default_template_yaml"}
    os.makedirs(tasks_dir, exist_ok=True)
    names = []
    for fmt, (shots, rest) in data.items():
        name = f"cmp_{fmt}"
        lines = [f"task: {name}"]
        if fmt in base:
            lines.insert(0, f"include: {os.path.join(pkg, 'tasks', base[fmt])}")
        else:  # the generic format: context and choices as written, nothing between them
            lines += ["output_type: multiple_choice", 'doc_to_text: "{{context}}"', "doc_to_choice: choices",
                      "doc_to_target: label", 'target_delimiter: ""', "metric_list:",
                      "  - metric: acc", "  - metric: acc_norm"]
        lines += ["tag: null", "dataset_path: json", "dataset_name: null", "dataset_kwargs:", "  data_files:",
                  f"    train: {json.dumps(shots)}", f"    test: {json.dumps(rest)}", "training_split: train",
                  "validation_split: null", "test_split: test", "fewshot_split: train", "fewshot_config:",
                  "  sampler: first_n"]
        if fmt == "mmlu":  # the template scores acc only; eval_lm reports both
            lines += ["metric_list:", "  - metric: acc", "  - metric: acc_norm"]
        with open(os.path.join(tasks_dir, f"{name}.yaml"), "w") as f:
            f.write("\n".join(lines) + "\n")
        names.append(name)
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lm_eval_python", required=True, help="the python of a virtual environment with lm-eval")
    p.add_argument("--num_fewshot", default="0,2", help="comma-separated k values")
    p.add_argument("--work_dir", default=None, help="default: a temporary directory")
    p.add_argument("--tol", type=float, default=1e-4, help="max |loglik difference| accepted")
    args = p.parse_args(argv)
    work = args.work_dir or tempfile.mkdtemp(prefix="compare_lm_eval_")
    os.makedirs(work, exist_ok=True)
    from evals.lm_tasks import fewshot_requests, read_task
    _, hf = build_model(work)
    records = task_records()
    ok = True
    print(f"model {hf}; max_length {MAX_LEN}; lm-eval from {args.lm_eval_python}")
    print(f"{'task':<10} {'k':>2} {'n':>3}  {'ours acc/acc_norm':>18}  {'lm-eval acc/acc_norm':>20}  "
          f"{'same requests':>13}  {'max |dll|':>9}")
    worst = 0.0
    for k in [int(x) for x in args.num_fewshot.split(",") if x != ""]:
        kdir = os.path.join(work, f"k{k}")
        os.makedirs(kdir, exist_ok=True)
        full, split = {}, {}
        for fmt, recs in records.items():
            paths = []
            # all: eval_lm's file; shots / rest: lm-eval's few-shot and test splits (k = 0: a shots file all the same,
            # never read, since the task configs declare a training split)
            for part, rs in (("all", recs), ("shots", recs[:k] or recs[:1]), ("rest", recs[k:])):
                path = os.path.join(kdir, f"{fmt}_{part}.jsonl")
                with open(path, "w", encoding="utf-8") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rs)
                paths.append(path)
            full[fmt], split[fmt] = paths[0], (paths[1], paths[2])
        ours_out, ours_lls = os.path.join(kdir, "ours.json"), os.path.join(kdir, "ours_lls.jsonl")
        subprocess.run([sys.executable, os.path.join(ROOT, "eval_lm.py"), f"--ckpt={os.path.join(work, 'run')}",
                        f"--tasks={','.join(full.values())}", f"--num_fewshot={k}", f"--max_seq_len={MAX_LEN}",
                        "--device=cpu", f"--out={ours_out}", f"--loglikelihoods_out={ours_lls}"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        ours = {os.path.basename(t["task"]).rsplit("_all.jsonl", 1)[0]: t for t in json.load(open(ours_out))["tasks"]}
        rows: dict[str, list] = {}
        for line in open(ours_lls):
            r = json.loads(line)
            rows.setdefault(r["task"].rsplit("_all.jsonl", 1)[0], []).append(r)
        names = lm_eval_configs(args.lm_eval_python, os.path.join(kdir, "lm_eval_tasks"), split)
        cfg = {"model_args": {"pretrained": hf, "dtype": "float32", "add_bos_token": True, "max_length": MAX_LEN},
               "tasks": names, "num_fewshot": k, "include_path": os.path.join(kdir, "lm_eval_tasks")}
        cfg_path, drv, theirs_path = (os.path.join(kdir, n) for n in ("cfg.json", "driver.py", "lm_eval.json"))
        json.dump(cfg, open(cfg_path, "w"))
        open(drv, "w").write(LM_EVAL_DRIVER)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": os.path.join(work, "hf_datasets_cache"), "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([args.lm_eval_python, drv, cfg_path, theirs_path], env=env, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            print(proc.stdout[-4000:], proc.stderr[-8000:], sep="\n", file=sys.stderr)
            return 2
        theirs = json.load(open(theirs_path))
        for fmt in records:
            name = f"cmp_{fmt}"
            res, samples = theirs["results"][name], sorted(theirs["samples"][name], key=lambda s: s["doc_id"])
            mine = sorted(rows[fmt], key=lambda r: r["index"])
            want = [[[c, ch] for ch in choices] for c, choices, _, _ in fewshot_requests(read_task(full[fmt]), k)]
            same = [s["requests"] for s in samples] == want and len(samples) == len(mine)
            diff = max(abs(a - b) for s, r in zip(samples, mine)
                       for a, b in zip(s["loglikelihoods"], r["loglikelihoods"]))
            worst = max(worst, diff)
            o, t = ours[fmt], (res.get("acc,none"), res.get("acc_norm,none"))
            good = same and diff <= args.tol and (o["acc"], o["acc_norm"]) == t
            ok &= good
            print(f"{fmt:<10} {k:>2} {o['n']:>3}  {o['acc']:>8.4f} / {o['acc_norm']:.4f}  {t[0]:>10.4f} / {t[1]:.4f}  "
                  f"{'yes' if same else 'NO':>13}  {diff:>9.2e}{'' if good else '  <- differs'}")
    print(f"max per-choice |loglik difference| {worst:.2e} (tolerance {args.tol:g}); "
          f"{'all requests and accuracies equal' if ok else 'DIFFERENCES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
