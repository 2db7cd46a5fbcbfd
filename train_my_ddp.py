"""Train a Llama2-style model: pretraining, SFT or DPO, on one process or many (torchrun).

    python train_my_ddp.py [config.py ...] --out_dir=out/run --data_dir=... --tokenizer_dir=...
    torchrun --standalone --nproc_per_node=2 train_my_ddp.py ...        (same flags)

    torchrun --standalone --nproc_per_node=4 train_my_ddp.py ... --pipeline_parallel_size=2   (2 stages x 2 dp)

One loop for every task, world size and engine: the same wrapper, optimizer, clipping, loss scaler and
precision policy whether or not the run is distributed; our DDP, FSDP2 (--parallel=fsdp) and pipeline
stages (--pipeline_parallel_size) sit behind parallel/engine.py (`engine.forward_backward`, `evaluate`,
`save`, `load`); what differs between pretraining, SFT and DPO (data, loss, units, validation figures)
is train_task.py's; where weights come from (Hugging Face, our checkpoints, LoRA bases) is
run_weights.py's. Read `train()` top to bottom: configuration -> where the run starts (`decide_start`)
-> model (`build_model`, `choose_trainable`, `dpo_reference`) -> engine + optimizer (`place_on_engine`)
-> data -> resumed state (`restore`) -> the loop (`Loop.step`: lr, micro-batches, token-normalised
loss, optimizer step; `Loop.log_step`: metrics, evaluation, samples; `Loop.save`) -> the end.

Exit codes (utils/constants.py): 0 done, 2 bad configuration, 3 bad data (also shards made with
another tokenizer), 4 non-finite loss, 5 a checkpoint or weights directory that cannot be loaded,
6 --out_dir is in use by another live run (one run per directory: utils/run_lock.py),
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

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import time
from typing import Any, Optional

PROG = "train_my_ddp.py"
if __name__ == "__main__":  # answered in a second: --help, typos, bad values, missing paths (no torch yet)
    from train_config import precheck
    precheck(sys.argv[1:], title=__doc__.strip().splitlines()[0], prog=PROG)

import torch  # after the pre-check, which must not wait for it

from utils.configurator import ConfigError, help_text, parse_config, save_config_json
from model.flops import mfu_from
from parallel.engine import StepStats
from run_weights import check_lora_base, load_lora_base, load_weights_from, select_trainable_for
from train_config import (TrainConfig, TrainingError, continues_run, existing_run_error, imply_engine,
                          max_iters_for_epochs, resolve_warmup,
                          nothing_to_continue_error, one_line, resume_flag, validate_config)
from train_task import build_data, count_tokens, count_units, evaluate, micro_batch_loss
from utils import checkpoint as ckpt
from utils import run_lock
from utils.constants import (EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_INTERRUPTED,
                             EXIT_NONFINITE_LOSS, EXIT_OK)
from utils.device import (HostCopy, StepTimer, low_precision_cpu_warning, memory_stats, parse_dtype, seed_everything,
                          synchronize)
from utils.dist import DistInfo, all_reduce_max, barrier, destroy, init_distributed
from utils.errors import exit_code_for
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


# ---------------------------------------------------------------------------- model

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


def build_task_evaluator(cfg: TrainConfig):
    """--eval_tasks: the task files read and checked (exit 3 naming file:line), the run's tokenizer; else None."""
    paths = [t.strip() for t in cfg.eval_tasks.split(",") if t.strip()]
    if not paths:
        return None
    from lm_tasks import TaskEvaluator
    return TaskEvaluator(paths, cfg.tokenizer_dir, cfg.max_seq_len, cfg.eval_tasks_limit)


def build_sampler(cfg: TrainConfig):
    """--sample_every > 0: the run's prompts encoded with its tokenizer (train_samples.py), else None.
    A prompt file or tokenizer that cannot be read is a bad configuration (exit 2)."""
    if cfg.sample_every <= 0:
        return None
    from train_samples import TrainSampler, read_prompts
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


QUIET_LINE_EVERY_S = 10.0  # stdout not a terminal, --log_interval not given: a step line at least this often (s)
_last_line_at = [0.0]


TIMING_WARMUP_STEPS = 2  # steps of each process left out of the logged rate and MFU (Throughput)


def _line_due(scheduled: bool, now: Optional[float] = None, quiet_lines: bool = True) -> bool:
    """Whether the loop prints this step's line: when `scheduled` (every --log_interval steps, evaluations,
    step 1), and, when stdout is not a terminal (a pipe or a log file: no progress bar there) and the user
    did not choose --log_interval (`quiet_lines`), also when no line came for QUIET_LINE_EVERY_S seconds,
    so that a piped run with the default interval is never silent for minutes."""
    now = time.time() if now is None else now
    quiet = quiet_lines and not sys.stdout.isatty() and now - _last_line_at[0] >= QUIET_LINE_EVERY_S
    if scheduled or quiet:
        _last_line_at[0] = now
        return True
    return False


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(help_text(TrainConfig(), __doc__.strip().splitlines()[0], prog=PROG))
        return EXIT_OK
    rank = int(os.environ.get("RANK", "0"))
    # the run directory's lock (utils/run_lock.py): global rank 0 holds it for the run's life and lets go on any
    # way out of main(), a refused start included
    with contextlib.ExitStack() as run_dir:
        try:
            given: set[str] = set()  # the flags this command sets (command line or config file), not defaults
            cfg = parse_config(TrainConfig(), argv, given=given)
            implied = imply_engine(cfg, given)  # --tensor_parallel_size / --dp_replicate_size > 1 -> --parallel=fsdp
            if implied and rank == 0:
                print(implied, flush=True)
            if rank == 0 and cfg.out_dir:  # before anything reads or writes out_dir (an empty one is
                # validate_config's); torchrun's other ranks are the same run
                run_dir.enter_context(run_lock.acquire(cfg.out_dir, command=run_lock.command_line(argv)))
                run_lock.check_run_dir_layout(cfg.out_dir)
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
        except (run_lock.RunDirBusy, run_lock.RunDirUnusable) as e:
            code, msg = exit_code_for(e)
            print(f"[rank {rank}] error: {msg}", file=sys.stderr, flush=True)
            return code
        try:
            from parallel.engine import needs_process_group
            info = init_distributed(cfg.device, need_group=needs_process_group(cfg))
            return train(cfg, info, continues=continues, max_iters_given="max_iters" in given,
                         log_interval_given="log_interval" in given)
        except Exception as e:  # noqa: BLE001 - named errors become one line and an exit code; others re-raise
            named = exit_code_for(e)  # utils/errors.py: the one exception -> exit code mapping
            if named is None:
                raise
            code, msg = named
            print(f"[rank {rank}] error: {msg}", file=sys.stderr, flush=True)
            return code
        finally:
            destroy()


