"""GRPO runs of train_my_ddp.py (--task_type=grpo) from the suite's tiny pretrained model: a run logs rewards,
lengths and the logprob parity, and writes its rollouts to samples.jsonl; one step at 2 gloo ranks equals one
process with the same global batch (same completions, same weights); a run stopped and resumed draws the same
completions and ends with the same weights, bit for bit; a reward that raises stops the run with one line."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from tests.conftest import child_env, run_cmd, run_trainer, train_cmd
from tests.trainer.test_end_to_end import final_weights
from utils.metrics import dedupe_by_step, read_metrics

PROMPTS = [f"{a} plus {b} is" for a in range(1, 7) for b in range(1, 3)]


def _args(pretrained, tmp_path, *extra) -> list[str]:
    prompts = tmp_path / "prompts.jsonl"
    if not prompts.exists():
        prompts.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in PROMPTS), encoding="utf-8")
    d = dict(a.split("=", 1) for a in pretrained["args"] if a.startswith("--tokenizer_dir"))
    return [f"--init_from={pretrained['out']}", "--task_type=grpo", f"--data_dir={prompts}", *[f"{k}={v}" for k, v in d.items()],
            "--reward_funcs=", "--reward_fn=tests.trainer.grpo_toy_rewards:vowels", "--num_generations=4",
            "--max_prompt_length=12", "--max_completion_length=8", "--batch_size=2", "--learning_rate=1e-3",
            "--lr_schedule=constant", "--warmup_iters=0", "--eval_interval=0", "--log_interval=1", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--seed=3", "--checkpoint_interval=2", "--threads=1", *extra]


def _rows(out) -> dict:
    return dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))


def test_grpo_run_logs_rewards_parity_and_samples(pretrained, tmp_path):
    out = tmp_path / "run"
    proc = run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=3", f"--out_dir={out}",
                                   "--generation_kv_cache=false", f"--eval_data_dir={tmp_path / 'prompts.jsonl'}",
                                   "--eval_interval=2")), env=child_env())
    rows = _rows(out)
    assert f"done: 3 steps, final val_reward {rows[3]['val_reward']:.4f}," in proc.stdout, proc.stdout[-1500:]
    from checkpoint.select import select_checkpoint
    best = select_checkpoint(str(out), "best", log=lambda m: None)  # a run without val_loss: the highest val_reward
    saved = {s: json.loads((out / "checkpoints" / f"step_{s:08d}" / "trainer_state.json").read_text())
             for s in (2, 3)}
    assert saved[2]["val_reward"] == rows[2]["val_reward"] and saved[3]["val_reward"] == rows[3]["val_reward"]
    assert best.endswith(f"step_{max((2, 3), key=lambda s: (rows[s]['val_reward'], s)):08d}")  # a tie: the newer
    assert sorted(rows) == [1, 2, 3]
    assert "val_reward" not in rows[1] and rows[2]["val_prompts"] == rows[3]["val_prompts"] == len(PROMPTS)
    assert rows[3]["val_reward"] == rows[3]["val_reward_tests.trainer.grpo_toy_rewards.vowels"]
    assert abs(rows[3]["val_reward"] - greedy_reference(out, pretrained)) < 1e-12
    for r in rows.values():
        assert 0 <= r["reward"] <= 1 and r["reward"] == r["reward_tests.trainer.grpo_toy_rewards.vowels"]
        assert r["reward_std"] == r["reward_tests.trainer.grpo_toy_rewards.vowels_std"] > 0
        assert 1 <= r["completion_length"] <= 8 and r["reward_std"] > 0 and r["entropy"] > 0
        assert r["logprob_diff_max"] == 0.0 and r["logprob_diff_mean"] == 0.0  # whole-row sampling: bit-equal
        assert r["clip_ratio"] == 0.0  # one update per rollout: the ratio is exactly 1
    samples = [json.loads(s) for s in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1] * 4 + [2] * 4 + [3] * 4
    assert all(s["prompt"] in PROMPTS and isinstance(s["reward"], float) for s in samples)


def test_soft_overlong_rewards_each_completions_length(pretrained, tmp_path):
    """--reward_funcs=soft_overlong with a buffer of the whole length (8): each completion scores -L / 8, so a step's
    mean soft_overlong reward is minus its mean completion length (through the stop token) over 8; the total adds the
    other reward."""
    out = tmp_path / "run"
    run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={out}", "--reward_funcs=soft_overlong",
                            "--soft_punish_cache=8")), env=child_env())
    rows = _rows(out)
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert abs(r["reward_soft_overlong"] + r["completion_length"] / 8) < 1e-12, r
        vowels = r["reward_tests.trainer.grpo_toy_rewards.vowels"]
        assert abs(r["reward"] - (r["reward_soft_overlong"] + vowels)) < 1e-12 and r["reward_soft_overlong"] < 0


def test_a_reward_written_for_trl_trains_as_ours(pretrained, tmp_path):
    """The vowels reward written for TRL's GRPOTrainer (all completions at once) gives the run of ours: the same
    rewards, losses and gradient norms step by step."""
    rows = {}
    for name in ("vowels", "trl_vowels"):
        out = tmp_path / name
        run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={out}",
                                f"--reward_fn=tests.trainer.grpo_toy_rewards:{name}")), env=child_env())
        rows[name] = _rows(out)
    for s in (1, 2):
        a, b = rows["vowels"][s], rows["trl_vowels"][s]
        assert (a["reward"], a["loss"], a["grad_norm"]) == (b["reward"], b["loss"], b["grad_norm"]), (a, b)
        assert b["reward_tests.trainer.grpo_toy_rewards.trl_vowels"] == a["reward"] and a["reward_std"] > 0


def test_a_reward_not_applicable_to_a_completion_is_left_out(pretrained, tmp_path):
    """A TRL-style reward returning None for half the prompts (one task of several): every completion's reward is
    the others' sum plus it where it applies (samples.jsonl holds every completion here), its logged mean is over the
    completions it applied to, and the held-out evaluation does the same."""
    out = tmp_path / "run"
    odd, vow = "reward_tests.trainer.grpo_toy_rewards.trl_odd_only", "reward_tests.trainer.grpo_toy_rewards.vowels"
    run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={out}", "--num_completions_to_print=8",
                            "--reward_funcs=tests.trainer.grpo_toy_rewards:trl_odd_only", "--reward_weights=2,1",
                            f"--eval_data_dir={tmp_path / 'prompts.jsonl'}", "--eval_interval=2")), env=child_env())
    rows, samples = _rows(out), [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert {x[odd] is None for x in samples} == {True, False}  # both kinds of prompt were drawn
    for s in (1, 2):
        mine = [x for x in samples if x["step"] == s]
        assert len(mine) == 8
        for x in mine:
            applies = int(x["prompt"].split()[0]) % 2 == 1
            assert (x[odd] is not None) == applies and (not applies or x[odd] == x[vow]), x
            assert abs(x["reward"] - (x[vow] + (2 * x[odd] if applies else 0.0))) < 1e-12, x
        applied = [x[odd] for x in mine if x[odd] is not None]
        assert abs(rows[s][odd] - sum(applied) / len(applied)) < 1e-12, (rows[s], applied)
        assert abs(rows[s]["reward"] - sum(x["reward"] for x in mine) / 8) < 1e-12
    # held out: the greedy answers of the odd prompts score their vowels; the mean is over them
    odd_prompts = [p for p in PROMPTS if int(p.split()[0]) % 2]
    assert abs(rows[2][f"val_{odd}"] - greedy_reference(out, pretrained, odd_prompts)) < 1e-12, rows[2]
    assert rows[2]["val_prompts"] == len(PROMPTS)


def greedy_reference(out, pretrained, prompts=PROMPTS) -> float:
    """The mean vowels reward of each prompt's greedy completion by the run's final weights, one prompt at a time
    (the evaluation batches prompts of equal length): tokens up to the first stop id, at most 8."""
    from model.generate import generate
    from tokenizer import encode_texts, load_tokenizer, load_tokenizer_meta
    from tests.trainer.grpo_toy_rewards import vowels
    from trainer.weights import load_weights_from
    tok_dir = next(a.split("=", 1)[1] for a in pretrained["args"] if a.startswith("--tokenizer_dir"))
    model, _ = load_weights_from(str(out), lambda m: None, tokenizer_dir=tok_dir)
    tok, sp = load_tokenizer(tok_dir), load_tokenizer_meta(tok_dir)["special_tokens"]
    stops = [int(sp["eos"]["id"]), int(sp["im_end"]["id"])]
    total = 0.0
    for p in prompts:
        ids = [int(sp["bos"]["id"])] + encode_texts(tok, [p])[0]
        new = generate(model, torch.tensor([ids]), 8, temperature=0.0, stop_ids=stops)[0, len(ids):].tolist()
        new = new[:next((j for j, t in enumerate(new) if t in stops), len(new))]
        total += vowels(p, tok.decode(new, skip_special_tokens=True), {})
    return total / len(prompts)


def _losses(out) -> dict:
    return {s: r["loss"] for s, r in _rows(out).items()}


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_two_ranks_equal_one_process(pretrained, tmp_path, scale):
    """The same global batch (2 prompts x 4 completions) at 2 gloo ranks x 1 prompt and at 1 process x 2 prompts:
    the same completions (rewards to the last bit of their sums), losses and weights up to float summation order;
    --scale_rewards=batch divides by the std of both ranks' rewards."""
    one, two = tmp_path / "one", tmp_path / "two"
    held = f"--eval_data_dir={tmp_path / 'prompts.jsonl'}"  # the training prompts: _args writes them
    run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={one}", "--batch_size=2", held,
                            f"--scale_rewards={scale}")), env=child_env())
    run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={two}", "--batch_size=1", held,
                            f"--scale_rewards={scale}"), nproc=2), env=child_env())
    a, b = _rows(one), _rows(two)
    assert a[2]["val_prompts"] == b[2]["val_prompts"] == len(PROMPTS)  # split over the ranks, each scored once
    # the same prompts, batches and greedy tokens; the weights differ by summation order (below), so a near tie
    # could flip one token: within one prompt's reward (vowels is in [0, 1])
    assert abs(a[2]["val_reward"] - b[2]["val_reward"]) <= 1 / len(PROMPTS)
    for s in (1, 2):
        for k in ("reward", "reward_std", "completion_length"):  # float64 sums of host values
            assert abs(a[s][k] - b[s][k]) <= 1e-12 * max(1.0, abs(a[s][k])), (s, k, a[s][k], b[s][k])
        assert abs(a[s]["entropy"] - b[s]["entropy"]) < 1e-6 * a[s]["entropy"]  # fp32 sums, in another order
        assert abs(a[s]["loss"] - b[s]["loss"]) < 1e-6
    assert a[2]["reward"] != a[1]["reward"]  # step 2 drew other completions
    wa, wb = final_weights(one), final_weights(two)
    for k in wa:  # as test_grad_accumulation_equals_big_batch: Adam's 1/sqrt(v) magnifies summation-order noise
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)
    assert any(not torch.equal(wa[k], final_weights_start(pretrained)[k]) for k in wa)


