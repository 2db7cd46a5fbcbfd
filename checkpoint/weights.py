"""One process's view of the weights of a checkpoint of any format (export, sampling, --init_from, the kill
trials): model.safetensors, a pipeline checkpoint's stages merged into one state dict, or a sharded (DCP)
checkpoint read whole without a process group.

Owns: choosing the reader by what the directory holds. Must never: load the optimizer's state, or import
torch.distributed.checkpoint for a plain checkpoint (it takes ~1 s to import, which sampling or exporting a
plain checkpoint should not pay).
"""
from __future__ import annotations

import torch
from safetensors import SafetensorError

from checkpoint.files import first_nonfinite, load_model_state
from checkpoint.reads import damaged_file_hint, is_pipeline_checkpoint, is_sharded_checkpoint
from utils.errors import CheckpointError


def checkpoint_model_state(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """The weights stored in a checkpoint of any format, in one process; a pipeline checkpoint's stages are
    merged into one model's state dict. CheckpointError naming the file when one does not load, or a tensor
    holds NaN or inf."""
    if is_pipeline_checkpoint(ckpt_dir):
        from checkpoint.pipeline import merge_stage_checkpoints
        try:
            sd = merge_stage_checkpoints(ckpt_dir)
        except (ValueError, KeyError, TypeError, OSError, RuntimeError, SafetensorError) as e:
            if isinstance(e, torch.OutOfMemoryError):
                raise
            raise CheckpointError(f"checkpoint {ckpt_dir}: {damaged_file_hint(ckpt_dir, e)}") from e
    elif is_sharded_checkpoint(ckpt_dir):
        from checkpoint.dcp import load_full_model_state_dict
        sd = load_full_model_state_dict(ckpt_dir)
    else:
        return load_model_state(ckpt_dir)  # checked there
    bad = first_nonfinite(sd.items())
    if bad is not None:
        raise CheckpointError(f"checkpoint {ckpt_dir}: {bad}")
    return sd
