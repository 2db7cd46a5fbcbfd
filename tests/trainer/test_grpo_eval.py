"""GRPO's held-out evaluation (trainer/tasks/grpo_eval.py, GRPOTask.evaluate) on a model whose greedy output is known
by construction: its blocks add nothing and its head maps each token to a fixed next token, so the greedy completion
of a prompt is a chain read off a table. The logged values equal the hand count; the prompts split over ranks are
each scored once, with every rank decoding as many batches. Sampled (--eval_num_generations): the logged means and
bests equal those of the answers themselves, the same answers at 1 and 2 ranks and at every call, none drawn from
the training's generator."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model import ModelConfig, Transformer
from trainer.tasks.grpo_data import Prompt
from trainer.tasks.grpo_eval import eval_plan, held_out_sums, held_out_metrics
from trainer.tasks.grpo_rewards import build_rewards

V, STOP = 128, 3
NEXT = {ord("="): ord("7"), ord("7"): ord("8"), ord("8"): ord("9"), ord("9"): STOP,  # "=" -> "789", stop
        ord("?"): ord("5"), ord("5"): ord("6"), ord("6"): ord("7")}                     # "?" -> "56789", stop


def chain_model() -> Transformer:
    """Greedy decoding continues token t with NEXT[t] (t itself otherwise): one-hot embeddings, blocks whose
    output projections are zero (the residual stream stays the embedding), a head that is the table."""
    torch.manual_seed(0)
    m = Transformer(ModelConfig(vocab_size=V, dim=V, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=32))
    with torch.no_grad():
        m.embed_tokens.weight.copy_(torch.eye(V))
        for layer in m.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.eye(V)[[NEXT.get(t, t) for t in range(V)]].T  # row n: 1 at every t with NEXT[t] = n
        m.lm_head.weight.copy_(head)
    return m.train()


def prompts(pairs) -> list:
    return [Prompt([1] + [ord(c) for c in q], q, a, {"q": q}, f"heldout.jsonl:{i + 1}")
            for i, (q, a) in enumerate(pairs)]


RECORDS = [("12=", "789"), ("3=", "788"), ("4?", "56789"), ("77?", "5"), ("9=", "789")]
# greedy: "=" gives 7 8 9 STOP (4 tokens, the stop counted); "?" gives 5 6 7 8 9 and is cut at 5 tokens
HAND = {"val_reward": 3 / 5, "val_reward_exact_match": 3 / 5, "val_completion_length": (4 + 4 + 5 + 5 + 4) / 5,
        "val_prompts": 5.0}


def rewards():
    return build_rewards(SimpleNamespace(reward_funcs="exact_match", reward_fn="", reward_weights="",
                                         answer_marker="", numeric_tolerance=0.0, format_regex=""))


def decode(ids) -> str:
    return "".join(chr(t) for t in ids)


def test_the_logged_values_equal_the_hand_count():
    model, rs = chain_model(), rewards()
    answers: list = []
    sums = held_out_sums(model, prompts(RECORDS), rs, decode, rows=2, max_new_tokens=5, stop_ids=[STOP],
                       device=torch.device("cpu"), answers=answers)
    assert held_out_metrics(sums, rs.names) == pytest.approx(HAND, abs=1e-12)
    assert sorted(answers) == [(0, "789", [1.0]), (1, "789", [0.0]), (2, "56789", [1.0]), (3, "56789", [0.0]),
                               (4, "789", [1.0])]
    assert model.training  # generate restores the mode


def test_the_tasks_evaluate_splits_the_prompts_over_ranks_and_sums_them(monkeypatch):
    """GRPOTask.evaluate at 1 rank, and each of 2 ranks' shares summed (what sum_over_data does), give the hand
    count; with 2 ranks both decode the same number of batches, the full length (no early stop)."""
    from model.decode import Decoder
    from trainer.tasks.grpo import GRPOTask
    cfg = SimpleNamespace(scale_rewards="group", num_generations=2, batch_size=1, reward_funcs="exact_match",
                          reward_fn="", reward_weights="", loss_type="dapo", beta=0.0, max_prompt_length=8,
                          max_completion_length=5, answer_marker="", numeric_tolerance=0.0, format_regex="",
                          eval_num_generations=0, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=0,
                          repetition_penalty=1.0)
    model, val = chain_model(), SimpleNamespace(prompts=prompts(RECORDS))
    forwards = []  # the decode forwards (generate's prefill and each step through model/decode.py's Decoder)
    for name in ("prefill", "step"):
        real = getattr(Decoder, name)
        monkeypatch.setattr(Decoder, name, lambda self, *a, _real=real: forwards.append(1) or _real(self, *a))

    def evaluate(rank: int, world: int, total=None) -> dict:
        task = GRPOTask(cfg)
        task._tok = SimpleNamespace(decode=lambda ids, skip_special_tokens: decode(ids))
        task._special, task._rewards = {"eos": {"id": STOP}, "im_end": {"id": STOP}}, rewards()
        task._stop_ids = [STOP]  # what _load_tools finds (tokenizer.chat.chat_stop_ids)
        engine = SimpleNamespace(module=model, dp_rank=rank, dp_size=world,
                                 optimizer=SimpleNamespace(finish_param_sync=lambda: None),
                                 sum_over_data=lambda v, device: torch.tensor(total or v, dtype=torch.float64))
        return task.evaluate(engine, val, SimpleNamespace(device=torch.device("cpu")))

    assert evaluate(0, 1) == pytest.approx(HAND, abs=1e-12)
    one_rank = len(forwards)
    import trainer.tasks.grpo_eval as grpo_eval
    seen = []  # the sampled answers (k >= 1) draw with the rollouts' cuts and repetition penalty
    real_generate = grpo_eval.generate
    monkeypatch.setattr(grpo_eval, "generate", lambda *a, **kw: seen.append(kw) or real_generate(*a, **kw))
    cfg.eval_num_generations, cfg.top_k, cfg.min_p, cfg.repetition_penalty = 2, 3, 0.01, 1.3
    evaluate(0, 1)
    assert seen and all((kw["top_k"], kw["min_p"], kw["repetition_penalty"]) == (3, 0.01, 1.3) for kw in seen)
    cfg.eval_num_generations, cfg.top_k, cfg.min_p, cfg.repetition_penalty = 0, 0, 0.0, 1.0
    forwards.clear()
    shares = []
    for rank in (0, 1):
        forwards.clear()
        shares.append(held_out_sums(model, val.prompts, rewards(), decode, rows=2, max_new_tokens=5,
                                  stop_ids=[STOP], device=torch.device("cpu"), rank=rank, world=2))
        assert len(forwards) == 2 * 5, rank  # 2 batches each (one a filler on rank 1), 5 tokens each
    total = [a + b for a, b in zip(*shares)]
    assert evaluate(0, 2, total) == pytest.approx(HAND, abs=1e-12)
    assert one_rank < 3 * 5  # one process stops early once every row of a batch has stopped


def test_the_plan_deals_batches_of_neighbouring_lengths_to_every_rank_alike():
    lengths = [4, 3, 4, 5, 3, 4, 6]  # (length, index) order: 1 4 0 2 5 3 6
    assert eval_plan(lengths, rows=2) == [([1, 4], True), ([0, 2], True), ([5, 3], True), ([6], True)]
    r0, r1, r2 = (eval_plan(lengths, rows=2, rank=r, world=3) for r in range(3))
    assert r0 == [([1, 4], True), ([6], True)] and r1 == [([0, 2], True), ([1, 4], False)]
    assert r2 == [([5, 3], True), ([1, 4], False)]
    assert sorted(i for plan in (r0, r1, r2) for b, counted in plan if counted for i in b) == list(range(7))
    assert eval_plan([], rows=2) == []


def test_prompts_of_different_lengths_decoded_together_answer_as_each_alone():
    """A random fp64 model (its answers depend on every prompt token): a batch of every prompt, left-padded, gives
    each prompt the greedy answer it gets in a batch of its own."""
    torch.manual_seed(1)
    model = Transformer(ModelConfig(vocab_size=V, dim=64, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=32,
                                    initializer_range=0.2)).double()
    ps = prompts(RECORDS + [("1234567=", "7"), ("?", "5")])
    assert len({len(p.ids) for p in ps}) > 2
    got = {}
    for rows in (1, 8):
        answers: list = []
        held_out_sums(model, ps, rewards(), decode, rows=rows, max_new_tokens=6, stop_ids=[STOP],
                      device=torch.device("cpu"), answers=answers)
        got[rows] = sorted(answers)
    assert got[8] == got[1] and len({a[1] for a in got[1]}) > 3


def test_sampled_answers_are_a_function_of_seed_and_prompt_and_their_best_is_logged():
    """k = 4 answers per prompt at temperature 2 (the chain's next token ~69% likely, so answers differ): the row's
    val_reward / val_reward_best / val_completion_length are the mean / best / mean length over each prompt's 4
    answers, averaged over prompts (recomputed here from the answers themselves); 2 ranks' shares summed give the
    same values and the same answers; a second call the same; another seed other answers; the global generator
    untouched (training draws the same with or without evaluation). At temperature 0.001 the samples are greedy's."""
    model, rs = chain_model(), rewards()
    kw = dict(rows=8, max_new_tokens=5, stop_ids=[STOP], device=torch.device("cpu"), samples=4, temperature=2.0)
    state = torch.random.get_rng_state()
    answers: list = []
    sums = held_out_sums(model, prompts(RECORDS), rs, decode, answers=answers, seed=3, **kw)
    assert torch.equal(torch.random.get_rng_state(), state)
    got = held_out_metrics(sums, rs.names, samples=4)
    by_prompt = {i: [a for a in answers if a[0] == i] for i in range(len(RECORDS))}
    assert all(len(v) == 4 for v in by_prompt.values())
    texts = {a[1] for a in answers}
    assert len(texts) > 3  # sampled: the answers differ
    mean = sum(sum(a[2][0] for a in v) / 4 for v in by_prompt.values()) / len(RECORDS)
    best = sum(max(a[2][0] for a in v) for v in by_prompt.values()) / len(RECORDS)
    length = sum(sum(min(len(a[1]) + 1, 5) for a in v) / 4 for v in by_prompt.values()) / len(RECORDS)
    assert got["val_reward"] == pytest.approx(mean, abs=1e-12) and got["val_reward_best"] == pytest.approx(best)
    assert got["val_completion_length"] == pytest.approx(length) and best > mean
    shares, split = [], []
    for rank in (0, 1):
        shares.append(held_out_sums(model, prompts(RECORDS), rs, decode, answers=split, seed=3, rank=rank, world=2,
                                    **kw))
    assert held_out_metrics([a + b for a, b in zip(*shares)], rs.names, 4) == pytest.approx(got, abs=1e-12)
    assert sorted(split) == sorted(answers)
    again: list = []
    held_out_sums(model, prompts(RECORDS), rs, decode, answers=again, seed=3, **kw)
    other: list = []
    held_out_sums(model, prompts(RECORDS), rs, decode, answers=other, seed=4, **kw)
    assert again == answers and other != answers
    cold = held_out_metrics(held_out_sums(model, prompts(RECORDS), rs, decode, seed=3, **{**kw, "temperature": 1e-3}),
                            rs.names, samples=4)
    assert cold == pytest.approx({**HAND, "val_reward_best": HAND["val_reward"]}, abs=1e-12)
    for cut in (dict(top_k=1), dict(min_p=0.9999)):  # the rollouts' cuts reach the sampled answers: only greedy's
        hot_cut = held_out_metrics(held_out_sums(model, prompts(RECORDS), rs, decode, seed=3, cuts=cut, **kw),
                                   rs.names, samples=4)
        assert hot_cut == pytest.approx({**HAND, "val_reward_best": HAND["val_reward"]}, abs=1e-12), cut
