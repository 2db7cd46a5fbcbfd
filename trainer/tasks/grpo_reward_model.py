"""GRPO's reward from a reward model (--reward_model): a --task_type=reward run or checkpoint, or a Hugging Face
*ForSequenceClassification directory, scoring each prompt + completion as it was trained to score prompt + reply.

With the run's own tokenizer (the same vocabulary, checked at the start) the model reads the policy's token ids: the
prompt as the rollout encoded it (the chat template up to the assistant's header) and the completion through its stop
token (<|im_end|>), which is the rendering of a DPO pair's prompt + reply the reward model trained on. With another
tokenizer (an off-the-shelf reward model of another family) it reads the text as TRL renders it: a chat prompt's
messages + the completion as the assistant's turn through the reward model's chat template, or the plain prompt +
completion, encoded by its own tokenizer. A prompt's completions are scored together, right-padded, at each row's
last token (model/score_head.py), without gradients, in the run's compute dtype on an accelerator.

Owns: `ModelReward` (the loaded scorer: `many`), `load_model_reward` (its checks, one line each, exit 2).
Must never: train the reward model, or feed it ids of a tokenizer other than its own.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from dataset.chat_dataset import right_pad
from model.score_head import last_token_scores
from trainer.config import TrainingError
from utils.constants import EXIT_BAD_CONFIG


class ModelReward:
    """A reward model's score of a prompt's completions (RewardSet calls `many`): from the policy's token ids when
    the two tokenizers are one, else (`tok` given) from the text rendered and tokenized by the reward model's own."""

    def __init__(self, model: Any, device: Any, pad_id: int, tok: Any = None, messages_field: str = "messages",
                 log: Callable[[str], None] = lambda line: None) -> None:
        self.model, self.device, self.pad_id = model, device, int(pad_id)
        self.tok, self.messages_field, self.log = tok, messages_field, log
        self.cut = 0  # text rows longer than the reward model's max_seq_len (the first one logged)

    @torch.no_grad()
    def many(self, prompt: str, completions: Sequence[str], record: dict, prompt_ids: Sequence[int],
             completion_ids: Sequence[Sequence[int]]) -> list[float]:
        """The score of prompt + each completion, read at its last token."""
        if self.tok is None:  # the policy's ids: the prompt as encoded, the completion through its stop token
            rows = [list(prompt_ids) + list(c) for c in completion_ids]
        else:
            rows = [self._text_ids(prompt, c, record) for c in completions]
        ids, _, mask = right_pad(rows, pad_id=self.pad_id)
        scores = last_token_scores(self.model, ids.to(self.device), mask.to(self.device))[:, 0]
        return [float(v) for v in scores.cpu()]

    def _text_ids(self, prompt: str, completion: str, record: dict) -> list[int]:
        """The reward model's ids of one answer (as TRL renders it): a chat prompt's messages + the completion as the
        assistant's turn through the reward model's chat template, or the plain prompt + completion text encoded with
        its special tokens; the last max_seq_len tokens when longer."""
        turns = record.get(self.messages_field) if isinstance(record, dict) else None
        if turns is not None:
            from trainer.tasks.grpo_data import prompt_messages
            chat = prompt_messages(turns) + [{"role": "assistant", "content": completion}]
            ids = self.tok(self.tok.apply_chat_template(chat, tokenize=False), add_special_tokens=False)["input_ids"]
        else:
            ids = self.tok(prompt + completion)["input_ids"]
        limit = self.model.cfg.max_seq_len
        if len(ids) > limit:
            self.cut += 1
            if self.cut == 1:
                self.log(f"[grpo] reward model: a prompt + completion of {len(ids)} of its tokens is longer than its "
                         f"max_seq_len {limit}: scored on its last {limit} tokens, as is every such row after it")
            ids = ids[-limit:]
        return list(ids)


def _tokenizer_dir_of(info: dict) -> str:
    """Where the reward model's tokenizer is: our checkpoint's recorded --tokenizer_dir, else the directory itself (a
    Hugging Face model's own files)."""
    from utils.checkpoint_json import recorded_tokenizer
    src = info["source"]
    return (recorded_tokenizer(src) if info["kind"] == "ours" else None) or src


def load_model_reward(path: str, policy_tok: Any, row_len: int, device: Any, dtype: torch.dtype,
                      pad_id: int, log: Callable[[str], None], messages_field: str = "messages") -> ModelReward:
    """--reward_model's scorer, on `device` (weights in `dtype`: the run's compute dtype on an accelerator, fp32 on
    the CPU), frozen: from token ids with the run's tokenizer, from text with another. TrainingError (exit 2) for a
    language model, more than one score, a tokenizer that does not load, or (the same tokenizer) rows longer than its
    max_seq_len."""
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
        tok = load_tokenizer(tok_dir)
    except Exception as e:  # noqa: BLE001 - no tokenizer there, or one that does not load
        raise TrainingError(f"--reward_model={path}: its tokenizer ({tok_dir}) does not load: "
                            f"{' '.join(str(e).split())[:200]}", EXIT_BAD_CONFIG) from e
    same = tok.get_vocab() == policy_tok.get_vocab()
    if same and row_len > model.cfg.max_seq_len:
        raise TrainingError(f"--reward_model={path}: its max_seq_len {model.cfg.max_seq_len} < the rollouts' rows of "
                            f"{row_len} tokens (--max_prompt_length + --max_completion_length)", EXIT_BAD_CONFIG)
    if not same and tok.pad_token_id is None and getattr(tok, "eos_token_id", None) is None:
        raise TrainingError(f"--reward_model={path}: its tokenizer ({tok_dir}) has no pad or eos token to pad rows "
                            "with", EXIT_BAD_CONFIG)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    how = ("the policy's token ids (the same tokenizer)" if same else
           f"the text re-rendered by its own tokenizer ({tok_dir}: not the run's)")
    log(f"[grpo] reward model {info['source']}: {sum(p.numel() for p in model.parameters()):,} parameters, "
        f"{dtype} on {device}, scoring prompt + completion at its last token from {how}")
    if same:
        return ModelReward(model, device, pad_id)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    return ModelReward(model, device, pad, tok, messages_field, log)
