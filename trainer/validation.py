"""The validation of a run's flags: every impossible value or combination, collected into one exit-2 error
that lists them all (`validate_config`), from the parallel layout's refusals (parallel/config.py, from the
engines' declared capabilities), the task names (trainer/tasks/), the model's shape, the numbers' ranges and the
extras (samples, --eval_tasks files).

Owns: the rules and their one-line wording. --max_iters and the step flags are bounded by a billion optimizer
steps, --num_train_epochs by MAX_EPOCHS (utils/constants.py: a checkpoint's trainer_state.json by the same bounds).
Must never: import torch (the pre-check runs it with torch_free=True), or read a checkpoint's tensors.
"""
from __future__ import annotations

import math
from typing import Optional

from optimizer.optimizer_config import bf16_state_conflicts
from trainer.config import (KERNEL_CHOICES, KTO_LOSSES, REFERENCE_FREE_LOSSES, RESUME_CHOICES, TrainConfig,
                            engine_needs, eval_task_paths, parallel_section, resume_policy)
from trainer.tasks.dpo_terms import dpo_loss_terms
from trainer.tasks.grpo_flags import grpo_problems, sampling_problems
from utils.constants import DISTILL_LOSSES, EXIT_BAD_CONFIG, MAX_EPOCHS, MAX_STEPS
from utils.errors import TrainingError
from utils.mla_flags import mla_problems
from utils.model_bounds import parse_sliding_layers, window_problem
from utils.moe_flags import moe_problems
from utils.rope_config import parse_rope_flag


def parallel_problems(cfg: TrainConfig, world_size: Optional[int] = None) -> list[str]:
    """parallel/config.py's refusals of this run's layout (sizes, the world, capabilities), plus the model
    shape's split over the stages and tensor ranks when the model is built from these flags."""
    section = parallel_section(cfg)
    out = section.problems(world_size, needs=engine_needs(cfg))
    sizes_valid = min(section.pp, section.tp) >= 1
    if cfg.init_from in ("scratch", "resume") and sizes_valid:
        out.extend(section.model_problems(n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                                          n_kv_heads=cfg.n_kv_heads or cfg.n_heads, max_seq_len=cfg.max_seq_len,
                                          dropout=cfg.dropout, moe_num_experts=cfg.moe_num_experts))
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


def loaded_mtp_problems(cfg: TrainConfig, depths: int, source: str) -> list[str]:
    """What a run cannot do with a model whose multi-token prediction depths came from its weights (`source`'s
    model_config.json) rather than from --mtp_num_layers, which validate_config checked: the layouts that cannot
    hold the depths (the engines' declarations decide, parallel/config.py) and LoRA, whose checkpoints would
    lose them."""
    asked_by = f"the model of {source} with {depths} multi-token prediction depth(s) (mtp_num_layers)"
    out = parallel_section(cfg).problems(needs={asked_by: "multi_token_prediction"})
    if cfg.lora_rank > 0:
        out.append(f"{asked_by} cannot be combined with --lora_rank={cfg.lora_rank} (the depths have no place in a "
                   "PEFT adapter of a Llama model)")
    return out


def run_tokenizer_meta(cfg: TrainConfig) -> dict:
    """The run's tokenizer_meta.json, holding the special tokens its task (trainer/tasks TaskEntry.tokens) and
    --sample_every read; TrainingError otherwise, the one line and code both the torch-free pre-check and the full
    start-up give (a damaged file, TokenizerMetaError: 3; a missing file, or a role the tokenizer lacks: 2)."""
    from tokenizer import load_tokenizer_meta
    from tokenizer.contract import MissingSpecialTokenError, special_ids
    from trainer.tasks import task_entry
    try:
        tok_meta = load_tokenizer_meta(cfg.tokenizer_dir)
    except (OSError, ValueError, KeyError) as e:
        raise TrainingError(f"--tokenizer_dir={cfg.tokenizer_dir}: {e}",
                            getattr(e, "exit_code", EXIT_BAD_CONFIG)) from e
    samples = cfg.sample_every or cfg.distill_lmbda > 0 or cfg.distill_seq_kd  # (a sampled reply stops at eos)
    roles = tuple(dict.fromkeys(task_entry(cfg.task_type).tokens + (("eos",) if samples else ())))
    try:
        special_ids(tok_meta, roles, f"--task_type={cfg.task_type}" + " with --sample_every" * bool(cfg.sample_every))
    except MissingSpecialTokenError as e:
        raise TrainingError(f"--tokenizer_dir={cfg.tokenizer_dir}: {e}", EXIT_BAD_CONFIG) from e
    return tok_meta