def final_weights_start(pretrained) -> dict:
    return final_weights(pretrained["out"])


@pytest.mark.parametrize("batch_prompts", ["1", "0"])
def test_crash_and_resume_draws_the_same_completions(pretrained, tmp_path, batch_prompts):
    """A crash at step 3 resumed from the step-2 checkpoint: the same losses, rewards and weights, bit for bit
    (the rollouts of step 3 and 4 are a function of seed, step and prompt; nothing about them is saved), one group
    at a time or the micro-batch's groups decoded together. The length is --num_train_epochs: each rollout trains
    --num_iterations=2 steps, so an epoch is twice the prompt batches (TRL's count), 1/3 of an epoch 4 steps."""
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    base = _args(pretrained, tmp_path, "--num_train_epochs=0.3333333", "--num_iterations=2", "--temperature=0.8",
                 "--top_p=0.9", "--min_p=0.001", "--repetition_penalty=1.1", "--beta=0.05", "--loss_type=grpo",
                 "--mask_truncated_completions=true", f"--rollout_batch_prompts={batch_prompts}")
    proc = run_cmd(train_cmd([*base, f"--out_dir={ref}"]), env=child_env())
    assert ("--num_train_epochs=0.333333: 1 epoch = 12 steps of 2 samples, each trained on for 2 steps (12 training "
            "samples) -> max_iters=4") in proc.stdout, proc.stdout[-3000:]
    proc = run_trainer(train_cmd([*base, f"--out_dir={crashed}"]),
                       env=child_env(MYLLM_FAULT="crash@3", MYLLM_FAULT_ONCE_FILE=str(tmp_path / "fired")))
    assert proc.returncode != 0 and max(_losses(crashed)) == 2
    run_cmd(train_cmd([*base, f"--out_dir={crashed}", "--init_from=resume"]), env=child_env())
    a, b = _rows(ref), _rows(crashed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        for k in ("loss", "reward", "kl", "clip_ratio", "grad_norm"):
            assert a[s][k] == b[s][k], (s, k)
    assert a[2]["kl"] > 0  # beta > 0: the reference is the initial weights, the policy moved
    wa, wb = final_weights(ref), final_weights(crashed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    steps = [json.loads(s)["step"] for s in (ref / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == [1, 3]  # num_iterations=2: rollouts at steps 1 and 3, reused at 2 and 4


def test_a_reward_that_raises_stops_the_run_with_one_line(pretrained, tmp_path):
    out = tmp_path / "run"
    proc = run_trainer(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={out}",
                                       "--reward_fn=tests.trainer.grpo_toy_rewards:broken")), env=child_env())
    assert proc.returncode == 3, proc.stderr[-2000:]
    want = ("reward tests.trainer.grpo_toy_rewards.broken raised ZeroDivisionError (no score for "
            f"{PROMPTS[0]}) on the record at")
    assert want in proc.stderr + proc.stdout, proc.stderr[-2000:]
    # --tools naming a function without a schema (no type hints): one line at the start, exit 2
    proc = run_trainer(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={tmp_path / 't'}",
                                       "--tools=tests.trainer.grpo_toy_rewards:vowels")), env=child_env())
    assert proc.returncode == 2 and "--tools 'tests.trainer.grpo_toy_rewards:vowels': no JSON schema from " \
        "its signature and docstring" in proc.stderr, proc.stderr[-2000:]


