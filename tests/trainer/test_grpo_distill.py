"""On-policy distillation through GRPO (--teacher_kl_coef): the flag checks, the per-token advantage in the loss (its
gradient is the policy gradient of each token's own advantage), a rollout's advantages against the teacher's
log-probabilities of the rows computed apart, a run of pure distillation whose reverse KL to the teacher falls, and
FSDP2 at two ranks (the sharded teacher scores the rollouts on every rank) against one process."""
from __future__ import annotations

import dataclasses
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import child_env, run_cmd, train_cmd
from tests.trainer.test_grpo_runs import _args, _rows


@pytest.fixture(scope="module")
def teacher(pretrained, tmp_path_factory):
    """The suite's pretrained model with its final norm's weight tripled (every logit x 3: a sharper distribution
    over the same tokenizer), exported as a Hugging Face directory: a teacher far from the policy on any prompt, and
    one the policy can reach."""
    from safetensors.torch import load_file, save_file
    out = tmp_path_factory.mktemp("grpo_distill") / "teacher"
    run_cmd([sys.executable, "export_hf.py", f"--ckpt={pretrained['out']}", f"--output_dir={out}"])
    state = load_file(str(out / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"] * 3
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _distill_args(pretrained, tmp_path, teacher_dir, *extra) -> list[str]:
    """test_grpo_runs' flags without a reward function: distillation from `teacher_dir` alone."""
    args = [a for a in _args(pretrained, tmp_path) if not a.startswith("--reward_fn=")]
    return args + [f"--ref_model={teacher_dir}", "--teacher_kl_coef=1.0", *extra]


def test_flag_checks():
    from trainer.config import TrainConfig
    from trainer.tasks.grpo_flags import grpo_problems
    base = TrainConfig(task_type="grpo", init_from="run", reward_funcs="", teacher_kl_coef=1.0)

    def problems(**kw) -> str:
        return " ".join(grpo_problems(dataclasses.replace(base, **kw), "auto"))
    assert problems() == "" and problems(num_generations=1) == ""  # no reward needed; one completion per prompt
    assert "name at least one reward (or distil from a teacher" in problems(teacher_kl_coef=0.0)
    assert "--num_generations=1: must be >= 2" in problems(num_generations=1, reward_funcs="exact_match")
    assert "--teacher_kl_coef=-1.0: must be a finite number >= 0" in problems(teacher_kl_coef=-1.0)
    assert "both penalise the KL to --ref_model" in problems(beta=0.04)
    assert "this run has none (--teacher_kl_coef alone)" in problems(eval_data_dir="held.jsonl")
    assert problems(eval_data_dir="held.jsonl", reward_funcs="exact_match", reward_weights="0") == ""  # watched


def test_per_token_advantages_give_each_tokens_policy_gradient():
    """At ratio 1 (one update per rollout) the clipped objective's gradient on token t is -A_t (dapo sums tokens);
    a [B] advantage equals the same value on every token of its row."""
    from trainer.tasks.grpo_loss import aggregate, per_token_terms
    torch.manual_seed(0)
    logps = (-torch.rand(2, 5, dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.float64)
    adv = torch.randn(2, 5, dtype=torch.float64)
    for loss_type in ("dapo", "grpo", "sapo", "cispo"):
        terms = per_token_terms(logps, logps.detach(), adv, epsilon=0.2, loss_type=loss_type)
        grad, = torch.autograd.grad(aggregate(terms["loss"], mask, "dapo", 5), logps)
        torch.testing.assert_close(grad, -adv * mask, rtol=0, atol=1e-12)  # (sapo's gate has slope 1 at ratio 1)
    row = torch.tensor([0.5, -1.5], dtype=torch.float64)
    a = per_token_terms(logps, logps.detach() - 0.1, row, epsilon=0.2)["loss"]
    b = per_token_terms(logps, logps.detach() - 0.1, row[:, None].expand(2, 5), epsilon=0.2)["loss"]
    assert torch.equal(a, b)


def test_rollout_advantages_are_the_reverse_kl_to_the_teacher(pretrained, teacher, tmp_path):
    """Each completion token's advantage is its row's group advantage (the vowels reward) minus coef x (the
    sampler's log p - the teacher's log p at the run's temperature), the teacher scored here one row at a time on its
    real tokens from whole logits; 0 off the completion."""
    from trainer.config import TrainConfig
    from trainer.tasks.grpo import GRPOTask
    from trainer.weights import load_weights_from
    from utils.configurator import parse_config
    cfg = parse_config(TrainConfig(), _args(pretrained, tmp_path, f"--ref_model={teacher}", "--teacher_kl_coef=0.5",
                                            "--temperature=0.8"))
    task = GRPOTask(cfg)
    assert task.needs_reference and "teacher_kl" in task.stat_keys
    data = task.datasets({}, 0.0, False, None)
    cpu = torch.device("cpu")
    task._load_tools(cpu)
    policy, _ = load_weights_from(str(pretrained["out"]), lambda m: None)
    tm, _ = load_weights_from(str(teacher), lambda m: None)
    assert task.reference_problem(policy.cfg, tm.cfg) is None
    rows = task._roll(policy.eval(), cpu, data.collate([0, 5]), 0, [])
    task._advantages([rows], SimpleNamespace(info=SimpleNamespace(world_size=1)), cpu)
    group = rows["advantages"].clone()
    task._teacher_advantages([rows], tm.eval(), cpu)
    mask = rows["completion_mask"]
    adv = rows["advantages"]
    assert adv.shape == mask.shape and float(group.abs().sum()) > 0
    n_real = rows["attention_mask"].sum(1)
    for i in range(adv.shape[0]):
        ids = rows["input_ids"][i:i + 1, :int(n_real[i])]
        with torch.no_grad():
            logp = torch.log_softmax(tm(ids)[0, :-1].double() / 0.8, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        on = mask[i, :ids.shape[1] - 1] > 0
        want = group[i] - 0.5 * (rows["gen_logps"][i, :ids.shape[1] - 1].double() - logp)
        torch.testing.assert_close(adv[i, :ids.shape[1] - 1][on].double(), want[on], rtol=0, atol=2e-5)
        assert float(adv[i, ids.shape[1] - 1:].abs().sum()) == 0 and float(adv[i][mask[i] == 0].abs().sum()) == 0
    assert float(rows["teacher_kl"].abs().sum()) > 0.1  # the teacher differs from the policy (a sampled estimate:
    # one token's log-ratio has either sign)


def _exact_reverse_kl(model_dir, teacher_dir, tok_dir) -> float:
    """The mean over every position of the run's prompts (as encoded for it: <s> + text) of KL(policy || teacher),
    whole distributions at temperature 1: the distance the sampled estimate follows, without its noise."""
    from tests.trainer.test_grpo_runs import PROMPTS
    from tokenizer import encode_texts, load_tokenizer, load_tokenizer_meta
    from trainer.weights import load_weights_from
    policy, _ = load_weights_from(str(model_dir), lambda m: None, tokenizer_dir=tok_dir)
    tm, _ = load_weights_from(str(teacher_dir), lambda m: None, tokenizer_dir=tok_dir)
    tok, bos = load_tokenizer(tok_dir), int(load_tokenizer_meta(tok_dir)["special_tokens"]["bos"]["id"])
    total, n = 0.0, 0
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([[bos] + encode_texts(tok, [p])[0]])
            q, t = (torch.log_softmax(m.eval()(ids)[0].double(), dim=-1) for m in (policy, tm))
            total += float((q.exp() * (q - t)).sum())
            n += ids.shape[1]
    return total / n


def test_distillation_alone_brings_the_policy_to_the_teacher(pretrained, teacher, tmp_path):
    """No reward function: the policy's exact reverse KL to the teacher falls by more than half over 16 steps, and
    the logged sampled estimate (each step's rollouts) is there and falls too."""
    out = tmp_path / "run"
    run_cmd(train_cmd(_distill_args(pretrained, tmp_path, teacher, "--max_iters=16", f"--out_dir={out}",
                                    "--num_generations=4", "--batch_size=4", "--learning_rate=1e-2")),
            env=child_env())
    rows = _rows(out)
    assert sorted(rows) == list(range(1, 17)) and all(r["reward"] == 0.0 for r in rows.values())
    kl = [rows[s]["teacher_kl"] for s in range(1, 17)]
    tok_dir = next(a.split("=", 1)[1] for a in pretrained["args"] if a.startswith("--tokenizer_dir"))
    before, after = (_exact_reverse_kl(d, teacher, tok_dir) for d in (pretrained["out"], out))
    assert after < 0.5 * before, (before, after)
    assert sum(kl[-3:]) < sum(kl[:3]), kl


def test_fsdp_two_ranks_equal_one_process(pretrained, teacher, tmp_path):
    """The teacher sharded by FSDP2 scores each rank's rollouts (a collective forward outside the step): the same
    global batch at 2 ranks gives one process's teacher KL, loss and weights."""
    from checkpoint.verify import find_latest_valid
    from checkpoint.weights import checkpoint_model_state
    from tests.trainer.test_end_to_end import final_weights
    one, two = tmp_path / "one", tmp_path / "two"
    run_cmd(train_cmd(_distill_args(pretrained, tmp_path, teacher, "--max_iters=2", f"--out_dir={one}",
                                    "--batch_size=2")), env=child_env())
    run_cmd(train_cmd(_distill_args(pretrained, tmp_path, teacher, "--max_iters=2", f"--out_dir={two}",
                                    "--batch_size=1", "--parallel=fsdp"), nproc=2), env=child_env())
    a, b = _rows(one), _rows(two)
    for s in (1, 2):
        assert abs(a[s]["teacher_kl"] - b[s]["teacher_kl"]) <= 1e-6 * abs(a[s]["teacher_kl"]), (s, a[s], b[s])
        assert abs(a[s]["loss"] - b[s]["loss"]) < 1e-6
    wa, wb = final_weights(one), checkpoint_model_state(find_latest_valid(str(two), log=lambda m: None))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_a_teacher_of_another_kind_is_refused():
    from model import ModelConfig
    from trainer.config import TrainConfig
    from trainer.tasks.grpo import GRPOTask
    task = GRPOTask(TrainConfig(task_type="grpo", reward_funcs="", teacher_kl_coef=1.0))
    kw = dict(vocab_size=448, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=64)
    assert "--ref_model has 1 outputs, the policy 448" in task.reference_problem(ModelConfig(**kw),
                                                                                  ModelConfig(**kw, num_labels=1))
    assert task.reference_problem(ModelConfig(**kw), ModelConfig(**dict(kw, vocab_size=512))) is None  # padded
    assert "--ref_model has 448 outputs, the policy 512" in task.reference_problem(
        ModelConfig(**dict(kw, vocab_size=512)), ModelConfig(**kw), 400)  # the policy could draw an id it lacks
