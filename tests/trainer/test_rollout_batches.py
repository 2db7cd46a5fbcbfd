"""Several prompts' rollouts decoded together (--rollout_batch_prompts, trainer/tasks/grpo_rollout.py sample_groups,
model/decode.py prefill_groups): prompts of different lengths left-padded in one batch draw, group by group, what each
group draws alone (its own generator), with the same log-probabilities up to rounding, for every block the decoder
computes itself (GQA, sliding windows, latent attention, Gemma 2's capped scores, Gemma 3's local RoPE, sinks, MoE)
and for the model's own forward (the fallback: FSDP2 / tensor-parallel models), with the KV cache and with whole-row
forwards; the trainer's GRPO runs take the flag (one process, FSDP2 and tensor parallelism at 2 ranks); on-policy
distillation's replies: tests/trainer/test_distill_on_policy.py."""
from __future__ import annotations

import json

import pytest
import torch

import model.decode as decode
from model import ModelConfig, Transformer
from trainer.tasks.grpo_rollout import sample_group, sample_groups

PROMPTS = [[1, 5, 9, 3], [7, 2], [4, 4, 8, 1, 6, 2, 3], [9]]  # lengths 4, 2, 7, 1: three rows padded
G, NEW = 3, 12
MLA = dict(n_kv_heads=4, kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)
GEMMA = dict(sandwich_norms=True, scale_embeddings=True, mlp_act="gelu_tanh", query_scale=12.0, attn_head_dim=16)
BLOCKS = {"gqa": {}, "window": dict(sliding_window=5), "mla": MLA,
          "gemma2": dict(GEMMA, attn_softcap=0.5, final_softcap=2.0),
          "gemma3": dict(GEMMA, qk_norm=True, sliding_window=5, rope_local_theta=10000.0),
          "sinks_moe": dict(attn_sinks=True, sliding_window=5, qkv_bias=True, moe_num_experts=4, moe_top_k=2,
                            moe_hidden_dim=16)}


def _model(kw: dict) -> Transformer:
    torch.manual_seed(0)
    base = dict(vocab_size=48, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32, hidden_dim=96,
                initializer_range=0.2)  # wide init: peaked, varied predictions
    return Transformer(ModelConfig(**{**base, **kw})).double()  # fp64: no draw near a tie flips by rounding


def _rollouts(model, use_cache: bool) -> tuple[list, list]:
    """(the groups decoded together, each decoded alone): the same generators' seeds, penalty and stop id."""
    args = dict(temperature=0.9, top_p=1.0, stop_ids=[0], pad_id=0, repetition_penalty=1.3, use_cache=use_cache,
                row_len=24)

    def gens():
        return [torch.Generator().manual_seed(10 + i) for i in range(len(PROMPTS))]
    together = sample_groups(model, PROMPTS, G, NEW, generators=gens(), **args)
    alone = [sample_group(model, p, G, NEW, generator=g, **args) for p, g in zip(PROMPTS, gens())]
    return together, alone


@pytest.mark.parametrize("fast", [True, False], ids=["decoder", "model_forward"])
@pytest.mark.parametrize("block", list(BLOCKS))
def test_groups_decoded_together_draw_what_each_draws_alone(monkeypatch, block, fast):
    model = _model(BLOCKS[block])
    assert decode.fast_path_applies(model)
    if not fast:  # the model's own forward over the cache (what FSDP2 / tensor-parallel models decode with)
        monkeypatch.setattr(decode, "fast_path_applies", lambda m: False)
    eps = torch.finfo(torch.float32).eps  # (the log-probabilities are kept in fp32)
    for use_cache in (True, False):
        together, alone = _rollouts(model, use_cache)
        for (t1, m1, l1), (t2, m2, l2) in zip(together, alone):
            n = t2.shape[1]  # a group done first decodes on with its rows masked: its extra columns are empty
            assert torch.equal(t1[:, :n], t2) and torch.equal(m1[:, :n], m2), (block, use_cache)
            assert not m1[:, n:].any() and not l1[:, n:].any() and (t1[:, n:] == 0).all()
            assert (l1[:, :n] - l2).abs().max().item() <= 4 * eps * max(1.0, l2.abs().max().item())
        lengths = {int(m.sum()) for _, m, _ in alone}
        assert len(lengths) > 1  # the groups end at different steps


