"""The sampler's recorded log-probabilities against the trainer's forward on the same tokens (fp32, CPU):
whole-row sampling (generation_kv_cache=False) equals the training forward bit for bit; KV-cache decoding differs by
rounding only: its error against a float64 forward is of the order of the trainer's own fp32 error. A group is a
function of (seed, step, prompt index) only."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer
from model.generate import generate
from trainer.tasks.grpo_rollout import Group, rollout_seed, sample_group, token_logps, training_rows

V, PAD, STOP = 96, 0, 5
PROMPTS = [[1, 7, 9, 11], [1, 20, 21, 22, 23, 24, 25]]
MAX_NEW, ROW = 10, 7 + 10


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=V, dim=48, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=32)).train()


def _groups(model, use_cache: bool, step: int = 0) -> list:
    out = []
    for i, ids in enumerate(PROMPTS):
        g = torch.Generator().manual_seed(rollout_seed(11, step, i))
        toks, mask, lps = sample_group(model, ids, 4, MAX_NEW, temperature=0.9, top_p=0.95, stop_ids=[STOP],
                                       pad_id=PAD, generator=g, use_cache=use_cache, row_len=ROW)
        out.append(Group(i, toks, mask, lps))
    return out


def _trainer_logps(model, rows) -> torch.Tensor:
    return token_logps(model(rows["input_ids"]), rows["input_ids"], 0.9)[0]  # train mode, gradients on


def test_whole_row_sampling_is_bit_equal_to_the_training_forward():
    model = _model()
    groups = _groups(model, use_cache=False)
    assert model.training
    rows = training_rows(PROMPTS, groups, ROW, PAD)
    on = rows["completion_mask"] > 0
    assert int(on.sum()) > 20
    got = _trainer_logps(model, rows)
    assert torch.equal(got[on], rows["gen_logps"][on])
    one = training_rows(PROMPTS[1:], groups[1:], ROW, PAD)  # another micro-batch layout: the same values
    assert torch.equal(_trainer_logps(model, one)[one["completion_mask"] > 0], rows["gen_logps"][4:][on[4:]])


def test_kv_cache_decoding_differs_by_rounding_only():
    model = _model()
    groups = _groups(model, use_cache=True)
    rows = training_rows(PROMPTS, groups, ROW, PAD)
    on = rows["completion_mask"] > 0
    with torch.no_grad():
        full = _trainer_logps(model, rows)[on]
        exact = token_logps(_model().double()(rows["input_ids"]), rows["input_ids"], 0.9)[0][on]
    decoded = rows["gen_logps"][on].double()
    err_trainer = (full.double() - exact).abs().max().item()
    err_decode = (decoded - exact).abs().max().item()
    assert 0 < err_trainer < 1e-4  # fp32 rounding, not a wrong position or token
    assert err_decode <= 4 * err_trainer, (err_decode, err_trainer)


def test_a_group_depends_on_seed_step_and_prompt_only():
    model = _model()
    a, b = _groups(model, True), _groups(model, True)
    assert all(torch.equal(x.tokens, y.tokens) and torch.equal(x.logps, y.logps) for x, y in zip(a, b))
    c = _groups(model, True, step=1)
    assert not torch.equal(a[0].tokens, c[0].tokens)
    # whole-row and cached sampling draw the same random numbers: the same tokens here
    assert all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, _groups(model, False)))
    assert len({rollout_seed(s, t, p) for s in range(3) for t in range(3) for p in range(3)}) == 27


def test_importance_sampling_correction_weights_each_token():
    """--importance_sampling_correction: each token's loss times min(p_trainer / p_sampler, cap); the logged
    difference is the sampler's shift."""
    import math

    from trainer.config import TrainConfig
    from trainer.tasks.grpo import GRPOTask
    model = _model()
    rows = training_rows(PROMPTS, _groups(model, use_cache=False), ROW, PAD)
    rows["gen_logps"] = rows["gen_logps"] - math.log(1.5) * rows["completion_mask"]  # p_trainer / p_sampler = 1.5
    rows.update(advantages=torch.tensor([1.0, -0.5, 0.25, 2.0, -1.0, 0.5, 0.0, 1.5]), reward=torch.zeros(8),
                rewards=torch.zeros(8, 1))

    def loss(**kw) -> tuple[float, dict]:
        cfg = TrainConfig(task_type="grpo", reward_funcs="format", loss_type="grpo", temperature=0.9, **kw)
        value, stats = GRPOTask(cfg).micro_batch_loss(model, None, rows, torch.device("cpu"))
        return float(value.detach()), stats
    plain, stats = loss()
    assert abs(float(stats["lp_diff_max"]) - math.log(1.5)) < 1e-6 and stats["one"] == 1.0
    assert abs(plain) > 1e-3
    assert abs(loss(importance_sampling_correction=True)[0] - 1.5 * plain) < 1e-5 * abs(plain)
    capped = loss(importance_sampling_correction=True, importance_sampling_cap=1.2)[0]
    assert abs(capped - 1.2 * plain) < 1e-5 * abs(plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_kv_cache_decoding_on_a_gpu_is_within_the_trainers_own_bf16_error():
    """On a GPU in bf16 (the DDP engine's parameter dtype): the sampler's recorded log-probabilities are as far from
    an fp32 forward of the same weights as the trainer's bf16 forward is (4x), i.e. they differ by bf16 rounding."""
    cuda = torch.device("cuda")
    exact_model = _model().to(cuda)
    model = _model().to(cuda, torch.bfloat16)
    groups = []
    for i, ids in enumerate(PROMPTS):
        g = torch.Generator(device=cuda).manual_seed(rollout_seed(11, 0, i))
        toks, mask, lps = sample_group(model, ids, 4, MAX_NEW, temperature=0.9, top_p=1.0, stop_ids=[STOP],
                                       pad_id=PAD, generator=g, use_cache=True, row_len=ROW)
        groups.append(Group(i, toks, mask, lps))
    rows = training_rows(PROMPTS, groups, ROW, PAD)
    on = rows["completion_mask"] > 0
    x = rows["input_ids"].to(cuda)
    with torch.no_grad():
        trainer = token_logps(model(x), x, 0.9)[0].cpu()[on].double()
        exact = token_logps(exact_model(x), x, 0.9)[0].cpu()[on].double()
    decoded = rows["gen_logps"][on].double()
    err_trainer, err_decode = (trainer - exact).abs().max().item(), (decoded - exact).abs().max().item()
    print(f"[parity] bf16 on {torch.cuda.get_device_name()}: trainer vs fp32 {err_trainer:.3g}, decode vs fp32 "
          f"{err_decode:.3g}, decode vs trainer {(decoded - trainer).abs().max().item():.3g}")
    assert 0 < err_trainer < 0.5
    assert err_decode <= 4 * err_trainer, (err_decode, err_trainer)


def test_truncated_completions_can_be_left_out():
    """--mask_truncated_completions: a row without a stop token (cut at the length limit) trains on nothing; a row
    that stopped keeps its mask, stop token included."""
    from trainer.tasks.grpo_rollout import drop_truncated
    toks = torch.tensor([[7, 8, STOP, PAD], [7, 8, 9, 10], [STOP, PAD, PAD, PAD]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
    assert drop_truncated(toks, mask, [STOP]).tolist() == [[True, True, True, False], [False] * 4,
                                                           [True, False, False, False]]


def test_top_k_and_min_p_cut_the_rollouts_but_not_the_log_probabilities():
    """--top_k 1 (or --min_p near 1) leaves the rollouts only each step's most probable token: every row of a group
    is the greedy continuation; the recorded log-probabilities stay those of the whole distribution of
    logits / temperature (as TRL trains them), equal to the trainer's forward."""
    model = _model()
    ids = PROMPTS[0]
    greedy = generate(model.eval(), torch.tensor([ids]), MAX_NEW, temperature=0.0)[0, len(ids):]
    model.train()
    for cut in (dict(top_k=1), dict(min_p=0.9999)):
        g = torch.Generator().manual_seed(rollout_seed(11, 0, 0))
        toks, mask, lps = sample_group(model, ids, 4, MAX_NEW, temperature=0.9, top_p=1.0, stop_ids=[STOP],
                                       pad_id=PAD, generator=g, use_cache=False, row_len=ROW, **cut)
        for row, m in zip(toks, mask):
            n = int(m.sum())
            assert torch.equal(row[:n], greedy[:n]), cut
        rows = training_rows([ids], [Group(0, toks, mask, lps)], ROW, PAD)
        on = rows["completion_mask"] > 0
        assert torch.equal(_trainer_logps(model, rows)[on], rows["gen_logps"][on])
        assert (rows["gen_logps"][on] < -1e-3).any()  # not the cut distribution's log 1 = 0


@pytest.mark.parametrize("use_cache", [False, True])
def test_a_repetition_penalty_changes_the_draws_but_not_the_log_probabilities(use_cache):
    """--repetition_penalty (0.2: < 1 favours repeats) with --top_k 1: every row of a group is generate()'s greedy
    continuation under the same penalty (the prompt's tokens and the completion's so far, transformers' rule), not
    the plain greedy one; the recorded log-probabilities stay those of logits / temperature (TRL's), equal to the
    trainer's forward."""
    model = _model()
    ids = PROMPTS[0]
    x = torch.tensor([ids])
    plain = generate(model.eval(), x, MAX_NEW, temperature=0.0)[0, len(ids):]
    penalised = generate(model, x, MAX_NEW, temperature=0.0, repetition_penalty=0.2)[0, len(ids):]
    model.train()
    assert not torch.equal(plain, penalised)  # the penalty matters on this model and prompt
    g = torch.Generator().manual_seed(rollout_seed(11, 0, 0))
    toks, mask, lps = sample_group(model, ids, 4, MAX_NEW, temperature=0.9, top_p=1.0, stop_ids=[STOP], pad_id=PAD,
                                   generator=g, use_cache=use_cache, row_len=ROW, top_k=1, repetition_penalty=0.2)
    for row, m in zip(toks, mask):
        n = int(m.sum())
        assert torch.equal(row[:n], penalised[:n])
    rows = training_rows([ids], [Group(0, toks, mask, lps)], ROW, PAD)
    on = rows["completion_mask"] > 0
    want = _trainer_logps(model, rows)[on]
    if use_cache:  # (KV-cache decoding: rounding apart, test_kv_cache_decoding_differs_by_rounding_only)
        assert torch.allclose(want, rows["gen_logps"][on], atol=1e-4)
    else:
        assert torch.equal(want, rows["gen_logps"][on])