def validate_config(cfg: TrainConfig, world_size: Optional[int] = None, torch_free: bool = False) -> None:
    """Every value the run cannot work with, as one exit-2 error listing all of them.
    world_size (when known) also checks that the processes form a pp x dp mesh. torch_free: only the
    checks that need no torch (the pre-check's): not the FSDP, pipeline and LoRA-target ones."""
    problems = _Problems(cfg)
    problems.extend(parallel_problems(cfg, world_size))
    _choices_and_combinations(cfg, problems, torch_free)
    _numbers_and_extras(cfg, problems, torch_free)
    problems.extend(moe_problems(cfg) + mla_problems(cfg))
    problems.extend(grpo_problems(cfg, resume_policy(cfg)))
    if problems:
        raise TrainingError("bad configuration: " + "; ".join(problems), EXIT_BAD_CONFIG)


def _sampled_replies_checks(cfg: TrainConfig, p: _Problems) -> None:
    """--distill_lmbda (a share of steps) and --distill_seq_kd: distillation's, on padded rows, with the rollouts'
    sampling flags."""
    p.number("distill_lmbda", 0.0, 1.0, high_open=False, what="must be in [0, 1] (the share of steps trained on the "
             "student's own replies)")
    flag = f"--distill_lmbda={cfg.distill_lmbda:g}" if cfg.distill_lmbda != 0 else "--distill_seq_kd=true"
    if cfg.task_type != "distill":
        p.append(f"{flag}: sampled replies are distillation's: it needs --task_type=distill")
    elif cfg.sft_packing:
        p.append(f"{flag} with --sft_packing=true: each row's last reply is replaced by a sampled one, a conversation "
                 "a row: drop the packing")
    p.extend(sampling_problems(cfg))


def _neftune_checks(cfg: TrainConfig, p: _Problems) -> None:
    """--neftune_noise_alpha: a training-forward noise on the embeddings of the language-model tasks, on layouts where
    each rank's embedding output is its own rows' whole length."""
    p.number("neftune_noise_alpha", 0.0)
    flag = f"--neftune_noise_alpha={cfg.neftune_noise_alpha:g}"
    if cfg.task_type not in ("sft", "pretrain"):
        p.append(f"{flag} is supervised training's (--task_type=sft or pretrain; TRL's SFTTrainer), not "
                 f"--task_type={cfg.task_type}'s")
    for size, name in ((cfg.tensor_parallel_size, "tensor_parallel_size"),
                       (cfg.context_parallel_size, "context_parallel_size")):
        if size > 1:
            p.append(f"{flag} cannot be combined with --{name}={size} yet (the noise of an embedding output split or "
                     "replicated over ranks is not built)")


def _checkpointing_checks(cfg: TrainConfig, p: _Problems) -> None:
    """--activation_checkpoint and its --selective_ac_option (op, or every N-th block)."""
    from utils.model_bounds import checkpoint_policy_problem
    p.choice("activation_checkpoint", ("none", "full", "selective", "memory_budget"))
    if cfg.activation_checkpoint == "memory_budget":
        p.number("activation_memory_budget", 0.0, 1.0, high_open=False)
        if not cfg.compile:
            p.append("--activation_checkpoint=memory_budget needs --compile=true (the compiled graphs' partitioner "
                     "chooses what to keep; an eager run has no graph)")
    if cfg.gradient_checkpointing and cfg.activation_checkpoint not in ("none", "full"):
        p.append(f"--gradient_checkpointing=true (each block recomputed whole) contradicts "
                 f"--activation_checkpoint={cfg.activation_checkpoint}: keep one of them")
    option = str(cfg.selective_ac_option).strip()
    if option == "full" or checkpoint_policy_problem(option):  # (the model's policies but full: op, or N)
        p.append(f"--selective_ac_option={cfg.selective_ac_option}: op (per operation) or a positive integer N "
                 "(every N-th block)")
    elif option != "op" and cfg.activation_checkpoint != "selective":
        p.append(f"--selective_ac_option={option} is --activation_checkpoint=selective's option: add that flag")