def test_lora_and_zero_at_two_ranks(pretrained, tmp_path):
    """GRPO on LoRA adapters under ZeRO-1 at 2 ranks runs its steps with gradients (the rollouts sample from the
    adapted model, ZeRO's updated weights gathered before them); pipeline stages and sequence parallelism are
    refused in one line."""
    out = tmp_path / "lora"
    run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={out}", "--batch_size=1",
                            "--lora_rank=4", "--use_distributed_optimizer=true"), nproc=2), env=child_env())
    rows = _rows(out)
    assert sorted(rows) == [1, 2] and all(r["grad_norm"] > 0 for r in rows.values())
    proc = run_trainer(train_cmd(_args(pretrained, tmp_path, "--max_iters=1", f"--out_dir={tmp_path / 'f'}",
                                       "--pipeline_parallel_size=2"), nproc=2), env=child_env())
    assert proc.returncode == 2
    assert "--task_type=grpo cannot be combined with --pipeline_parallel_size=2 (sampling (GRPO's rollouts, " \
           "on-policy distillation's replies) runs a forward per generated token on every rank" in proc.stderr
    proc = run_trainer(train_cmd(_args(pretrained, tmp_path, "--max_iters=1", f"--out_dir={tmp_path / 's'}",
                                       "--parallel=fsdp", "--tensor_parallel_size=2", "--sequence_parallel=true"),
                                 nproc=2), env=child_env())
    assert proc.returncode == 2
    assert "--task_type=grpo cannot be combined with --sequence_parallel=true (decoding feeds one position" \
        in proc.stderr, proc.stderr[-2000:]


