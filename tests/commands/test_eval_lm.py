"""eval_lm.py (issue 37 item 10): multiple-choice log-likelihoods in the HellaSwag / ARC / PIQA / MMLU jsonl formats
and perplexity on held-out files equal those of the exported model under transformers (the same numbers), and
acc / acc_norm are the argmax of the raw and of the per-character log-likelihoods, as lm-evaluation-harness
scores them. A tiny model and generated sets; nothing downloaded."""
import json
import math
import os

import pytest
import torch

import eval_lm
import export_hf
from model import ModelConfig, Transformer
from utils import checkpoint as ckpt

transformers = pytest.importorskip("transformers")

WORDS = "the cat dog sat ran on a mat log big small red blue and or it is was".split()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from tokenizer.train_tokenizer import train_tokenizer
    d = tmp_path_factory.mktemp("eval")
    with open(d / "c.jsonl", "w", encoding="utf-8") as f:
        for i in range(120):
            f.write(json.dumps({"text": " ".join(WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(12))}) + "\n")
    train_tokenizer(str(d / "c.jsonl"), str(d / "tok"), vocab_size=320)
    meta = json.loads((d / "tok" / "tokenizer_meta.json").read_text())
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=meta["vocab_size"], dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                hidden_dim=64, max_seq_len=48, initializer_range=0.2))
    req = ckpt.SaveRequest(step=1, rank=0, world_size=1, model_state=m.state_dict(), model_config=m.cfg.to_dict(),
                           optimizer_state=None, extra_state={}, trainer_state={},
                           run_config={"lora_rank": 0, "tokenizer_dir": str(d / "tok")})
    ckpt.save_checkpoint(str(d / "run"), req, keep_last=1, log=lambda s: None)
    assert export_hf.main([f"--ckpt={d / 'run'}", f"--out_dir={d / 'hf'}"]) == 0
    return d


def _sentence(i, n):
    return " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(n))


def _task_files(d):
    sets = {
        "hellaswag.jsonl": [{"ctx": _sentence(i, 6), "endings": [_sentence(i + j, 3 + j) for j in range(4)],
                             "label": i % 4} for i in range(4)],
        "arc.jsonl": [{"question": _sentence(i, 5) + "?", "choices": {"text": [_sentence(i + j, 2) for j in range(4)],
                                                                       "label": list("ABCD")}, "answerKey": "ABCD"[i % 4]}
                      for i in range(4)],
        "piqa.jsonl": [{"goal": _sentence(i, 4), "sol1": _sentence(i + 1, 3), "sol2": _sentence(i + 2, 5),
                        "label": i % 2} for i in range(4)],
        "mmlu.jsonl": [{"question": _sentence(i, 7), "choices": [_sentence(i + j, 1) for j in range(4)], "answer": i % 4}
                       for i in range(4)],
    }
    for name, recs in sets.items():
        with open(d / name, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in recs))
    return [str(d / n) for n in sets]


def _hf_loglikelihood(hf, ids, n_cont, max_len):
    x = torch.tensor([ids[:-1][-max_len:]])
    with torch.no_grad():
        logp = torch.log_softmax(hf(x).logits[0].float(), dim=-1)
    return float(logp[-n_cont:].gather(1, torch.tensor(ids[-n_cont:])[:, None]).sum())


def test_choice_loglikelihoods_and_perplexity_equal_the_exported_model_under_transformers(run, tmp_path, capsys):
    from transformers import AutoTokenizer, LlamaForCausalLM
    tasks = _task_files(tmp_path)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": _sentence(i, 40)}) + "\n" for i in range(3)))  # > 48 tokens each
    out, lls = tmp_path / "results.json", tmp_path / "lls.jsonl"
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={','.join(tasks)}", f"--perplexity_files={held}",
                         f"--out={out}", f"--loglikelihoods_out={lls}", "--device=cpu", "--max_seq_len=24"]) == 0
    results = json.loads(out.read_text())
    rows = [json.loads(line) for line in lls.read_text().splitlines()]
    assert [r["format"] for r in rows] == ["hellaswag"] * 4 + ["arc"] * 4 + ["piqa"] * 4 + ["mmlu"] * 4

    hf = LlamaForCausalLM.from_pretrained(str(run / "hf")).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(run / "hf"))
    bos = hf_tok.convert_tokens_to_ids("<s>")
    for path, task in zip(tasks, results["tasks"]):
        mine = [r for r in rows if r["task"] == os.path.basename(path)]
        acc = acc_norm = 0
        for r, (context, choices, gold, _) in zip(mine, eval_lm.read_task(path)):
            want = []
            for choice in choices:  # lm-eval's pair encoding, with the HF tokenizer of the export
                whole = hf_tok(context + choice, add_special_tokens=False).input_ids
                ctx = hf_tok(context, add_special_tokens=False).input_ids
                cont = whole[len(ctx):]
                want.append(_hf_loglikelihood(hf, [bos] + ctx + cont, len(cont), 24))
            assert r["loglikelihoods"] == pytest.approx(want, abs=1e-4), path
            acc += int(max(range(len(want)), key=want.__getitem__) == gold)
            norm = [v / len(c) for v, c in zip(want, choices)]
            acc_norm += int(max(range(len(norm)), key=norm.__getitem__) == gold)
        assert (task["n"], task["acc"], task["acc_norm"]) == (4, acc / 4, acc_norm / 4), path

    nll = tokens = 0
    for i in range(3):
        ids = [bos] + hf_tok(_sentence(i, 40), add_special_tokens=False).input_ids + [hf_tok.convert_tokens_to_ids("</s>")]
        assert len(ids) > 25  # more than one window
        for start in range(0, len(ids) - 1, 24):
            w = ids[start:start + 25]
            nll -= _hf_loglikelihood(hf, w, len(w) - 1, 24)
            tokens += len(w) - 1
    ppl = results["perplexity"]
    assert ppl["tokens"] == tokens and ppl["ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert "[eval] arc.jsonl: acc" in capsys.readouterr().out


def test_bad_task_files_are_one_line(run, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 0}) + "\n" + json.dumps({"q": 1}) + "\n")
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={bad}", "--device=cpu"]) == 3
    assert f"{bad}:2: fits no multiple-choice format (keys: q)" in capsys.readouterr().err
    assert eval_lm.main([f"--ckpt={run / 'run'}", "--device=cpu"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={tmp_path / 'nope.jsonl'}"]) == 2
