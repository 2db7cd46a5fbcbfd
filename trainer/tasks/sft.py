"""Supervised fine-tuning: conversations rendered with the chat template, the loss on assistant replies only
(labels -100 elsewhere), optionally packed several to a row."""
from __future__ import annotations

from data_preprocess.chat_tokens import SFT
from data_preprocess.pretokenize_sft_data import tokenize_sft_records
from dataset.dataset_sft import build_sft_splits, pad_collate
from trainer.tasks.base import Task, TaskData
from trainer.tasks.data import chat_data


class SFTTask(Task):
    name = "sft"
    chat = True

    def datasets(self, tok_meta, val_ratio, fixed_shape, log):
        cfg = self.cfg
        data = chat_data(cfg, cfg.data_dir, tokenize_sft_records, SFT, tok_meta, "train", log)
        train, val, collate = build_sft_splits(data, cfg.max_seq_len, val_ratio=val_ratio, seed=cfg.seed,
                                               pack=cfg.sft_packing)
        if cfg.eval_data_dir:  # all of it: the "train" side of a split with no validation share
            ev = chat_data(cfg, cfg.eval_data_dir, tokenize_sft_records, SFT, tok_meta, "validation", log)
            val = build_sft_splits(ev, cfg.max_seq_len, val_ratio=0.0, seed=cfg.seed, pack=cfg.sft_packing)[0]
        if fixed_shape and not cfg.sft_packing:  # packed rows are max_seq_len already
            collate = pad_collate(int(tok_meta["special_tokens"]["pad"]["id"]), pad_to=cfg.max_seq_len)
        return TaskData(train, val, collate, "packed rows" if cfg.sft_packing else SFT.units,
                        *chat_val_words(cfg))


def chat_val_words(cfg) -> tuple[str, str]:
    """(where validation came from, what to do when it is small): the [data] line's words for SFT and DPO."""
    return (f"--eval_data_dir={cfg.eval_data_dir}" if cfg.eval_data_dir else f"--val_ratio={cfg.val_ratio} of --data_dir",
            "give a separate validation file with --eval_data_dir=<records> (or a larger --val_ratio)")