def test_fsdp_two_ranks_equal_one_process(pretrained, tmp_path):
    """FSDP2 at 2 ranks: every rank decodes as many tokens (its forward all-gathers), in the rollouts and in the
    held-out evaluation, and the step equals one process's with the same global batch."""
    one, two = tmp_path / "one", tmp_path / "two"
    run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={one}", "--batch_size=2")),
            env=child_env())
    run_cmd(train_cmd(_args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={two}", "--batch_size=1",
                            "--parallel=fsdp", f"--eval_data_dir={tmp_path / 'prompts.jsonl'}"), nproc=2),
            env=child_env())
    a, b = _rows(one), _rows(two)
    assert b[2]["val_prompts"] == len(PROMPTS)  # FSDP: both ranks decoded as many batches (no hang)
    for s in (1, 2):
        for k in ("reward", "reward_std", "completion_length"):  # float64 sums of host values, in another order
            assert abs(a[s][k] - b[s][k]) <= 1e-12 * max(1.0, abs(a[s][k])), (s, k, a[s][k], b[s][k])
        assert abs(a[s]["loss"] - b[s]["loss"]) < 1e-6
    from checkpoint.verify import find_latest_valid
    from checkpoint.weights import checkpoint_model_state
    wa, wb = final_weights(one), checkpoint_model_state(find_latest_valid(str(two), log=lambda m: None))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