def _refuse_if_too_big(mcfg, device: str, what: str, code: int) -> None:
    """TrainingError before anything is allocated when the model's fp32 weights alone exceed the memory the
    device has free (a checkpoint's model_config.json within the bounds can still describe a model no
    machine holds: it built layers until memory ran out)."""
    from utils.model_bounds import fit_problem, param_count
    n = param_count(mcfg.dim, mcfg.n_layers, mcfg.n_heads, mcfg.vocab_size, mcfg.n_kv_heads, mcfg.hidden_dim,
                    tie_embeddings=mcfg.tie_embeddings)
    problem = fit_problem(n, device, what)
    if problem:
        raise TrainingError(problem, code)


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


@dataclasses.dataclass
class Start:
    """Where a run begins: a checkpoint of this out_dir to continue, or weights to start from."""
    continues: bool
    resume_dir: Optional[str] = None      # the checkpoint continued (None: a new run, or nothing saved yet)
    saved_state: dict = dataclasses.field(default_factory=dict)  # its trainer_state.json
    init_from: str = "scratch"            # what a run that does not continue a checkpoint starts from
    init_flag: str = "--init_from"        # where init_from came from, for messages
    saved_cfg: dict = dataclasses.field(default_factory=dict)    # its config.json (read by restore)
    run_start: Optional[dict] = None      # run_start.json of a start without a checkpoint, written before step 1


@dataclasses.dataclass
class Progress:
    """What the loop advances and a checkpoint's trainer_state.json records."""
    step: int = 0                          # optimizer steps done
    data_step: int = 0                     # data steps drawn (trained or skipped by --skip_data_steps)
    best_val: float = float("inf")
    last_val: Optional[float] = None
    tokens_seen: int = 0
    skip_steps: set = dataclasses.field(default_factory=set)
    saved_guard: Optional[dict] = None     # the spike guard's window, as saved
    rng: Optional[dict] = None             # RNG states to restore right before the loop
    max_iters_from: Optional[str] = None   # --num_train_epochs runs: which flag set max_iters


def decide_start(cfg: TrainConfig, info: DistInfo, continues: Optional[bool], log) -> Start:
    """--resume: continue the newest valid checkpoint of out_dir, or start from --init_from (logged)."""
    if continues is None:  # not given by main(): decide now, before this rank writes anything there
        continues = continues_run(cfg)
    barrier()  # every rank has decided before rank 0 records this start (run_start.json)
    start = Start(continues, init_from=cfg.init_from)
    if continues:
        start.resume_dir = ckpt.find_latest_valid(cfg.out_dir, log=log)
        if start.resume_dir is not None:
            step = int(os.path.basename(start.resume_dir).removeprefix("step_"))
            log(f"[resume] continuing {cfg.out_dir} from step {step} ({resume_flag(cfg)})")
            # else exit 5 naming the file
            start.saved_state = ckpt.read_trainer_state(start.resume_dir, required=("step", "world_size"))
        else:  # as run_start.json records (or --resume_fallback), else exit 2 / 5
            start.init_from, start.init_flag = start_without_checkpoint(cfg, log)
    elif ckpt.list_checkpoints(cfg.out_dir):  # --resume=never
        raise existing_run_error(cfg)
    else:
        if info.is_main and os.path.exists(os.path.join(cfg.out_dir, "metrics.jsonl")):
            # a run that died before it recorded its start: keep its log, but do not mix it into this one
            aside = os.path.join(cfg.out_dir, f"metrics.jsonl.{int(time.time())}.old")
            os.replace(os.path.join(cfg.out_dir, "metrics.jsonl"), aside)
            log(f"[init] previous metrics.jsonl (no checkpoint) moved to {aside}")
        log(f"[init] new run from {cfg.init_from} in {cfg.out_dir} ({resume_flag(cfg)})")
    return start