def _choices_and_combinations(cfg: TrainConfig, p: _Problems, torch_free: bool) -> None:
    """Choices, required paths, and flags that cannot be combined."""
    from trainer.tasks import TASKS, task_entry  # (torch-free: the registrations only)
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
    try:
        dpo_loss_terms(cfg.dpo_loss, cfg.dpo_loss_weights)
    except ValueError as e:
        p.append(str(e))
    p.number("ld_alpha", 0.0, 1.0, high_open=False)
    if cfg.ld_alpha != 1.0 and cfg.dpo_loss in REFERENCE_FREE_LOSSES:
        p.append(f"--ld_alpha: --dpo_loss={cfg.dpo_loss} is reference-free (LD-DPO weighs DPO's policy log-ratios)")
    p.choice("kto_loss", KTO_LOSSES)
    p.choice("distill_loss", DISTILL_LOSSES)
    if cfg.distill_loss == "jsd":
        p.number("distill_beta", 0.0, 1.0, low_open=True, what="must be in (0, 1) (--distill_loss=forward_kl or "
                 "reverse_kl are its two ends)")
    if cfg.distill_lmbda != 0 or cfg.distill_seq_kd:  # (nan too)
        _sampled_replies_checks(cfg, p)
    if cfg.task_type == "distill" and not cfg.ref_model:
        p.append("--task_type=distill learns from a teacher: pass --ref_model=<the teacher's run, checkpoint or "
                 "Hugging Face dir>")
    if cfg.ref_model and cfg.dpo_loss in REFERENCE_FREE_LOSSES:
        p.append(f"--ref_model: --dpo_loss={cfg.dpo_loss} is reference-free (no reference model is loaded)")
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
    cfg.fa4 = str(cfg.fa4).lower()
    p.choice("fa4", ("auto", "true", "false"))
    _checkpointing_checks(cfg, p)
    if cfg.eval_on_start and cfg.eval_interval <= 0:
        p.append("--eval_on_start=true needs --eval_interval > 0 (the run's validation set and evaluations)")
    if cfg.neftune_noise_alpha != 0:  # (nan too)
        _neftune_checks(cfg, p)
    p.choice("resume", RESUME_CHOICES)
    if cfg.init_from == "resume" and cfg.resume == "never":
        p.append("--init_from=resume (= --resume=always) contradicts --resume=never")
    pretrained = cfg.task_type in TASKS and task_entry(cfg.task_type).from_pretrained  # SFT, DPO
    if pretrained and cfg.init_from == "scratch" and resume_policy(cfg) != "always":
        p.append(f"--task_type={cfg.task_type} starts from pretrained weights: pass --init_from=<run dir>")
    if cfg.task_type in TASKS and task_entry(cfg.task_type).score_head:  # (a reward model: no LM head)
        for on, flag in ((cfg.sample_every > 0, f"--sample_every={cfg.sample_every}"),
                         (bool(cfg.eval_tasks.strip(" ,")), "--eval_tasks")):
            if on:
                p.append(f"{flag} generates text: --task_type={cfg.task_type} trains a reward model, whose head "
                         "scores sequences (no LM head to generate with)")
    if pretrained and resume_policy(cfg) == "always" and cfg.resume_fallback == "scratch":
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
                    cfg.hidden_dim or None, cfg.multiple_of, None, cfg.tie_embeddings, cfg.head_dim or None,
                    cfg.qk_norm, cfg.qkv_bias)
    problem = fit_problem(n, cfg.device, f"--dim={cfg.dim} --n_layers={cfg.n_layers}")
    if problem:
        p.append(problem)


def _sliding_layers_problem(cfg: TrainConfig) -> Optional[str]:
    """What is wrong with --sliding_layers (it needs --sliding_window; a list or every:N:K of layers in range)."""
    if not cfg.sliding_layers:
        return None
    if not cfg.sliding_window:
        return f"--sliding_layers={cfg.sliding_layers!r} names the layers that slide: it needs --sliding_window"
    try:
        layers = parse_sliding_layers(cfg.sliding_layers, cfg.n_layers)
    except ValueError as e:
        return str(e)
    return window_problem(cfg.sliding_window, layers, cfg.n_layers)


def _lora_target_problems(lora_targets: str) -> list[str]:
    from model.lora import ALL_LINEAR
    from model.lora_experts import EXPERT_TARGETS
    targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in ALL_LINEAR + EXPERT_TARGETS + ("all", "experts")]
    if not unknown and targets:
        return []
    return [f"--lora_targets={lora_targets}: unknown module name(s) {','.join(unknown) or '(none)'}; use a "
            f"comma-separated subset of {','.join(ALL_LINEAR)}, or all; on an MoE model also experts (or "
            f"{' / '.join(EXPERT_TARGETS)})"]