_CP_TP_RUN = ["--max_iters=2", "--max_prompt_length=11", "--beta=0.04", "--num_iterations=2", "--eval_interval=2",
              "--eval_num_generations=2"]


@pytest.fixture(scope="module")
def one_process_cp_tp(pretrained, tmp_path_factory) -> tuple:
    """The one-process run (whole logits) the cp / tp layouts below are compared with: (rows, final weights)."""
    d = tmp_path_factory.mktemp("grpo_one")
    run_cmd(train_cmd(_args(pretrained, d, *_CP_TP_RUN, f"--eval_data_dir={d / 'prompts.jsonl'}",
                            f"--out_dir={d / 'one'}")), env=child_env())
    return _rows(d / "one"), final_weights(d / "one")


@pytest.mark.parametrize("layout", [["--context_parallel_size=2"], ["--parallel=fsdp", "--tensor_parallel_size=2"],
                                    ["--context_parallel_size=2", "--chunked_logprobs=true"],
                                    ["--parallel=fsdp", "--tensor_parallel_size=2", "--chunked_logprobs=true"]],
                         ids=["cp2", "tp2", "cp2_chunked", "tp2_chunked"])
def test_context_and_tensor_parallel_two_ranks_equal_one_process(pretrained, one_process_cp_tp, tmp_path, layout):
    """--context_parallel_size=2: both ranks roll out the replica's prompts alike on whole sequences (the cp switch
    off while decoding, held-out answers too), then each trains on its chunks of the rows (19 tokens padded to 20,
    whole 2 x cp chunks), the per-token log-probabilities, the reference's (--beta) and the sampling policy's
    (--num_iterations=2) gathered into whole rows. --tensor_parallel_size=2: each rank decodes with its half of the
    heads (a KV cache of its key/value heads) and the gathered logits, so both draw the same tokens. Either way: the
    completions, losses, rewards, KL and entropy of one process, and its sampled held-out answers
    (--eval_num_generations=2: their mean and best reward). --chunked_logprobs: the trainer's log-probabilities
    and entropies chunk by chunk in the head (under tp from each rank's vocabulary shard), the same values."""
    two = tmp_path / "two"
    proc = run_cmd(train_cmd(_args(pretrained, tmp_path, *_CP_TP_RUN, f"--eval_data_dir={tmp_path / 'prompts.jsonl'}",
                                   f"--out_dir={two}", *layout), nproc=2), env=child_env())
    assert ("context 2" if "context" in layout[0] else "tensor 2") in proc.stdout, proc.stdout[-2000:]
    (a, wa), b = one_process_cp_tp, _rows(two)
    assert sorted(a) == sorted(b) == [1, 2]
    for s in (1, 2):
        for k in ("reward", "reward_std", "completion_length"):  # the same completions
            assert a[s][k] == b[s][k], (s, k, a[s][k], b[s][k])
        for k in ("loss", "kl", "entropy"):
            assert abs(a[s][k] - b[s][k]) <= 1e-5 * max(1.0, abs(a[s][k])), (s, k, a[s][k], b[s][k])
    assert a[2]["kl"] > 0 and a[2]["val_reward"] == b[2]["val_reward"]  # 2 sampled answers per held-out prompt
    assert a[2]["val_reward_best"] == b[2]["val_reward_best"] >= b[2]["val_reward"]
    from checkpoint.verify import find_latest_valid
    from checkpoint.weights import checkpoint_model_state
    wb = checkpoint_model_state(find_latest_valid(str(two), log=lambda m: None))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", [["--loss_type=cispo", "--importance_sampling_level=sequence"],
                                     ["--delta=1.3", "--importance_sampling_level=sequence"],
                                     ["--loss_type=sapo", "--sapo_temperature_pos=2", "--sapo_temperature_neg=2"],
                                     ["--top_entropy_quantile=0.2"]],
                         ids=["cispo", "delta", "sapo", "top_entropy"])
