"""The trainer's configuration: every flag of train_my_ddp.py with its default and help, and the
validation that turns impossible values into one exit-2 error listing all of them.

Owns: `TrainConfig` (plain values, overridden by config files and `--key=value` through
utils/configurator.py; HF Trainer / torchtitan spellings such as `--lr` or `--max_steps` are aliases, see
utils/cli.py), `validate_config`, `TrainingError` (an error with its exit code), whether a start
continues the run in --out_dir (`--resume`, `continues_run`), and `precheck`: the answers
train_my_ddp.py gives before it imports torch.
Must never: import torch, touch devices or start processes; read anything but the config files,
tokenizer_meta.json and --eval_tasks files named on the command line and --out_dir's listing and JSON (never a
checkpoint's tensors).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from optimizer.optimizer_config import bf16_state_conflicts
from parallel.config import ParallelFlags
from trainer.tasks.grpo_flags import GRPOFlags, grpo_problems
from utils.configurator import flag
from utils.constants import EXIT_BAD_CONFIG, EXIT_BAD_DATA
from utils.errors import TrainingError, one_line  # noqa: F401  (re-exported: the trainer and tests use them)


_f = flag  # utils/configurator.py: a flag's default and help


@dataclass
class RunFlags:
    """Where the run writes, what it reads, where it starts."""
    # ---- run and data
    out_dir: str = _f("out/run", "run directory: metrics.jsonl, checkpoints/, config.json")
    task_type: str = _f("pretrain", "pretrain | sft | dpo | grpo (online RL from --data_dir prompts: docs/grpo.md)")
    data_dir: str = _f("", "pretrain: directory of token shards + index_L<L>/; sft/dpo: a .jsonl file or a directory of them")
    data_mix: str = _f("", 'pretrain: JSON {"name": weight} (shard dirs under --data_dir) or {"name": {"path": dir, "weight": w}}')
    tokenizer_dir: str = _f("", "tokenizer directory (tokenizer_meta.json gives the vocab size and special ids)")
    val_ratio: float = _f(0.05, "sft/dpo: fraction of records held out for validation (unused with "
                          "--eval_data_dir)")
    eval_data_dir: str = _f("", "validation data read instead of a split of --data_dir (TRL's eval_dataset), all of "
                            "it: sft/dpo: a records file or folder, or a pretokenized folder (--val_ratio is then "
                            "unused: every record of --data_dir trains); pretrain: a folder of token shards, every "
                            "L+1-token sample of it (no index needed; with --data_dir's index its val split is "
                            "unused). The start warns when validation has fewer than 20 samples")
    prefetch_batches: int = _f(-1, "training batches drawn ahead on a background thread (collated, and pinned for "
                               "a GPU) while the step runs; -1 = auto: 2 on an accelerator, 0 (off) on the CPU, where "
                               "the thread would compete with the compute threads. Batches and checkpoints are the "
                               "same either way")
    sft_packing: bool = _f(False, "sft: pack several samples per row (attention restricted to each sample)")
    init_from: str = _f("scratch", "what a new run starts from: scratch | <our run or checkpoint dir> | <Hugging Face "
                        "model dir> (a run that continues, see --resume, ignores it); resume = --resume=always")
    init_checkpoint: str = _f("latest", "which checkpoint of the --init_from run to start from: latest | best (the "
                              "lowest validation loss among its valid checkpoints) | step_N; the load line names it")
    resume: str = _f("auto", "auto: continue the run in --out_dir from its newest valid checkpoint, or, with none yet, "
                     "as its run_start.json records it started; a new run from --init_from when --out_dir holds "
                     "neither | always: continue, exit 2 when there is nothing to continue (unless "
                     "--resume_fallback) | never: a new run, exit 2 when --out_dir holds checkpoints")
    resume_fallback: str = _f("", "--resume=always (--init_from=resume) with no checkpoint and no run_start.json: start "
                              "from this (scratch | <weights dir>) instead of exiting 2")
    ref_model: str = _f("", "dpo: weights of the frozen reference model (default: the initial weights)")
    allow_data_change: bool = _f(False, "a run that continues: accept data that differs from the saved run's (data "
                                 "flags: data_dir, data_mix, seed, ...; or the same --data_dir holding other shards, "
                                 "its index rebuilt): the weights, optimizer and step count carry on and the new "
                                 "data is read from its start (epoch 0); without it such a resume is exit 2")


@dataclass
class ModelFlags:
    """The model's shape and kernels (a checkpoint's model_config.json wins over them)."""
    # ---- model (ignored when initialising from a checkpoint, whose model_config.json wins)
    dim: int = _f(256, "model width")
    n_layers: int = _f(4, "transformer blocks")
    n_heads: int = _f(8, "attention heads")
    n_kv_heads: int = _f(0, "key/value heads for GQA (0 = n_heads)")
    hidden_dim: int = _f(0, "SwiGLU width (0 = Llama formula)")
    multiple_of: int = _f(32, "round the SwiGLU width up to this")
    max_seq_len: int = _f(256, "tokens per training sample")
    vocab_size: int = _f(0, "0 = from the tokenizer (padded to a multiple of 64)")
    rope_theta: float = _f(10000.0, "RoPE base")
    dropout: float = _f(0.0, "attention and residual dropout")
    tie_embeddings: bool = _f(False, "share the embedding and LM-head weights")
    gradient_checkpointing: bool = _f(False, "recompute each layer in backward to save activation memory")
    fused_kernels: str = _f("auto", "auto|true (per device: Triton kernels on CUDA, Inductor-fused references for the "
                            "norms/RoPE/SwiGLU under --compile; hand-written autograd kernels on CPU) | triton | torch "
                            "(force one implementation) | false (plain PyTorch references, as HF)")
    compile: bool = _f(False, "torch.compile the model")


@dataclass
class TrainableFlags:
    """What trains: everything, the embeddings, LoRA adapters."""
    # ---- what trains
    trainable: str = _f("all", "all (full fine-tuning; with --lora_rank>0 the adapters) | embeddings (only the "
                        "embedding and LM head; with --lora_rank>0 those plus the adapters)")
    # ---- LoRA
    lora_rank: int = _f(0, "0 = full fine-tuning; >0 = LoRA adapters of this rank, base frozen")
    lora_alpha: float = _f(16.0, "LoRA scaling numerator")
    lora_dropout: float = _f(0.0, "dropout on the LoRA input")
    lora_targets: str = _f("q_proj,v_proj", "comma-separated linear names, or 'all'")
    lora_train_embeddings: bool = _f(False, "also train the embedding and LM head (continued pretraining)")


@dataclass
class OptimizationFlags:
    """Batch, schedule, AdamW, precision, seed."""
    # ---- optimisation
    batch_size: int = _f(8, "samples per micro-batch per rank")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    max_iters: int = _f(1000, "optimizer steps")
    num_train_epochs: float = _f(0.0, "passes over the training set (0 = off; fractions allowed): sets --max_iters to "
                                 "ceil(epochs x (training samples // global batch)), logged at start; the LR decay "
                                 "follows. A --max_iters given explicitly (command line or config file) wins")
    learning_rate: float = _f(6e-4, "peak learning rate")
    min_lr: float = _f(6e-5, "floor of the decay")
    warmup_iters: int = _f(-1, "linear warmup steps (-1 = auto: --warmup_ratio x max_iters when --warmup_ratio > 0, "
                           "else pretrain min(100, 10% of max_iters), sft/dpo 3% of max_iters; at least 1). The steps "
                           "chosen are logged at start and saved with the run")
    warmup_ratio: float = _f(0.0, "linear warmup as a fraction of max_iters (HF Trainer's warmup_ratio), used when "
                             "--warmup_iters is not given (-1); e.g. 0.03")
    lr_decay_iters: int = _f(0, "0 = max_iters")
    lr_schedule: str = _f("cosine", "cosine | linear | wsd | constant")
    weight_decay: float = _f(0.1, "AdamW weight decay, applied to matrices only")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "clip by the global norm over all ranks (0 = off)")
    optimizer: str = _f("adamw", "adamw | muon: Muon on the hidden 2-D matrices of the blocks (q/k/v/o, gate/up/down, "
                        "LoRA adapters), AdamW (the flags above) on embeddings, LM head and norms (docs/optimizer.md)")
    muon_lr: float = _f(0.0, "Muon's peak learning rate (0 = --learning_rate: with --muon_adjust_lr=match_rms_adamw an "
                        "AdamW-tuned rate carries over); the schedule scales it like --learning_rate")
    muon_momentum: float = _f(0.95, "Muon's momentum (Nesterov)")
    muon_weight_decay: float = _f(0.1, "Muon's decoupled weight decay: p <- p (1 - lr x wd)")
    muon_adjust_lr: str = _f("match_rms_adamw", "match_rms_adamw (Moonlight: update RMS 0.2, AdamW's lr carries "
                             "over) | original (Keller Jordan: sqrt(max(1, rows/cols)))")
    optimizer_state_dtype: str = _f("fp32", "fp32 | bf16: AdamW's moments (exp_avg, exp_avg_sq) in bf16 with "
                                    "stochastic rounding, as DeepSeek-V3 keeps them: 8 bytes a parameter less to "
                                    "keep and to stream each step (--parallel=ddp's one-launch AdamW; "
                                    "docs/optimizer.md)")
    dtype: str = _f("fp32", "fp32 | bf16 | fp16 model precision (fp32 main params in the optimizer)")
    seed: int = _f(1337, "seed of initialisation and data order")
    deterministic: bool = _f(False, "torch.use_deterministic_algorithms (bit-exact resume on GPU)")


@dataclass
class DPOFlags:
    """DPO's loss."""
    # ---- DPO
    dpo_beta: float = _f(0.1, "DPO temperature")
    dpo_loss: str = _f("sigmoid", "sigmoid | ipo | hinge")
    dpo_label_smoothing: float = _f(0.0, "conservative DPO label smoothing (sigmoid loss)")


