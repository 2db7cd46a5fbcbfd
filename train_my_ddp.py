"""Train a Llama2-style model: pretraining, SFT or DPO, on one process or many (torchrun).

    python train_my_ddp.py [config.py ...] --out_dir=out/run --data_dir=... --tokenizer_dir=...
    torchrun --standalone --nproc_per_node=2 train_my_ddp.py ...        (same flags)

    torchrun --standalone --nproc_per_node=4 train_my_ddp.py ... --pipeline_parallel_size=2   (2 stages x 2 dp)

One loop for every task, world size and engine: the same wrapper, optimizer, clipping, loss scaler and
precision policy whether or not the run is distributed; our DDP, FSDP2 (--parallel=fsdp) and pipeline
stages (--pipeline_parallel_size) sit behind parallel/engine.py (`engine.forward_backward`, `evaluate`,
`save`, `load`). Read it top to bottom: configuration -> process group -> model -> engine + optimizer
-> data -> resume -> the loop (lr, micro-batches, token-normalised loss, step, log, evaluate, samples,
checkpoint) -> final evaluation.

Exit codes (utils/constants.py): 0 done, 2 bad configuration, 3 bad data (also shards made with
another tokenizer), 4 non-finite loss, 5 a checkpoint or weights directory that cannot be loaded,
75 interrupted by SIGTERM/SIGINT after saving a checkpoint, 76 a loss spike stopped the run (--spike_guard:
the step is in <out_dir>/spike.json; the supervisor rolls back, replays, skips data). 2, 3, 4 and 5 print one line
"[rank R] error: ..." on stderr and are never retried by monitor_process.py; any other failure is a
crash (exit 1, traceback) that the supervisor restarts.

Running the same command again continues the run (--resume=auto, the default): from the newest valid
checkpoint in --out_dir, or, before the first one, the way <out_dir>/run_start.json records the run
started (a crash before the first checkpoint must not restart from random weights); an --out_dir holding
neither starts a new run from --init_from. --resume=always (alias --init_from=resume) must continue
(exit 2 when there is nothing), --resume=never must not (exit 2 when --out_dir holds checkpoints).

--help, a typo, a bad value and a path that is not there are answered before torch is imported
(train_config.precheck), with the same line and exit code as below.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import pickle
import signal
import sys
import time
from typing import Any, Optional

PROG = "train_my_ddp.py"
if __name__ == "__main__":  # answered in a second: --help, typos, bad values, missing paths (no torch yet)
    from train_config import precheck
    precheck(sys.argv[1:], title=__doc__.strip().splitlines()[0], prog=PROG)

import torch  # after the pre-check, which must not wait for it

from configurator import ConfigError, help_text, parse_config, save_config_json
from train_config import (TrainConfig, TrainingError, continues_run, existing_run_error, max_iters_for_epochs,
                          nothing_to_continue_error, one_line, resume_flag, validate_config)
from utils import checkpoint as ckpt
from utils.constants import (EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_INTERRUPTED,
                             EXIT_NONFINITE_LOSS, EXIT_OK, IGNORE_INDEX)
from utils.device import HostCopy, low_precision_cpu_warning, memory_stats, parse_dtype, seed_everything, synchronize
from utils.dist import DistInfo, all_reduce_max, barrier, destroy, init_distributed
from utils.lr_schedule import lr_at
from utils.metrics import MetricsLogger, Throughput, format_line
from utils.run_config import DATA_KEYS, global_batch_problem, resolve_resume_config, same_value


# ---------------------------------------------------------------------------- fault hooks (tests)

def _fault(kind: str, step: int) -> bool:
    """MYLLM_FAULT=kind@step fires once per MYLLM_FAULT_ONCE_FILE (used by the supervisor tests).

    Kinds: crash (exit 1 at the start of the step), hang (park forever there), kill_in_save (SIGKILL
    in the middle of that step's checkpoint save), nan_loss (that step's loss is NaN), and two loss
    spikes keyed on the DATA, not the step (so skipping the data makes them go away; see
    `_spike_fault`): spike_data@D (the step that trains on data step D) and spike_token@T (the
    micro-batches holding token id T: a corrupt sample in real shards).
    """
    spec = os.environ.get("MYLLM_FAULT", "")
    if not spec or "@" not in spec:
        return False
    k, s = spec.split("@", 1)
    if k != kind or int(s) != step:
        return False
    once = os.environ.get("MYLLM_FAULT_ONCE_FILE")
    if once:
        if os.path.exists(once):
            return False
        with open(once, "w") as f:
            f.write(spec)
    return True


def _fire_step_faults(step: int) -> None:
    if _fault("crash", step):
        print(f"[fault] crash@{step}", flush=True)
        os._exit(1)
    if _fault("hang", step):
        print(f"[fault] hang@{step}", flush=True)
        while True:
            time.sleep(3600)


def _has_token(batch: dict, token: int) -> bool:
    return any(bool((v == token).any()) for k, v in batch.items() if k.endswith("input_ids"))


def _spike_fault(data_step: int, batches: list) -> Optional[tuple[float, Optional[int]]]:
    """(factor, token or None) when an injected loss spike hits this step's data, else None.

    spike_data@D fires on the step that trains on data step D, spike_token@T on the micro-batches
    holding token id T; both fire every time that data is read again (a replay from a checkpoint
    reproduces them), or once with MYLLM_FAULT_ONCE_FILE (a one-off fault of the machine). The loss
    and the gradients of the hit micro-batches are multiplied by MYLLM_FAULT_SPIKE_FACTOR (default 100).
    Pipeline stages compute their loss inside the schedule and ignore these hooks."""
    spec = os.environ.get("MYLLM_FAULT", "")
    factor = float(os.environ.get("MYLLM_FAULT_SPIKE_FACTOR", "100"))
    if spec.startswith("spike_data@") and _fault("spike_data", data_step):
        return factor, None
    if spec.startswith("spike_token@"):
        token = int(spec.split("@", 1)[1])
        if any(_has_token(b, token) for b in batches) and _fault("spike_token", token):
            return factor, token
    return None


def _spiked(loss_fn, factor: float, token: Optional[int]):
    """loss_fn with its loss sum (hence its gradients) multiplied by `factor` on the hit micro-batches."""
    def fn(model, batch):
        loss_sum, stats = loss_fn(model, batch)
        return (loss_sum * factor if token is None or _has_token(batch, token) else loss_sum), stats
    return fn


# ---------------------------------------------------------------------------- data

def check_data_tokenizer(data_dir: str, fingerprint: str, vocab_size: int, tokenizer_dir: str, tok_meta: dict) -> None:
    """Token files must come from the tokenizer the run uses: same fingerprint (when the files
    record one) and same vocabulary size. Anything else trains on ids that mean other words."""
    from data_preprocess.shard_format import DataError
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
    from dataset.loader import ResumableLoader

    if cfg.task_type == "pretrain":
        from dataset import PretokDatasetWithIndex
        if cfg.data_mix:  # several corpora, sampled by weight; validation mixes their val splits alike
            from dataset.mixture import build_pretrain_mixture
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
        from dataset.dataset_sft import build_sft_splits
        sft_meta = os.path.join(cfg.data_dir, "sft_meta.json")
        if os.path.isfile(sft_meta):  # pretokenized: made with which tokenizer?
            meta = ckpt.read_json(sft_meta)
            check_data_tokenizer(cfg.data_dir, str(meta.get("tokenizer_fingerprint", "")),
                                 int(meta.get("vocab_size", tok_meta["vocab_size"])), cfg.tokenizer_dir, tok_meta)
        train, val, collate = build_sft_splits(cfg.data_dir, cfg.tokenizer_dir, cfg.max_seq_len,
                                               val_ratio=cfg.val_ratio, seed=cfg.seed, pack=cfg.sft_packing)
        if fixed_shape and not cfg.sft_packing:  # packed rows are max_seq_len already
            from dataset.dataset_sft import pad_collate
            collate = pad_collate(int(tok_meta["special_tokens"]["pad"]["id"]), pad_to=cfg.max_seq_len)
    elif cfg.task_type == "dpo":
        from dataset.dataset_dpo import build_dpo_splits
        dpo_meta = os.path.join(cfg.data_dir, "dpo_meta.json")
        if os.path.isfile(dpo_meta):  # pretokenized (data_preprocess.pretokenize_dpo_data): which tokenizer?
            meta = ckpt.read_json(dpo_meta)
            check_data_tokenizer(cfg.data_dir, str(meta.get("tokenizer_fingerprint", "")),
                                 int(meta.get("vocab_size", tok_meta["vocab_size"])), cfg.tokenizer_dir, tok_meta)
        train, val, collate = build_dpo_splits(cfg.data_dir, cfg.tokenizer_dir, cfg.max_seq_len,
                                               val_ratio=cfg.val_ratio, seed=cfg.seed)
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


# ---------------------------------------------------------------------------- model

def _is_hf_dir(path: str) -> bool:
    from utils.run_dir import is_hf_dir  # torch-free: sample.py's pre-check asks it too
    return is_hf_dir(path)


def model_from_checkpoint(found: str) -> tuple[Any, dict]:
    """(model with the checkpoint's weights, the run's config) from one of our checkpoint directories.

    For a LoRA run the adapters are rebuilt as the run configured them and loaded, not merged.
    Every file that cannot be used raises CheckpointError naming it (exit 5).
    """
    from model import Transformer
    from parallel.engine import checkpoint_model_state, load_weights
    run_cfg = ckpt.read_checkpoint_json(found, "config.json")
    lora_base = ckpt.read_trainer_state(found).get("lora_base")
    if lora_base:  # a light checkpoint: the frozen base comes from where the run took it
        model = load_lora_base(lora_base, found, log=lambda m: None)
    else:
        model = Transformer(ckpt.read_model_config(found))
    try:
        select_trainable_for(model, run_cfg)
    except (ValueError, TypeError, AttributeError) as e:
        raise ckpt.CheckpointError(f"checkpoint {found}: config.json: its LoRA / trainable settings do not apply "
                                   f"({_one_line(e)})") from e
    if lora_base:
        check_lora_base(model, lora_base, found)
    load_weights(model, checkpoint_model_state(found), partial=bool(lora_base), source=found)
    return model, run_cfg


def select_trainable_for(model, run: dict) -> str:
    """Which parameters a run (its config as a dict) trains; returns the log line's prefix."""
    from model.lora import select_trainable
    from train_config import trains_embeddings
    return select_trainable(model, lora_rank=run.get("lora_rank", 0), lora_alpha=run.get("lora_alpha", 16.0),
                            lora_dropout=run.get("lora_dropout", 0.0),
                            lora_targets=run.get("lora_targets", "q_proj,v_proj"),
                            train_embeddings=trains_embeddings(run))


