"""eval_lm.py (issue 37 item 10): the prompts of every format are lm-evaluation-harness's (written out by hand
here: HellaSwag's preprocessed activity_label/ctx_a/ctx_b query, ARC's letter and numbered keys, PIQA, MMLU,
generic; the " " before each continuation, the few-shot blank line), the pair encoding moves a context's trailing
spaces onto the continuation, the multiple-choice log-likelihoods and the perplexity equal those of the exported
model under transformers, and acc / acc_norm are the argmax of the raw and of the per-character log-likelihoods
(characters of the choice without the " " in front), as lm-eval scores them. A tiny model and generated sets;
nothing downloaded. scripts/compare_lm_eval.py runs lm-eval itself against eval_lm.py (docs/eval.md)."""
import json
import math
import os

import pytest
import torch

import eval_lm
import export_hf
from model import ModelConfig, Transformer
from checkpoint.plain import SaveRequest, save_checkpoint

transformers = pytest.importorskip("transformers")

MAX_LEN = 96  # the tasks: the longest contexts are left-truncated, every continuation fits
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
                                hidden_dim=64, max_seq_len=256, initializer_range=0.2))
    req = SaveRequest(step=1, rank=0, world_size=1, model_state=m.state_dict(), model_config=m.cfg.to_dict(),
                      optimizer_state=None, extra_state={}, trainer_state={},
                      run_config={"lora_rank": 0, "tokenizer_dir": str(d / "tok")})
    save_checkpoint(str(d / "run"), req, keep_last=1, log=lambda s: None)
    assert export_hf.main([f"--ckpt={d / 'run'}", f"--out_dir={d / 'hf'}"]) == 0
    return d


def _sentence(i, n):
    return " ".join(WORDS[(i * 5 + k) % len(WORDS)] for k in range(n))


