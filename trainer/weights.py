"""Where a run's weights come from: a Hugging Face directory, one of our runs or checkpoints (any
engine's layout), a LoRA run's frozen base; shared by the trainer, sample.py and export_hf.py.

Owns: `load_weights_from` (a model from any of those, checked against a tokenizer and grown to it when
it extends the model's own), `model_from_checkpoint` (a checkpoint of any engine, LoRA adapters rebuilt
as the run configured them), the LoRA base of a light checkpoint and its fingerprint check, and which
parameters a run trains (`select_trainable_for`).
Layer: beside the three commands, above `parallel/` (a checkpoint's weights are read through the
engine that wrote them: checkpoint.weights.checkpoint_model_state), so it is not in `model/`.
Must never: import the trainer, write anything, or start a process group.
"""
from __future__ import annotations

import os
from typing import Any, Optional

from checkpoint.verify import resolve_checkpoint_dir, selection_exit_code
from utils.checkpoint_json import read_checkpoint_json, read_trainer_state
from utils.checkpoint_layout import RUN_CONFIG
from utils.errors import CheckpointError
from utils.constants import EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG
from utils.errors import TrainingError, one_line
from utils.run_dir import no_weights_detail


def is_hf_dir(path: str) -> bool:
    from utils.run_dir import is_hf_dir as torch_free  # torch-free: sample.py's pre-check asks it too
    return torch_free(path)


def model_from_checkpoint(found: str) -> tuple[Any, dict]:
    """(model with the checkpoint's weights, the run's config) from one of our checkpoint directories.

    For a LoRA run the adapters are rebuilt as the run configured them and loaded, not merged.
    Every file that cannot be used raises CheckpointError naming it (exit 5).
    """
    from model import Transformer
    from model.config import read_model_config
    from checkpoint.reads import load_weights
    from checkpoint.weights import checkpoint_model_state
    run_cfg = read_checkpoint_json(found, RUN_CONFIG)
    lora_base = read_trainer_state(found).get("lora_base")
    if lora_base:  # a light checkpoint: the frozen base comes from where the run took it
        model = load_lora_base(lora_base, found, log=lambda m: None)
    else:
        model = Transformer(read_model_config(found))
    try:
        select_trainable_for(model, run_cfg)
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint {found}: config.json: its LoRA / trainable settings do not apply "
                              f"({one_line(e)})") from e
    if lora_base:
        check_lora_base(model, lora_base, found)
    load_weights(model, checkpoint_model_state(found), partial=bool(lora_base), source=found)
    return model, run_cfg


def select_trainable_for(model, run: dict) -> str:
    """Which parameters a run (its config as a dict) trains; returns the log line's prefix."""
    from model.lora import select_trainable
    from trainer.config import trains_embeddings
    return select_trainable(model, lora_rank=run.get("lora_rank", 0), lora_alpha=run.get("lora_alpha", 16.0),
                            lora_dropout=run.get("lora_dropout", 0.0),
                            lora_targets=run.get("lora_targets", "q_proj,v_proj"),
                            train_embeddings=trains_embeddings(run))


def load_lora_base(lora_base: dict, where: str, log) -> Any:
    """The frozen base of a light checkpoint, grown to the run's tokenizer when the run grew it, with the RoPE
    the run trained it at (the checkpoint's model_config.json: a --rope_scaling context extension) and a reward
    model's score head where the run added one."""
    from model.config import read_model_config
    model, _ = load_weights_from(lora_base["source"], log, flag="the LoRA base of " + where,
                                 tokenizer_dir=lora_base.get("tokenizer_dir"))
    saved = read_model_config(where)
    if (saved.rope_scaling, saved.max_seq_len) != (model.cfg.rope_scaling, model.cfg.max_seq_len):
        model.set_rope(saved.rope_scaling, saved.max_seq_len)
    if saved.num_labels and not model.cfg.num_labels:  # a reward model's run: its score head (trained, in the
        from model.score_head import add_score_head    # checkpoint) in place of the base's LM head
        add_score_head(model, saved.num_labels)
    return model