@dataclass
class TrainConfig(GRPOFlags, ParallelFlags, DPOFlags, OptimizationFlags, TrainableFlags, ModelFlags, RunFlags):
    """Every training flag, flat (`--key=value`), composed of typed sections in this order: RunFlags,
    ModelFlags, TrainableFlags, OptimizationFlags, DPOFlags, the parallel engine's (parallel/config.py
    ParallelFlags, declared once there), then evaluation, logging, checkpoints and the guard below."""
    # ---- evaluation, logging, checkpoints
    eval_interval: int = _f(100, "evaluate every N steps (0 = only at the end)")
    eval_iters: int = _f(20, "validation micro-batches per rank per evaluation (>= 1)")
    log_interval: int = _f(10, "log a line every N steps")
    checkpoint_interval: int = _f(100, "checkpoint every N steps (and at the end)")
    keep_last: int = _f(3, "keep this many newest checkpoints (plus the best by validation loss)")
    async_checkpoint: bool = _f(False, "save checkpoints in the background: the saving step copies the state to host "
                                "memory (pinned on a GPU, reused) and goes on; one writer thread writes, verifies, "
                                "publishes and prunes as a synchronous save does. One save in flight (the next save, "
                                "the end of the run and SIGTERM wait for it); a crash during the write leaves the "
                                "previous checkpoint the latest (docs/checkpoints.md)")
    # ---- stability guard (docs/monitor.md, "Loss spikes")
    spike_guard: bool = _f(False, "stop with exit 76 and record the step in <out_dir>/spike.json when a step's loss "
                           "is non-finite or above --spike_factor x the median of the previous --spike_window steps "
                           "(judged once that many were seen); monitor_process.py then rolls back, replays the steps "
                           "once, and skips their data if the spike comes back")
    spike_factor: float = _f(3.0, "--spike_guard: a loss above this multiple of the running median is a spike (> 1)")
    spike_window: int = _f(50, "--spike_guard: steps in the running median, and the warm-up before the first check")
    skip_data_steps: str = _f("", "data steps never trained on, e.g. 12,13 or 10-13 (data step N = the global batch "
                              "step N reads when nothing is skipped): drawn from the loader and discarded, the step "
                              "trains on the next data. Kept in checkpoints: a resume skips them without the flag")
    eval_tasks: str = _f("", "multiple-choice task files (local jsonl: HellaSwag / ARC / PIQA / MMLU-style or generic, "
                         "comma-separated) scored at every evaluation on rank 0 as lm-evaluation-harness scores them "
                         "(eval_lm.py), --batch_size choices per forward: val_<task>_acc and val_<task>_acc_norm in "
                         "metrics.jsonl; the files are checked before the start (exit 3 naming file:line); not with "
                         "--parallel=fsdp or pipeline stages (no rank holds the whole model)")
    eval_tasks_limit: int = _f(0, "--eval_tasks: score only each file's first N records (0 = all)")
    sample_every: int = _f(0, "every N optimizer steps (0 = off), after that step's evaluation, rank 0 generates a "
                           "continuation of each --sample_prompts prompt with the run's tokenizer: console, "
                           "<out_dir>/samples.jsonl, TensorBoard text, a W&B table. Training is unchanged (RNG "
                           "states restored). Not with --parallel=fsdp or --pipeline_parallel_size > 1")
    sample_prompts: str = _f("", "--sample_every: prompts separated by |, or a text file with one prompt per line "
                             "(default: 'Once upon a time'); sft/dpo runs wrap each in the chat template as a "
                             "user turn")
    sample_max_new_tokens: int = _f(32, "--sample_every: tokens generated per prompt (fewer when </s> or <|im_end|> "
                                    "comes first)")
    sample_temperature: float = _f(0.0, "--sample_every: 0 = greedy; > 0 samples with a private generator seeded by "
                                   "(--seed, step), never the training's random numbers")
    tensorboard: bool = _f(False, "also log to <out_dir>/tensorboard when tensorboard is installed")
    wandb: bool = _f(False, "also log to Weights & Biases (WANDB_MODE=offline works without network); a resumed "
                     "run continues the same W&B run")
    wandb_project: str = _f("myllm", "W&B project")
    wandb_run_name: str = _f("", "W&B run name (default: W&B's own)")
    progress: bool = _f(True, "progress bar with ETA on rank 0 (when stdout is a terminal)")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N")
    threads: int = _f(0, "CPU compute threads per process (0 = auto: OMP_NUM_THREADS when set, as torchrun sets it "
                      "per rank; else the cores this process may use, shared among the node's ranks, and on CPU "
                      "one thread while that is measured faster: beside other busy processes PyTorch's spinning "
                      "threads train several times slower; not with --deterministic=true). Said in the [layout] "
                      "line; a fixed count keeps a CPU run bit-reproducible (docs/training.md \"CPU threads\")")
    peak_flops: float = _f(0.0, "peak FLOP/s per device for MFU (0 = the data-sheet table for known GPUs, else a "
                           "measured matmul peak, the best ever seen on this machine, kept in peak_flops.json under "
                           "$MYLLM_CACHE_DIR or ~/.cache/myllm: an estimate, MFU shown as mfu~)")