def load_lora_base(lora_base: dict, where: str, log) -> Any:
    """The frozen base of a light checkpoint, grown to the run's tokenizer when the run grew it."""
    model, _ = load_weights_from(lora_base["source"], log, flag="the LoRA base of " + where,
                                 tokenizer_dir=lora_base.get("tokenizer_dir"))
    return model


def check_lora_base(model, lora_base: dict, where: str) -> None:
    """The frozen base under the adapters must be the one the run trained on (same tensors, bit for bit)."""
    from parallel.engine import base_fingerprint
    if base_fingerprint(model) != lora_base["fingerprint"]:
        raise ckpt.CheckpointError(f"checkpoint {where}: the LoRA base at {lora_base['source']} is not the one the run "
                                   "trained on (its fingerprint changed); restore that base, or re-train the adapters")


def load_weights_from(path: str, log, flag: str = "--init_from",
                      tokenizer_dir: Optional[str] = None) -> tuple[Any, dict]:
    """A model from an HF directory, our run directory, or one of our checkpoint directories.

    `flag` names where the path came from in error messages (exit 2 when nothing is there, exit 5
    when what is there cannot be loaded). With `tokenizer_dir`, an HF model is checked against that
    tokenizer and grown to it when it extends the model's own tokenizer (model/resize.py; exit 2 when
    it is not an extension)."""
    where = f"{flag}={path}" if flag.startswith("--") else f"{flag} {path}"
    if os.path.isdir(path) and _is_hf_dir(path):
        from model.hf_interop import import_hf
        try:
            model = import_hf(path)
        except (ValueError, OSError, KeyError) as e:
            raise TrainingError(f"{where}: cannot import the Hugging Face model ({e})", EXIT_BAD_CHECKPOINT) from e
        log(f"[init] imported Hugging Face model from {path}")
        info = {"source": path, "kind": "hf"}
        if tokenizer_dir:
            from model.resize import VocabMismatch, resize_to_tokenizer
            try:
                grown = resize_to_tokenizer(model, path, tokenizer_dir)
            except VocabMismatch as e:
                raise TrainingError(f"{where} with --tokenizer_dir={tokenizer_dir}: {e}", EXIT_BAD_CONFIG) from e
            if grown["new_vocab"] > grown["old_vocab"]:
                info["resized"] = dict(grown, tokenizer_dir=os.path.abspath(tokenizer_dir))
                log(f"[init] vocabulary {grown['old_vocab']} -> {grown['new_vocab']} for {tokenizer_dir}: "
                    f"{grown['from_pieces']} new rows from the mean of their base pieces, {grown['mean_of_all']} "
                    "(specials, reserved) from the mean of all rows; old rows unchanged")
        return model, info
    found = ckpt.resolve_checkpoint_dir(path, log=log) if os.path.isdir(path) else None
    if found is None:
        raise TrainingError(f"{where}: no complete checkpoint or Hugging Face model there", EXIT_BAD_CONFIG)
    try:
        model, run_cfg = model_from_checkpoint(found)
    except (ValueError, KeyError, OSError) as e:  # CheckpointError (naming the file) passes: exit 5 as well
        raise TrainingError(f"checkpoint {found}: {_one_line(e)}", EXIT_BAD_CHECKPOINT) from e
    if run_cfg.get("lora_rank", 0) > 0:  # adapters were trained: fold them into the weights
        from model.lora import merge_lora
        merge_lora(model)
    log(f"[init] loaded weights from {found}")
    return model, {"source": found, "kind": "ours"}