# One record per format with the (context, continuations, gold) lm-evaluation-harness builds for it, written out by
# hand from lm-eval's task configs (hellaswag's utils.process_docs/preprocess, arc_easy, piqa, mmlu's default
# template): query, the target delimiter " " before each choice, the gold index.
HELLASWAG = [
    ({"ind": 24, "activity_label": "Roof shingle removal",
      "ctx_a": "A man is sitting on a roof.", "ctx_b": "he",
      "ctx": "A man is sitting on a roof. he",
      "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                  "is holding a rubik's cube.", "starts pulling up roofing on a roof."], "label": "3"},
     "Roof shingle removal: A man is sitting on a roof. He",
     [" is using wrap to wrap a pair of skis.", " is ripping level tiles off.", " is holding a rubik's cube.",
      " starts pulling up roofing on a roof."], 3),
    ({"activity_label": "Home and Garden", "ctx_a": "[header] How to clean a grill [title] Heat the grill.",
      "ctx_b": "[step] Turn the BURNERS on high", "ctx": "[header] How to clean a grill [title] Heat the grill. "
                                                         "[step] Turn the BURNERS on high",
      "endings": ["Close the lid [title] Wait. ", " Scrub  the grates [substeps] with a brush.",
                  "three   spaces [sub] here", "Done"], "label": 0},
     "Home and Garden: How to clean a grill. Heat the grill. turn the burners on high",
     [" Close the lid. Wait.", " Scrub the grates with a brush.", " three  spaces here", " Done"], 0),
    ({"activity_label": "Cat", "ctx_a": "the cat sat on a mat.", "ctx_b": "", "ctx": "the cat sat on a mat. ",
      "endings": ["it ran", "the dog sat"], "label": 1},
     "Cat: the cat sat on a mat.", [" it ran", " the dog sat"], 1),
]
ARC = [
    ({"id": "Mercury_7175875", "question": "An astronomer observes that a planet rotates faster after a meteorite "
      "impact. Which is the most likely effect of this increase in rotation?",
      "choices": {"text": ["Planetary density will decrease.", "Planetary years will become longer.",
                           "Planetary days will become shorter.", "Planetary gravity will become stronger."],
                  "label": ["A", "B", "C", "D"]}, "answerKey": "C"},
     "Question: An astronomer observes that a planet rotates faster after a meteorite impact. Which is the most "
     "likely effect of this increase in rotation?\nAnswer:",
     [" Planetary density will decrease.", " Planetary years will become longer.",
      " Planetary days will become shorter.", " Planetary gravity will become stronger."], 2),
    ({"question": "Which of these is a mammal?", "choices": {"text": ["shark", "whale", "trout", "eel"],
                                                             "label": ["1", "2", "3", "4"]}, "answerKey": "2"},
     "Question: Which of these is a mammal?\nAnswer:", [" shark", " whale", " trout", " eel"], 1),
    ({"question": "Which is red?", "choices": {"text": ["a sky", "a leaf", "a blood cell"], "label": ["1", "2", "3"]},
      "answerKey": "3"},
     "Question: Which is red?\nAnswer:", [" a sky", " a leaf", " a blood cell"], 2),
    ({"question": "the cat is", "choices": {"text": ["big", "small", "red", "blue"], "label": ["A", "B", "C", "D"]},
      "answerKey": "4"},  # a numbered key among lettered choices: "1".."4" is A..D
     "Question: the cat is\nAnswer:", [" big", " small", " red", " blue"], 3),
]
PIQA = [
    ({"goal": "How do I ready a guinea pig cage for it's new occupants?",
      "sol1": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips.",
      "sol2": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material.",
      "label": 0},
     "Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:",
     [" Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips.",
      " Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material."], 0),
    ({"goal": "the dog sat", "sol1": "on a mat", "sol2": "on a log", "label": 1},
     "Question: the dog sat\nAnswer:", [" on a mat", " on a log"], 1),
]
MMLU = [
    ({"question": "  Find the degree for the given field extension Q(sqrt(2)) over Q. ", "subject": "abstract_algebra",
      "choices": ["0", "2", "1", "3"], "answer": 1},
     "Find the degree for the given field extension Q(sqrt(2)) over Q.\nA. 0\nB. 2\nC. 1\nD. 3\nAnswer:",
     [" A", " B", " C", " D"], 1),
    ({"question": "the cat sat on a", "choices": ["mat", "log", "dog", "cat"], "answer": "D"},
     "the cat sat on a\nA. mat\nB. log\nC. dog\nD. cat\nAnswer:", [" A", " B", " C", " D"], 3),
]
GENERIC = [
    ({"context": "The number 3 is", "choices": [" small", " odd", "large"], "label": 1},
     "The number 3 is", [" small", " odd", "large"], 1),
    ({"query": "the cat sat on a ", "choices": ["mat", "log"], "gold": 0}, "the cat sat on a ", ["mat", "log"], 0),
]
FORMATS = {"hellaswag": HELLASWAG, "arc": ARC, "piqa": PIQA, "mmlu": MMLU, "generic": GENERIC}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_prompts_are_lm_evaluation_harness_prompts_written_out(fmt):
    for rec, context, continuations, gold in FORMATS[fmt]:
        assert eval_lm.mc_request(rec) == (context, continuations, gold, fmt)


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_fewshot_examples_precede_each_context_separated_by_a_blank_line(tmp_path):
    from evals.lm_tasks import fewshot_requests
    arc = eval_lm.read_task(_write(tmp_path / "arc.jsonl", [r[0] for r in ARC]))
    assert fewshot_requests(arc, 2) == [
        ("Question: An astronomer observes that a planet rotates faster after a meteorite impact. Which is the most "
         "likely effect of this increase in rotation?\nAnswer: Planetary days will become shorter.\n\n"
         "Question: Which of these is a mammal?\nAnswer: whale\n\n"
         "Question: Which is red?\nAnswer:", [" a sky", " a leaf", " a blood cell"], 2, "arc"),
        ("Question: An astronomer observes that a planet rotates faster after a meteorite impact. Which is the most "
         "likely effect of this increase in rotation?\nAnswer: Planetary days will become shorter.\n\n"
         "Question: Which of these is a mammal?\nAnswer: whale\n\n"
         "Question: the cat is\nAnswer:", [" big", " small", " red", " blue"], 3, "arc")]
    hs = eval_lm.read_task(_write(tmp_path / "hs.jsonl", [r[0] for r in HELLASWAG]))
    assert fewshot_requests(hs, 1)[1][0] == ("Roof shingle removal: A man is sitting on a roof. He starts pulling up "
                                             "roofing on a roof.\n\nCat: the cat sat on a mat.")
    gen = eval_lm.read_task(_write(tmp_path / "gen.jsonl", [r[0] for r in GENERIC]))
    assert fewshot_requests(gen, 1) == [("The number 3 is odd\n\nthe cat sat on a ", ["mat", "log"], 0, "generic")]
    assert fewshot_requests(arc, 0) == arc


def test_pair_encoding_moves_the_contexts_trailing_space_onto_the_continuation(run):
    from evals.lm_tasks import encode_pair
    from tokenizer import load_tokenizer
    tok = load_tokenizer(str(run / "tok"))
    for context, continuation, want_ctx, want_cont in [
            ("Question: the cat sat\nAnswer:", " on a mat", "Question: the cat sat\nAnswer:", " on a mat"),
            ("the cat sat on a ", "mat", "the cat sat on a", " mat"),
            ("The number 3 is  ", " odd", "The number 3 is", "   odd"),
            ("the dog ran\n\n", "it sat", "the dog ran", "\n\nit sat")]:
        ctx, cont = encode_pair(tok, context, continuation)
        assert (tok.decode(ctx), tok.decode(cont)) == (want_ctx, want_cont), (context, continuation)
        assert ctx + cont == tok(want_ctx + want_cont, add_special_tokens=False).input_ids


def test_a_hellaswag_record_without_lm_evals_fields_is_refused(tmp_path):
    bad = _write(tmp_path / "hs.jsonl", [HELLASWAG[0][0], {"ctx": "a man sat", "endings": ["b", "c"], "label": 0}])
    with pytest.raises(eval_lm.TaskFormatError, match=r"hs.jsonl:2: a HellaSwag record \(endings\) lacks "
                                                      r"activity_label, ctx_a, ctx_b"):
        eval_lm.read_task(bad)


def test_acc_norm_divides_by_the_choices_characters_without_the_target_delimiter(monkeypatch):
    # lm-eval: argmax(ll / len(choice)), the choice as doc_to_choice gives it (no " " in front); a model whose
    # log-likelihoods are -1.0 for "a" and -2.4 for "abc" is right by acc_norm (-1.0 < -0.8), wrong by acc; with
    # the delimiter counted (-0.5 > -0.6) acc_norm would be wrong too
    from evals import lm_tasks
    lls = {"a": -1.0, " a": -1.0, "abc": -2.4, " abc": -2.4}
    monkeypatch.setattr(lm_tasks, "encode_pair", lambda tok, context, continuation: ([], [continuation]))
    monkeypatch.setattr(lm_tasks, "loglikelihoods", lambda model, reqs, *a, **k: [lls[ids[-1]] for ids, _ in reqs])
    reqs = [("Question: q\nAnswer:", [" a", " abc"], 1, "arc"), ("q", ["a", "abc"], 1, "generic")]
    assert lm_tasks.score_requests(None, None, 0, reqs, 8, "cpu") == {"n": 2, "acc": 0.0, "acc_norm": 1.0}
    reqs = [("q", [" a", "abc"], 1, "generic")]  # generic choices are counted as written: -0.5 > -0.8
    assert lm_tasks.score_requests(None, None, 0, reqs, 8, "cpu") == {"n": 1, "acc": 0.0, "acc_norm": 0.0}


def _task_files(d):
    return [_write(d / f"{fmt}.jsonl", [r[0] for r in recs]) for fmt, recs in FORMATS.items()]


def _hf_loglikelihood(hf, ids, n_cont, max_len):
    x = torch.tensor([ids[:-1][-max_len:]])
    with torch.no_grad():
        logp = torch.log_softmax(hf(x).logits[0].float(), dim=-1)
    return float(logp[-n_cont:].gather(1, torch.tensor(ids[-n_cont:])[:, None]).sum())


def test_choice_loglikelihoods_and_perplexity_equal_the_exported_model_under_transformers(run, tmp_path, capsys):
    from transformers import AutoTokenizer, LlamaForCausalLM
    tasks = _task_files(tmp_path)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": _sentence(i, 40)}) + "\n" for i in range(3)))  # > 24 tokens each
    out, lls, out_ppl = tmp_path / "results.json", tmp_path / "lls.jsonl", tmp_path / "ppl.json"
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={','.join(tasks)}", f"--out={out}",
                         f"--loglikelihoods_out={lls}", "--device=cpu", f"--max_seq_len={MAX_LEN}"]) == 0
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--perplexity_files={held}", f"--out={out_ppl}", "--device=cpu",
                         "--max_seq_len=24"]) == 0
    results = json.loads(out.read_text())
    rows = [json.loads(line) for line in lls.read_text().splitlines()]
    assert [r["format"] for r in rows] == [fmt for fmt, recs in FORMATS.items() for _ in recs]

    hf = LlamaForCausalLM.from_pretrained(str(run / "hf")).eval()
    hf_tok = AutoTokenizer.from_pretrained(str(run / "hf"))
    bos = hf_tok.convert_tokens_to_ids("<s>")
    for (fmt, recs), task in zip(FORMATS.items(), results["tasks"]):
        mine = [r for r in rows if r["task"] == f"{fmt}.jsonl"]
        acc = acc_norm = 0
        for r, (_, context, choices, gold) in zip(mine, recs):  # the prompts written out above
            want = []
            for choice in choices:  # lm-eval's HFLM._encode_pair with the export's tokenizer
                n = len(context) - len(context.rstrip())
                c, cont_text = (context[:-n], context[-n:] + choice) if n else (context, choice)
                whole = hf_tok(c + cont_text, add_special_tokens=False).input_ids
                ctx = hf_tok(c, add_special_tokens=False).input_ids
                cont = whole[len(ctx):]
                want.append(_hf_loglikelihood(hf, [bos] + ctx + cont, len(cont), MAX_LEN))
            assert (r["gold"], r["loglikelihoods"]) == (gold, pytest.approx(want, abs=1e-4)), fmt
            acc += int(max(range(len(want)), key=want.__getitem__) == gold)
            # acc_norm divides by the choice's characters without lm-eval's target delimiter " "
            norm = [v / len(c if fmt == "generic" else c.removeprefix(" ")) for v, c in zip(want, choices)]
            acc_norm += int(max(range(len(norm)), key=norm.__getitem__) == gold)
        n = len(recs)
        assert (task["n"], task["acc"], task["acc_norm"]) == (n, acc / n, acc_norm / n), fmt

    nll = tokens = 0
    for i in range(3):
        ids = [bos] + hf_tok(_sentence(i, 40), add_special_tokens=False).input_ids + [hf_tok.convert_tokens_to_ids("</s>")]
        assert len(ids) > 25  # more than one window
        for start in range(0, len(ids) - 1, 24):
            w = ids[start:start + 25]
            nll -= _hf_loglikelihood(hf, w, len(w) - 1, 24)
            tokens += len(w) - 1
    ppl = json.loads(out_ppl.read_text())["perplexity"]
    assert ppl["tokens"] == tokens and ppl["ppl"] == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert "[eval] arc.jsonl: acc" in capsys.readouterr().out


