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
from typing import Callable, Optional

import torch

from data_preprocess.chat_tokens import DPO, SFT, ChatTokens, read_summary
from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records  # raw SFT / DPO records: tokenized in memory
from data_preprocess.pretokenize_sft_data import tokenize_sft_records
from data_preprocess.shard_format import DataError
from dataset import PretokDataset, PretokDatasetWithIndex
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


MIN_VAL_SAMPLES = 20  # fewer validation samples (rows) than this: val_loss is noise, and the start warns


def _check_chat_tokenizer(path: str, meta_name: str, cfg: TrainConfig, tok_meta: dict) -> Optional[dict]:
    """The meta of a pretokenized SFT / DPO folder (None for raw records), checked against the run's tokenizer."""
    meta_path = os.path.join(path, meta_name)
    if not os.path.isfile(meta_path):
        return None
    meta = ckpt.read_json(meta_path)
    check_data_tokenizer(path, str(meta.get("tokenizer_fingerprint", "")),
                         int(meta.get("vocab_size", tok_meta["vocab_size"])), cfg.tokenizer_dir, tok_meta)
    return meta


def _chat_data(cfg: TrainConfig, path: str, tokenize, kind, tok_meta: dict, what: str, log):
    """What the SFT / DPO dataset reads for `path` (raw records tokenized here, or a pretokenized folder), with
    the account of what was read logged (rank 0): records, rows kept, truncated, dropped and skipped by reason,
    tokens."""
    meta = _check_chat_tokenizer(path, kind.meta_name, cfg, tok_meta)
    data = tokenize(path, cfg.tokenizer_dir, cfg.max_seq_len)
    if isinstance(data, ChatTokens):
        meta, tokens = data.meta, int(data.ids.size)
    else:
        tokens = int((meta or {}).get("num_tokens", 0))
    if log is not None and meta is not None:
        log(f"[data] {cfg.task_type} {what} {path}: {read_summary(kind, meta, tokens)}")
    return data


def build_data(cfg: TrainConfig, dp_rank: int, dp_size: int, tok_meta: dict, fixed_shape: bool = False,
               log: Optional[Callable[[str], None]] = None):
    """(train_loader, make_val_loader) for the task; loaders yield dicts of tensors.

    dp_rank / dp_size: this rank's data-parallel coordinates (the engine's: the ranks of one pipeline
    read the same batches). fixed_shape: every batch is [batch_size, max_seq_len] (pipeline stages
    exchange fixed-shape activations): SFT rows are padded to max_seq_len, validation batches are
    batch_size rows. --eval_data_dir: validation is read from there (all of it) instead of a split of
    --data_dir. `log` (rank 0's) gets what was read (SFT / DPO), the split's sizes, and a warning when
    validation has fewer than MIN_VAL_SAMPLES samples."""
    eval_dir = cfg.eval_data_dir
    val_ratio = 0.0 if eval_dir else cfg.val_ratio  # a separate validation set: every record of --data_dir trains
    if cfg.task_type == "pretrain":
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
        collate = None
        splits = sorted({ds.meta.get("split_by", "sample") for ds in (train.datasets if cfg.data_mix else [train])})
        unit, val_from = "samples", (f"--eval_data_dir={eval_dir}" if eval_dir else
                                     f"the val split of the index of --data_dir, by {' and '.join(splits)}")
        more = "rebuild the index with a larger --val_ratio or --val_samples, or give --eval_data_dir=<shard folder>"
    elif cfg.task_type in ("sft", "dpo"):
        sft = cfg.task_type == "sft"
        kind = SFT if sft else DPO
        tokenize = tokenize_sft_records if sft else tokenize_dpo_records
        data = _chat_data(cfg, cfg.data_dir, tokenize, kind, tok_meta, "train", log)
        if sft:
            train, val, collate = build_sft_splits(data, cfg.max_seq_len, val_ratio=val_ratio, seed=cfg.seed,
                                                   pack=cfg.sft_packing)
        else:
            train, val, collate = build_dpo_splits(data, cfg.max_seq_len, val_ratio=val_ratio, seed=cfg.seed)
        if eval_dir:  # all of it: the "train" side of a split with no validation share
            ev = _chat_data(cfg, eval_dir, tokenize, kind, tok_meta, "validation", log)
            val = (build_sft_splits(ev, cfg.max_seq_len, val_ratio=0.0, seed=cfg.seed, pack=cfg.sft_packing) if sft
                   else build_dpo_splits(ev, cfg.max_seq_len, val_ratio=0.0, seed=cfg.seed))[0]
        if sft and fixed_shape and not cfg.sft_packing:  # packed rows are max_seq_len already
            collate = pad_collate(int(tok_meta["special_tokens"]["pad"]["id"]), pad_to=cfg.max_seq_len)
        unit = "packed rows" if sft and cfg.sft_packing else kind.units
        val_from = f"--eval_data_dir={eval_dir}" if eval_dir else f"--val_ratio={cfg.val_ratio} of --data_dir"
        more = "give a separate validation file with --eval_data_dir=<records> (or a larger --val_ratio)"
    else:
        raise TrainingError(f"--task_type={cfg.task_type!r}: expected pretrain, sft or dpo", EXIT_BAD_CONFIG)
    if log is not None:
        log(f"[data] {cfg.task_type}: {len(train)} training / {len(val)} validation {unit} (validation: {val_from})")
        if 0 < len(val) < MIN_VAL_SAMPLES:
            log(f"[warning] data: only {len(val)} validation {unit} ({val_from}): a val_loss over fewer than "
                f"{MIN_VAL_SAMPLES} is noise; {more}")
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