def trains_embeddings(run: Any) -> bool:
    """Whether a run (TrainConfig or its saved config dict) trains the embedding and LM head while
    freezing the rest: --trainable=embeddings, or LoRA with --lora_train_embeddings=true."""
    get = run.get if isinstance(run, dict) else lambda k, d=None: getattr(run, k, d)
    return get("trainable", "all") == "embeddings" or (get("lora_rank", 0) > 0 and bool(get("lora_train_embeddings")))




# ---------------------------------------------------------------------------- how a run starts (--resume)

RESUME_CHOICES = ("auto", "always", "never")


def resume_policy(cfg: TrainConfig) -> str:
    """--resume, with --init_from=resume read as its alias --resume=always."""
    return "always" if cfg.init_from == "resume" else cfg.resume


def resume_flag(cfg: TrainConfig) -> str:
    """The flag that chose the policy, as messages name it."""
    return "--init_from=resume" if cfg.init_from == "resume" else f"--resume={cfg.resume}"


def continues_run(cfg: TrainConfig) -> bool:
    """Whether this start continues the run in --out_dir (from its newest valid checkpoint or, with none
    yet, as its run_start.json records it started) rather than starting a new run from --init_from.

    Told from the directory's listing alone (no torch, nothing verified: a continuing run whose every
    checkpoint is damaged exits 5 later), so the pre-check and every rank decide alike; the trainer
    decides on every rank before any of them can write there (train_my_ddp.main)."""
    from utils.run_dir import has_run_start, listed_checkpoints
    policy = resume_policy(cfg)
    return policy == "always" or (policy == "auto" and (bool(listed_checkpoints(cfg.out_dir))
                                                        or has_run_start(cfg.out_dir)))