def apply_rope_flag(model, flag: str, max_seq_len: int, log, who: str = "") -> None:
    """--rope_scaling on loaded weights, in place of their own RoPE scaling: the weights' trained length
    (their max_seq_len) becomes the setting's original_max_position_embeddings where the kind has one (llama3,
    yarn; YaRN's factor, when not given, the extension ratio), and max_seq_len grows to the run's (dynamic NTK
    keeps it: it is the length past which the base grows). TrainingError (exit 2) for a setting that does not
    apply to these weights. `who`: the log line's name of the model ("" = the one trained)."""
    from utils.rope_config import normalize_rope_scaling, parse_rope_flag
    setting = dict(parse_rope_flag(flag))
    old = model.cfg
    kind = setting.get("type", setting.get("rope_type"))
    if kind in ("llama3", "yarn"):
        setting.setdefault("original_max_position_embeddings", old.max_seq_len)
    length = old.max_seq_len if kind == "dynamic" else max(old.max_seq_len, max_seq_len)
    try:
        model.set_rope(normalize_rope_scaling(setting, length), length)
    except ValueError as e:
        raise TrainingError(f"--rope_scaling={flag!r}: {e}", EXIT_BAD_CONFIG) from e
    log(f"[rope]{who} --rope_scaling: {old.rope_scaling or 'plain RoPE'} at max_seq_len {old.max_seq_len} -> "
        f"{model.cfg.rope_scaling} at max_seq_len {length}")


def check_lora_base(model, lora_base: dict, where: str) -> None:
    """The frozen base under the adapters must be the one the run trained on (same tensors, bit for bit)."""
    from checkpoint.reads import base_fingerprint
    if base_fingerprint(model) != lora_base["fingerprint"]:
        raise CheckpointError(f"checkpoint {where}: the LoRA base at {lora_base['source']} is not the one the run "
                              "trained on (its fingerprint changed); restore that base, or re-train the adapters")


def load_weights_from(path: str, log, flag: str = "--init_from", tokenizer_dir: Optional[str] = None,
                      which: str = "latest", mtp_layers: int = 0) -> tuple[Any, dict]:
    """A model from an HF directory, our run directory, or one of our checkpoint directories.

    `flag` names where the path came from in error messages (exit 2 when nothing is there, exit 5
    when what is there cannot be loaded). With `tokenizer_dir`, an HF model is checked against that
    tokenizer and grown to it when it extends the model's own tokenizer (model/resize.py; exit 2 when
    it is not an extension). `which`: the checkpoint of a run directory (latest | best | step_N:
    --init_checkpoint). `mtp_layers`: an HF model's multi-token prediction layers to keep (DeepSeek-V3's, GLM-4.5's;
    model/hf_mtp.py), up to this many; our checkpoints bring the depths they have."""
    where = f"{flag}={path}" if flag.startswith("--") else f"{flag} {path}"
    # which load the log line is (DPO loads the policy and the reference; a resume names its recorded start)
    role = "" if flag == "--init_from" else f" ({flag.rstrip(':')})"
    if os.path.isdir(path) and is_hf_dir(path):
        from model.hf_interop import import_hf
        from model.hf_mtp import held_in_dir
        try:
            model = import_hf(path, mtp_layers=mtp_layers)
            held = held_in_dir(path)
        except (ValueError, OSError, KeyError) as e:
            raise TrainingError(f"{where}: cannot import the Hugging Face model ({e})", EXIT_BAD_CHECKPOINT) from e
        log(f"[init] imported Hugging Face model from {path}{role}")
        if held:
            kept = model.cfg.mtp_num_layers
            log(f"[init] its {held} multi-token prediction layer(s): "
                + (f"{kept} kept as the model's MTP depths" if kept else
                   "left out (a run's --mtp_num_layers or sample.py's --speculative=mtp keeps them)"))
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
    if which != "latest" and os.path.isdir(path):
        from checkpoint.select import select_checkpoint
        try:
            found = select_checkpoint(path, which, log=log)
        except CheckpointError as e:
            raise TrainingError(f"{where} --init_checkpoint={which}: {one_line(e)}",
                                selection_exit_code(e, path, which)) from e
        role += f" (--init_checkpoint={which})"
    else:
        found = resolve_checkpoint_dir(path, log=log) if os.path.isdir(path) else None
    if found is None:
        raise TrainingError(f"{where}: no complete checkpoint or Hugging Face model there"
                            f"{no_weights_detail(path) if os.path.isdir(path) else ''}", EXIT_BAD_CONFIG)
    try:
        model, run_cfg = model_from_checkpoint(found)
    except (ValueError, KeyError, OSError) as e:  # CheckpointError (naming the file) passes: exit 5 as well
        raise TrainingError(f"checkpoint {found}: {one_line(e)}", EXIT_BAD_CHECKPOINT) from e
    if run_cfg.get("lora_rank", 0) > 0:  # adapters were trained: fold them into the weights
        from model.lora import merge_lora
        merge_lora(model)
    log(f"[init] loaded weights from {found}{role}")
    return model, {"source": found, "kind": "ours"}