def new_model_config(cfg: TrainConfig, tok_meta: dict):
    from model import ModelConfig
    vocab = cfg.vocab_size or int(tok_meta["vocab_size"])
    from train_config import KERNEL_CHOICES
    fused, backend = KERNEL_CHOICES[str(cfg.fused_kernels).lower()]
    return ModelConfig(vocab_size=vocab, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       n_kv_heads=cfg.n_kv_heads or None, hidden_dim=cfg.hidden_dim or None,
                       multiple_of=cfg.multiple_of, max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta,
                       attn_dropout=cfg.dropout, resid_dropout=cfg.dropout, tie_embeddings=cfg.tie_embeddings,
                       gradient_checkpointing=cfg.gradient_checkpointing, fused_rmsnorm=fused,
                       fused_rope=fused, fused_swiglu=fused, fused_qkv=fused, fused_cross_entropy=fused,
                       kernel_backend=backend)


# ---------------------------------------------------------------------------- one micro-batch

def micro_batch_loss(cfg: TrainConfig, model, ref_model, batch: dict, device) -> tuple[torch.Tensor, dict]:
    """(sum of the per-unit losses of this micro-batch, sums of logged statistics).

    A unit is a target token for pretrain/SFT and a preference pair for DPO; the caller divides by
    the number of units over all micro-batches and ranks, so every token (pair) weighs the same.
    """
    if cfg.task_type != "dpo":
        x = batch["input_ids"].to(device, non_blocking=True)
        y = batch["labels"].to(device, non_blocking=True)
        kw = {k: batch[k].to(device) for k in ("attention_mask", "position_ids") if k in batch}
        return model(x, labels=y, reduction="sum", **kw), {}
    from utils.dpo_loss import dpo_loss

    def seq_logps(m, prefix: str) -> torch.Tensor:
        x = batch[f"{prefix}_input_ids"].to(device)
        y = batch[f"{prefix}_labels"].to(device)
        kw = {"attention_mask": batch[f"{prefix}_attention_mask"].to(device)} \
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
    """Tokens the policy model processes for this micro-batch (padding included), for tokens/s and MFU."""
    return sum(int(v.numel()) for k, v in batch.items() if k.endswith("input_ids"))


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
                           lambda batch: count_units(cfg, batch))  # loss, units, chosen_r, rejected_r, acc
    tot = engine.sum_over_data(sums, info.device)
    out = {"val_loss": float(tot[0] / max(1.0, float(tot[1])))}
    if cfg.task_type == "dpo":
        out["val_reward_acc"] = float(tot[4] / max(1.0, float(tot[1])))
    return out


def build_sampler(cfg: TrainConfig):
    """--sample_every > 0: the run's prompts encoded with its tokenizer (utils/train_samples.py), else None.
    A prompt file or tokenizer that cannot be read is a bad configuration (exit 2)."""
    if cfg.sample_every <= 0:
        return None
    from utils.train_samples import TrainSampler, read_prompts
    try:
        prompts = read_prompts(cfg.sample_prompts)
    except ValueError as e:
        raise TrainingError(f"--sample_prompts={cfg.sample_prompts!r}: {e}", EXIT_BAD_CONFIG) from e
    try:
        return TrainSampler(prompts, cfg.tokenizer_dir, cfg.task_type, cfg.sample_every, cfg.sample_max_new_tokens,
                            cfg.sample_temperature, cfg.seed)
    except (OSError, ValueError, KeyError) as e:
        raise TrainingError(f"--sample_every={cfg.sample_every}: cannot load the tokenizer of --tokenizer_dir="
                            f"{cfg.tokenizer_dir} to encode the prompts ({_one_line(e)})", EXIT_BAD_CONFIG) from e


# ---------------------------------------------------------------------------- main

_one_line = one_line  # the pre-check (train_config.precheck) prints its messages the same way


