"""The checkpoint directory layout, written once: every name a run directory's checkpoints use.

Owns: the names (and only the names) of `<out_dir>/checkpoints/step_XXXXXXXX/` and the files in it,
for every format: plain (checkpoint/plain.py), sharded DCP (checkpoint/dcp.py, checkpoint/dcp_files.py) and
the pipeline stages' files (checkpoint/pipeline.py), plus the run directory's `run_start.json` and
`config.json`. The trainer, the monitor, sample.py, eval_lm.py, export_hf.py and the scripts read the
layout from here; none of them spells a name itself.

  <out_dir>/
    run_start.json                 how the run started (before its first step)
    config.json                    the resolved run configuration
    checkpoints/
      step_XXXXXXXX/               one checkpoint (step zero-padded to 8 digits); being written: step_XXXXXXXX.tmp
        COMPLETE                   written last: the directory is whole
        manifest.json              {file: {"bytes", "sha256"}} of every other file
        trainer_state.json         step, data cursor, schedule position, ...
        config.json                the run configuration of that save
        model_config.json          the architecture
        model.safetensors          DDP: full weights
        optimizer_rank{r}.pt       DDP: optimizer state (one per rank when ZeRO shards it)
        extra_rank{r}.pt           every engine: rank r's RNG (+ comm-hook) state
        dcp_manifest.json          FSDP (DCP): step, world size, files, the optimizer's scalars
        .metadata, __{r}_{k}.distcp  FSDP (DCP): DCP's index and rank r's shards
        pipeline.json              pipeline: stages, layer ranges, data-parallel size
        stage{s}_model.safetensors, stage{s}_optimizer_dp{r}.pt   pipeline: per-stage files

Must never: import torch or anything that does (the commands' pre-checks and the monitor read it
before torch), touch the filesystem (utils/run_dir.py looks, checkpoint/ reads and writes).
"""
from __future__ import annotations

import os
import re
from typing import Any, Optional

# ---- the run directory
CKPT_SUBDIR = "checkpoints"
RUN_START = "run_start.json"
RUN_CONFIG = "config.json"           # in the run directory and in every checkpoint

# ---- one checkpoint directory
STEP_PREFIX = "step_"
STEP_DIGITS = 8
COMPLETE_MARKER = "COMPLETE"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
MODEL_CONFIG = "model_config.json"
MODEL_FILE = "model.safetensors"
OPTIMIZER_PREFIX = "optimizer_rank"  # optimizer_rank{r}.pt
EXTRA_PREFIX = "extra_rank"          # extra_rank{r}.pt
RANK_FILE_SUFFIX = ".pt"
# JSON sidecars every reader parses (each a JSON object)
SIDECARS = (TRAINER_STATE, MODEL_CONFIG, RUN_CONFIG)

# ---- the sharded (DCP) format
DCP_MANIFEST = "dcp_manifest.json"
DCP_METADATA = ".metadata"
DCP_SHARD_SUFFIX = ".distcp"
DCP_FILES_DESCRIPTION = f"{DCP_METADATA} / __*{DCP_SHARD_SUFFIX}"

# ---- the pipeline format
PIPELINE_META = "pipeline.json"
STAGE_FILES_DESCRIPTION = "stage*_model.safetensors"

_STEP_NAME = re.compile(rf"{STEP_PREFIX}([0-9]+)")
_RANK_KINDS = {"optimizer": OPTIMIZER_PREFIX, "extra": EXTRA_PREFIX}


def checkpoint_root(out_dir: str) -> str:
    """<out_dir>/checkpoints."""
    return os.path.join(out_dir, CKPT_SUBDIR)


def step_dir_name(step: int) -> str:
    """step_XXXXXXXX (8 digits, zero-padded)."""
    return f"{STEP_PREFIX}{int(step):0{STEP_DIGITS}d}"


def parse_step(name: str) -> Optional[int]:
    """The step of a checkpoint directory name `step_<digits>` (any padding), else None (a `.tmp`,
    `.old` or any other name). ASCII digits only."""
    m = _STEP_NAME.fullmatch(name or "")
    return int(m.group(1)) if m else None


def rank_file(kind: str, rank: int) -> str:
    """optimizer_rank{r}.pt (kind "optimizer") or extra_rank{r}.pt (kind "extra")."""
    return f"{_RANK_KINDS[kind]}{int(rank)}{RANK_FILE_SUFFIX}"


def optimizer_file(rank: int) -> str:
    return rank_file("optimizer", rank)


def extra_file(rank: int) -> str:
    return rank_file("extra", rank)


def is_extra_file(name: str) -> bool:
    """A per-rank extra state file (extra_rank{r}.pt)."""
    return str(name).startswith(EXTRA_PREFIX)


def dcp_shard_file(rank: int, k: int = 0) -> str:
    """__{rank}_{k}.distcp: DCP's k-th data file of a rank (FileSystemWriter's naming)."""
    return f"__{int(rank)}_{int(k)}{DCP_SHARD_SUFFIX}"


def dcp_shard_prefix(rank: int) -> str:
    """The prefix of every DCP data file of `rank` (`__{rank}_`)."""
    return f"__{int(rank)}_"


def stage_model_file(stage: int) -> str:
    """stage{s}_model.safetensors: one pipeline stage's weights."""
    return f"stage{int(stage)}_model.safetensors"


def stage_optimizer_file(stage: int, dp_rank: int) -> str:
    """stage{s}_optimizer_dp{r}.pt: one pipeline stage's optimizer state of data-parallel rank r."""
    return f"stage{int(stage)}_optimizer_dp{int(dp_rank)}.pt"


def plain_file_name(name: Any) -> bool:
    """A file directly inside a checkpoint directory: no separator, not '.', '..' or empty."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and os.sep not in name and "\0" not in name