def existing_run_error(cfg: TrainConfig) -> TrainingError:
    """--resume=never on an --out_dir that holds checkpoints."""
    return TrainingError(f"--out_dir={cfg.out_dir} already holds checkpoints of a run and --resume=never does not "
                         "continue it; continue it with --resume=auto (the default), or start a new run in another "
                         "--out_dir", EXIT_BAD_CONFIG)


def nothing_to_continue_error(cfg: TrainConfig, ckpt_root: str) -> TrainingError:
    """--resume=always with no checkpoint, no run_start.json and no --resume_fallback."""
    return TrainingError(f"{resume_flag(cfg)}: no complete checkpoint in {ckpt_root} and no record of how the run "
                         "started (run_start.json); start it with --init_from=scratch or --init_from=<weights dir> "
                         "(and --resume=auto), or pass --resume_fallback", EXIT_BAD_CONFIG)


def no_weights_message(flag: str, path: str) -> str:
    """A weights path (--init_from, --ref_model, --resume_fallback) with nothing loadable there."""
    from utils.run_dir import no_weights_detail
    return f"{flag}={path}: no complete checkpoint or Hugging Face model there{no_weights_detail(path)}"


def init_checkpoint_problem(cfg: TrainConfig) -> Optional[str]:
    """Why --init_checkpoint (other than latest) names nothing of --init_from, told from names and JSON only."""
    if cfg.init_checkpoint == "latest":
        return None
    from utils.run_dir import checkpoint_choice_problem, is_hf_dir
    if cfg.init_from in ("scratch", "resume") or is_hf_dir(cfg.init_from):
        return (f"--init_checkpoint={cfg.init_checkpoint} chooses among the checkpoints of an --init_from run "
                f"directory; --init_from={cfg.init_from} is not one")
    choice = checkpoint_choice_problem(cfg.init_from, cfg.init_checkpoint)
    return "--init_checkpoint: " + choice.replace("--checkpoint=", "--init_checkpoint=") if choice else None


# ---------------------------------------------------------------------------- the pre-check (no torch)

def precheck(argv: list[str], title: str, prog: str) -> None:
    """train_my_ddp.py's answers that need no torch, given before it imports torch (a second, not a minute on a
    busy machine): --help (exit 0); a flag, value or config file that does not parse, a value validate_config
    refuses, a --tokenizer_dir without tokenizer_meta.json, --resume=never on an --out_dir with checkpoints,
    --resume=always with nothing to continue, and an --init_from, --resume_fallback or (DPO) --ref_model path
    that is not there, an --out_dir that cannot be created or whose checkpoints/ cannot be written, a new model
    whose --dim does not split into --n_heads (exit 2), an --eval_tasks file that cannot be scored (exit 3 naming
    file:line; exit 2 for a path that is no task file), a --data_dir (or --eval_data_dir) that does not exist or
    (pretrain) holds raw text instead of token shards, with the pretokenizer's commands (exit 3,
    data_preprocess/train_data_check.py; the full path says "no token shards" without the commands), and an
    --out_dir another run holds (exit 6, utils/run_lock.py). Each is printed as the full path prints that
    mistake, with its exit code; with several mistakes the full path may name another one first. Returns when it
    finds none: the full path checks the rest (devices, what the
    checkpoints hold, the data, the FSDP / pipeline / LoRA-target options, changes a resume refuses); a bad
    value in a configuration that uses those options is left to it too, so that its one message lists every
    problem.
    Reads only --out_dir's listing and JSON, the config files, tokenizer_meta.json and --eval_tasks files named and
    --data_dir's listing; creates --out_dir and probes its lock (run.lock) last, once everything else passed."""
    import sys

    from utils.configurator import ConfigError, help_text, parse_config
    from utils.constants import EXIT_OK
    from utils.run_dir import CKPT_SUBDIR, has_run_start, listed_checkpoints

    def fail(msg: str, code: int = EXIT_BAD_CONFIG) -> None:
        print(msg, file=sys.stderr, flush=True)
        sys.exit(code)

    if any(a in ("-h", "--help") for a in argv):
        print(help_text(TrainConfig(), title, prog=prog))
        sys.exit(EXIT_OK)
    given: set[str] = set()
    try:
        cfg = parse_config(TrainConfig(), argv, given=given)
    except ConfigError as e:
        fail(f"{prog}: error: {one_line(e)}")
    imply_engine(cfg, given)
    error = f"[rank {int(os.environ.get('RANK', '0'))}] error: "
    continues = continues_run(cfg)
    if continues:  # the run's saved configuration with the command line over it, as the full path builds it
        cfg = _saved_config_under(cfg, argv)
        if cfg is None:
            return
    try:
        validate_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")), torch_free=True)
    except TrainingError as e:
        if validated_with_torch(cfg):  # the full path's one message lists those problems too: let it
            return
        fail(error + one_line(e))
    from tokenizer import load_tokenizer_meta
    try:
        load_tokenizer_meta(cfg.tokenizer_dir)
    except (OSError, ValueError, KeyError) as e:  # a damaged tokenizer_meta.json (TokenizerMetaError) is data: 3
        fail(error + one_line(TrainingError(f"--tokenizer_dir={cfg.tokenizer_dir}: {e}", EXIT_BAD_CONFIG)),
             getattr(e, "exit_code", EXIT_BAD_CONFIG))  # the same line and code as trainer/loop.py train
    bad_task = eval_tasks_content_error(cfg)
    if bad_task is not None:  # the line and code the full path gives (trainer/loop.py build_task_evaluator)
        from utils.errors import exit_code_for
        code, msg = exit_code_for(bad_task)
        fail(error + msg, code)
    checkpoints = listed_checkpoints(cfg.out_dir)
    if not continues and cfg.init_from == "scratch":  # the model is built from these flags: do they split?
        from utils.model_bounds import head_shape_problem
        shape = head_shape_problem(cfg.dim, cfg.n_heads, cfg.n_kv_heads or None)
        if shape:
            fail(error + f"bad model configuration: {shape}")  # as build_model says it, 14 s later
    from data_preprocess.train_data_check import training_data_problem
    data = training_data_problem(cfg.task_type, cfg.data_dir, cfg.tokenizer_dir, cfg.max_seq_len, cfg.data_mix)
    if data:  # missing, or raw text where token shards belong (with the commands that make them)
        fail(error + data, EXIT_BAD_DATA)
    if cfg.eval_data_dir:  # the same look at the validation data, the flag named
        data = training_data_problem(cfg.task_type, cfg.eval_data_dir, cfg.tokenizer_dir, cfg.max_seq_len)
        if data:
            fail(error + data.replace("data: ", "data: --eval_data_dir=", 1).replace(
                "then train with --data_dir=", "then pass --eval_data_dir="), EXIT_BAD_DATA)
    if continues and not checkpoints and not has_run_start(cfg.out_dir):  # --resume=always, nothing to continue
        if not cfg.resume_fallback:
            fail(error + one_line(nothing_to_continue_error(cfg, os.path.join(cfg.out_dir, CKPT_SUBDIR))))
        if cfg.resume_fallback != "scratch" and not os.path.isdir(cfg.resume_fallback):
            fail(error + no_weights_message("--resume_fallback", cfg.resume_fallback))
    if not continues:
        if checkpoints:
            fail(error + one_line(existing_run_error(cfg)))
        if cfg.init_from != "scratch" and not os.path.isdir(cfg.init_from):
            fail(error + no_weights_message("--init_from", cfg.init_from))
        choice = init_checkpoint_problem(cfg)
        if choice:
            fail(error + choice)
    if cfg.task_type == "dpo" and cfg.ref_model and not os.path.isdir(cfg.ref_model):
        fail(error + no_weights_message("--ref_model", cfg.ref_model))
    if int(os.environ.get("RANK", "0")) == 0:  # an --out_dir that cannot be made, or one another run holds
        from utils import run_lock
        from utils.errors import exit_code_for
        try:
            run_lock.acquire(cfg.out_dir, command=run_lock.command_line(argv)).release()  # main() takes it for good
            run_lock.check_run_dir_layout(cfg.out_dir)
        except run_lock.REFUSALS as e:
            code, msg = exit_code_for(e)
            print(error + msg, file=sys.stderr, flush=True)
            sys.exit(code)