def build_model(cfg: TrainConfig, info: DistInfo, start: Start, tok_meta: dict, log) -> tuple[Any, dict]:
    """(model, init_info): the continued checkpoint's architecture (its weights load with the engine),
    a Hugging Face or our model (run_weights), or a new one from the flags; checked against the tokenizer."""
    from model import Transformer
    from model.config import read_model_config
    init_info: dict = {"source": "scratch", "kind": "scratch"}
    if start.resume_dir is not None:
        init_info = start.saved_state.get("init_info", init_info)
        if start.saved_state.get("lora_base"):  # a light checkpoint: rebuild the frozen base first
            model = load_lora_base(start.saved_state["lora_base"], start.resume_dir, log)
        else:
            mcfg = read_model_config(start.resume_dir)  # CheckpointError naming the file: exit 5
            _refuse_if_too_big(mcfg, cfg.device, f"checkpoint {start.resume_dir}: model_config.json",
                               EXIT_BAD_CHECKPOINT)
            model = Transformer(mcfg)
    elif start.init_from != "scratch":
        model, init_info = load_weights_from(start.init_from, log, flag=start.init_flag,
                                             tokenizer_dir=cfg.tokenizer_dir)
    else:
        try:
            mcfg = new_model_config(cfg, tok_meta)
        except ValueError as e:
            raise TrainingError(f"bad model configuration: {e}", EXIT_BAD_CONFIG) from e
        # the vocabulary may come from the tokenizer (--vocab_size=0): the pre-check could not count it
        _refuse_if_too_big(mcfg, cfg.device, f"bad configuration: --dim={cfg.dim} --n_layers={cfg.n_layers}",
                           EXIT_BAD_CONFIG)
        model = Transformer(mcfg)
    if start.resume_dir is None:  # written right before the first step (train): a restart begins the same way
        start.run_start = {"init_from": init_info["source"], "requested_init_from": start.init_from,
                           "kind": init_info["kind"], "task_type": cfg.task_type, "started_at": time.time()}
    if model.cfg.vocab_size < int(tok_meta["vocab_size"]):
        hint = ("; to grow the vocabulary to an extended tokenizer, start from a Hugging Face directory holding the "
                "model's own tokenizer (export this one with export_hf.py)" if init_info["kind"] == "ours" else "")
        raise TrainingError(f"model vocab {model.cfg.vocab_size} < tokenizer vocab {tok_meta['vocab_size']}{hint}",
                            EXIT_BAD_CONFIG)
    return model, init_info


def choose_trainable(cfg: TrainConfig, model, init_info: dict, start: Start, log) -> Optional[dict]:
    """Select what trains (all, LoRA adapters, embeddings) and return the light-checkpoint base, if any.

    Light checkpoints (LoRA or --trainable=embeddings) hold only the trainable tensors + a reference to
    the frozen base (path, fingerprint, and the tokenizer it was grown to), when the base is a file the
    checkpoint can point at (not random weights; not fsdp, whose sharded checkpoints are written
    without gathering anyway). A grown base is re-derived deterministically (model/resize.py); the
    fingerprint covers its frozen rows."""
    from model.lora import trainable_parameters
    try:
        what = select_trainable_for(model, dataclasses.asdict(cfg))
    except ValueError as e:
        raise TrainingError(f"--lora_*: {e}", EXIT_BAD_CONFIG) from e
    c = trainable_parameters(model)
    log(f"{what}: {c['trainable']:,} trainable of {c['total']:,} parameters ({c['percent']:.2f}%)")
    from parallel.engine import light_checkpoints_supported
    frozen_base = cfg.lora_rank > 0 or cfg.trainable == "embeddings"
    if not (frozen_base and light_checkpoints_supported(cfg) and init_info["kind"] in ("ours", "hf")):
        return None
    if start.resume_dir is not None:
        lora_base = start.saved_state.get("lora_base")
        if lora_base:
            check_lora_base(model, lora_base, start.resume_dir)
        return lora_base
    from parallel.engine import base_fingerprint
    lora_base = {"source": os.path.abspath(init_info["source"]), "fingerprint": base_fingerprint(model)}
    if init_info.get("resized"):
        lora_base["tokenizer_dir"] = init_info["resized"]["tokenizer_dir"]
    log(f"[lora] checkpoints hold the trainable tensors only; the frozen base is {lora_base['source']} "
        f"(sha256 {lora_base['fingerprint'][:12]})")
    return lora_base


def dpo_reference(cfg: TrainConfig, init_info: dict, log) -> Optional[Any]:
    """DPO's frozen reference model (--ref_model, else the policy's starting weights); None otherwise."""
    if cfg.task_type != "dpo":
        return None
    ref_src = cfg.ref_model or init_info.get("ref_source") or init_info["source"]
    if ref_src == "scratch":
        raise TrainingError("--task_type=dpo needs a frozen reference model, and this run started from scratch: "
                            "pass --ref_model=<run, checkpoint or Hugging Face dir>", EXIT_BAD_CONFIG)
    ref_model, _ = load_weights_from(ref_src, log, flag="--ref_model" if cfg.ref_model else "reference model",
                                     tokenizer_dir=cfg.tokenizer_dir)
    init_info["ref_source"] = ref_src
    return ref_model.requires_grad_(False).eval()