def named_error(e: BaseException) -> Optional[tuple[int, str]]:
    """(exit code, message) for every error the trainer can name; None for a crash (exit 1, retried)."""
    from data_preprocess.sft_format import RecordError
    from data_preprocess.shard_format import DataError
    from safetensors import SafetensorError
    from utils.dist import DeviceError
    if isinstance(e, TrainingError):
        return e.code, _one_line(e)
    if isinstance(e, (ConfigError, DeviceError)):
        return EXIT_BAD_CONFIG, _one_line(e)
    if isinstance(e, (DataError, RecordError)):  # StaleIndexError is a DataError
        return EXIT_BAD_DATA, "data: " + _one_line(e)
    if isinstance(e, (ckpt.CheckpointError, pickle.UnpicklingError, SafetensorError)):  # names the file
        msg = ckpt.one_line(e)
        return EXIT_BAD_CHECKPOINT, msg if msg.startswith("checkpoint ") else "checkpoint: " + msg
    if isinstance(e, ckpt.CheckpointMismatchError):  # an intact checkpoint of another model
        return EXIT_BAD_CONFIG, ckpt.one_line(e)
    return None


QUIET_LINE_EVERY_S = 10.0  # stdout not a terminal: a step line at least this often (seconds)
_last_line_at = [0.0]


def _line_due(scheduled: bool, now: Optional[float] = None) -> bool:
    """Whether the loop prints this step's line: when `scheduled` (every --log_interval steps, evaluations,
    step 1), and, when stdout is not a terminal (a pipe or a log file: no progress bar there), also when
    no line came for QUIET_LINE_EVERY_S seconds, so that a piped run is never silent for minutes."""
    now = time.time() if now is None else now
    if scheduled or (not sys.stdout.isatty() and now - _last_line_at[0] >= QUIET_LINE_EVERY_S):
        _last_line_at[0] = now
        return True
    return False


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(TrainConfig(), __doc__.strip().splitlines()[0], prog=PROG))
        return EXIT_OK
    rank = int(os.environ.get("RANK", "0"))
    try:
        given: set[str] = set()  # the flags this command sets (command line or config file), not defaults
        cfg = parse_config(TrainConfig(), argv, given=given)
        # Decided on every rank before init_distributed: no rank can have written to out_dir yet.
        continues = continues_run(cfg)
        if continues:  # the run's saved configuration, with the command line over it
            asked = cfg.resume
            cfg, _ = resolve_resume_config(TrainConfig(), argv, cfg.out_dir,
                                           log=(lambda m: print(m, flush=True)) if rank == 0 else (lambda m: None))
            cfg.resume = asked  # how to start is this command's choice, never the saved run's
    except ConfigError as e:
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    try:
        info = init_distributed(cfg.device, need_group=cfg.parallel == "fsdp" or cfg.pipeline_parallel_size > 1)
        return train(cfg, info, continues=continues, max_iters_given="max_iters" in given)
    except Exception as e:  # noqa: BLE001 - named errors become one line and an exit code; others re-raise
        named = named_error(e)
        if named is None:
            raise
        code, msg = named
        print(f"[rank {rank}] error: {msg}", file=sys.stderr, flush=True)
        return code
    finally:
        destroy()


def start_without_checkpoint(cfg: TrainConfig, log) -> tuple[str, str]:
    """A run that continues (--resume) with no complete checkpoint in out_dir: what it starts from instead.

    The start recorded in <out_dir>/run_start.json (a crash before the first checkpoint restarts the
    run exactly as it began, not from random weights), else --resume_fallback, else exit 2. When
    checkpoints exist but every one is damaged, exit 5: starting over would hide lost work.
    Returns (what to start from, where that came from, for messages).
    """
    flag = resume_flag(cfg)
    found = ckpt.list_checkpoints(cfg.out_dir)
    if found:
        raise TrainingError(f"{flag}: none of the {len(found)} checkpoint(s) in "
                            f"{ckpt.checkpoint_root(cfg.out_dir)} is complete and undamaged (see the messages "
                            "above); restore one, or start a new run in another --out_dir", EXIT_BAD_CHECKPOINT)
    record = ckpt.read_run_start(cfg.out_dir)
    if record is not None:
        if record.get("task_type", cfg.task_type) != cfg.task_type:
            raise TrainingError(f"{flag}: {os.path.join(cfg.out_dir, ckpt.RUN_START)} records a "
                                f"{record['task_type']} run, not --task_type={cfg.task_type}", EXIT_BAD_CONFIG)
        log(f"[resume] no checkpoint in {cfg.out_dir} yet: starting as the run did, from {record['init_from']} "
            f"(recorded in {ckpt.RUN_START}; {flag})")
        asked = record.get("requested_init_from")
        same = isinstance(asked, str) and os.path.abspath(asked) == os.path.abspath(cfg.init_from)
        if cfg.init_from != "resume" and isinstance(asked, str) and not same:
            log(f"[resume] note: this command says --init_from={cfg.init_from}, the recorded run started from "
                f"{asked}; to start over from {cfg.init_from}, pass --resume=never or use another --out_dir")
        return record["init_from"], f"the start recorded in {os.path.join(cfg.out_dir, ckpt.RUN_START)}:"
    if cfg.resume_fallback:
        log(f"[resume] no checkpoint in {cfg.out_dir} yet: starting from --resume_fallback={cfg.resume_fallback}")
        return cfg.resume_fallback, "--resume_fallback"
    raise nothing_to_continue_error(cfg, ckpt.checkpoint_root(cfg.out_dir))


