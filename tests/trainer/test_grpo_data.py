"""GRPO's prompts and rewards (trainer/tasks/grpo_data.py, grpo_rewards.py, grpo_flags.py): records read with bad
ones named and counted, prompts encoded as SFT / sample.py encode them, the built-in rewards, a user's function, and
a reward that raises or returns a non-number stopping with one line naming it and the record."""
from __future__ import annotations

import importlib
import json
import math
import re
import sys

import pytest

from trainer.config import TrainConfig, TrainingError
from trainer.validation import validate_config
from trainer.tasks.grpo_data import read_prompts_file
from trainer.tasks.grpo_flags import reward_specs
from trainer.tasks.grpo_rewards import RewardError, build_rewards, exact_match, first_number, numeric_match


def _cfg(**kw) -> TrainConfig:
    base = dict(task_type="grpo", data_dir="x", tokenizer_dir="y", init_from="somewhere", max_seq_len=64,
                max_prompt_length=24, max_completion_length=8)
    return TrainConfig(**{**base, **kw})


def test_prompts_file_counts_and_names_bad_records(tiny_pretrain_data, tmp_path):
    from tokenizer import encode_chat, load_tokenizer, load_tokenizer_meta
    tok_dir = tiny_pretrain_data["tokenizer_dir"]
    tok, meta = load_tokenizer(tok_dir), load_tokenizer_meta(tok_dir)
    f = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "2+3=", "answer": "5"},
            {"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"},
            {"prompt": "no answer here"},
            {"question": "wrong field", "answer": "1"},
            {"prompt": "long " * 40, "answer": "1"},
            {"messages": [{"role": "robot", "content": "x"}], "answer": "1"}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n{broken json\n", encoding="utf-8")
    lines = []
    prompts = read_prompts_file(str(f), _cfg(), tok, meta, needs_answer=True, log=lines.append)
    assert [p.answer for p in prompts] == ["5", "2"] and prompts[0].where.endswith("prompts.jsonl:1")
    assert prompts[0].ids[0] == meta["special_tokens"]["bos"]["id"]
    assert prompts[1].ids == list(encode_chat(tok, [{"role": "user", "content": "1+1?"}], add_generation_prompt=True)[0])
    assert prompts[1].text == "1+1?"
    assert lines == [f"[data] grpo {f}: 6 records -> 2 prompts, skipped 5 (bad prompt 2, malformed JSON 1, "
                     "no answer 1, prompt too long 1)"]
    # field names by flag; without an answer reward a record without an answer is kept
    other = read_prompts_file(str(f), _cfg(prompt_field="question"), tok, meta, needs_answer=False, log=None)
    assert [p.text for p in other] == ["1+1?", "wrong field"]
    # TRL's conversational prompt: the messages under "prompt" read as under "messages"
    trl = tmp_path / "trl.jsonl"
    trl.write_text(json.dumps({"prompt": rows[1]["messages"], "answer": "2"}) + "\n", encoding="utf-8")
    got = read_prompts_file(str(trl), _cfg(), tok, meta, needs_answer=True, log=None)
    assert [(p.ids, p.text) for p in got] == [(prompts[1].ids, "1+1?")]


def test_a_saved_datasets_folder_reads_as_its_jsonl(tiny_pretrain_data, tmp_path):
    datasets = pytest.importorskip("datasets")
    from tokenizer import load_tokenizer, load_tokenizer_meta
    tok_dir = tiny_pretrain_data["tokenizer_dir"]
    tok, meta = load_tokenizer(tok_dir), load_tokenizer_meta(tok_dir)
    rows = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "", "answer": "1"}, {"prompt": "4+4=", "answer": "8"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    a = read_prompts_file(str(tmp_path / "p.jsonl"), _cfg(), tok, meta, needs_answer=True, log=None)
    lines = []
    b = read_prompts_file(str(tmp_path / "ds"), _cfg(), tok, meta, needs_answer=True, log=lines.append)
    assert [(p.ids, p.answer) for p in a] == [(p.ids, p.answer) for p in b] and len(b) == 2
    assert "3 records -> 2 prompts, skipped 1 (bad prompt 1)" in lines[0] and b[1].where.endswith("row 3")


def test_builtin_rewards():
    assert exact_match("think... #### 42", "42", "####") == 1.0
    assert exact_match("#### 41 then #### 42\nmore", "42", "####") == 1.0  # the last marker, its first line
    assert exact_match("42", "42", "####") == 0.0 and exact_match(" 42 ", "42", "") == 1.0
    assert numeric_match("#### 1,234.0", "1234", "####", 1e-6) == 1.0
    assert numeric_match("#### 3.1416", 3.14159, "####", 1e-4) == 1.0
    assert numeric_match("#### 3.15", 3.14159, "####", 1e-4) == 0.0
    assert numeric_match("#### none", "3", "####", 1e-4) == 0.0 and first_number("x -2.5e1 y") == -25.0
    cfg = _cfg(reward_funcs="exact_match,format", reward_weights="1,0.5")
    rs = build_rewards(cfg)
    vals = rs.score_many("p", ["so #### 7"], {}, "7", "f:1")[0]
    assert vals == [1.0, 1.0] and rs.total(vals) == 1.5
    assert rs.score_many("p", ["seven"], {}, "7", "f:1") == [[0.0, 0.0]]


def test_soft_overlong_is_dapos_length_penalty():
    """TRL's get_soft_overlong_punishment written out: 0 up to max - cache tokens, (max - cache - L) / cache above,
    -1 past max; it reads the completions' token ids (through the stop token), and needs a buffer within the length."""
    def trl(length: int, max_len: int, cache: int) -> float:
        if length <= max_len - cache:
            return 0.0
        return (max_len - cache - length) / cache if length <= max_len else -1.0
    rs = build_rewards(_cfg(reward_funcs="soft_overlong,format", soft_punish_cache=3, format_regex=".*"))
    assert rs.names == ["soft_overlong", "format"] and not rs.needs_answer
    ids = [[7] * n for n in range(0, 11)]
    got = rs.score_many("p", ["x"] * len(ids), {}, None, "f:1", [1, 2], ids)
    assert [v[0] for v in got] == [trl(n, 8, 3) for n in range(0, 11)] and [v[1] for v in got] == [1.0] * 11
    assert got[5][0] == 0.0 and got[6][0] == -1 / 3 and got[8][0] == -1.0 and got[10][0] == -1.0
    for cache in (0, 9):
        with pytest.raises(TrainingError, match="soft_overlong needs 0 < --soft_punish_cache <= "
                                                "--max_completion_length"):
            validate_config(_cfg(reward_funcs="soft_overlong", soft_punish_cache=cache))


def _user_module(tmp_path, monkeypatch, name: str, source: str):
    """`source` importable as module `name` (a fresh import)."""
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def test_user_reward_function_and_its_failures(tmp_path, monkeypatch):
    _user_module(tmp_path, monkeypatch, "my_rewards",
                 "def length(prompt, completion, record):\n    return len(completion) / 10\n"
                 "def boom(prompt, completion, record):\n    raise KeyError('score')\n"
                 "def text(prompt, completion, record):\n    return 'high'\n"
                 "def nan(prompt, completion, record):\n    return float('nan')\n")
    rs = build_rewards(_cfg(reward_funcs="", reward_fn="my_rewards:length"))
    assert rs.names == ["my_rewards.length"] and rs.score_many("p", ["abcde"], {}, None, "f:3") == [[0.5]]
    assert not rs.needs_answer
    for fn, said in (("boom", "raised KeyError ('score')"), ("text", "returned 'high' (str), not a finite number,"),
                     ("nan", "returned nan (float), not a finite number,")):
        rs = build_rewards(_cfg(reward_funcs="exact_match", reward_fn=f"my_rewards:{fn}"))
        with pytest.raises(RewardError) as e:
            rs.score_many("p", ["c"], {"prompt": "p"}, "1", "data/prompts.jsonl:7")
        assert str(e.value) == f"reward my_rewards.{fn} {said} on the record at data/prompts.jsonl:7"
        assert e.value.exit_code == 3
    with pytest.raises(ValueError, match="cannot import it"):
        build_rewards(_cfg(reward_fn="my_rewards:missing"))


def test_a_reward_written_for_trl_gets_its_batched_arguments(tmp_path, monkeypatch):
    """A function with a `completions` parameter is called as TRL's GRPOTrainer calls it: prompts, completions,
    completion_ids and every other field of the record as lists of G; a chat prompt's messages and assistant
    messages; only the named arguments without **kwargs; a wrong-length answer or None is one line naming it."""
    trl_rewards = _user_module(
        tmp_path, monkeypatch, "trl_rewards",
        "seen = []\n"
        "def spy(prompts, completions, completion_ids, **kwargs):\n"
        "    seen.append(dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs))\n"
        "    return [float(len(ids)) for ids in completion_ids]\n"
        "def named(completions, answer):\n    return [float(c == a) for c, a in zip(completions, answer)]\n"
        "def short(completions, **kw):\n    return [1.0]\n"
        "def none(completions, **kw):\n    return [None] * len(completions)\n")
    rs = build_rewards(_cfg(reward_funcs="", reward_fn="trl_rewards:spy"))
    rec = {"prompt": "2+2?", "answer": "4", "level": 1}
    got = rs.score_many("2+2?", ["4", "five"], rec, "4", "f:1", [5, 6], [[7, 2], [8, 9, 2]])
    assert got == [[2.0], [3.0]]
    assert trl_rewards.seen[-1] == {"prompts": ["2+2?"] * 2, "completions": ["4", "five"],
                                    "completion_ids": [[7, 2], [8, 9, 2]], "answer": ["4"] * 2, "level": [1] * 2}
    chat = {"messages": [{"role": "user", "content": "hi"}], "answer": "4"}
    for record in (chat, {"prompt": chat["messages"], "answer": "4"}):  # ours, and TRL's conversational prompt
        rs.score_many("hi", ["yo"], record, "4", "f:2", [5], [[3, 2]])
        assert trl_rewards.seen[-1]["prompts"] == [chat["messages"]]
        assert trl_rewards.seen[-1]["completions"] == [[{"role": "assistant", "content": "yo"}]]
        assert "messages" not in trl_rewards.seen[-1] and trl_rewards.seen[-1]["answer"] == ["4"]
    named = build_rewards(_cfg(reward_funcs="", reward_fn="trl_rewards:named"))
    assert named.score_many("2+2?", ["4", "5"], rec, "4", "f:1", [5], [[1], [2]]) == [[1.0], [0.0]]
    with pytest.raises(RewardError, match=re.escape("reward trl_rewards.short raised ValueError (a TRL-style reward "
                                                    "returns one number per completion: 2 expected, got list of 1)")):
        build_rewards(_cfg(reward_funcs="", reward_fn="trl_rewards:short")).score_many(
            "2+2?", ["4", "5"], rec, "4", "f:9", [5], [[1], [2]])
    # None: not applicable (TRL's multi-task rewards): NaN here, left out of the weighted total
    rs = build_rewards(_cfg(reward_funcs="format,trl_rewards:none", reward_weights="0.5,2", format_regex="4"))
    vals = rs.score_many("2+2?", ["4", "5"], rec, "4", "f:9", [5], [[1], [2]])
    assert [v[0] for v in vals] == [1.0, 0.0] and all(math.isnan(v[1]) for v in vals)
    assert [rs.total(v) for v in vals] == [0.5, 0.0]


def test_flag_checks():
    assert reward_specs(_cfg(reward_funcs="exact_match , format", reward_fn="m:f")) == \
        [("exact_match", 1.0), ("format", 1.0), ("m:f", 1.0)]
    with pytest.raises(TrainingError) as e:
        validate_config(_cfg(reward_weights="1,2", max_prompt_length=60, temperature=0.0, loss_type="ppo",
                             epsilon=1.5), torch_free=True)
    msg = str(e.value)
    for part in ("--reward_weights='1,2': 2 finite weights for 1 reward functions (exact_match)",
                 "--max_prompt_length=60 + --max_completion_length=8 must be <= --max_seq_len=64",
                 "--temperature=0.0: must be a finite number > 0",
                 "--loss_type=ppo: grpo | dr_grpo | dapo | bnpo | cispo | sapo",
                 "--epsilon=1.5: must be in (0, 1)"):
        assert part in msg
    with pytest.raises(TrainingError) as e:
        validate_config(_cfg(delta=1.1, importance_sampling_level="turn"), torch_free=True)
    for part in ("--delta=1.1: must be 0 (off) or > 1 + epsilon_high = 1.2",
                 "--importance_sampling_level=turn: token | sequence"):
        assert part in str(e.value)
    with pytest.raises(TrainingError, match="--loss_type=cispo caps its weight"):
        validate_config(_cfg(delta=1.5, loss_type="cispo"), torch_free=True)
    with pytest.raises(TrainingError) as e:
        validate_config(_cfg(delta=1.5, loss_type="sapo", sapo_temperature_neg=0.0, top_entropy_quantile=0.0,
                             eval_num_generations=-1, top_k=-1, min_p=1.5, repetition_penalty=0.0),
                        torch_free=True)
    for part in ("--loss_type=sapo has no clip (its gate is soft)",
                 "--eval_num_generations=-1: must be in [0, 1024] (0 = one greedy answer)",
                 "--sapo_temperature_neg=0.0: must be a finite number > 0",
                 "--top_entropy_quantile=0.0: must be in (0, 1]", "--top_k=-1: must be >= 0 (0 = off)",
                 "--min_p=1.5: must be in [0, 1] (0 = off)",
                 "--repetition_penalty=0.0: must be a finite number > 0 (1 = off)"):
        assert part in str(e.value)
    validate_config(_cfg(), torch_free=True)  # the defaults are a valid GRPO run
    validate_config(_cfg(delta=1.5, importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
                    torch_free=True)


def test_resplot_draws_grpo_reward(tmp_path, monkeypatch):
    """A GRPO run's reward and completion length get their own panels beside an LM run's losses."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from utils.resplot import plot_runs
    lm, rl = tmp_path / "lm", tmp_path / "rl"
    for d in (lm, rl):
        d.mkdir()
    (lm / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 7.0 - 0.1 * s}) + "\n" for s in range(1, 5)))
    (rl / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 0.01, "reward": 0.1 * s,
                                                          "completion_length": 8.0, **({"val_reward": 0.5} if s % 2
                                                                                       else {})}) + "\n"
                                              for s in range(1, 5)))
    saved = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda self, *a, **k: saved.setdefault("fig", self))
    plot_runs([str(lm), str(rl)], str(tmp_path / "c.png"))
    axes = {ax.get_title(): ax for ax in saved["fig"].axes if ax.get_visible()}
    reward = axes["GRPO reward (step's completions line, held-out greedy dots)"]
    assert [list(ln.get_ydata()) for ln in reward.get_lines()] == [[0.1, 0.2, 0.30000000000000004, 0.4], [0.5, 0.5]]
    assert [list(ln.get_xdata()) for ln in reward.get_lines()][1] == [1, 3]
    assert [ln.get_label() for ln in axes["train loss"].get_lines()] == ["lm"]  # the GRPO loss is not an LM loss
    assert [ln.get_label() for ln in axes["GRPO loss"].get_lines()] == ["rl"]
