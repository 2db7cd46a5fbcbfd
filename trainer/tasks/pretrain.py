"""Pretraining: next-token loss over fixed-length samples of token shards (an index's train / val split, a
--data_mix of several corpora, or --eval_data_dir's whole shard folder for validation)."""
from __future__ import annotations

from dataset import PretokDataset, PretokDatasetWithIndex
from dataset.mixture import build_pretrain_mixture
from trainer.tasks.base import Task, TaskData
from trainer.tasks.data import check_data_tokenizer


class PretrainTask(Task):
    name = "pretrain"

    def datasets(self, tok_meta, val_ratio, fixed_shape, log):
        cfg = self.cfg
        eval_dir = cfg.eval_data_dir
        if cfg.data_mix:  # several corpora, sampled by weight; validation mixes their val splits alike
            root = cfg.data_dir or None
            train = build_pretrain_mixture(cfg.data_mix, cfg.max_seq_len, "train", seed=cfg.seed, data_root=root)
            val = None if eval_dir else \
                build_pretrain_mixture(cfg.data_mix, cfg.max_seq_len, "val", seed=cfg.seed, data_root=root)
        else:
            train = PretokDatasetWithIndex(cfg.data_dir, cfg.max_seq_len, split="train")
            val = None if eval_dir else PretokDatasetWithIndex(cfg.data_dir, cfg.max_seq_len, split="val")
        if eval_dir:  # every sample of that shard folder (L+1 tokens at stride L, as an index cuts them)
            val = PretokDataset(eval_dir, cfg.max_seq_len)
        for ds in (train.datasets if cfg.data_mix else [train]) + ([val] if eval_dir else []):
            shard = ds.stream.shards[0]  # list_shards made sure every shard of a directory agrees
            check_data_tokenizer(ds.data_dir, shard.fingerprint, shard.vocab_size, cfg.tokenizer_dir, tok_meta)
        splits = sorted({ds.meta.get("split_by", "sample") for ds in (train.datasets if cfg.data_mix else [train])})
        return TaskData(train, val, None, "samples",
                        f"--eval_data_dir={eval_dir}" if eval_dir else
                        f"the val split of the index of --data_dir, by {' and '.join(splits)}",
                        "rebuild the index with a larger --val_ratio or --val_samples, or give "
                        "--eval_data_dir=<shard folder>")