def place_on_engine(cfg: TrainConfig, info: DistInfo, model, ref_model, log, threads: str = "") -> tuple[Any, Any]:
    """(engine, reference model laid out like the policy): the precision policy, the kernel and layout
    lines (the layout line ends with `threads`, set_threads' words), and our DDP / FSDP / pipeline stages
    behind one interface (parallel/engine.py)."""
    dtype = parse_dtype(cfg.dtype)
    slow_dtype = low_precision_cpu_warning(info.device, dtype)
    if slow_dtype:
        log(f"[warning] {slow_dtype}")
    model_cfg = model.cfg
    from model.attention import describe_attention
    from model.kernels import describe_choice, flash_attn_functions
    if model_cfg.flash_attn:
        flash_attn_functions(info.device)  # detected (and logged) once
    log(f"[kernels] attention: {describe_attention(info.device, model_cfg, dtype, cfg.compile)}; "
        f"{describe_choice(info.device, model_cfg.kernel_backend, cfg.compile, fused=model_cfg.fused_rmsnorm)}")
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"[model] {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trainable), {model_cfg.n_layers} layers, "
        f"dim {model_cfg.dim}, vocab {model_cfg.vocab_size}, dtype {cfg.dtype}, device {info.device}, "
        f"world {info.world_size}")
    from parallel.engine import build_engine, describe_layout
    try:  # the engine casts the model to its precision policy and moves what this rank runs to the device
        engine = build_engine(model, cfg, device=info.device)
    except ValueError as e:  # a layout that cannot run (e.g. a checkpoint's layers do not split into stages)
        raise TrainingError(f"bad parallel configuration: {_one_line(e)}", EXIT_BAD_CONFIG) from e
    log(describe_layout(cfg, engine, info.world_size) + (f"; {threads}" if threads else ""))
    if ref_model is not None:  # DPO: the frozen reference, sharded like the policy under fsdp
        ref_model = engine.place_reference(ref_model, info.device, dtype)
        log(f"[dpo] reference model: {engine.reference_layout()} on each of {engine.dp_size} rank(s), "
            f"{cfg.dtype}, frozen")
    return engine, ref_model


def restore(cfg: TrainConfig, info: DistInfo, engine, train_loader, start: Start, log) -> Progress:
    """A continued run's weights, optimizer (sharded under ZeRO), comm-hook state, data cursor and the
    loop's counters; a new run's counters at zero. --skip_data_steps joins the saved skip list."""
    from utils.spike_guard import parse_data_steps
    progress = Progress()
    if start.resume_dir is not None:
        resume_dir, saved = start.resume_dir, start.saved_state
        saved_cfg = start.saved_cfg = ckpt.read_json(os.path.join(resume_dir, "config.json"))
        problem = global_batch_problem(dict(saved_cfg, world_size=saved["world_size"]), cfg.batch_size,
                                       cfg.gradient_accumulation_steps, info.world_size, cfg.pipeline_parallel_size,
                                       cfg.tensor_parallel_size) \
            or engine.resume_problem(resume_dir, int(saved["world_size"]), info.world_size)
        if problem:
            raise TrainingError(f"cannot resume {resume_dir}: {problem}", EXIT_BAD_CONFIG)
        extra = _load_checkpoint(cfg, info, engine, resume_dir, saved, saved_cfg)
        new_data = [k for k in DATA_KEYS if k in saved_cfg and not same_value(k, saved_cfg[k], getattr(cfg, k))]
        saved_n = saved["data_cursor"].get("num_samples") if isinstance(saved.get("data_cursor"), dict) else None
        if not new_data and saved_n is not None and int(saved_n) != train_loader.num_samples:
            # the same flags, other data: shards were added or removed and the index rebuilt. The saved position
            # would name other samples, so it is refused, or with --allow_data_change the new data starts over
            change = (f"the training data changed since {resume_dir} was saved: {saved_n} training samples then, "
                      f"{train_loader.num_samples} now in --data_dir={cfg.data_dir} (shards added or removed, the "
                      "index rebuilt)")
            if not cfg.allow_data_change:
                raise TrainingError(f"cannot resume: {change}; the saved data position would name other samples. "
                                    "Pass --allow_data_change=true to continue the run on the new data from its start "
                                    "(a new epoch 0; the weights, optimizer and step count carry on), or restore the "
                                    "old data", EXIT_BAD_CONFIG)
            new_data = ["the data's content"]
        if new_data:  # only with --allow_data_change=true (main() refuses changed data flags otherwise)
            log(f"[resume] data changed ({', '.join(new_data)}): reading the new data from its start "
                "(--allow_data_change=true)")
        else:
            try:
                train_loader.load_state_dict(saved["data_cursor"])
            except ValueError as e:
                raise TrainingError(f"cannot resume the data order from {resume_dir}: {e}. When changing the number "
                                    "of processes keep --batch_size x --gradient_accumulation_steps x data-parallel "
                                    "ranks (the global batch) the same", EXIT_BAD_CONFIG) from e
        progress.step = int(saved["step"])
        progress.best_val = saved.get("best_val_loss") or float("inf")
        progress.tokens_seen = int(saved.get("tokens_seen", 0))
        if isinstance(saved.get("val_loss"), (int, float)):
            progress.last_val = float(saved["val_loss"])  # resuming a finished run reports its real final loss
        if not new_data:  # the skip list names data steps of this data stream: a new stream starts afresh
            try:
                progress.data_step = int(saved.get("data_step", progress.step))
                progress.skip_steps = {int(d) for d in saved.get("skip_data_steps", [])}
                guard = saved.get("spike_guard")
                progress.saved_guard = {"recent": [float(v) for v in guard["recent"]]} if guard else None
            except (TypeError, ValueError, KeyError) as e:
                raise TrainingError(f"checkpoint {resume_dir}: trainer_state.json: unreadable data_step, "
                                    f"skip_data_steps or spike_guard ({e})", EXIT_BAD_CHECKPOINT) from e
        progress.rng = extra["rng"] if extra is not None else None
        log(f"[resume] at step {progress.step}, data cursor {saved['data_cursor']}")
    progress.skip_steps |= set(parse_data_steps(cfg.skip_data_steps))
    return progress


