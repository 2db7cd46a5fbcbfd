"""What differs between pretraining, SFT and DPO, in one place: their data, the loss of one
micro-batch, what a loss is averaged over (target tokens or preference pairs), and the validation
figures. The trainer's loop (train_my_ddp.py) is the same for all three and asks this module.

Owns: `build_data` (train loader + a maker of validation loaders for the task, checked against the
tokenizer the run uses), `micro_batch_loss` (sum of per-unit losses + DPO's reward sums, kept on the
device), `count_units` / `count_tokens` (from the host batch: no device read), `evaluate` (mean
validation loss over every data-parallel rank; DPO adds the reward accuracy).
Must never: branch on the engine (parallel/engine.py hides it), or read a device value per micro-batch.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records  # raw SFT / DPO records: tokenized in memory
from data_preprocess.pretokenize_sft_data import tokenize_sft_records
from data_preprocess.shard_format import DataError
from dataset import PretokDatasetWithIndex
from dataset.dataset_dpo import build_dpo_splits
from dataset.dataset_sft import build_sft_splits, pad_collate
from dataset.loader import ResumableLoader
from dataset.mixture import build_pretrain_mixture
from parallel.engine import StepStats
from trainer.config import TrainConfig, TrainingError
from utils import checkpoint as ckpt
from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA, IGNORE_INDEX
from utils.device import is_accelerator, to_device
from utils.dist import DistInfo
from utils.dpo_loss import dpo_loss


# ---------------------------------------------------------------------------- data

def check_data_tokenizer(data_dir: str, fingerprint: str, vocab_size: int, tokenizer_dir: str, tok_meta: dict) -> None:
    """Token files must come from the tokenizer the run uses: same fingerprint (when the files
    record one) and same vocabulary size. Anything else trains on ids that mean other words."""
    want_fp, want_vocab = str(tok_meta.get("fingerprint", "")), int(tok_meta["vocab_size"])
    if (fingerprint and want_fp and fingerprint != want_fp) or int(vocab_size) != want_vocab:
        raise DataError(f"{data_dir} were tokenized with another tokenizer (fingerprint {fingerprint[:12] or '?'}, "
                        f"vocab {vocab_size}) than --tokenizer_dir={tokenizer_dir} (fingerprint {want_fp[:12]}, "
                        f"vocab {want_vocab}); re-tokenize the data with this tokenizer, or pass the one it was "
                        "made with")


def build_data(cfg: TrainConfig, dp_rank: int, dp_size: int, tok_meta: dict, fixed_shape: bool = False):
    """(train_loader, make_val_loader) for the task; loaders yield dicts of tensors.

    dp_rank / dp_size: this rank's data-parallel coordinates (the engine's: the ranks of one pipeline
    read the same batches). fixed_shape: every batch is [batch_size, max_seq_len] (pipeline stages
    exchange fixed-shape activations): SFT rows are padded to max_seq_len, validation batches are
    batch_size rows."""

    if cfg.task_type == "pretrain":
        if cfg.data_mix:  # several corpora, sampled by weight; validation mixes their val splits alike
            root = cfg.data_dir or None
            train = build_pretrain_mixture(cfg.data_mix, cfg.max_seq_len, "train", seed=cfg.seed, data_root=root)
            val = build_pretrain_mixture(cfg.data_mix, cfg.max_seq_len, "val", seed=cfg.seed, data_root=root)
        else:
            train = PretokDatasetWithIndex(cfg.data_dir, cfg.max_seq_len, split="train")
            val = PretokDatasetWithIndex(cfg.data_dir, cfg.max_seq_len, split="val")
        for ds in (train.datasets if cfg.data_mix else [train]):
            shard = ds.stream.shards[0]  # list_shards made sure every shard of a directory agrees
            check_data_tokenizer(ds.data_dir, shard.fingerprint, shard.vocab_size, cfg.tokenizer_dir, tok_meta)
        collate = None
    elif cfg.task_type == "sft":
        sft_meta = os.path.join(cfg.data_dir, "sft_meta.json")
        if os.path.isfile(sft_meta):  # pretokenized: made with which tokenizer?
            meta = ckpt.read_json(sft_meta)
            check_data_tokenizer(cfg.data_dir, str(meta.get("tokenizer_fingerprint", "")),
                                 int(meta.get("vocab_size", tok_meta["vocab_size"])), cfg.tokenizer_dir, tok_meta)
        train, val, collate = build_sft_splits(tokenize_sft_records(cfg.data_dir, cfg.tokenizer_dir, cfg.max_seq_len),
                                               cfg.max_seq_len, val_ratio=cfg.val_ratio, seed=cfg.seed,
                                               pack=cfg.sft_packing)
        if fixed_shape and not cfg.sft_packing:  # packed rows are max_seq_len already
            collate = pad_collate(int(tok_meta["special_tokens"]["pad"]["id"]), pad_to=cfg.max_seq_len)
    elif cfg.task_type == "dpo":
        dpo_meta = os.path.join(cfg.data_dir, "dpo_meta.json")
        if os.path.isfile(dpo_meta):  # pretokenized (data_preprocess.pretokenize_dpo_data): which tokenizer?
            meta = ckpt.read_json(dpo_meta)
            check_data_tokenizer(cfg.data_dir, str(meta.get("tokenizer_fingerprint", "")),
                                 int(meta.get("vocab_size", tok_meta["vocab_size"])), cfg.tokenizer_dir, tok_meta)
        train, val, collate = build_dpo_splits(tokenize_dpo_records(cfg.data_dir, cfg.tokenizer_dir, cfg.max_seq_len),
                                               cfg.max_seq_len, val_ratio=cfg.val_ratio, seed=cfg.seed)
    else:
        raise TrainingError(f"--task_type={cfg.task_type!r}: expected pretrain, sft or dpo", EXIT_BAD_CONFIG)
    per_step = cfg.batch_size * dp_size * cfg.gradient_accumulation_steps  # samples per optimizer step
    if len(train) < per_step:
        raise TrainingError(f"{cfg.data_dir}: {len(train)} training samples, fewer than one global batch "
                            f"({cfg.batch_size} x {dp_size} data-parallel ranks x {cfg.gradient_accumulation_steps} "
                            "accumulation steps)", EXIT_BAD_DATA)
    # the cursor counts samples of G = per_step: any (ranks, batch, accumulation) with the same G resumes it
    train_loader = ResumableLoader(train, cfg.batch_size, cfg.seed, dp_rank, dp_size,
                                   collate_fn=collate, shuffle=True, samples_per_step=per_step)

    def make_val_loader():
        if len(val) < (cfg.batch_size if fixed_shape else 1) * dp_size:
            return None
        bs = cfg.batch_size if fixed_shape else max(1, min(cfg.batch_size, len(val) // dp_size))
        return ResumableLoader(val, bs, cfg.seed, dp_rank, dp_size, collate_fn=collate, shuffle=False)

    return train_loader, make_val_loader


def prefetch_depth(cfg: TrainConfig, device) -> int:
    """Training batches drawn ahead (--prefetch_batches; -1 = 2 on an accelerator, 0 on the CPU)."""
    if cfg.prefetch_batches >= 0:
        return cfg.prefetch_batches
    return 2 if is_accelerator(device) else 0


# ---------------------------------------------------------------------------- one micro-batch

def micro_batch_loss(cfg: TrainConfig, model, ref_model, batch: dict, device) -> tuple[torch.Tensor, dict]:
    """(sum of the per-unit losses of this micro-batch, sums of logged statistics).

    A unit is a target token for pretrain/SFT and a preference pair for DPO; the caller divides by
    the number of units over all micro-batches and ranks, so every token (pair) weighs the same.
    """
    if cfg.task_type != "dpo":
        x, y = to_device(batch["input_ids"], device), to_device(batch["labels"], device)  # pinned, async
        kw = {k: to_device(batch[k], device) for k in ("attention_mask", "position_ids") if k in batch}
        return model(x, labels=y, reduction="sum", **kw), {}

    def seq_logps(m, prefix: str) -> torch.Tensor:
        x = to_device(batch[f"{prefix}_input_ids"], device)
        y = to_device(batch[f"{prefix}_labels"], device)
        kw = {"attention_mask": to_device(batch[f"{prefix}_attention_mask"], device)} \
            if f"{prefix}_attention_mask" in batch else {}
        per_token = m(x, labels=y, reduction="none", **kw)  # -log p, 0 at ignored positions
        return -per_token.float().sum(dim=-1)

    pc, pr = seq_logps(model, "chosen"), seq_logps(model, "rejected")
    with torch.no_grad():
        rc, rr = seq_logps(ref_model, "chosen"), seq_logps(ref_model, "rejected")
    losses, ch_r, rj_r = dpo_loss(pc, pr, rc, rr, beta=cfg.dpo_beta, loss_type=cfg.dpo_loss,
                                  label_smoothing=cfg.dpo_label_smoothing)
    stats = {"chosen_reward": ch_r.detach().sum(), "rejected_reward": rj_r.detach().sum(),  # stay on the device
             "reward_acc": (ch_r > rj_r).float().sum()}
    return losses.sum(), stats


def count_units(cfg: TrainConfig, batch: dict) -> int:
    if cfg.task_type == "dpo":
        return int(batch["chosen_input_ids"].shape[0])
    return int((batch["labels"] != IGNORE_INDEX).sum())


def count_tokens(batch: dict) -> int:
    """Real tokens the policy model reads in this micro-batch, for tokens/s and MFU: padding (attention_mask
    0, on the host here) is not counted; without a mask every position is a token."""
    n = 0
    for k, v in batch.items():
        if k.endswith("input_ids"):
            mask = batch.get(k[:-len("input_ids")] + "attention_mask")
            n += int(mask.sum()) if mask is not None else int(v.numel())
    return n


@torch.no_grad()
def evaluate(cfg: TrainConfig, engine, ref_model, make_val_loader, info: DistInfo) -> Optional[dict]:
    """Mean validation loss over all data-parallel ranks: all-reduce of loss sums and unit counts.
    Reads --eval_iters batches (rounded up to whole groups when the engine runs them in groups: a
    pipeline's micro-batches), or one pass over the split when that is shorter."""
    loader = make_val_loader()
    if loader is None:
        return None
    group = engine.micro_batches_per_call
    batches: list = []
    it = iter(loader)
    while len(batches) < -(-cfg.eval_iters // group) * group:
        batches.append(next(it))
        if loader.state_dict().get("epoch", 0) > 0 and len(batches) % group == 0:  # one pass is enough
            break
    sums = engine.evaluate(batches, lambda model, batch: micro_batch_loss(cfg, model, ref_model, batch, info.device),
                           lambda batch: count_units(cfg, batch))
    per_unit = StepStats.from_tensor(engine.sum_over_data(sums, info.device)).per_unit()
    out = {"val_loss": per_unit["loss"]}
    if cfg.task_type == "dpo":
        out["val_reward_acc"] = per_unit["reward_acc"]
    return out