def _numbers_and_extras(cfg: TrainConfig, p: _Problems, torch_free: bool) -> None:
    """Ranges of the numeric flags, and the checks of samples, skipped data steps and LoRA targets."""
    for name in ("batch_size", "gradient_accumulation_steps", "max_iters", "max_seq_len", "checkpoint_interval",
                 "log_interval", "eval_iters", "keep_last", "dim", "n_layers", "n_heads", "multiple_of",
                 "bucket_size", "powersgd_rank"):
        p.at_least(name, 1)
    for name in ("eval_interval", "lr_decay_iters", "n_kv_heads", "hidden_dim", "vocab_size",
                 "lora_rank", "powersgd_start_iter", "head_dim", "sliding_window"):
        p.at_least(name, 0)
    problem = _sliding_layers_problem(cfg)
    if problem:
        p.append(problem)
    if cfg.sliding_window and cfg.context_parallel_size > 1:
        p.append(f"--sliding_window={cfg.sliding_window}: not in the ring attention of --context_parallel_size="
                 f"{cfg.context_parallel_size}")
    if cfg.warmup_iters < -1:
        p.append(f"--warmup_iters={cfg.warmup_iters}: must be >= 0 (or -1 = auto, see --help)")
    p.number("warmup_ratio", 0.0, 1.0)
    p.number("exit_duration_in_mins", 0.0)
    p.at_least("early_stopping_patience", 0)
    p.number("early_stopping_threshold", 0.0)
    if cfg.early_stopping_patience > 0 and cfg.eval_interval <= 0:
        p.append(f"--early_stopping_patience={cfg.early_stopping_patience} counts evaluations: it needs "
                 f"--eval_interval > 0 (got {cfg.eval_interval}: one evaluation, at the end)")
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
    try:
        parse_rope_flag(cfg.rope_scaling)
    except ValueError as e:
        p.append(f"--rope_scaling={cfg.rope_scaling!r}: {e}")
    _model_size_problems(cfg, p, torch_free)
    p.number("lora_alpha", 0.0, low_open=True)
    p.number("dpo_beta", 0.0, low_open=True)
    p.number("dpo_label_smoothing", 0.0, 0.5)
    p.number("simpo_gamma", 0.0)
    p.number("kto_desirable_weight", 0.0, low_open=True)
    p.number("kto_undesirable_weight", 0.0, low_open=True)
    p.number("reward_center_coef", 0.0)
    p.number("distill_temperature", 0.0, low_open=True)
    p.number("distill_alpha", 0.0, 1.0, high_open=False)
    p.number("discopop_tau", 0.0, low_open=True)
    p.number("rpo_alpha", 0.0)
    if cfg.rpo_alpha and cfg.dpo_loss in REFERENCE_FREE_LOSSES:
        p.append(f"--rpo_alpha: --dpo_loss={cfg.dpo_loss} is reference-free (orpo has its own NLL term)")
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
    if not 0 <= cfg.mtp_num_layers <= 16:
        p.append(f"--mtp_num_layers={cfg.mtp_num_layers}: must be in [0, 16]")
    p.number("mtp_loss_weight", 0.0)
    if cfg.mtp_num_layers > 0 and cfg.task_type not in ("pretrain", "sft"):
        p.append(f"--mtp_num_layers={cfg.mtp_num_layers} trains beside a language-model loss: --task_type=pretrain "
                 f"or sft, not {cfg.task_type} (its per-sequence log-probabilities never run the MTP blocks)")
    if cfg.mtp_num_layers > 0 and cfg.lora_rank > 0:
        p.append(f"--mtp_num_layers={cfg.mtp_num_layers} cannot be combined with --lora_rank={cfg.lora_rank} (the "
                 "MTP blocks have no place in a PEFT adapter of a Llama model)")
    if cfg.lora_train_embeddings and cfg.lora_rank == 0:
        p.append("--lora_train_embeddings=true needs --lora_rank>0 (to train only the embedding and LM head, "
                 "use --trainable=embeddings)")
    if cfg.lora_rank > 0 and not torch_free:
        p.extend(_lora_target_problems(cfg.lora_targets))