def test_bad_task_files_are_one_line(run, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(HELLASWAG[2][0]) + "\n" + json.dumps({"q": 1}) + "\n")
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={bad}", "--device=cpu"]) == 3
    assert f"{bad}:2: fits no multiple-choice format (keys: q)" in capsys.readouterr().err
    assert eval_lm.main([f"--ckpt={run / 'run'}", "--device=cpu"]) == 2
    assert "nothing to evaluate" in capsys.readouterr().err
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={tmp_path / 'nope.jsonl'}"]) == 2


# ---------------------------------------------------------------------------- bad inputs: one line, before the model

GOOD = {"context": "the cat sat on a", "choices": [" mat", " log"], "label": 0}


def _no_model(monkeypatch):
    """Fail the test if the model is loaded: every mistake below is told before."""
    from inference import loading

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")
    monkeypatch.setattr(loading, "load_for_inference", refuse)


def _bad_case(tmp_path, name):
    """(path, extra flags, exit code, what the line says) of one bad task input."""
    f = tmp_path / "t.jsonl"
    good = json.dumps(GOOD) + "\n"
    if name == "invalid_utf8":
        f.write_bytes(good.encode() + b'{"context": "caf\xe9", "choices": [" a", " b"], "label": 0}\n')
        return f, [], 3, f"{f}:2: invalid UTF-8 (byte 17 of the line)"
    if name == "directory":
        f.mkdir()
        return f, [], 2, f"{f}: is a directory"
    if name == "arrow":
        f = tmp_path / "t.arrow"
        f.write_bytes(b"ARROW1\x00\x00")
        return f, [], 2, f"{f}: a task file is .jsonl or .json (one JSON object per line), not .arrow"
    recs = {"choice_number": {"context": "a", "choices": [" b", 5], "label": 0},
            "choice_null": {"context": "a", "choices": [" b", None], "label": 0},
            "context_list": {"context": ["a"], "choices": [" b", " c"], "label": 0},
            "empty_choice": {"context": "a", "choices": [" b", ""], "label": 0},
            "label_half": {"context": "a", "choices": [" b", " c"], "label": 0.5},
            "label_bool": {"goal": "a", "sol1": "b", "sol2": "c", "label": True},
            "mmlu_choice_number": {"question": "q", "choices": ["a", 2], "answer": 0},
            "arc_key": {"question": "q", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "E"},
            "piqa_no_sol2": {"goal": "a", "sol1": "b", "label": 0},
            "choices_string": {"context": "a", "choices": " b", "label": 0}}
    says = {"choice_number": "choices[1] is a number 5, not a string",
            "choice_null": "choices[1] is null, not a string",
            "context_list": "context is a list, not a string",
            "empty_choice": "choices[1] is an empty string",
            "label_half": "label is a number 0.5, not an integer",
            "label_bool": "label is a boolean true, not an integer",
            "mmlu_choice_number": "choices[1] is a number 2, not a string",
            "arc_key": "answerKey 'E' is none of the labels ['A', 'B']",
            "piqa_no_sol2": "a PIQA record (goal, sol1) lacks sol2",
            "choices_string": 'choices is a string " b", not a list of strings'}
    if name == "empty":
        f.write_text("\n  \n")
        return f, [], 3, f"{f}: no records (an empty task file)"
    if name == "fewshot_too_many":
        f.write_text(good * 3)
        return f, ["--num_fewshot=3"], 2, f"{f}: --num_fewshot=3 leaves nothing to score: the file has 3 record(s)"
    f.write_text(good + json.dumps(recs[name]) + "\n")
    return f, [], 3, f"{f}:2: {says[name]}"


