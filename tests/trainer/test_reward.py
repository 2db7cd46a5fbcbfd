"""Reward modelling (--task_type=reward): the loss against its formula in Python floats, the whole rows and last-token
scores a micro-batch is made of against the model run on each pair's sequences alone, runs from the pretrained tiny
model (the chosen replies come to score above the rejected ones; two data-parallel ranks give the one-process run's
steps), the export read by transformers' *ForSequenceClassification with the scores the checkpoint gives, and the
refusals."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys

import pytest
import torch

from tests.conftest import ROOT, run_cmd, run_python, run_trainer, toy_dpo_pairs, train_cmd
from tests.trainer.test_end_to_end import _env
from utils.constants import IGNORE_INDEX
from utils.metrics import dedupe_by_step, read_metrics


def test_reward_loss_is_bradley_terry_with_the_centring_term_and_the_margin():
    from trainer.tasks.reward import reward_loss
    chosen, rejected, margin = [1.5, -0.25, 0.0, 2.0], [0.5, 0.75, -1.0, 2.0], [1.0, 0.0, -0.5, 3.0]
    for coef in (0.0, 0.01):
        for m in (None, margin):
            got = reward_loss(torch.tensor(chosen, dtype=torch.float64), torch.tensor(rejected, dtype=torch.float64),
                              coef, None if m is None else torch.tensor(m, dtype=torch.float64))
            for i, (c, r) in enumerate(zip(chosen, rejected)):
                want = -math.log(1 / (1 + math.exp(-(c - r - (m[i] if m else 0.0))))) + coef * (c + r) ** 2
                assert abs(float(got[i]) - want) < 1e-12


def _pairs():
    """test_kto's three pairs as the DPO collate gets them (shifted: input t, label t = token t + 1; the reply
    labelled)."""
    from tests.trainer.test_kto import _items
    raw, unshifted = _items()
    items = []
    for it in unshifted:
        items.append({})
        for side in ("chosen", "rejected"):
            items[-1].update({f"{side}_input_ids": it[f"{side}_ids"][:-1], f"{side}_labels": it[f"{side}_labels"][1:]})
    return raw, items


def test_whole_rows_end_with_the_replys_last_token_within_the_length():
    from dataset.dataset_dpo import dpo_collate
    from model.score_head import last_token_index, whole_rows
    raw, items = _pairs()
    batch = dpo_collate(pad_id=0)(items)
    ids, mask = whole_rows(batch["chosen_input_ids"], batch["chosen_labels"], batch["chosen_attention_mask"])
    for b, (prompt, chosen, _) in enumerate(raw):
        n = len(prompt) + len(chosen)
        assert ids[b, :n].tolist() == prompt + chosen and mask[b].tolist() == [1] * n + [0] * (mask.shape[1] - n)
        assert int(last_token_index(mask)[b]) == n - 1
    # a row already max_len long (its reply cut) stays as it is; so does one whose last label is ignored
    capped, cmask = whole_rows(batch["rejected_input_ids"], batch["rejected_labels"],
                               batch["rejected_attention_mask"], max_len=6)
    assert capped.shape[1] == 6 and capped[2].tolist() == [6, 7, 8, 9, 23, 24] and int(cmask[2].sum()) == 6
    labels = batch["chosen_labels"].clone()
    labels[0, 3] = IGNORE_INDEX  # row 0's last label (the reply's end) ignored
    ids2, mask2 = whole_rows(batch["chosen_input_ids"], labels, batch["chosen_attention_mask"])
    assert int(mask2[0].sum()) == 4 and ids2[0, :4].tolist() == [1, 2, 3, 10]


def _tiny_reward_model(seed: int = 0, **kw):
    from model import ModelConfig, Transformer
    from model.score_head import add_score_head
    torch.manual_seed(seed)
    model = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, multiple_of=16, max_seq_len=16,
                                    tie_embeddings=True, **kw))
    lm_embedding = model.embed_tokens.weight.detach().clone()
    add_score_head(model)
    assert torch.equal(model.embed_tokens.weight, lm_embedding)  # the language model's, untied from the head now
    assert model.lm_head.weight.shape == (1, 16) and model.cfg.num_labels == 1 and not model.cfg.tie_embeddings
    return model


def test_a_micro_batch_scores_each_sequence_as_the_model_run_on_it_alone():
    """The task's loss is reward_loss of the scores the model gives each whole sequence (prompt + reply) run alone,
    unpadded, at its last token: padding, the one forward of both sides and the whole rows change nothing."""
    from dataset.dataset_dpo import dpo_collate
    from trainer.config import TrainConfig
    from trainer.tasks.reward import RewardTask, reward_loss
    raw, items = _pairs()
    model = _tiny_reward_model()
    cfg = TrainConfig(task_type="reward", reward_center_coef=0.05, max_seq_len=16)
    loss, stats = RewardTask(cfg).micro_batch_loss(model, None, dpo_collate(pad_id=0)(items), torch.device("cpu"))
    with torch.no_grad():
        def alone(tokens):
            return float(model(torch.tensor([tokens]))[0, -1, 0])
        c = torch.tensor([alone(p + ch) for p, ch, _ in raw])
        r = torch.tensor([alone(p + rj) for p, _, rj in raw])
    assert abs(float(loss.detach()) - float(reward_loss(c, r, 0.05).sum())) < 1e-5
    assert abs(float(stats["reward_margin"]) - float((c - r).sum())) < 1e-5
    assert float(stats["reward_acc"]) == float((c > r).sum())
    # the pairs' margins (their records'), where the data has them, are subtracted inside the sigmoid
    m = [2.0, -1.0, 0.5]
    batch = dpo_collate(pad_id=0, margins=True)([dict(it, margin=torch.tensor(v)) for it, v in zip(items, m)])
    loss_m, _ = RewardTask(cfg).micro_batch_loss(model, None, batch, torch.device("cpu"))
    want = sum(-math.log(1 / (1 + math.exp(-(float(ci) - float(ri) - mi)))) + 0.05 * float(ci + ri) ** 2
               for ci, ri, mi in zip(c, r, m))
    assert abs(float(loss_m.detach()) - want) < 1e-5 and abs(want - float(loss.detach())) > 0.1


def test_lora_keeps_the_new_score_head_trainable():
    from model.lora import select_trainable
    model = _tiny_reward_model()
    what = select_trainable(model, lora_rank=2)
    assert "score head" in what and model.lm_head.weight.requires_grad and not model.embed_tokens.weight.requires_grad


def test_the_export_is_transformers_sequence_classifier_with_our_scores(tmp_path):
    """export_hf writes a LlamaForSequenceClassification (Qwen3's for a Qwen3 block, Qwen3-MoE's for its MoE) whose
    scores of a right-padded batch equal ours; import_hf reads it (and one transformers built) back as the same reward model."""
    from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    from model.hf_interop import export_hf, import_hf
    from model.score_head import last_token_scores
    pad = 31
    ids = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, pad, pad, pad]])
    mask = (ids != pad).long()
    moe = {"qk_norm": True, "moe_num_experts": 4, "moe_top_k": 2, "moe_hidden_dim": 8, "hidden_dim": 32}
    for kw, family in (({}, "LlamaForSequenceClassification"), ({"qk_norm": True, "attn_head_dim": 8},
                                                                  "Qwen3ForSequenceClassification"),
                       (moe, "Qwen3MoeForSequenceClassification")):
        ours = _tiny_reward_model(**kw).eval()
        out = export_hf(ours, str(tmp_path / family), special_ids={"pad_token_id": pad, "eos_token_id": 2})
        hf = AutoModelForSequenceClassification.from_pretrained(out).eval()
        assert type(hf).__name__ == family and hf.config.num_labels == 1
        with torch.no_grad():
            want = last_token_scores(ours, ids, mask)
            got = hf(input_ids=ids, attention_mask=mask).logits.float()
            assert torch.allclose(got, want, atol=1e-5), (got, want)
            back = import_hf(out).eval()
            assert back.cfg.num_labels == 1 and torch.equal(back.lm_head.weight, ours.lm_head.weight)
            assert torch.allclose(last_token_scores(back, ids, mask), want, atol=1e-6)
    torch.manual_seed(1)
    theirs = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_labels=2, pad_token_id=pad, max_position_embeddings=16)).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    mine = import_hf(str(tmp_path / "theirs")).eval()
    assert mine.cfg.num_labels == 2
    with torch.no_grad():
        assert torch.allclose(last_token_scores(mine, ids, mask), theirs(input_ids=ids, attention_mask=mask).logits,
                              atol=1e-5)


def _toy(tmp_path, n: int):
    return toy_dpo_pairs(tmp_path / "toy_prefs.jsonl", n)


def _args(tiny_pretrain_data, toy, init, out, *extra):
    return [f"--tokenizer_dir={tiny_pretrain_data['tokenizer_dir']}", "--max_seq_len=96", "--device=cpu",
            "--progress=false", "--peak_flops=1e11", "--log_interval=1", "--eval_interval=0", "--warmup_iters=2",
            "--seed=3", "--val_ratio=0.0", "--task_type=reward", f"--data_dir={toy}", f"--init_from={init}",
            f"--out_dir={out}", "--learning_rate=3e-3", *extra]


def test_a_reward_model_learns_the_preferences_and_exports(pretrained, tiny_pretrain_data, tmp_path):
    """From the pretrained language model: a new score head, the chosen replies come to score above the rejected ones
    (accuracy and margin up, loss down), and the export scores the pairs as the trainer does."""
    from transformers import AutoModelForSequenceClassification

    from dataset.dataset_dpo import build_dpo_splits
    from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
    from model.score_head import last_token_scores, whole_rows
    from trainer.weights import model_from_checkpoint
    out, toy = tmp_path / "rm", _toy(tmp_path, 16)
    r = run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], out, "--max_iters=12", "--batch_size=8",
                                "--checkpoint_interval=12")), env=_env())
    assert "[init] reward model: the blocks of " in r.stdout and "new score head (1 output" in r.stdout
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    first, last = (1, 2, 3), (10, 11, 12)
    assert sum(recs[s]["loss"] for s in last) < sum(recs[s]["loss"] for s in first) - 0.1, recs
    assert sum(recs[s]["reward_acc"] for s in last) > sum(recs[s]["reward_acc"] for s in first), recs
    assert all(0 <= recs[s]["reward_acc"] <= 1 for s in recs)
    assert all(abs(recs[s]["reward_margin"] - (recs[s]["chosen_reward"] - recs[s]["rejected_reward"])) < 1e-4
               for s in recs)
    from checkpoint.verify import find_latest_valid
    ckpt = find_latest_valid(str(out))
    hf_dir = tmp_path / "rm_hf"
    e = run_cmd([sys.executable, os.path.join(ROOT, "export_hf.py"),
                 f"--ckpt={ckpt}", f"--out_dir={hf_dir}"], env=_env())
    assert "LlamaForSequenceClassification" in e.stdout
    model, _ = model_from_checkpoint(ckpt)
    hf = AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    data = tokenize_dpo_records(str(toy), tiny_pretrain_data["tokenizer_dir"], 96)
    _, _, collate = build_dpo_splits(data, 96, val_ratio=0.0)
    train = build_dpo_splits(data, 96, val_ratio=0.0)[0]
    batch = collate([train[i] for i in range(4)])
    ids, mask = whole_rows(batch["chosen_input_ids"], batch["chosen_labels"], batch["chosen_attention_mask"],
                           max_len=96, pad_id=hf.config.pad_token_id)
    with torch.no_grad():
        ours = last_token_scores(model.eval(), ids, mask)
        theirs = hf(input_ids=ids, attention_mask=mask).logits.float()
    assert torch.allclose(ours, theirs, atol=1e-4), (ours, theirs)
    # eval_lm.py --preferences: the accuracy and margin of each pair scored alone here (unpadded, one row a forward)
    res = tmp_path / "eval.json"
    run_cmd([sys.executable, os.path.join(ROOT, "eval_lm.py"), f"--ckpt={out}", f"--preferences={toy}",
             "--device=cpu", f"--out={res}", "--batch_size=3", "--max_seq_len=96"], env=_env())
    got = json.loads(res.read_text())["preferences"][0]
    margins = []
    with torch.no_grad():
        for i in range(len(train)):
            side = []
            for s in ("chosen", "rejected"):
                x, y = train[i][f"{s}_input_ids"], train[i][f"{s}_labels"]
                grow = int(y[-1]) != IGNORE_INDEX and len(x) < 96  # (the reply's last token, within the length)
                side.append(torch.cat([x, y[-1:]]) if grow else x)
            c, r = (float(model(x[None])[0, -1, 0]) for x in side)
            margins.append(c - r)
    assert got["n"] == len(train) == 16 and got["acc"] == sum(m > 0 for m in margins) / 16, (got, margins)
    assert abs(got["margin"] - sum(margins) / 16) < 1e-4, (got, margins)


def test_a_run_on_pairs_with_margins_subtracts_them(pretrained, tiny_pretrain_data, tmp_path):
    """Pairs whose records carry "margin": 1.5 (one a step): each step's loss is -log sigma(r_c - r_r - 1.5) of the
    scores it logs, and the start says how many pairs carry one."""
    toy = tmp_path / "margins.jsonl"
    lines = _toy(tmp_path, 4).read_text(encoding="utf-8").splitlines()
    toy.write_text("".join(json.dumps(dict(json.loads(x), margin=1.5)) + "\n" for x in lines), encoding="utf-8")
    out = tmp_path / "rm"
    r = run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], out, "--max_iters=2", "--batch_size=1",
                                "--checkpoint_interval=100")), env=_env())
    assert "4 of 4 DPO pairs carry a margin" in r.stdout + r.stderr
    recs = dedupe_by_step(read_metrics(os.path.join(out, "metrics.jsonl")))
    assert sorted(recs) == [1, 2]
    for s, x in recs.items():
        d = x["chosen_reward"] - x["rejected_reward"]
        assert abs(x["loss"] - math.log1p(math.exp(-(d - 1.5)))) < 1e-5 * max(1.0, x["loss"]), (s, x)
        assert abs(x["loss"] - math.log1p(math.exp(-d))) > 1e-3


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_two_ranks_follow_one_process(pretrained, tiny_pretrain_data, tmp_path, engine):
    """2 ranks of 2 pairs each against one process accumulating the same two micro-batches: the same steps (to fp32
    summation order)."""
    toy = _toy(tmp_path, 12)
    common = ["--max_iters=3", "--batch_size=2", "--checkpoint_interval=100", "--reward_center_coef=0.01"]
    one = tmp_path / "one"
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], one, *common,
                            "--gradient_accumulation_steps=2")), env=_env())
    two = tmp_path / engine
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], two, *common, f"--parallel={engine}"), 2),
            env=_env())
    a, b = (dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))) for d in (one, two))
    assert sorted(a) == sorted(b) == [1, 2, 3] and a[3]["reward_margin"] != a[1]["reward_margin"]
    for s in a:
        for key in ("loss", "reward_margin", "chosen_reward"):
            assert abs(a[s][key] - b[s][key]) <= 1e-5 * max(1.0, abs(a[s][key])), (s, key, a[s][key], b[s][key])
    if engine == "fsdp":  # a sharded checkpoint exports shard by shard (export_hf_streaming): the same reward model
        from transformers import AutoModelForSequenceClassification
        for d in (one, two):
            run_cmd([sys.executable, os.path.join(ROOT, "export_hf.py"), f"--ckpt={d}", f"--out_dir={d}_hf",
                     "--max_shard_gb=0.00005"], env=_env())
        assert (tmp_path / "fsdp_hf" / "model.safetensors.index.json").exists()
        ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
        mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
        with torch.no_grad():
            got = [AutoModelForSequenceClassification.from_pretrained(f"{d}_hf").eval()(
                input_ids=ids, attention_mask=mask).logits for d in (one, two)]
        assert torch.allclose(got[0], got[1], atol=1e-4), got


def test_layouts_and_flags_a_reward_model_cannot_take_are_refused_in_one_line():
    from parallel.config import ParallelConfig
    from trainer.config import TrainConfig, TrainingError, engine_needs
    from trainer.validation import validate_config
    base = dataclasses.replace(TrainConfig(), task_type="reward", init_from="x", data_dir="d", tokenizer_dir="t")
    for flags, start in (({"pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
                          "--task_type=reward cannot be combined with --pipeline_parallel_size=2 (a reward model's"),
                         ({"tensor_parallel_size": 2, "parallel": "fsdp"},
                          "--task_type=reward cannot be combined with --tensor_parallel_size=2 (the LM head"),
                         ({"context_parallel_size": 2}, "--task_type=reward cannot be combined with "
                                                        "--context_parallel_size=2 (a row's score")):
        cfg = dataclasses.replace(base, **flags)
        problems = ParallelConfig.from_flags(cfg).problems(world_size=2, needs=engine_needs(cfg))
        assert sum(p.startswith(start) for p in problems) == 1, problems
    assert not ParallelConfig.from_flags(base).problems(world_size=2, needs=engine_needs(base))
    with pytest.raises(TrainingError, match=r"--sample_every=5 generates text: --task_type=reward trains a reward"):
        validate_config(dataclasses.replace(base, sample_every=5), world_size=1)


def test_a_lora_reward_run_resumes_exactly_and_language_model_uses_are_refused(pretrained, tiny_pretrain_data,
                                                                               tmp_path):
    """LoRA on a reward model (light checkpoints: the adapters and the new score head over the language model's frozen
    base): a crash at step 3, the resume from step 2 gives the uninterrupted run's losses bit for bit. Then SFT from
    the reward model: one line, exit 2; sample.py and eval_lm.py refuse it; its adapters load in PEFT over the export."""
    from tests.trainer.test_end_to_end import losses
    toy = _toy(tmp_path, 8)
    args = ["--max_iters=4", "--batch_size=4", "--checkpoint_interval=2", "--lora_rank=2"]
    ref, rm = tmp_path / "ref", tmp_path / "rm"
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], ref, *args)), env=_env())
    once = tmp_path / "fired"
    proc = run_trainer(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], rm, *args)),
                       env=_env(MYLLM_FAULT="crash@3", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists()
    run_cmd(train_cmd(_args(tiny_pretrain_data, toy, pretrained["out"], rm, *args, "--resume=always")), env=_env())
    assert losses(rm) == losses(ref) and sorted(losses(ref)) == [1, 2, 3, 4]
    sft = tmp_path / "sft"
    args = [a for a in _args(tiny_pretrain_data, toy, rm, sft, "--max_iters=1")
            if not a.startswith("--task_type")] + ["--task_type=sft"]
    r = run_trainer(train_cmd(args), env=_env())
    assert r.returncode == 2 and "is a reward model (a score head of 1 output(s), no LM head): --task_type=sft" \
        in r.stdout + r.stderr
    s = run_python([sys.executable, os.path.join(ROOT, "sample.py"), f"--ckpt={rm}", "--prompt=hi", "--device=cpu"],
                   env=_env())
    assert s.returncode == 2 and f"{rm} is a reward model (1 score(s) per sequence, no LM head)" in s.stderr
    ev = run_python([sys.executable, os.path.join(ROOT, "eval_lm.py"), f"--ckpt={rm}", "--device=cpu",
                     f"--perplexity_files={toy}"], env=_env())
    assert ev.returncode == 2 and f"{rm} is a reward model" in ev.stderr, ev.stderr[-2000:]
    lm = run_python([sys.executable, os.path.join(ROOT, "eval_lm.py"), f"--ckpt={pretrained['out']}", "--device=cpu",
                     f"--preferences={toy}"], env=_env())
    assert lm.returncode == 2 and "is a language model: --preferences scores pairs with a reward model" in lm.stderr
    # the adapters in PEFT's sequence-classification layout over the exported base: PEFT gives our scores
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForSequenceClassification

    from model.score_head import last_token_scores
    from trainer.weights import load_weights_from
    base, ad = tmp_path / "base", tmp_path / "ad"
    run_cmd([sys.executable, os.path.join(ROOT, "export_hf.py"), f"--ckpt={rm}", f"--out_dir={base}",
             f"--adapters_out_dir={ad}"], env=_env())
    assert json.loads((ad / "adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    ours, _ = load_weights_from(str(rm), lambda m: None)  # (the adapters merged)
    pm = peft.PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base), str(ad)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])
    with torch.no_grad():
        assert torch.allclose(pm(input_ids=ids).logits, last_token_scores(ours.eval(), ids), atol=1e-5)


def test_the_start_adds_a_head_to_a_language_model_and_refuses_other_heads():
    """trainer/start.py: a reward run on a language model's weights gets the new head; on a model of 2 scores, or a
    language-model run on a reward model, one line each (exit 2)."""
    from types import SimpleNamespace

    from model import ModelConfig, Transformer
    from trainer.config import TrainConfig, TrainingError
    from trainer.start import _score_head_for
    start, info = SimpleNamespace(resume_dir=None), {"source": "src"}
    lm = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, multiple_of=16, max_seq_len=16))
    lines = []
    _score_head_for(TrainConfig(task_type="reward"), lm, start, info, lines.append)
    assert lm.cfg.num_labels == 1 and lm.lm_head.weight.shape == (1, 16) and "[init] reward model" in lines[0]
    two = Transformer(ModelConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, multiple_of=16, max_seq_len=16,
                                  num_labels=2))
    for task, words in (("reward", "src gives 2 scores per sequence: --task_type=reward trains a reward model of 1"),
                        ("sft", "src is a reward model (a score head of 2 output(s), no LM head): --task_type=sft")):
        with pytest.raises(TrainingError, match=re.escape(words)) as e:
            _score_head_for(TrainConfig(task_type=task), two, start, info, lines.append)
        assert e.value.exit_code == 2