def _load_checkpoint(cfg: TrainConfig, info: DistInfo, engine, resume_dir: str, saved: dict,
                     saved_cfg: dict) -> Optional[dict]:
    """engine.load of a continued checkpoint; its extra state (RNG), or None when extra_rank{r}.pt is
    missing (logged). A damaged file raises CheckpointError naming it (exit 5); weights that do not fit
    the model are exit 5, or exit 2 naming the --lora_* / --trainable flags changed since the run began."""
    try:
        return engine.load(resume_dir, int(saved["world_size"]), info.rank, info.world_size,
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


def set_threads(cfg: TrainConfig, info: DistInfo, log) -> tuple[str, Any]:
    """The CPU compute threads of this process (utils/threads.py), set now: --threads, else OMP_NUM_THREADS
    as torchrun sets it, else the usable cores, and then (CPU runs, not --deterministic) a ThreadTuner that
    trains on one thread while that is measured faster (other processes compete for the cores). Warns once
    (rank 0) when the machine is oversubscribed. Returns (the words of the [layout] line, the tuner or None)."""
    from utils.threads import ThreadTuner, choose_threads, describe_threads, oversubscription_warning
    choice = choose_threads(cfg.threads)
    torch.set_num_threads(choice.threads)
    fixed = choice.source in ("--threads", "OMP_NUM_THREADS") or cfg.deterministic
    tuner = ThreadTuner(choice.threads) if not fixed and choice.threads > 1 and info.device.type == "cpu" else None
    busy = oversubscription_warning(choice.threads)
    if busy:
        log(f"[warning] threads: {busy}")
    return describe_threads(choice, adaptive=tuner is not None), tuner


def _rank0_log(info: DistInfo):
    def log(msg: str) -> None:
        if info.is_main:
            from tqdm import tqdm
            tqdm.write(msg, file=sys.stdout)  # keeps the progress bar (if any) below the log lines
            sys.stdout.flush()
    return log


def train(cfg: TrainConfig, info: DistInfo, continues: Optional[bool] = None, max_iters_given: bool = False,
          log_interval_given: bool = False) -> int:
    """One run (main() has parsed and resolved `cfg`). max_iters_given: --max_iters was set explicitly
    (command line or config file), so it wins over --num_train_epochs; log_interval_given: --log_interval
    too, so no extra time-based lines are printed between the lines it asks for."""
    log = _rank0_log(info)
    if info.is_main:  # library modules report optional-accelerator detection through logging
        logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    validate_config(cfg, world_size=info.world_size)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    threads, tuner = set_threads(cfg, info, log)
    os.makedirs(cfg.out_dir, exist_ok=True)
    from tokenizer import load_tokenizer_meta
    try:
        tok_meta = load_tokenizer_meta(cfg.tokenizer_dir)
    except (OSError, ValueError, KeyError) as e:  # a damaged tokenizer_meta.json (TokenizerMetaError) is data: 3
        raise TrainingError(f"--tokenizer_dir={cfg.tokenizer_dir}: {e}", getattr(e, "exit_code", EXIT_BAD_CONFIG)) from e

    # ---- where from, the model, what trains, DPO's reference, the engine, the data, the resumed state
    start = decide_start(cfg, info, continues, log)
    seed_everything(cfg.seed)  # identical initial weights on every rank (and DDP broadcasts anyway)
    model, init_info = build_model(cfg, info, start, tok_meta, log)
    model_cfg = model.cfg
    lora_base = choose_trainable(cfg, model, init_info, start, log)
    engine, ref_model = place_on_engine(cfg, info, model, dpo_reference(cfg, init_info, log), log, threads)
    del model  # the engine holds what this rank runs (under pp the other stages' layers are freed)
    engine.lora_base = lora_base
    optimizer = engine.optimizer
    from data_preprocess.shard_format import DataError
    try:
        train_loader, make_val_loader = build_data(cfg, engine.dp_rank, engine.dp_size, tok_meta,
                                                   fixed_shape=engine.fixed_batch_shape)
    except (DataError, ValueError, OSError) as e:  # DataError includes StaleIndexError
        raise TrainingError(f"data: {' '.join(str(e).split())}", EXIT_BAD_DATA) from e
    progress = restore(cfg, info, engine, train_loader, start, log)
    if cfg.num_train_epochs > 0:  # max_iters from the epochs, unless --max_iters was given (now or when the run began)
        given = max_iters_given or start.saved_state.get("max_iters_from") == "max_iters"
        cfg.max_iters, line = max_iters_for_epochs(cfg.num_train_epochs, train_loader.num_samples,
                                                   train_loader.samples_per_step, cfg.max_iters, given)
        progress.max_iters_from = "max_iters" if given else "num_train_epochs"
        log(line)
    if cfg.warmup_iters < 0:  # auto: resolved once max_iters is final, then saved (a resume keeps these steps)
        cfg.warmup_iters, how = resolve_warmup(cfg.warmup_iters, cfg.warmup_ratio, cfg.max_iters, cfg.task_type)
        log(f"[schedule] warmup {cfg.warmup_iters} steps ({how})")
    if info.is_main:
        save_config_json(cfg, os.path.join(cfg.out_dir, "config.json"))
    metrics = MetricsLogger(cfg.out_dir, enabled=info.is_main, tensorboard=cfg.tensorboard, log=log,
                            wandb=cfg.wandb, wandb_project=cfg.wandb_project, wandb_run_name=cfg.wandb_run_name,
                            run_config=dataclasses.asdict(cfg),
                            resume_step=progress.step if start.continues else None)
    loop = Loop(cfg, info, engine, ref_model, model_cfg, train_loader, make_val_loader, metrics, progress, init_info,
                log)
    loop.tuner = tuner
    loop.quiet_lines = not log_interval_given
    loop.announce(saved_max_iters=int(start.saved_cfg.get("max_iters") or 0))

    # ---- graceful stop: finish the step, save, exit 75
    stop = {"requested": False}

    def on_signal(signum, frame):
        stop["requested"] = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    if start.run_start is not None and info.is_main:  # only now: a start that fails in set-up leaves no trace
        ckpt.write_run_start(cfg.out_dir, start.run_start)
    if progress.rng is not None:  # last thing before the loop: set-up above may draw random numbers
        ckpt.restore_rng_state(progress.rng, info.device)
    engine.model.train()
    while progress.step < cfg.max_iters:
        rec = loop.step()
        do_eval = (cfg.eval_interval > 0 and progress.step % cfg.eval_interval == 0) or progress.step == cfg.max_iters
        loop.log_step(rec, do_eval)
        stop_now = all_reduce_max(1.0 if stop["requested"] else 0.0, info.device) > 0
        if progress.step % cfg.checkpoint_interval == 0 or progress.step == cfg.max_iters or stop_now:
            loop.save(progress.last_val if do_eval else None)
        loop.restart_clock()  # evaluation and checkpoint time is not charged to the next step's tokens/s
        if stop_now:
            log(f"[train] stop requested by signal: saved step {progress.step}, exiting with {EXIT_INTERRUPTED}")
            loop.close()
            return EXIT_INTERRUPTED
    loop.close()
    optimizer.finish_param_sync()
    synchronize(info.device)
    barrier()  # let the last asynchronous collectives drain before the process group goes away
    last = progress.last_val if progress.last_val is not None else float("nan")
    log(f"[train] done: {progress.step} steps, final val_loss {last:.4f}, best {progress.best_val:.4f}")
    return EXIT_OK


class Loop:
    """One optimizer step at a time: learning rate, this rank's micro-batches, forward + backward
    through the engine, the optimizer step, the spike guard, the log line, evaluation, samples and
    checkpoints. The same for every task and engine (parallel/engine.py hides which one runs)."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, engine, ref_model, model_cfg, train_loader, make_val_loader,
                 metrics: MetricsLogger, progress: Progress, init_info: dict, log) -> None:
        from model.flops import flops_per_token, resolve_peak_flops
        from utils.spike_guard import SpikeDetector
        self.cfg, self.info, self.engine, self.ref_model, self.model_cfg = cfg, info, engine, ref_model, model_cfg
        self.train_loader, self.make_val_loader, self.metrics = train_loader, make_val_loader, metrics
        self.progress, self.init_info, self.log = progress, init_info, log
        self.flops_per_token = flops_per_token(model_cfg, cfg.max_seq_len)
        self.peak = resolve_peak_flops(info.device, parse_dtype(cfg.dtype), override=cfg.peak_flops,
                                       cache_dir=cfg.out_dir if info.is_main else None)
        # the logged rate and MFU: a 20-step window of device-timed steps, the first TIMING_WARMUP_STEPS of the
        # process left out (compiling, autotuning, the optimizer's first allocation), evaluation, checkpoint
        # and sample time never counted (restart_clock), real (non-padding) tokens only
        self.throughput = Throughput(window=20, warmup=TIMING_WARMUP_STEPS)
        self.timer = StepTimer(info.device)
        self.lr_kw = dict(max_lr=cfg.learning_rate, min_lr=cfg.min_lr, warmup_iters=cfg.warmup_iters,
                          decay_iters=cfg.lr_decay_iters or cfg.max_iters, schedule=cfg.lr_schedule)
        self.guard = SpikeDetector(cfg.spike_factor, cfg.spike_window) if cfg.spike_guard else None
        if self.guard is not None and progress.saved_guard:
            self.guard.load_state_dict(progress.saved_guard)
        self.sampler = build_sampler(cfg)  # --sample_every: prompts and tokenizer checked on every rank
        self.task_eval = build_task_evaluator(cfg) if info.is_main else None  # --eval_tasks: files read now
        self.resumed_from = {"step": progress.step, "data_step": progress.data_step}
        self.loss_fn = lambda model, batch: micro_batch_loss(cfg, model, ref_model, batch, info.device)  # noqa: E731
        self.pbar = None
        self.tuner = None  # utils/threads.ThreadTuner: the thread count chosen by measuring (set by train())
        self.t_last = time.time()
        self.quiet_lines = True  # time-based lines between the --log_interval ones (when not a terminal)
        self.t_loop_start = time.time()
        self._eta_from: Optional[tuple[float, int]] = None  # (time, step) after the warm-up steps: the ETA's base

    def restart_clock(self) -> None:
        """After evaluation, a checkpoint or samples: none of that time is charged to the next step."""
        self.t_last = time.time()
        self.timer.restart()

    def announce(self, saved_max_iters: int) -> None:
        """The start-up lines of the loop: schedule warnings, sizes, skipped data, the spike guard."""
        from utils.constants import EXIT_LOSS_SPIKE
        from utils.lr_schedule import schedule_warnings
        from utils.spike_guard import format_data_steps
        cfg, p, log = self.cfg, self.progress, self.log
        for warning in schedule_warnings(max_iters=cfg.max_iters, warmup_iters=cfg.warmup_iters,
                                         lr_decay_iters=cfg.lr_decay_iters, schedule=cfg.lr_schedule,
                                         resumed_at=p.step, saved_max_iters=saved_max_iters):
            log(f"[warning] schedule: {warning}")
        layout = f"{self.engine.dp_size} data-parallel ranks"
        if cfg.pipeline_parallel_size > 1:
            layout += f" x {cfg.pipeline_parallel_size} pipeline stages ({cfg.pipeline_schedule})"
        if cfg.tensor_parallel_size > 1:
            layout += f" x {cfg.tensor_parallel_size} tensor-parallel ranks"
        log(f"[train] {cfg.task_type}: {cfg.max_iters} steps x {cfg.gradient_accumulation_steps} micro-batches x "
            f"{cfg.batch_size} samples x {layout}, seq {cfg.max_seq_len}; MFU against {self.peak.describe()} per device")
        if p.skip_steps:
            log(f"[data] data steps never trained on: {format_data_steps(p.skip_steps)} (drawn and discarded; "
                f"{sum(d > p.data_step for d in p.skip_steps)} of them still ahead, at data step {p.data_step})")
        if self.guard is not None:
            log(f"[spike_guard] exit {EXIT_LOSS_SPIKE} when a loss is non-finite or above {cfg.spike_factor:g} x "
                f"the median of the previous {cfg.spike_window} steps ({len(self.guard.recent)} known)")
        if self.info.is_main and cfg.progress and sys.stdout.isatty():  # a bar in a terminal; lines in log files
            from tqdm import tqdm
            self.pbar = tqdm(total=cfg.max_iters, initial=p.step, desc="train", dynamic_ncols=True, mininterval=2.0,
                             file=sys.stdout)

    def _draw(self) -> tuple[list, list]:
        """This rank's micro-batches of the next data step, after discarding any data steps to skip."""
        p, gas = self.progress, self.cfg.gradient_accumulation_steps
        skipped = []
        while p.data_step + 1 in p.skip_steps:  # --skip_data_steps: the cursor moves past that data, untrained
            for _ in range(gas):
                next(self.train_loader)
            p.data_step += 1
            skipped.append(p.data_step)
        batches = [next(self.train_loader) for _ in range(gas)]
        p.data_step += 1
        return batches, skipped

    def step(self) -> dict:
        """One optimizer step; returns its metrics row (before evaluation)."""
        cfg, info, engine, p = self.cfg, self.info, self.engine, self.progress
        _fire_step_faults(p.step + 1)
        if self.tuner is not None and self.tuner.threads_for_next_step() != torch.get_num_threads():
            torch.set_num_threads(self.tuner.threads_for_next_step())
        lr = lr_at(p.step, **self.lr_kw)
        engine.optimizer.set_lr(lr)
        batches, skipped = self._draw()
        counts = engine.sum_over_data([float(sum(count_units(cfg, b) for b in batches)),
                                       float(sum(count_tokens(b) for b in batches))], info.device)
        global_units, step_tokens = max(1.0, float(counts[0])), float(counts[1])
        engine.optimizer.zero_grad()
        poison = _fault("nan_loss", p.step + 1)  # test hook: this step's loss (and gradients) become NaN
        spike_fault = _spike_fault(p.data_step, batches)  # test hook: a loss spike on this step's data
        # forward + backward of every micro-batch (gradient accumulation, or the pipeline schedule); the
        # gradients are those of (all ranks' loss sums) / global_units
        sums = engine.forward_backward(batches, _spiked(self.loss_fn, *spike_fault) if spike_fault else self.loss_fn,
                                       global_units, poison=poison)
        # the step's sums, reduced and copied to the host behind the backward: the optimizer's one host
        # sync (reading the gradient norm) comes after that copy, so reading it then waits for nothing
        sums_copy = HostCopy(engine.sum_over_data(sums, info.device, to_host=False))
        stepped, grad_norm = engine.optimizer.step()  # waits for the gradient reductions, clips, steps
        stats = StepStats.from_tensor(sums_copy.get()).per_unit(global_units)
        self._check_loss(stats["loss"])
        p.step += 1
        p.tokens_seen += int(global_units) if cfg.task_type != "dpo" else 0
        self.metrics.heartbeat()
        if self.pbar is not None:
            self.pbar.update(1)
        now = time.time()
        dt, self.t_last = max(1e-9, now - self.t_last), now  # this step on the host clock (the raw, per-step rate)
        tps_avg = self.throughput.add(self.timer.lap(step_tokens))  # the window's rate, warm-up steps excluded
        if self.tuner is not None:
            self._tune_threads(dt, step_tokens)
        rec: dict[str, Any] = {"step": p.step, "loss": stats["loss"], "lr": lr, "grad_norm": grad_norm,
                               "stepped": bool(stepped), "tokens_per_sec": step_tokens / dt,
                               "tokens_seen": p.tokens_seen}
        if tps_avg is not None:  # None during the warm-up steps: no rate or MFU is claimed for them
            rec.update(tokens_per_sec_avg=tps_avg, mfu_is_estimate=self.peak.is_estimate,
                       mfu=mfu_from(self.flops_per_token * tps_avg / info.world_size, self.peak))
        if cfg.task_type == "dpo":
            rec.update({k: stats[k] for k in ("chosen_reward", "rejected_reward", "reward_acc")})
        if p.skip_steps or self.guard is not None:
            rec["data_step"] = p.data_step  # the data this step trained on
        if skipped:
            rec["skipped_data_steps"] = skipped  # drawn and discarded before it
        if p.step % cfg.log_interval == 0 or p.step <= TIMING_WARMUP_STEPS + 1:
            rec.update(memory_stats(info.device))  # the allocator's statistics: built anew on each call
        return rec

    def _tune_threads(self, seconds: float, tokens: float) -> None:
        """Feed this step's time to the ThreadTuner; a switch it keeps is one log line."""
        kept = len(self.tuner.changes)
        self.tuner.record(seconds, tokens)
        if len(self.tuner.changes) > kept:
            _, old, new, r_old, r_new = self.tuner.changes[-1]
            self.log(f"[threads] {old} -> {new} thread{'s' if new != 1 else ''} at step {self.progress.step}: "
                     f"{r_old:,.0f} -> {r_new:,.0f} tokens/s measured (measured again now and then)")

    def _check_loss(self, loss: float) -> None:
        """--spike_guard: a spike records the step and exits 76 (the supervisor rolls back); a non-finite
        loss without fp16 loss scaling exits 4. The step counter has not advanced yet."""
        from utils.constants import EXIT_LOSS_SPIKE
        from utils.spike_guard import SPIKE_FILE, write_spike_record
        cfg, p = self.cfg, self.progress
        spike = self.guard.check(loss, nonfinite_is_spike=cfg.dtype != "fp16") if self.guard is not None else None
        if spike is not None:  # the rollback is the supervisor's: record the step, save nothing, exit 76
            if self.info.is_main:
                write_spike_record(cfg.out_dir, dict(spike, step=p.step + 1, data_step=p.data_step, loss=loss,
                                                     factor=cfg.spike_factor, window=cfg.spike_window,
                                                     resumed_from=self.resumed_from,
                                                     skip_data_steps=sorted(p.skip_steps), time=time.time()))
            barrier()  # no rank exits before the record is on disk
            why = "is non-finite" if spike["reason"] == "non_finite" else \
                f"> {cfg.spike_factor:g} x the running median {spike['median']:.4g}"
            raise TrainingError(f"loss spike at step {p.step + 1} (data step {p.data_step}): loss {loss:.4g} {why}; "
                                f"recorded in {os.path.join(cfg.out_dir, SPIKE_FILE)}, nothing saved after it",
                                EXIT_LOSS_SPIKE)
        if not math.isfinite(loss) and cfg.dtype != "fp16":
            raise TrainingError(f"non-finite loss {loss} at step {p.step + 1}; the last good checkpoint in "
                                f"{cfg.out_dir}/checkpoints is intact (lower --learning_rate or use --dtype=fp16 "
                                "with loss scaling)", EXIT_NONFINITE_LOSS)

    def log_step(self, rec: dict, do_eval: bool) -> None:
        """Evaluate when due, write the metrics row, print the line when due, then samples (--sample_every)."""
        p = self.progress
        if do_eval:
            ev = evaluate(self.cfg, self.engine, self.ref_model, self.make_val_loader, self.info)
            if ev is not None:
                rec.update(ev)
                p.last_val = ev["val_loss"]
                p.best_val = min(p.best_val, p.last_val)
            if self.task_eval is not None:  # rank 0, the whole model (validate_config refuses fsdp / pipeline)
                self.engine.optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
                scores = self.task_eval.run(self.engine.module, self.info.device)
                rec.update(scores)
                self.log(f"[eval_tasks] step {p.step}: " + ", ".join(
                    f"{k[len('val_'):]} {v:.4f}" for k, v in scores.items()))
        self.metrics.write(rec)
        if self.info.is_main and _line_due(p.step % self.cfg.log_interval == 0 or do_eval or p.step == 1,
                                           quiet_lines=self.quiet_lines):
            self.log(format_line(rec, total=self.cfg.max_iters, elapsed=time.time() - self.t_loop_start,
                                 eta=self._eta(p.step)))
        if self.info.is_main and self.sampler is not None and self.sampler.due(p.step):  # RNG untouched
            self.engine.optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
            self.metrics.write_samples(self.sampler.sample(self.engine.module, p.step, self.info.device))

    def _eta(self, step: int) -> Optional[float]:
        """Seconds to --max_iters at this process's wall-clock pace since its warm-up steps (evaluations,
        checkpoints and samples included, as they will recur); None until that pace is known."""
        now = time.time()
        if self._eta_from is None:
            if step - self.resumed_from["step"] >= TIMING_WARMUP_STEPS:
                self._eta_from = (now, step)
            return None
        t0, s0 = self._eta_from
        if step <= s0:
            return None
        return (now - t0) / (step - s0) * max(0, self.cfg.max_iters - step)

    def save(self, val_loss: Optional[float]) -> None:
        """A checkpoint of this step (engine.save: every rank, atomic publish, keep_last)."""
        cfg, info, p = self.cfg, self.info, self.progress
        state = {"data_cursor": self.train_loader.state_dict(),
                 "best_val_loss": None if p.best_val == float("inf") else p.best_val,
                 "val_loss": val_loss, "tokens_seen": p.tokens_seen, "init_info": self.init_info,
                 "lr": lr_at(max(0, p.step - 1), **self.lr_kw), "task_type": cfg.task_type,
                 "data_step": p.data_step, "skip_data_steps": sorted(p.skip_steps)}  # a resume skips them too
        if p.max_iters_from is not None:  # which flag set max_iters: a resume decides the same way
            state["max_iters_from"] = p.max_iters_from
        if self.guard is not None:  # the running window: a resumed run judges its steps as an uninterrupted one
            state["spike_guard"] = self.guard.state_dict()
        fault = (lambda: os.kill(os.getpid(), signal.SIGKILL)) if _fault("kill_in_save", p.step) else None
        path = self.engine.save(cfg.out_dir, p.step, rank=info.rank, world_size=info.world_size,
                                model_config=self.model_cfg.to_dict(), trainer_state=state,
                                run_config=dataclasses.asdict(cfg),
                                extra_state={"rng": ckpt.capture_rng_state(info.device)}, keep_last=cfg.keep_last,
                                barrier=barrier, fault_hook=fault, log=self.log)
        self.log(f"[checkpoint] step {p.step} -> {path}")

    def close(self) -> None:
        if self.pbar is not None:
            self.pbar.close()
        self.metrics.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