BAD_CASES = ["invalid_utf8", "directory", "arrow", "choice_number", "choice_null", "context_list", "empty_choice",
             "label_half", "label_bool", "mmlu_choice_number", "arc_key", "piqa_no_sol2", "choices_string", "empty",
             "fewshot_too_many"]


@pytest.mark.parametrize("name", BAD_CASES)
def test_a_bad_task_file_is_one_line_with_its_exit_code_before_the_model_is_loaded(run, tmp_path, capsys, monkeypatch,
                                                                                    name):
    path, flags, code, says = _bad_case(tmp_path, name)
    _no_model(monkeypatch)
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={path}", "--device=cpu", *flags]) == code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"eval_lm.py: {says}"), err


def test_a_continuation_longer_than_max_seq_len_is_one_line(run, tmp_path, capsys):
    f = _write(tmp_path / "long.jsonl", [GOOD, {"context": "a", "choices": [" " + _sentence(1, 30), " b"], "label": 0}])
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={f}", "--device=cpu", "--max_seq_len=8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"eval_lm.py: {f}:2: choice 0 is ") and "more than the 8 a forward holds" in err[-1], err


def test_a_choice_that_encodes_to_no_token_is_refused_naming_its_line(monkeypatch):
    from evals import lm_tasks
    monkeypatch.setattr(lm_tasks, "encode_pair", lambda tok, context, continuation: ([5], []))
    with pytest.raises(lm_tasks.TaskFormatError, match=r"t.jsonl:7: choice 0 \(' x'\) encodes to no token"):
        lm_tasks.encode_requests(None, 1, [("a", [" x"], 0, "generic")], 8, ["t.jsonl:7"])