def test_without_the_padding_rule_the_groups_differ(monkeypatch):
    """The check above fails when the pads are attended to (the rule this feature adds, taken away)."""
    model = _model({})
    real = decode.Decoder.padded

    def attend_to_pads(pads, past, T):
        positions, keys = real(pads, past, T)
        return positions, torch.ones_like(keys)
    monkeypatch.setattr(decode.Decoder, "padded", staticmethod(attend_to_pads))
    together, alone = _rollouts(model, use_cache=True)
    worst = max((l1[:, :l2.shape[1]] - l2).abs().max().item() for (_, _, l1), (_, _, l2) in zip(together, alone))
    assert worst > 1e-3


def test_the_flag_is_checked():
    from trainer.config import TrainConfig
    from trainer.tasks.grpo_flags import sampling_problems
    bad = TrainConfig(task_type="grpo", rollout_batch_prompts=-1)
    assert any(p.startswith("--rollout_batch_prompts=-1:") for p in sampling_problems(bad))
    assert not any("rollout_batch_prompts" in p for p in sampling_problems(TrainConfig(task_type="grpo")))


# ------------------------------------------------------------------------------ the trainer

def _prompt_file(tmp_path) -> str:
    """Prompts of several token lengths (the batch pads them)."""
    texts = ["1 plus 2 is", "what is 3 plus 4", "two", "say a long sentence about five and six", "7 is",
             "count to four please", "9 plus", "and then eight"]
    path = tmp_path / "prompts_varied.jsonl"
    path.write_text("".join(json.dumps({"prompt": t, "answer": "x"}) + "\n" for t in texts), encoding="utf-8")
    return str(path)


def _grpo(pretrained, tmp_path, out, *extra):
    from tests.trainer.test_grpo_runs import _args
    args = _args(pretrained, tmp_path, "--max_iters=2", f"--out_dir={out}", "--max_completion_length=6", *extra)
    return [a if not a.startswith("--data_dir=") else f"--data_dir={_prompt_file(tmp_path)}" for a in args]


def _samples(out) -> list:
    return [(s["step"], s["prompt"], s["completion"]) for s in map(json.loads, (out / "samples.jsonl").read_text()
                                                                     .splitlines())]


def test_grpo_batched_rollouts_follow_one_group_at_a_time(pretrained, tmp_path):
    """One process, 2 prompts a micro-batch: decoded together (0 = the micro-batch) or one group at a time, the
    same completions and rewards, losses within fp32 rounding; FSDP2 at 2 ranks (its forward all-gathers: the
    model's own forward decodes, every rank as many steps) with 2 prompts a rank, and tensor parallelism at 2 (each
    rank decoding with its share of the heads), follow the one-process run."""
    from tests.conftest import child_env, run_cmd, train_cmd
    from tests.trainer.test_grpo_runs import _rows
    two = ["--rollout_batch_prompts=0", "--parallel=fsdp"]
    runs = {"one_by_one": ["--rollout_batch_prompts=1"], "together": ["--rollout_batch_prompts=0"],
            "fsdp2": [*two, "--batch_size=2"],  # (2 prompts a rank)
            "tp2": [*two, "--tensor_parallel_size=2"]}  # (one data-parallel rank: the decode of each tensor rank)
    rows = {}
    for name, flags in runs.items():
        out = tmp_path / name
        batch = [] if name == "fsdp2" else ["--batch_size=2", "--gradient_accumulation_steps=2"]
        run_cmd(train_cmd(_grpo(pretrained, tmp_path, out, "--num_completions_to_print=32", *batch, *flags),
                          nproc=1 if name in ("one_by_one", "together") else 2), env=child_env())
        rows[name] = _rows(out)
        if name != "fsdp2":
            rows[name + "_samples"] = _samples(out)
    assert rows["together_samples"] == rows["one_by_one_samples"] and len(rows["together_samples"]) == 2 * 16
    assert rows["tp2_samples"] == rows["one_by_one_samples"]
    for name in ("together", "fsdp2", "tp2"):
        for s in (1, 2):
            a, b = rows["one_by_one"][s], rows[name][s]
            for k in ("reward", "reward_std", "completion_length"):
                assert abs(a[k] - b[k]) <= 1e-12 * max(1.0, abs(a[k])), (name, s, k)
            assert abs(a["loss"] - b["loss"]) < 1e-6, (name, s)