def validated_with_torch(cfg: TrainConfig) -> bool:
    """Whether validate_config also checks options that need torch to tell (LoRA target names), which the
    pre-check cannot list with the others."""
    return cfg.lora_rank > 0 and cfg.lora_targets != "all"


def _saved_config_under(asked: TrainConfig, argv: list[str]) -> Optional[TrainConfig]:
    """The configuration a continuing run resolves (utils.run_config.resolve_resume_config): the saved
    one with argv over it, --resume as asked. None when a saved value does not read back: the full
    path names that."""
    import dataclasses
    import typing

    from utils.configurator import ConfigError, coerce_value, parse_config
    from utils.run_dir import saved_config
    try:
        saved = saved_config(asked.out_dir)
    except ValueError:
        return None
    if saved is None:
        return asked
    hints = typing.get_type_hints(TrainConfig)
    values = {}
    try:
        for k, v in saved.items():
            if k in hints and k != "init_from":  # utils.run_config.NOT_RESTORED
                values[k] = coerce_value(k, v, hints[k], "saved configuration")
        cfg = parse_config(dataclasses.replace(TrainConfig(), **values), argv)
    except ConfigError:
        return None
    cfg.resume = asked.resume  # how to start is this command's choice, never the saved run's
    return cfg


def parallel_section(cfg: TrainConfig):
    """The parallel flags as parallel/config.py's typed section (same names)."""
    from parallel.config import ParallelConfig
    return ParallelConfig.from_flags(cfg)


def engine_needs(cfg: TrainConfig) -> dict[str, str]:
    """What this run asks of the engine, {the flag that asks: capability} (parallel/config.py CAPABILITIES):
    the engine's declarations decide what is refused, never a test of the engine's name here."""
    asked = ((cfg.task_type == "dpo", "--task_type=dpo", "dpo"),
             (cfg.task_type == "grpo", "--task_type=grpo", "grpo"),
             (cfg.lora_rank > 0, f"--lora_rank={cfg.lora_rank}", "frozen_parameters"),
             (cfg.trainable != "all", f"--trainable={cfg.trainable}", "frozen_parameters"),
             (cfg.tie_embeddings, "--tie_embeddings=true", "tied_embeddings"),
             (cfg.sample_every > 0, f"--sample_every={cfg.sample_every}", "whole_model_on_one_rank"),
             (bool(cfg.eval_tasks.strip(" ,")), "--eval_tasks", "whole_model_on_one_rank"),
             (cfg.optimizer_state_dtype != "fp32", f"--optimizer_state_dtype={cfg.optimizer_state_dtype}",
              "low_precision_optimizer_states"))
    return {asked_by: cap for on, asked_by, cap in asked if on}