def test_loss_variants_reach_the_step(pretrained, one_process_cp_tp, tmp_path, variant):
    """--loss_type=cispo / sapo, --delta, --importance_sampling_level=sequence and --top_entropy_quantile (their
    math: test_grpo_loss.py) run through the trainer: the completions of the default objective's run, another loss
    where the objective differs (CISPO's -A log p and the top-entropy tokens' share from the first step; the
    sequence-level clip once the reused rollout's ratios move, step 2). SAPO at temperature 2 on both sides: at
    ratio 1 (step 1) every token's term is -(4/2) sigmoid(0) A = -A, and the mean over completions of their
    advantages is 0 (each group's sum to 0): the step's loss is 0 (with the default temperatures, 1 and 1.05, this
    run's step 1 logs -0.037: the temperatures reach the loss)."""
    out = tmp_path / "run"
    run_cmd(train_cmd(_args(pretrained, tmp_path, *_CP_TP_RUN, f"--eval_data_dir={tmp_path / 'prompts.jsonl'}",
                            f"--out_dir={out}", *variant)), env=child_env())
    (a, _), b = one_process_cp_tp, _rows(out)
    for s in (1, 2):
        assert a[s]["reward"] == b[s]["reward"] and math.isfinite(b[s]["loss"]), (s, b[s])
    assert abs(b[2]["loss"] - a[2]["loss"]) > 1e-6 * max(1.0, abs(a[2]["loss"])), (a[2]["loss"], b[2]["loss"])
    if "--loss_type=cispo" in variant or "--top_entropy_quantile=0.2" in variant:
        assert abs(b[1]["loss"] - a[1]["loss"]) > 1e-6 * max(1.0, abs(a[1]["loss"])), (a[1]["loss"], b[1]["loss"])
    if "--loss_type=sapo" in variant:
        assert abs(b[1]["loss"]) < 1e-6 and b[1]["reward_std"] > 0, b[1]


def test_rows_longer_than_the_model_are_refused(pretrained, tmp_path):
    proc = run_trainer(train_cmd(_args(pretrained, tmp_path, "--max_iters=1", f"--out_dir={tmp_path / 'r'}",
                                       "--max_prompt_length=20", "--max_completion_length=20")), env=child_env())
    assert proc.returncode == 2
    assert ("--max_prompt_length=20 + --max_completion_length=20 = 40 tokens per row, more than the model's "
            "max_seq_len 32") in proc.stderr, proc.stderr[-2000:]


def test_an_moe_policy_trains_and_counts_only_its_training_forwards(tiny_pretrain_run_args, tmp_path):
    """GRPO on a mixture-of-experts policy (4 experts, top 2, every block MoE; DeepSeek and Qwen3 RL MoE models):
    the run trains and logs the balancing metrics, and each step's expert loads are those of its training forward
    alone, 8 rows x 20 positions x top 2 = 320 per layer (the rollouts' decoding and the held-out answers route
    tokens too, but must neither count nor move the selection biases); the biases moved."""
    moe = ["--moe_num_experts=4", "--moe_top_k=2", "--moe_hidden_dim=16"]
    base = tmp_path / "base"
    run_cmd(train_cmd([*tiny_pretrain_run_args, *moe, "--max_iters=4", f"--out_dir={base}"]), env=child_env())
    out = tmp_path / "grpo"
    run_cmd(train_cmd(_args({"out": base, "args": tiny_pretrain_run_args}, tmp_path, "--max_iters=2",
                            f"--out_dir={out}", "--moe_aux_loss_coef=0.01", "--moe_bias_update_rate=0.01",
                            f"--eval_data_dir={tmp_path / 'prompts.jsonl'}", "--eval_interval=1")), env=child_env())
    rows = _rows(out)
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        assert math.isfinite(r["loss"]) and 0 <= r["reward"] <= 1 and "val_reward" in r
        assert [sum(layer) for layer in r["moe_tokens_per_expert"]] == [2 * 4 * 20 * 2] * 2, r["moe_tokens_per_expert"]
        assert 0.5 < r["moe_aux_loss"] <= 2
    start, end = final_weights(base), final_weights(out)
    assert not torch.equal(start["layers.0.mlp.expert_bias"], end["layers.0.mlp.expert_bias"])