def test_the_out_destination_is_checked_before_the_model_and_a_missing_directory_is_created(run, tmp_path, capsys,
                                                                                             monkeypatch):
    import tempfile
    task = _write(tmp_path / "t.jsonl", [GOOD, GOOD])
    base = [f"--ckpt={run / 'run'}", f"--tasks={task}", "--device=cpu"]
    blocker = tmp_path / "file.txt"
    blocker.write_text("x")
    with monkeypatch.context() as m:
        _no_model(m)
        # a path under a regular file: its directory cannot be made (root too)
        assert eval_lm.main([*base, f"--out={blocker / 'res.json'}"]) == 2
        err = capsys.readouterr().err
        assert f"eval_lm.py: --out={blocker / 'res.json'}: cannot create its directory {blocker}" in err
        assert eval_lm.main([*base, f"--loglikelihoods_out={tmp_path}"]) == 2  # a directory where the file belongs
        assert f"--loglikelihoods_out={tmp_path}: is a directory" in capsys.readouterr().err

        def read_only(*a, **k):  # a directory that refuses new files (permission bits do not stop root)
            raise PermissionError(13, "Permission denied")
        m.setattr(tempfile, "mkstemp", read_only)
        assert eval_lm.main([*base, f"--out={tmp_path / 'res.json'}"]) == 2
        err = capsys.readouterr().err
        assert f"--out={tmp_path / 'res.json'}: cannot write in {tmp_path}: Permission denied" in err
    out = tmp_path / "new" / "sub" / "res.json"  # missing parents: created, as mkdir -p
    assert eval_lm.main([*base, f"--out={out}", f"--loglikelihoods_out={tmp_path / 'new2' / 'lls.jsonl'}"]) == 0
    assert json.loads(out.read_text())["tasks"][0]["n"] == 2
    assert len((tmp_path / "new2" / "lls.jsonl").read_text().splitlines()) == 2