def parallel_problems(cfg: TrainConfig, world_size: Optional[int] = None) -> list[str]:
    """parallel/config.py's refusals of this run's layout (sizes, the world, capabilities), plus the model
    shape's split over the stages and tensor ranks when the model is built from these flags."""
    section = parallel_section(cfg)
    out = section.problems(world_size, needs=engine_needs(cfg))
    sizes_valid = min(section.pp, section.tp) >= 1
    if cfg.init_from in ("scratch", "resume") and sizes_valid:
        out.extend(section.model_problems(n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                                          n_kv_heads=cfg.n_kv_heads or cfg.n_heads, max_seq_len=cfg.max_seq_len,
                                          dropout=cfg.dropout))
    return out


def sample_problems(cfg: TrainConfig) -> list[str]:
    """What --sample_every > 0 cannot work with: prompts that name nothing (an engine where no rank holds
    the whole model is parallel_problems'). Reads no file (the prompt file is read when the run starts)."""
    from trainer.samples import prompts_problem
    out = []
    problem = prompts_problem(cfg.sample_prompts)
    if problem:
        out.append(f"--sample_prompts={cfg.sample_prompts!r}: {problem}")
    return out


def eval_task_paths(cfg: TrainConfig) -> list[str]:
    return [t.strip() for t in cfg.eval_tasks.split(",") if t.strip()]


def eval_tasks_problems(cfg: TrainConfig) -> list[str]:
    """What --eval_tasks cannot work with: a path that is no task file (missing, a directory, not .jsonl/.json,
    unreadable; an engine where no rank holds the whole model is parallel_problems'). Reads no record (the
    pre-check reads them: eval_tasks_content_error)."""
    from evals.lm_tasks import task_file_problem
    return [f"--eval_tasks: {problem}" for problem in map(task_file_problem, eval_task_paths(cfg)) if problem]


def eval_tasks_content_error(cfg: TrainConfig) -> Optional[BaseException]:
    """The first --eval_tasks file whose records cannot be scored (evals/lm_tasks.py read_task_lines: exit 3
    naming file:line, exit 2 for a path that is no task file), or None. Reads every record, no torch: the
    pre-check's, so that a bad file ends the start before the model is built, not at the first evaluation."""
    from evals.lm_tasks import TaskConfigError, TaskFormatError, read_task_lines
    for path in eval_task_paths(cfg):
        try:
            read_task_lines(path)
        except (TaskFormatError, TaskConfigError) as e:
            return e
    return None


SFT_DPO_WARMUP_RATIO = 0.03  # the warmup of the common SFT recipes (Alpaca, TRL examples): 3% of the run
PRETRAIN_WARMUP_STEPS = 100


