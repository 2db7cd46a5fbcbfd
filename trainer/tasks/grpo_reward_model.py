"""GRPO's reward from a reward model (--reward_model): a --task_type=reward run or checkpoint, or a Hugging Face
*ForSequenceClassification directory, scoring each prompt + completion as it was trained to score prompt + reply.

The model reads the policy's own token ids: the prompt as the rollout encoded it (the chat template up to the
assistant's header) and the completion through its stop token (<|im_end|>), which is the rendering of a DPO pair's
prompt + reply the reward model trained on. So the two tokenizers must be one: checked once at the start (the same
vocabulary), never re-tokenized from text. A prompt's completions are scored together, right-padded, at each row's
last token (model/score_head.py), without gradients, in the run's compute dtype on an accelerator.

Owns: `ModelReward` (the loaded scorer: `many(prompt_ids, completion_ids)`), `load_model_reward` (its checks, one
line each, exit 2). Must never: train the reward model, or score text re-tokenized by another tokenizer.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from model.score_head import last_token_scores
from trainer.config import TrainingError
from utils.constants import EXIT_BAD_CONFIG


class ModelReward:
    """A reward model's score of a prompt's completions (RewardSet calls `many`)."""

    def __init__(self, model: Any, device: Any, pad_id: int) -> None:
        self.model, self.device, self.pad_id = model, device, int(pad_id)

    @torch.no_grad()
    def many(self, prompt_ids: Sequence[int], completion_ids: Sequence[Sequence[int]]) -> list[float]:
        """The score of prompt + each completion (its tokens through the stop token), read at its last token."""
        rows = [list(prompt_ids) + list(c) for c in completion_ids]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            mask[i, :len(r)] = 1
        scores = last_token_scores(self.model, ids.to(self.device), mask.to(self.device))[:, 0]
        return [float(v) for v in scores.cpu()]


def _tokenizer_dir_of(info: dict) -> str:
    """Where the reward model's tokenizer is: our checkpoint's recorded --tokenizer_dir, else the directory itself (a
    Hugging Face model's own files)."""
    from utils.checkpoint_json import read_checkpoint_json
    from utils.checkpoint_layout import RUN_CONFIG
    src = info["source"]
    if info["kind"] == "ours" and os.path.exists(os.path.join(src, RUN_CONFIG)):
        recorded = read_checkpoint_json(src, RUN_CONFIG).get("tokenizer_dir")
        if isinstance(recorded, str) and recorded:
            return recorded
    return src


def load_model_reward(path: str, policy_tok: Any, row_len: int, device: Any, dtype: torch.dtype,
                      pad_id: int, log: Callable[[str], None]) -> ModelReward:
    """--reward_model's scorer, on `device` (weights in `dtype`: the run's compute dtype on an accelerator, fp32 on
    the CPU), frozen. TrainingError (exit 2) for a language model, more than one score, another tokenizer, or rows
    longer than its max_seq_len."""
    from tokenizer import load_tokenizer
    from trainer.weights import load_weights_from
    model, info = load_weights_from(path, log, flag="--reward_model")
    n = model.cfg.num_labels
    if n != 1:
        what = "a language model (no score head)" if n == 0 else f"a model with {n} scores per sequence"
        raise TrainingError(f"--reward_model={path}: {what}; a reward model (--task_type=reward's, or a Hugging Face "
                            "*ForSequenceClassification with num_labels 1) gives one", EXIT_BAD_CONFIG)
    tok_dir = _tokenizer_dir_of(info)
    try:
        same = load_tokenizer(tok_dir).get_vocab() == policy_tok.get_vocab()
    except Exception as e:  # noqa: BLE001 - no tokenizer there, or one that does not load
        raise TrainingError(f"--reward_model={path}: its tokenizer ({tok_dir}) does not load: "
                            f"{' '.join(str(e).split())[:200]}", EXIT_BAD_CONFIG) from e
    if not same:
        raise TrainingError(f"--reward_model={path}: its tokenizer ({tok_dir}) is not the run's --tokenizer_dir; the "
                            "reward model scores the policy's token ids (re-tokenizing the text is not built)",
                            EXIT_BAD_CONFIG)
    if row_len > model.cfg.max_seq_len:
        raise TrainingError(f"--reward_model={path}: its max_seq_len {model.cfg.max_seq_len} < the rollouts' rows of "
                            f"{row_len} tokens (--max_prompt_length + --max_completion_length)", EXIT_BAD_CONFIG)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    log(f"[grpo] reward model {info['source']}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{dtype} on {device}, scoring prompt + completion at its last token")
    return ModelReward(model, device, pad_id)