# ---------------------------------------------------------------------------- batched scoring

def _model(run):
    from model.config import read_model_config
    from checkpoint.weights import checkpoint_model_state
    from checkpoint.verify import find_latest_valid
    d = find_latest_valid(str(run / "run"), log=lambda m: None)
    m = Transformer(read_model_config(d))
    m.load_state_dict(checkpoint_model_state(d))
    return m.eval()


def test_batched_scoring_equals_one_forward_per_request(run, tmp_path):
    """Every format's choices (contexts left-truncated at MAX_LEN, 2-shot) and perplexity windows of other
    lengths, scored in padded batches of 1, 3, 16 and 64: each log-likelihood equals the unbatched
    choice_loglikelihood's up to float32 rounding (even at 1 row per forward the LM head runs on the scored
    positions alone, a matrix product of another shape), and acc / acc_norm / the perplexity are the same."""
    from evals import lm_tasks
    from tokenizer import load_tokenizer
    tok = load_tokenizer(str(run / "tok"))
    model = _model(run)
    bos, eos = 1, 2
    reqs = [r for path in _task_files(tmp_path) for r in lm_tasks.fewshot_requests(eval_lm.read_task(path), 1)]
    encoded = lm_tasks.encode_requests(tok, bos, reqs, MAX_LEN)
    want = [[choice_ll(model, ids, n) for ids, n in item] for item in encoded]
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": _sentence(i, 5 + 9 * i)}) + "\n" for i in range(8)))
    windows, docs, _ = lm_tasks.perplexity_requests(tok, bos, eos, [str(held)], "text", 24)
    want_ppl = [choice_ll(model, w, n, 24) for w, n in windows]
    assert len({len(w) for w, _ in windows}) > 3 and len({len(ids) for item in encoded for ids, _ in item}) > 10
    assert max(len(ids) for item in encoded for ids, _ in item) > MAX_LEN + 1  # some are left-truncated
    for bs in (1, 3, 16, 64):
        got = lm_tasks.score_encoded(model, encoded, MAX_LEN, "cpu", batch_size=bs)
        for g, w in zip(got, want):
            assert g == pytest.approx(w, rel=1e-5, abs=1e-4), bs
        assert lm_tasks.tally(reqs, got) == lm_tasks.tally(reqs, want)
        got_ppl = lm_tasks.loglikelihoods(model, windows, 24, "cpu", batch_size=bs)
        assert got_ppl == pytest.approx(want_ppl, rel=1e-5, abs=1e-4), bs
        assert lm_tasks.perplexity_result(windows, got_ppl, docs, 0)["ppl"] == pytest.approx(
            lm_tasks.perplexity_result(windows, want_ppl, docs, 0)["ppl"], rel=1e-6)