def resolve_warmup(warmup_iters: int, warmup_ratio: float, max_iters: int, task_type: str) -> tuple[int, str]:
    """(warmup steps, how they were chosen): --warmup_iters when given (>= 0); else --warmup_ratio x max_iters
    when > 0; else the task's default: pretraining min(100, 10% of the run), SFT/DPO 3% of the run (a
    short fine-tuning run reaches its peak learning rate). At least 1 step when derived."""
    if warmup_iters >= 0:
        return warmup_iters, f"--warmup_iters={warmup_iters}"
    if warmup_ratio > 0:
        return max(1, round(warmup_ratio * max_iters)), f"--warmup_ratio={warmup_ratio:g} x {max_iters} steps"
    if task_type == "pretrain":
        steps = min(PRETRAIN_WARMUP_STEPS, max(1, max_iters // 10))
        return steps, f"the pretrain default, min({PRETRAIN_WARMUP_STEPS}, 10% of {max_iters} steps)"
    steps = max(1, round(SFT_DPO_WARMUP_RATIO * max_iters))
    return steps, f"the {task_type} default, {SFT_DPO_WARMUP_RATIO:.0%} of {max_iters} steps"


def imply_engine(cfg: TrainConfig, given: set) -> Optional[str]:
    """The engine a layout implies when --parallel was not given (parallel/config.py `implied_engine`), set
    on `cfg`; the line that says so, or None."""
    section = parallel_section(cfg)
    line = section.implied_engine(given)
    cfg.parallel = section.parallel
    return line


def max_iters_for_epochs(num_train_epochs: float, num_samples: int, samples_per_step: int, max_iters: int,
                         max_iters_given: bool) -> tuple[int, str]:
    """--num_train_epochs: (the run's max_iters, the start-up line that says how it was set).

    An epoch is num_samples // samples_per_step optimizer steps (dataset/loader.py drops the < one global
    batch left over), samples_per_step = batch_size x gradient_accumulation_steps x data-parallel ranks: a
    resume at another split of the same global batch (a resume must keep it) gets the same number. A
    fractional last step counts as a step (ceil). A --max_iters given explicitly wins (and the line says so)."""
    per_epoch = max(1, num_samples // samples_per_step)
    steps = max(1, math.ceil(round(num_train_epochs * per_epoch, 6)))  # round: 0.1 x 30 is 3, not 4
    head = (f"[schedule] --num_train_epochs={num_train_epochs:g}: 1 epoch = {per_epoch} steps of {samples_per_step} "
            f"samples ({num_samples} training samples)")
    if max_iters_given:
        return max_iters, f"{head} -> {steps} steps, but --max_iters={max_iters} was given and wins"
    return steps, f"{head} -> max_iters={steps}"


# --fused_kernels value -> (fused switches on, ModelConfig.kernel_backend); model/kernels.py picks per op
KERNEL_CHOICES = {"auto": (True, "auto"), "true": (True, "auto"), "triton": (True, "triton"),
                  "torch": (True, "torch"), "false": (False, "auto")}


# --max_iters and the step flags: a billion optimizer steps; --num_train_epochs (utils/constants.py: a
# checkpoint's trainer_state.json is bounded by the same MAX_STEPS)
from utils.constants import MAX_EPOCHS, MAX_STEPS  # noqa: E402


class _Problems(list):
    """The problems validate_config collects, with the three shapes of check most flags need."""

    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def choice(self, name: str, allowed: tuple[str, ...]) -> None:
        if getattr(self.cfg, name) not in allowed:
            self.append(f"--{name}={getattr(self.cfg, name)!r} ({' | '.join(allowed)})")

    def at_least(self, name: str, low: int) -> None:
        if getattr(self.cfg, name) < low:
            self.append(f"--{name}={getattr(self.cfg, name)}: must be >= {low}")

    def at_most(self, name: str, high: int) -> None:
        if getattr(self.cfg, name) > high:
            self.append(f"--{name}={getattr(self.cfg, name)}: must be <= {high:,}")

    def number(self, name: str, low: float, high: float = math.inf, low_open: bool = False, high_open: bool = True,
               what: str = "") -> None:
        v = getattr(self.cfg, name)
        ok = math.isfinite(v) and (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        if not ok:
            if what:
                rule = what
            elif high == math.inf:
                rule = f"must be a finite number {'>' if low_open else '>='} {low:g}"
            else:
                rule = f"must be in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
            self.append(f"--{name}={v}: {rule}")


def validate_config(cfg: TrainConfig, world_size: Optional[int] = None, torch_free: bool = False) -> None:
    """Every value the run cannot work with, as one exit-2 error listing all of them.
    world_size (when known) also checks that the processes form a pp x dp mesh. torch_free: only the
    checks that need no torch (the pre-check's): not the FSDP, pipeline and LoRA-target ones."""
    problems = _Problems(cfg)
    problems.extend(parallel_problems(cfg, world_size))
    _choices_and_combinations(cfg, problems, torch_free)
    _numbers_and_extras(cfg, problems, torch_free)
    problems.extend(grpo_problems(cfg, resume_policy(cfg)))
    if problems:
        raise TrainingError("bad configuration: " + "; ".join(problems), EXIT_BAD_CONFIG)


def _choices_and_combinations(cfg: TrainConfig, p: _Problems, torch_free: bool) -> None:
    """Choices, required paths, and flags that cannot be combined."""
    from trainer.tasks import TASKS  # (torch-free: the names only)
    p.choice("task_type", tuple(TASKS))
    if not str(cfg.out_dir).strip():
        p.append(f"--out_dir={cfg.out_dir!r}: must name the run directory (it holds the checkpoints)")
    if not 0 <= cfg.seed < 2**32:  # numpy's and the data order's generators take a 32-bit unsigned seed
        p.append(f"--seed={cfg.seed}: must be in [0, {2**32 - 1}]")
    if not cfg.data_dir and not cfg.data_mix:
        p.append("--data_dir is required")
    if not cfg.tokenizer_dir:
        p.append("--tokenizer_dir is required")
    p.choice("dtype", ("fp32", "bf16", "fp16"))
    p.choice("lr_schedule", ("cosine", "linear", "wsd", "constant"))
    p.choice("dpo_loss", ("sigmoid", "ipo", "hinge"))
    p.choice("trainable", ("all", "embeddings"))
    p.choice("optimizer", ("adamw", "muon"))
    p.choice("muon_adjust_lr", ("match_rms_adamw", "original"))
    p.number("muon_momentum", 0.0, 1.0)  # as --beta1: a momentum of 1 never forgets, above 1 diverges
    p.number("muon_lr", 0.0, what="must be a finite number >= 0 (0 = --learning_rate)")
    p.number("muon_weight_decay", 0.0)
    p.choice("optimizer_state_dtype", ("fp32", "bf16"))
    if cfg.optimizer_state_dtype == "bf16":
        flags = {"optimizer": "--optimizer=muon", "precision": "--dtype=fp16", "zero_stage": "--zero_stage=2",
                 "overlap_optim_step": "--overlap_optim_step=true"}
        asked = [flags[k] for k, _ in bf16_state_conflicts(cfg.optimizer, cfg.dtype, cfg.zero_stage,
                                                           cfg.overlap_optim_step)]
        if cfg.comm_hook not in ("allreduce", "reduce_scatter"):  # (a hook is the engine's, not OptimizerConfig's)
            asked.append(f"--comm_hook={cfg.comm_hook}")
        for other in asked:
            p.append(f"--optimizer_state_dtype=bf16 cannot be combined with {other} (the bf16 moments live in "
                     "the one-launch AdamW, which does not step that)")
    cfg.fused_kernels = str(cfg.fused_kernels).lower()
    p.choice("fused_kernels", tuple(KERNEL_CHOICES))
    p.choice("resume", RESUME_CHOICES)
    if cfg.init_from == "resume" and cfg.resume == "never":
        p.append("--init_from=resume (= --resume=always) contradicts --resume=never")
    if cfg.task_type in ("sft", "dpo") and cfg.init_from == "scratch" and resume_policy(cfg) != "always":
        p.append(f"--task_type={cfg.task_type} starts from pretrained weights: pass --init_from=<run dir>")
    if cfg.task_type in ("sft", "dpo") and resume_policy(cfg) == "always" and cfg.resume_fallback == "scratch":
        p.append(f"--task_type={cfg.task_type} starts from pretrained weights: --resume_fallback=scratch "
                 "cannot be used")


def _model_size_problems(cfg: TrainConfig, p: _Problems, torch_free: bool) -> None:
    """The model flags within utils/model_bounds.py's bounds (--dim=1048576 is a typo, not a 4 TB model),
    and, with torch (the full start-up), the model's fp32 weights within the memory --device has free:
    refused before anything is allocated. A vocabulary from the tokenizer (--vocab_size=0) counts as 0
    here, so only a model too large without its embedding is refused at this point."""
    from utils.model_bounds import bound_problems, fit_problem, param_count
    fields = {k: getattr(cfg, k) for k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "hidden_dim",
                                           "multiple_of", "max_seq_len", "rope_theta")}
    fields = {k: v for k, v in fields.items() if not (k in ("vocab_size", "n_kv_heads", "hidden_dim") and v == 0)}
    bounds = bound_problems(fields, prefix="--")
    p.extend(bounds)
    if bounds or torch_free or min(cfg.dim, cfg.n_layers, cfg.n_heads, cfg.multiple_of) < 1:
        return
    n = param_count(cfg.dim, cfg.n_layers, cfg.n_heads, cfg.vocab_size, cfg.n_kv_heads or None,
                    cfg.hidden_dim or None, cfg.multiple_of, None, cfg.tie_embeddings)
    problem = fit_problem(n, cfg.device, f"--dim={cfg.dim} --n_layers={cfg.n_layers}")
    if problem:
        p.append(problem)


def _numbers_and_extras(cfg: TrainConfig, p: _Problems, torch_free: bool) -> None:
    """Ranges of the numeric flags, and the checks of samples, skipped data steps and LoRA targets."""
    for name in ("batch_size", "gradient_accumulation_steps", "max_iters", "max_seq_len", "checkpoint_interval",
                 "log_interval", "eval_iters", "keep_last", "dim", "n_layers", "n_heads", "multiple_of",
                 "bucket_size", "powersgd_rank"):
        p.at_least(name, 1)
    for name in ("eval_interval", "lr_decay_iters", "n_kv_heads", "hidden_dim", "vocab_size",
                 "lora_rank", "powersgd_start_iter"):
        p.at_least(name, 0)
    if cfg.warmup_iters < -1:
        p.append(f"--warmup_iters={cfg.warmup_iters}: must be >= 0 (or -1 = auto, see --help)")
    p.number("warmup_ratio", 0.0, 1.0)
    if cfg.tensorboard:
        import importlib.util
        if importlib.util.find_spec("tensorboard") is None:  # HF Trainer refuses too, rather than log nothing
            p.append("--tensorboard=true needs the tensorboard package, optional for training (requirements.txt does "
                     "not install it; requirements-dev.txt does, for the tests): pip install tensorboard, or leave "
                     "--tensorboard off (metrics.jsonl has every value)")
    p.number("learning_rate", 0.0, low_open=True)
    p.number("min_lr", 0.0)
    p.number("weight_decay", 0.0)
    p.number("eps", 0.0, low_open=True)
    p.number("grad_clip", 0.0, what="must be a finite number >= 0 (0 = no clipping)")
    for name in ("beta1", "beta2", "dropout", "lora_dropout", "val_ratio"):
        p.number(name, 0.0, 1.0)
    p.number("rope_theta", 0.0, low_open=True)
    _model_size_problems(cfg, p, torch_free)
    p.number("lora_alpha", 0.0, low_open=True)
    p.number("dpo_beta", 0.0, low_open=True)
    p.number("dpo_label_smoothing", 0.0, 0.5)
    p.number("powersgd_min_compression_rate", 0.0)
    p.number("peak_flops", 0.0, what="must be a finite number >= 0 (0 = measure)")
    p.number("spike_factor", 1.0, low_open=True)
    p.number("num_train_epochs", 0.0, what="must be a finite number >= 0 (0 = off: --max_iters sets the length)")
    # A run of more steps than these is a typo (--max_iters=99999999999999999999 ran "forever")
    for name in ("max_iters", "lr_decay_iters", "warmup_iters"):
        p.at_most(name, MAX_STEPS)
    if math.isfinite(cfg.num_train_epochs) and cfg.num_train_epochs > MAX_EPOCHS:
        p.append(f"--num_train_epochs={cfg.num_train_epochs:g}: must be <= {MAX_EPOCHS:g}")
    p.at_least("sample_every", 0)
    p.at_least("threads", 0)
    p.at_least("prefetch_batches", -1)
    p.at_least("sample_max_new_tokens", 1)
    p.number("sample_temperature", 0.0, what="must be a finite number >= 0 (0 = greedy)")
    if cfg.sample_every > 0:
        p.extend(sample_problems(cfg))
    p.at_least("eval_tasks_limit", 0)
    p.extend(eval_tasks_problems(cfg))
    p.at_least("spike_window", 1)
    from utils.spike_guard import parse_data_steps
    try:
        parse_data_steps(cfg.skip_data_steps)
    except ValueError as e:
        p.append(f"--skip_data_steps={cfg.skip_data_steps!r}: {e}")
    if cfg.lora_train_embeddings and cfg.lora_rank == 0:
        p.append("--lora_train_embeddings=true needs --lora_rank>0 (to train only the embedding and LM head, "
                 "use --trainable=embeddings)")
    if cfg.lora_rank > 0 and not torch_free:
        from model.lora import ALL_LINEAR
        targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
        unknown = [t for t in targets if t not in ALL_LINEAR]
        if cfg.lora_targets != "all" and (unknown or not targets):
            p.append(f"--lora_targets={cfg.lora_targets}: unknown module name(s) "
                     f"{','.join(unknown) or '(none)'}; use a comma-separated subset of "
                     f"{','.join(ALL_LINEAR)}, or all")