def train(cfg: TrainConfig, info: DistInfo, continues: Optional[bool] = None, max_iters_given: bool = False) -> int:
    """One run (main() has parsed and resolved `cfg`). max_iters_given: --max_iters was set explicitly
    (command line or config file), so it wins over --num_train_epochs."""
    def log(msg: str) -> None:
        if info.is_main:
            from tqdm import tqdm
            tqdm.write(msg, file=sys.stdout)  # keeps the progress bar (if any) below the log lines
            sys.stdout.flush()
    if info.is_main:  # library modules report optional-accelerator detection through logging
        logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    validate_config(cfg, world_size=info.world_size)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    os.makedirs(cfg.out_dir, exist_ok=True)
    from tokenizer import load_tokenizer_meta
    try:
        tok_meta = load_tokenizer_meta(cfg.tokenizer_dir)
    except (OSError, ValueError, KeyError) as e:
        raise TrainingError(f"--tokenizer_dir={cfg.tokenizer_dir}: {e}", EXIT_BAD_CONFIG) from e

    # ---- where do we start from? (--resume: continue the run in out_dir, or a new one from --init_from)
    if continues is None:  # not given by main(): decide now, before this rank writes anything there
        continues = continues_run(cfg)
    barrier()  # every rank has decided before rank 0 records this start (run_start.json, below)
    resume_dir = None
    init_from, init_flag = cfg.init_from, "--init_from"  # what a run that does not continue starts from
    if continues:
        resume_dir = ckpt.find_latest_valid(cfg.out_dir, log=log)
        if resume_dir is not None:
            step = int(os.path.basename(resume_dir).removeprefix("step_"))
            log(f"[resume] continuing {cfg.out_dir} from step {step} ({resume_flag(cfg)})")
        else:  # as run_start.json records (or --resume_fallback), else exit 2 / 5
            init_from, init_flag = start_without_checkpoint(cfg, log)
    elif ckpt.list_checkpoints(cfg.out_dir):  # --resume=never
        raise existing_run_error(cfg)
    else:
        if info.is_main and os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl")):
            # a run that died before it recorded its start: keep its log, but do not mix it into this one
            aside = os.path.join(cfg.out_dir, f"metrics.jsonl.{int(time.time())}.old")
            os.replace(os.path.join(cfg.out_dir, "metrics.jsonl"), aside)
            log(f"[init] previous metrics.jsonl (no checkpoint) moved to {aside}")
        log(f"[init] new run from {cfg.init_from} in {cfg.out_dir} ({resume_flag(cfg)})")
    seed_everything(cfg.seed)  # identical initial weights on every rank (and DDP broadcasts anyway)

    from model import Transformer
    init_info: dict = {"source": "scratch", "kind": "scratch"}
    if resume_dir is not None:
        saved_state = ckpt.read_trainer_state(resume_dir, required=("step", "world_size"))  # else exit 5 naming it
        init_info = saved_state.get("init_info", init_info)
        if saved_state.get("lora_base"):  # a light checkpoint: rebuild the frozen base first
            model = load_lora_base(saved_state["lora_base"], resume_dir, log)
        else:
            model = Transformer(ckpt.read_model_config(resume_dir))  # CheckpointError naming the file: exit 5
    elif init_from != "scratch":
        model, init_info = load_weights_from(init_from, log, flag=init_flag, tokenizer_dir=cfg.tokenizer_dir)
    else:
        try:
            model_cfg = new_model_config(cfg, tok_meta)
        except ValueError as e:
            raise TrainingError(f"bad model configuration: {e}", EXIT_BAD_CONFIG) from e
        model = Transformer(model_cfg)
    if resume_dir is None and info.is_main:  # before the first step: a restart with resume starts the same way
        ckpt.write_run_start(cfg.out_dir, {"init_from": init_info["source"], "requested_init_from": init_from,
                                           "kind": init_info["kind"], "task_type": cfg.task_type,
                                           "started_at": time.time()})
    mcfg = model.cfg
    if mcfg.vocab_size < int(tok_meta["vocab_size"]):
        hint = ("; to grow the vocabulary to an extended tokenizer, start from a Hugging Face directory holding the "
                "model's own tokenizer (export this one with export_hf.py)" if init_info["kind"] == "ours" else "")
        raise TrainingError(f"model vocab {mcfg.vocab_size} < tokenizer vocab {tok_meta['vocab_size']}{hint}",
                            EXIT_BAD_CONFIG)

    from model.lora import trainable_parameters
    try:
        what = select_trainable_for(model, dataclasses.asdict(cfg))
    except ValueError as e:
        raise TrainingError(f"--lora_*: {e}", EXIT_BAD_CONFIG) from e
    c = trainable_parameters(model)
    log(f"{what}: {c['trainable']:,} trainable of {c['total']:,} parameters ({c['percent']:.2f}%)")
    # Light checkpoints (LoRA or --trainable=embeddings): only the trainable tensors + a reference to the
    # frozen base (path, fingerprint, and the tokenizer it was grown to), when the base is a file the
    # checkpoint can point at (not random weights; not fsdp, whose sharded checkpoints are written
    # without gathering anyway). A grown base is re-derived deterministically (model/resize.py); the
    # fingerprint covers its frozen rows.
    lora_base = None
    frozen_base = cfg.lora_rank > 0 or cfg.trainable == "embeddings"
    if frozen_base and cfg.parallel == "ddp" and init_info["kind"] in ("ours", "hf"):
        from parallel.engine import base_fingerprint
        if resume_dir is not None and saved_state.get("lora_base"):
            lora_base = saved_state["lora_base"]
            check_lora_base(model, lora_base, resume_dir)
        elif resume_dir is None:
            lora_base = {"source": os.path.abspath(init_info["source"]), "fingerprint": base_fingerprint(model)}
            if init_info.get("resized"):
                lora_base["tokenizer_dir"] = init_info["resized"]["tokenizer_dir"]
            log(f"[lora] checkpoints hold the trainable tensors only; the frozen base is {lora_base['source']} "
                f"(sha256 {lora_base['fingerprint'][:12]})")

    ref_model = None
    if cfg.task_type == "dpo":
        ref_src = cfg.ref_model or init_info.get("ref_source") or init_info["source"]
        if ref_src == "scratch":
            raise TrainingError("--task_type=dpo needs a frozen reference model, and this run started from scratch: "
                                "pass --ref_model=<run, checkpoint or Hugging Face dir>", EXIT_BAD_CONFIG)
        ref_model, _ = load_weights_from(ref_src, log, flag="--ref_model" if cfg.ref_model else "reference model",
                                         tokenizer_dir=cfg.tokenizer_dir)
        init_info["ref_source"] = ref_src
        ref_model.requires_grad_(False).eval()

    dtype = parse_dtype(cfg.dtype)
    slow_dtype = low_precision_cpu_warning(info.device, dtype)
    if slow_dtype:
        log(f"[warning] {slow_dtype}")
    # fsdp keeps fp32 sharded parameters (the optimizer's masters) and computes in `dtype` through its
    # mixed-precision policy; ddp runs the model in `dtype` with fp32 masters in the optimizer.
    # the engine moves to the device what this rank runs (the whole model, or its pipeline stage)
    model.to(dtype=torch.float32 if cfg.parallel == "fsdp" else dtype)
    from model.kernels import flash_attn_functions
    flash = mcfg.flash_attn and flash_attn_functions(info.device) is not None  # detected (and logged) once
    from model.kernels import describe_choice
    from model.attention import describe_attention
    log(f"[kernels] attention: {describe_attention(info.device, mcfg, dtype, cfg.compile)}; "
        f"{describe_choice(info.device, mcfg.kernel_backend, cfg.compile, fused=mcfg.fused_rmsnorm)}")
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"[model] {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trainable), {mcfg.n_layers} layers, "
        f"dim {mcfg.dim}, vocab {mcfg.vocab_size}, dtype {cfg.dtype}, device {info.device}, world {info.world_size}")

    from parallel.engine import build_engine, describe_layout
    try:  # our DDP / FSDP / pipeline stages: the loop below talks to all of them the same way
        engine = build_engine(model, cfg, device=info.device)
    except ValueError as e:  # a layout that cannot run (e.g. a checkpoint's layers do not split into stages)
        raise TrainingError(f"bad parallel configuration: {_one_line(e)}", EXIT_BAD_CONFIG) from e
    log(describe_layout(cfg, engine, info.world_size))
    del model  # the engine holds what this rank runs (under pp the other stages' layers are freed)
    if ref_model is not None:  # DPO: the frozen reference, sharded like the policy under fsdp
        ref_model = engine.place_reference(ref_model, info.device, dtype)
        log(f"[dpo] reference model: {'sharded by FSDP2' if engine.kind == 'fsdp' else 'a full copy'} on each of "
            f"{engine.dp_size} rank(s), {cfg.dtype}, frozen")
    engine.lora_base = lora_base
    optimizer = engine.optimizer

    from data_preprocess.shard_format import DataError
    try:
        train_loader, make_val_loader = build_data(cfg, engine.dp_rank, engine.dp_size, tok_meta,
                                                   fixed_shape=engine.fixed_batch_shape)
    except (DataError, ValueError, OSError) as e:  # DataError includes StaleIndexError
        raise TrainingError(f"data: {' '.join(str(e).split())}", EXIT_BAD_DATA) from e

    # ---- resume: weights, optimizer (sharded under ZeRO), comm-hook state, data cursor, RNG
    iter_num, best_val, tokens_seen = 0, float("inf"), 0
    rng_to_restore = None
    data_step, saved_skips, saved_guard = 0, [], None  # data steps drawn so far (trained or skipped); spike guard
    if resume_dir is not None:
        saved_cfg = ckpt.read_json(os.path.join(resume_dir, "config.json"))
        problem = global_batch_problem(dict(saved_cfg, world_size=saved_state["world_size"]), cfg.batch_size,
                                       cfg.gradient_accumulation_steps, info.world_size, cfg.pipeline_parallel_size) \
            or engine.resume_problem(resume_dir, int(saved_state["world_size"]), info.world_size)
        if problem:
            raise TrainingError(f"cannot resume {resume_dir}: {problem}", EXIT_BAD_CONFIG)
        try:  # a damaged file raises CheckpointError naming it (exit 5); a missing extra_rank{r}.pt is logged
            extra = engine.load(resume_dir, int(saved_state["world_size"]), info.rank, info.world_size,
                                log=lambda m: print(m if info.is_main else f"[rank {info.rank}] {m}", flush=True))
        except ckpt.CheckpointMismatchError as e:  # other tensor names or shapes than this model's
            changed = [f"--{k}" for k in ("lora_rank", "lora_targets", "lora_train_embeddings", "trainable")
                       if k in saved_cfg and saved_cfg[k] != getattr(cfg, k)]
            if not changed:  # the run's own configuration builds this model: the file, not the flags, is wrong
                raise ckpt.CheckpointError(f"{ckpt.one_line(e)} (the model is built from the checkpoint's own "
                                           "model_config.json and config.json: the file is damaged)") from e
            raise TrainingError(f"the weights in {resume_dir} do not fit the model this configuration builds "
                                f"({', '.join(changed)} changed since the run started): {ckpt.one_line(e)}",
                                EXIT_BAD_CONFIG) from e
        new_data = [k for k in DATA_KEYS if k in saved_cfg and not same_value(k, saved_cfg[k], getattr(cfg, k))]
        if new_data:  # only reachable with --allow_data_change=true (main() refuses it otherwise)
            log(f"[resume] data changed ({', '.join(new_data)}): reading the new data from its start")
        else:
            try:
                train_loader.load_state_dict(saved_state["data_cursor"])
            except ValueError as e:
                raise TrainingError(f"cannot resume the data order from {resume_dir}: {e}. When changing the number "
                                    "of processes keep --batch_size x --gradient_accumulation_steps x data-parallel "
                                    "ranks (the global batch) the same", EXIT_BAD_CONFIG) from e
        iter_num = int(saved_state["step"])
        best_val = saved_state.get("best_val_loss") or float("inf")
        tokens_seen = int(saved_state.get("tokens_seen", 0))
        if not new_data:  # the skip list names data steps of this data stream: a new stream starts afresh
            try:
                data_step = int(saved_state.get("data_step", iter_num))
                saved_skips = [int(d) for d in saved_state.get("skip_data_steps", [])]
                saved_guard = saved_state.get("spike_guard")
                saved_guard = {"recent": [float(v) for v in saved_guard["recent"]]} if saved_guard else None
            except (TypeError, ValueError, KeyError) as e:
                raise TrainingError(f"checkpoint {resume_dir}: trainer_state.json: unreadable data_step, "
                                    f"skip_data_steps or spike_guard ({e})", EXIT_BAD_CHECKPOINT) from e
        if extra is not None:
            rng_to_restore = extra["rng"]
        log(f"[resume] at step {iter_num}, data cursor {saved_state['data_cursor']}")

    if cfg.num_train_epochs > 0:  # max_iters from the epochs, unless --max_iters was given (now or when the run began)
        given = max_iters_given or (resume_dir is not None and saved_state.get("max_iters_from") == "max_iters")
        cfg.max_iters, line = max_iters_for_epochs(cfg.num_train_epochs, train_loader.num_samples,
                                                   train_loader.samples_per_step, cfg.max_iters, given)
        max_iters_from = "max_iters" if given else "num_train_epochs"
        log(line)
    if info.is_main:
        save_config_json(cfg, os.path.join(cfg.out_dir, "config.json"))
    metrics = MetricsLogger(cfg.out_dir, enabled=info.is_main, tensorboard=cfg.tensorboard, log=log,
                            wandb=cfg.wandb, wandb_project=cfg.wandb_project, wandb_run_name=cfg.wandb_run_name,
                            run_config=dataclasses.asdict(cfg),
                            resume_step=iter_num if continues else None)

    # ---- graceful stop: finish the step, save, exit 75
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    def save(step: int, val_loss: Optional[float]) -> None:
        state = {"data_cursor": train_loader.state_dict(), "best_val_loss": None if best_val == float("inf") else best_val,
                 "val_loss": val_loss, "tokens_seen": tokens_seen, "init_info": init_info,
                 "lr": lr_at(max(0, step - 1), **lr_kw), "task_type": cfg.task_type}
        state.update(data_step=data_step, skip_data_steps=sorted(skip_steps))  # a resume skips them too
        if cfg.num_train_epochs > 0:  # which flag set max_iters: a resume decides the same way
            state["max_iters_from"] = max_iters_from
        if guard is not None:  # the running window: a resumed run judges its steps as an uninterrupted one
            state["spike_guard"] = guard.state_dict()
        fault = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if _fault("kill_in_save", step) else None
        path = engine.save(cfg.out_dir, step, rank=info.rank, world_size=info.world_size, model_config=mcfg.to_dict(),
                           trainer_state=state, run_config=dataclasses.asdict(cfg),
                           extra_state={"rng": ckpt.capture_rng_state(info.device)}, keep_last=cfg.keep_last,
                           barrier=barrier, fault_hook=fault, log=log)
        log(f"[checkpoint] step {step} -> {path}")

    from model.flops import flops_per_token, mfu_from, resolve_peak_flops
    fpt = flops_per_token(mcfg, cfg.max_seq_len)
    peak = resolve_peak_flops(info.device, dtype, override=cfg.peak_flops,
                              cache_dir=cfg.out_dir if info.is_main else None)
    throughput = Throughput(window=20)
    lr_kw = dict(max_lr=cfg.learning_rate, min_lr=cfg.min_lr, warmup_iters=cfg.warmup_iters,
                 decay_iters=cfg.lr_decay_iters or cfg.max_iters, schedule=cfg.lr_schedule)
    from utils.lr_schedule import schedule_warnings
    for warning in schedule_warnings(max_iters=cfg.max_iters, warmup_iters=cfg.warmup_iters,
                                     lr_decay_iters=cfg.lr_decay_iters, schedule=cfg.lr_schedule, resumed_at=iter_num,
                                     saved_max_iters=int(saved_cfg.get("max_iters") or 0) if resume_dir else 0):
        log(f"[warning] schedule: {warning}")
    gas = cfg.gradient_accumulation_steps
    layout = (f"{engine.dp_size} data-parallel ranks x {cfg.pipeline_parallel_size} pipeline stages "
              f"({cfg.pipeline_schedule})" if cfg.pipeline_parallel_size > 1 else f"{info.world_size} ranks")
    log(f"[train] {cfg.task_type}: {cfg.max_iters} steps x {gas} micro-batches x {cfg.batch_size} samples x "
        f"{layout}, seq {cfg.max_seq_len}; MFU against {peak.describe()} per device")

    pbar = None
    if info.is_main and cfg.progress and sys.stdout.isatty():  # a bar in a terminal; plain lines in log files
        from tqdm import tqdm
        pbar = tqdm(total=cfg.max_iters, initial=iter_num, desc="train", dynamic_ncols=True, mininterval=2.0,
                    file=sys.stdout)
    if rng_to_restore is not None:  # last thing before the loop: set-up above may draw random numbers
        ckpt.restore_rng_state(rng_to_restore, info.device)
    engine.model.train()
    last_val: Optional[float] = None
    if resume_dir is not None and isinstance(saved_state.get("val_loss"), (int, float)):
        last_val = float(saved_state["val_loss"])  # resuming a finished run reports its real final loss
    # ---- spike guard and skipped data (docs/monitor.md, "Loss spikes")
    from utils.constants import EXIT_LOSS_SPIKE
    from utils.spike_guard import SPIKE_FILE, SpikeDetector, format_data_steps, parse_data_steps, write_spike_record
    skip_steps = set(saved_skips) | set(parse_data_steps(cfg.skip_data_steps))
    if skip_steps:
        log(f"[data] data steps never trained on: {format_data_steps(skip_steps)} (drawn and discarded; "
            f"{sum(d > data_step for d in skip_steps)} of them still ahead, at data step {data_step})")
    guard = None
    if cfg.spike_guard:
        guard = SpikeDetector(cfg.spike_factor, cfg.spike_window)
        if saved_guard:
            guard.load_state_dict(saved_guard)
        log(f"[spike_guard] exit {EXIT_LOSS_SPIKE} when a loss is non-finite or above {cfg.spike_factor:g} x the "
            f"median of the previous {cfg.spike_window} steps ({len(guard.recent)} known)")
    sampler = build_sampler(cfg)  # --sample_every: prompts and tokenizer checked on every rank, sampled on rank 0
    resumed_from = {"step": iter_num, "data_step": data_step}
    t_last = time.time()
    while iter_num < cfg.max_iters:
        _fire_step_faults(iter_num + 1)
        lr = lr_at(iter_num, **lr_kw)
        optimizer.set_lr(lr)
        skipped = []
        while data_step + 1 in skip_steps:  # --skip_data_steps: the cursor moves past that data, untrained
            for _ in range(gas):
                next(train_loader)
            data_step += 1
            skipped.append(data_step)
        batches = [next(train_loader) for _ in range(gas)]  # this data-parallel rank's micro-batches
        data_step += 1
        counts = engine.sum_over_data([float(sum(count_units(cfg, b) for b in batches)),
                                       float(sum(count_tokens(b) for b in batches))], info.device)
        global_units, step_tokens = max(1.0, float(counts[0])), float(counts[1])
        optimizer.zero_grad()
        poison = _fault("nan_loss", iter_num + 1)  # test hook: this step's loss (and gradients) become NaN
        # forward + backward of every micro-batch (gradient accumulation, or the pipeline schedule); the
        # gradients are those of (all ranks' loss sums) / global_units
        spike_fault = _spike_fault(data_step, batches)  # test hook: a loss spike on this step's data
        loss_fn = lambda model, batch: micro_batch_loss(cfg, model, ref_model, batch, info.device)  # noqa: E731
        loss_acc = engine.forward_backward(batches, _spiked(loss_fn, *spike_fault) if spike_fault else loss_fn,
                                           global_units, poison=poison)
        # the step's sums, reduced and copied to the host behind the backward: the optimizer's one host
        # sync (reading the gradient norm) comes after that copy, so reading it then waits for nothing
        tot_copy = HostCopy(engine.sum_over_data(loss_acc, info.device, to_host=False))
        stepped, grad_norm = optimizer.step()  # waits for the gradient reductions, clips, steps
        tot = tot_copy.get()
        loss = float(tot[0]) / global_units
        spike = guard.check(loss, nonfinite_is_spike=cfg.dtype != "fp16") if guard is not None else None
        if spike is not None:  # the rollback is the supervisor's: record the step, save nothing, exit 76
            if info.is_main:
                write_spike_record(cfg.out_dir, dict(spike, step=iter_num + 1, data_step=data_step, loss=loss,
                                                     factor=cfg.spike_factor, window=cfg.spike_window,
                                                     resumed_from=resumed_from, skip_data_steps=sorted(skip_steps),
                                                     time=time.time()))
            barrier()  # no rank exits before the record is on disk
            why = "is non-finite" if spike["reason"] == "non_finite" else \
                f"> {cfg.spike_factor:g} x the running median {spike['median']:.4g}"
            raise TrainingError(f"loss spike at step {iter_num + 1} (data step {data_step}): loss {loss:.4g} {why}; "
                                f"recorded in {os.path.join(cfg.out_dir, SPIKE_FILE)}, nothing saved after it",
                                EXIT_LOSS_SPIKE)
        if not math.isfinite(loss) and cfg.dtype != "fp16":
            raise TrainingError(f"non-finite loss {loss} at step {iter_num + 1}; the last good checkpoint in "
                                f"{cfg.out_dir}/checkpoints is intact (lower --learning_rate or use --dtype=fp16 "
                                "with loss scaling)", EXIT_NONFINITE_LOSS)
        iter_num += 1
        tokens_seen += int(global_units) if cfg.task_type != "dpo" else 0
        metrics.heartbeat()
        if pbar is not None:
            pbar.update(1)

        # ---- log
        dt = max(1e-9, time.time() - t_last)
        tps_avg = throughput.update(step_tokens, dt)  # tokens/s over the last 20 steps: readable, not per-step noise
        rec: dict[str, Any] = {"step": iter_num, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                               "stepped": bool(stepped), "tokens_per_sec": step_tokens / dt,
                               "tokens_per_sec_avg": tps_avg, "mfu": mfu_from(fpt * tps_avg / info.world_size, peak),
                               "mfu_is_estimate": peak.is_estimate, "tokens_seen": tokens_seen}
        if cfg.task_type == "dpo":
            rec.update(chosen_reward=float(tot[1]) / global_units, rejected_reward=float(tot[2]) / global_units,
                       reward_acc=float(tot[3]) / global_units)
        if skip_steps or guard is not None:
            rec["data_step"] = data_step  # the data this step trained on
        if skipped:
            rec["skipped_data_steps"] = skipped  # drawn and discarded before it
        rec.update(memory_stats(info.device))
        do_eval = (cfg.eval_interval > 0 and iter_num % cfg.eval_interval == 0) or iter_num == cfg.max_iters
        if do_eval:
            ev = evaluate(cfg, engine, ref_model, make_val_loader, info)
            if ev is not None:
                rec.update(ev)
                last_val = ev["val_loss"]
                best_val = min(best_val, last_val)
        metrics.write(rec)
        if info.is_main and _line_due(iter_num % cfg.log_interval == 0 or do_eval or iter_num == 1):
            log(format_line(rec))
        if info.is_main and sampler is not None and sampler.due(iter_num):  # after the evaluation, RNG untouched
            optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
            metrics.write_samples(sampler.sample(engine.module, iter_num, info.device))

        # ---- checkpoint / stop
        stop_now = all_reduce_max(1.0 if stop["requested"] else 0.0, info.device) > 0
        if iter_num % cfg.checkpoint_interval == 0 or iter_num == cfg.max_iters or stop_now:
            save(iter_num, last_val if do_eval else None)
        t_last = time.time()  # evaluation and checkpoint time is not charged to the next step's tokens/s
        if stop_now:
            log(f"[train] stop requested by signal: saved step {iter_num}, exiting with {EXIT_INTERRUPTED}")
            if pbar is not None:
                pbar.close()
            metrics.close()
            return EXIT_INTERRUPTED
    if pbar is not None:
        pbar.close()
    optimizer.finish_param_sync()
    synchronize(info.device)
    barrier()  # let the last asynchronous collectives drain before the process group goes away
    metrics.close()
    log(f"[train] done: {iter_num} steps, final val_loss {last_val if last_val is not None else float('nan'):.4f}, "
        f"best {best_val:.4f}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