def test_a_bool_logits_to_keep_returns_the_logits_of_its_positions_only(run):
    import torch
    model = _model(run)
    x = torch.randint(3, 200, (3, 11))
    keep = torch.zeros(3, 11, dtype=torch.bool)
    keep[0, 2:5], keep[2, 10] = True, True  # row 1: none
    with torch.no_grad():
        got, full = model(x, logits_to_keep=keep), model(x)
    assert got.shape == (4, full.shape[-1])
    torch.testing.assert_close(got, full[keep])  # float32 rounding: the head's product has fewer rows


def test_batched_scoring_runs_each_batch_on_the_tuners_thread_count(run, tmp_path):
    """With a ThreadTuner the batches run on the count it asks for (set before each batch, here alternating
    1 and 2), it is told each batch's input tokens, and the values are those of the fixed count's scoring up to
    float32 rounding (other counts sum in another order)."""
    import torch

    from evals import lm_tasks
    from tokenizer import load_tokenizer
    model = _model(run)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"text": _sentence(i, 5 + 9 * i)}) + "\n" for i in range(8)))
    windows, _, _ = lm_tasks.perplexity_requests(load_tokenizer(str(run / "tok")), 1, 2, [str(held)], "text", 24)

    class Alternating:
        def __init__(self):
            self.asked, self.records, self.ran = 0, [], []

        def threads_for_next_step(self):
            return 1 + len(self.records) % 2

        def record(self, seconds, tokens):
            self.ran.append(torch.get_num_threads())
            self.records.append((seconds, tokens))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        want = lm_tasks.loglikelihoods(model, windows, 24, "cpu", batch_size=3)
        tuner = Alternating()
        got = lm_tasks.loglikelihoods(model, windows, 24, "cpu", batch_size=3, tuner=tuner)
    finally:
        torch.set_num_threads(before)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)
    batches = -(-len(windows) // 3)
    assert tuner.ran == [1 + k % 2 for k in range(batches)]
    assert sum(t for _, t in tuner.records) == sum(len(w[:-1][-24:]) for w, _ in windows)
    assert all(s > 0 for s, _ in tuner.records)


def choice_ll(model, ids, n, max_len=MAX_LEN):
    return eval_lm.choice_loglikelihood(model, ids, n, max_len, "cpu")


def test_progress_goes_to_stderr_and_batch_size_is_a_flag(run, tmp_path, capsys, monkeypatch):
    from inference import loading
    tasks = _task_files(tmp_path)
    seen = []
    real_load = loading.load_for_inference

    def load(*a, **k):  # what the user had seen when the model began to load
        seen.append(capsys.readouterr().err)
        return real_load(*a, **k)
    monkeypatch.setattr(loading, "load_for_inference", load)
    forwards = []
    real_forward = Transformer.forward
    monkeypatch.setattr(Transformer, "forward",
                        lambda self, x, *a, **k: forwards.append(x.shape) or real_forward(self, x, *a, **k))
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={','.join(tasks)}", "--device=cpu", "--batch_size=5",
                         f"--max_seq_len={MAX_LEN}"]) == 0
    n_records = sum(len(recs) for recs in FORMATS.values())
    n_choices = sum(len(r[2]) for recs in FORMATS.values() for r in recs)
    # before the model loads (and before torch is imported): the files checked, the bar
    assert seen[0].startswith(f"[eval] 5 task file(s) checked: {n_records} records\n")
    assert "[eval] loading the tokenizer and the model: 0req" in seen[0]
    captured = capsys.readouterr()
    assert "[eval] scoring: 100%" in captured.err and f"{n_choices}/{n_choices}" in captured.err
    assert ("req/s" in captured.err or "s/req" in captured.err) and "[eval] scoring" not in captured.out
    assert "[eval] arc.jsonl: acc" in captured.out
    # the requests of each file in forwards of at most 5 rows, padded to the batch's longest
    per_file = [sum(len(r[2]) for r in recs) for recs in FORMATS.values()]
    assert len(forwards) == sum(-(-c // 5) for c in per_file) and max(s[0] for s in forwards) == 5
    assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={tasks[0]}", "--batch_size=0"]) == 2
    assert "--batch_size >= 1" in capsys.readouterr().err


def test_a_tokenizer_dir_that_does_not_load_is_one_line(run, tmp_path, capsys):
    """As sample.py: a tokenizer directory without tokenizer_meta.json (exit 2), or one whose tokenizer_config.json
    was edited to ask for remote code (exit 3: a file changed since its meta listed it), is one line naming the
    file, never a traceback."""
    import shutil
    f = _write(tmp_path / "t.jsonl", [GOOD, GOOD])
    no_meta = tmp_path / "no_meta"
    shutil.copytree(run / "tok", no_meta)
    (no_meta / "tokenizer_meta.json").unlink()
    remote = tmp_path / "remote"
    shutil.copytree(run / "tok", remote)
    cfg = json.loads((remote / "tokenizer_config.json").read_text())
    (remote / "tokenizer_config.json").write_text(json.dumps(dict(cfg, auto_map={"AutoTokenizer": ["x.Tok", None]})))
    for tok, names, code in ((no_meta, "tokenizer_meta.json", 2), (remote, "tokenizer_config.json", 3)):
        capsys.readouterr()
        assert eval_lm.main([f"--ckpt={run / 'run'}", f"--tasks={f}", "--device=cpu",
                             f"--tokenizer_dir={tok}"]) == code
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Traceback" not in ln]
        assert err and f"{tok / names}" in err[-1] and err[-1].startswith("eval_lm.py:"), err
