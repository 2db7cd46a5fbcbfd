"""Where a run starts and what it starts with: the checkpoint it continues or the weights it begins from
(`decide_start`), the model (`build_model`), what trains (`choose_trainable`), DPO's frozen reference
(`dpo_reference`), the engine (`place_on_engine`), and a continued run's state (`restore`).

Owns: the order and the checks of the set-up before the first step, and the exit code of each refusal.
Must never: run a training step, or read an engine's kind (the engine answers for itself: parallel/).
"""
from __future__ import annotations

import dataclasses
import os
import time
from types import SimpleNamespace
from typing import Any, Optional

import torch

from model import ModelConfig, Transformer
from model.neftune import add_neftune
from model.attention import describe_attention
from model.config import read_model_config
from model.fa4 import forced_error as fa4_forced_error
from model.kernels import describe_choice, flash_attn_functions
from model.lora import trainable_parameters
from model.score_head import add_score_head
from parallel.build import build_engine, describe_layout
from checkpoint.reads import base_fingerprint
from trainer.config import (KERNEL_CHOICES, TrainConfig, TrainingError, continues_run, existing_run_error,
                            nothing_to_continue_error, parallel_section, resume_flag)
from trainer.tasks import get_task, task_entry
from trainer.validation import loaded_mtp_problems
from trainer.weights import (apply_rope_flag, check_lora_base, load_lora_base, load_weights_from,
                             select_trainable_for)
from checkpoint.files import read_run_start
from checkpoint.verify import find_latest_valid, list_checkpoints
from utils.checkpoint_json import read_json, read_trainer_state
from utils.checkpoint_layout import RUN_CONFIG, RUN_START, checkpoint_root, parse_step
from utils.errors import CheckpointError, CheckpointMismatchError, one_line
from utils.constants import EXIT_BAD_CHECKPOINT, EXIT_BAD_CONFIG
from utils.device import low_precision_cpu_warning, parse_dtype
from utils.dist import DistInfo, barrier
from utils.model_bounds import fit_problem, param_count, parse_sliding_layers
from utils.mla_flags import mla_model_fields, mla_param_delta
from utils.moe_flags import moe_model_fields, moe_param_delta
from utils.rope_config import parse_rope_flag
from utils.run_config import DATA_KEYS, global_batch_problem, same_value
from utils.spike_guard import parse_data_steps
from utils.threads import describe_threads, plan_threads

def new_model_config(cfg: TrainConfig, tok_meta: dict):
    vocab = cfg.vocab_size or int(tok_meta["vocab_size"])
    fused, backend = KERNEL_CHOICES[str(cfg.fused_kernels).lower()]
    return ModelConfig(vocab_size=vocab, dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                       n_kv_heads=cfg.n_kv_heads or None, hidden_dim=cfg.hidden_dim or None,
                       multiple_of=cfg.multiple_of, max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta,
                       attn_dropout=cfg.dropout, resid_dropout=cfg.dropout, tie_embeddings=cfg.tie_embeddings,
                       gradient_checkpointing=cfg.gradient_checkpointing, fused_rmsnorm=fused,
                       fused_rope=fused, fused_swiglu=fused, fused_qkv=fused, fused_cross_entropy=fused,
                       kernel_backend=backend, fa4=cfg.fa4, mtp_num_layers=cfg.mtp_num_layers,
                       rope_scaling=parse_rope_flag(cfg.rope_scaling), qkv_bias=cfg.qkv_bias, o_bias=cfg.o_bias,
                       attn_sinks=cfg.attn_sinks,
                       attn_head_dim=cfg.head_dim or None, qk_norm=cfg.qk_norm,
                       sliding_window=cfg.sliding_window or None,
                       sliding_layers=parse_sliding_layers(cfg.sliding_layers, cfg.n_layers) if cfg.sliding_window
                       else None, **moe_model_fields(cfg), **mla_model_fields(cfg))



def _refuse_if_too_big(mcfg, device: str, what: str, code: int) -> None:
    """TrainingError before anything is allocated when the model's fp32 weights alone exceed the memory the
    device has free (a checkpoint's model_config.json within the bounds can still describe a model no
    machine holds: it built layers until memory ran out)."""
    n = param_count(mcfg.dim, mcfg.n_layers + mcfg.mtp_num_layers, mcfg.n_heads, mcfg.vocab_size, mcfg.n_kv_heads,
                    mcfg.hidden_dim, tie_embeddings=mcfg.tie_embeddings, head_dim=mcfg.head_dim, qk_norm=mcfg.qk_norm,
                    qkv_bias=mcfg.qkv_bias, sandwich_norms=mcfg.sandwich_norms, pre_norms=mcfg.pre_norms,
                    qk_norm_full=mcfg.qk_norm_full)
    n += moe_param_delta(mcfg) + mla_param_delta(mcfg)  # (MTP: as blocks)
    n += (mcfg.n_layers + mcfg.mtp_num_layers) * (mcfg.n_heads * mcfg.attn_sinks + mcfg.dim * mcfg.o_bias)
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
    found = list_checkpoints(cfg.out_dir)
    if found:
        raise TrainingError(f"{flag}: none of the {len(found)} checkpoint(s) in "
                            f"{checkpoint_root(cfg.out_dir)} is complete and undamaged (see the messages "
                            "above); restore one, or start a new run in another --out_dir", EXIT_BAD_CHECKPOINT)
    record = read_run_start(cfg.out_dir)
    if record is not None:
        if record.get("task_type", cfg.task_type) != cfg.task_type:
            raise TrainingError(f"{flag}: {os.path.join(cfg.out_dir, RUN_START)} records a "
                                f"{record['task_type']} run, not --task_type={cfg.task_type}", EXIT_BAD_CONFIG)
        log(f"[resume] no checkpoint in {cfg.out_dir} yet: starting as the run did, from {record['init_from']} "
            f"(recorded in {RUN_START}; {flag})")
        asked = record.get("requested_init_from")
        same = isinstance(asked, str) and os.path.abspath(asked) == os.path.abspath(cfg.init_from)
        if cfg.init_from != "resume" and isinstance(asked, str) and not same:
            log(f"[resume] note: this command says --init_from={cfg.init_from}, the recorded run started from "
                f"{asked}; to start over from {cfg.init_from}, pass --resume=never or use another --out_dir")
        return record["init_from"], f"the start recorded in {os.path.join(cfg.out_dir, RUN_START)}:"
    if cfg.resume_fallback:
        log(f"[resume] no checkpoint in {cfg.out_dir} yet: starting from --resume_fallback={cfg.resume_fallback}")
        return cfg.resume_fallback, "--resume_fallback"
    raise nothing_to_continue_error(cfg, checkpoint_root(cfg.out_dir))


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
    saved_early_stop: Optional[dict] = None  # --early_stopping_patience's count, as saved
    rng: Optional[dict] = None             # RNG states to restore right before the loop
    max_iters_from: Optional[str] = None   # --num_train_epochs runs: which flag set max_iters


def decide_start(cfg: TrainConfig, info: DistInfo, continues: Optional[bool], log) -> Start:
    """--resume: continue the newest valid checkpoint of out_dir, or start from --init_from (logged)."""
    if continues is None:  # not given by main(): decide now, before this rank writes anything there
        continues = continues_run(cfg)
    barrier()  # every rank has decided before rank 0 records this start (run_start.json)
    start = Start(continues, init_from=cfg.init_from)
    if continues:
        start.resume_dir = find_latest_valid(cfg.out_dir, log=log)
        if start.resume_dir is not None:
            step = parse_step(os.path.basename(start.resume_dir))
            log(f"[resume] continuing {cfg.out_dir} from step {step} ({resume_flag(cfg)})")
            # else exit 5 naming the file
            start.saved_state = read_trainer_state(start.resume_dir, required=("step", "world_size"))
        else:  # as run_start.json records (or --resume_fallback), else exit 2 / 5
            start.init_from, start.init_flag = start_without_checkpoint(cfg, log)
    elif list_checkpoints(cfg.out_dir):  # --resume=never
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
    a Hugging Face or our model (trainer/weights.py), or a new one from the flags; checked against the tokenizer."""
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
        which = cfg.init_checkpoint if start.init_flag == "--init_from" else "latest"
        model, init_info = load_weights_from(start.init_from, log, flag=start.init_flag,
                                             tokenizer_dir=cfg.tokenizer_dir, which=which,
                                             mtp_layers=cfg.mtp_num_layers)
        if cfg.rope_scaling:  # context extension of the loaded weights
            apply_rope_flag(model, cfg.rope_scaling, cfg.max_seq_len, log)
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
    _score_head_for(cfg, model, start, init_info, log)
    _mtp_depths_for(cfg, model, start, log)
    if model.cfg.vocab_size < int(tok_meta["vocab_size"]):
        hint = ("; to grow the vocabulary to an extended tokenizer, start from a Hugging Face directory holding the "
                "model's own tokenizer (export this one with export_hf.py)" if init_info["kind"] == "ours" else "")
        raise TrainingError(f"model vocab {model.cfg.vocab_size} < tokenizer vocab {tok_meta['vocab_size']}{hint}",
                            EXIT_BAD_CONFIG)
    return model, init_info


def _mtp_depths_for(cfg: TrainConfig, model, start: Start, log) -> None:
    """The multi-token prediction depths of the run: those the weights brought (--mtp_num_layers left at 0: the run
    trains them, where its layout can hold them), grown to --mtp_num_layers with new depths where the weights have
    fewer (a model pretrained without MTP, or a Hub model with fewer MTP layers); fewer than they have is refused
    (exit 2: the others would be dropped)."""
    depths, source = getattr(model.cfg, "mtp_num_layers", 0), start.resume_dir or start.init_from
    if depths and not cfg.mtp_num_layers:  # the weights brought depths the flags did not ask for
        problems = loaded_mtp_problems(cfg, depths, source)
        if problems:
            raise TrainingError("bad configuration: " + "; ".join(problems), EXIT_BAD_CONFIG)
    elif depths > cfg.mtp_num_layers:
        raise TrainingError(f"bad configuration: --mtp_num_layers={cfg.mtp_num_layers}: the model of {source} has "
                            f"{depths} multi-token prediction depths (ask for {depths}, or leave the flag at 0 to "
                            "train them as they are)", EXIT_BAD_CONFIG)
    elif start.resume_dir is None and _grown(model, cfg.mtp_num_layers, source):
        log(f"[init] {cfg.mtp_num_layers - depths} new multi-token prediction depth(s) (initialised as a new "
            f"model's) after the {depths} of {source}")


def _grown(model, depths: int, source: str) -> int:
    try:
        return model.add_mtp_depths(depths)
    except ValueError as e:  # (a model that cannot have depths: Gemma 2's capped logits, a reward model)
        raise TrainingError(f"bad configuration: --mtp_num_layers={depths} on the model of {source}: {e}",
                            EXIT_BAD_CONFIG) from e


def _score_head_for(cfg: TrainConfig, model, start: Start, init_info: dict, log) -> None:
    """A reward model's task on a language model's weights: its LM head replaced by a new score head
    (model/score_head.py); a language-model task on a reward model's weights: refused (exit 2)."""
    want, have = task_entry(cfg.task_type).score_head, model.cfg.num_labels
    if want == have:
        return
    source = start.resume_dir or init_info["source"]
    if have and want:
        raise TrainingError(f"{source} gives {have} scores per sequence: --task_type={cfg.task_type} trains a reward "
                            f"model of {want}", EXIT_BAD_CONFIG)
    if have:
        raise TrainingError(f"{source} is a reward model (a score head of {have} output(s), no LM head): "
                            f"--task_type={cfg.task_type} trains a language model; start it from one",
                            EXIT_BAD_CONFIG)
    if start.resume_dir is not None:
        raise TrainingError(f"checkpoint {source} holds a language model: --task_type={cfg.task_type} continues "
                            "a reward model's run", EXIT_BAD_CONFIG)
    try:
        add_score_head(model, want)
    except ValueError as e:
        raise TrainingError(f"--task_type={cfg.task_type} on {source}: {e}", EXIT_BAD_CONFIG) from e
    log(f"[init] reward model: the blocks of {source} with a new score head ({want} output, N(0, "
        f"{model.cfg.initializer_range:g})) in place of its LM head")


def choose_trainable(cfg: TrainConfig, model, init_info: dict, start: Start, log) -> Optional[dict]:
    """Select what trains (all, LoRA adapters, embeddings) and return the light-checkpoint base, if any.

    Light checkpoints (LoRA or --trainable=embeddings) hold only the trainable tensors + a reference to
    the frozen base (path, fingerprint, and the tokenizer it was grown to), when the base is a file the
    checkpoint can point at (not random weights; not fsdp, whose sharded checkpoints are written
    without gathering anyway). A grown base is re-derived deterministically (model/resize.py); the
    fingerprint covers its frozen rows."""
    try:
        what = select_trainable_for(model, dataclasses.asdict(cfg))
    except ValueError as e:
        raise TrainingError(f"--lora_*: {e}", EXIT_BAD_CONFIG) from e
    c = trainable_parameters(model)
    log(f"{what}: {c['trainable']:,} trainable of {c['total']:,} parameters ({c['percent']:.2f}%)")
    frozen_base = cfg.lora_rank > 0 or cfg.trainable == "embeddings"
    if not (frozen_base and parallel_section(cfg).saves_light_checkpoints() and init_info["kind"] in ("ours", "hf")):
        return None
    if start.resume_dir is not None:
        lora_base = start.saved_state.get("lora_base")
        if lora_base:
            check_lora_base(model, lora_base, start.resume_dir)
        return lora_base
    lora_base = {"source": os.path.abspath(init_info["source"]), "fingerprint": base_fingerprint(model)}
    if init_info.get("resized"):
        lora_base["tokenizer_dir"] = init_info["resized"]["tokenizer_dir"]
    log(f"[lora] checkpoints hold the trainable tensors only; the frozen base is {lora_base['source']} "
        f"(sha256 {lora_base['fingerprint'][:12]})")
    return lora_base


def dpo_reference(cfg: TrainConfig, init_info: dict, log, task=None, model_cfg=None, vocab: int = 0) -> Optional[Any]:
    """The frozen reference model of a task that needs one (DPO: --ref_model, else the policy's starting weights;
    distillation's teacher); None otherwise. `task`: the run's task object (built from cfg when not given);
    `model_cfg`: the trained model's, which the task checks the reference against (exit 2) given `vocab`, the run
    tokenizer's number of ids."""
    task = task or get_task(cfg)
    if not task.needs_reference:  # an instance: GRPO needs one only with --beta > 0
        return None
    ref_src = cfg.ref_model or init_info.get("ref_source") or init_info["source"]
    if ref_src == "scratch":
        raise TrainingError(f"--task_type={cfg.task_type} needs a frozen reference model, and this run started from "
                            "scratch: pass --ref_model=<run, checkpoint or Hugging Face dir>", EXIT_BAD_CONFIG)
    ref_model, _ = load_weights_from(ref_src, log, flag="--ref_model" if cfg.ref_model else "reference model",
                                     tokenizer_dir=cfg.tokenizer_dir)
    if cfg.rope_scaling and not cfg.ref_model:  # the policy's starting weights: extended as the policy was
        apply_rope_flag(ref_model, cfg.rope_scaling, cfg.max_seq_len, log, who=" (reference model)")
    problem = task.reference_problem(model_cfg, ref_model.cfg, vocab) if model_cfg is not None else None
    if problem:
        raise TrainingError(problem, EXIT_BAD_CONFIG)
    init_info["ref_source"] = ref_src
    return ref_model.requires_grad_(False).eval()


def place_on_engine(cfg: TrainConfig, info: DistInfo, model, ref_model, log, threads: str = "",
                    task=None) -> tuple[Any, Any]:
    """(engine, reference model laid out like the policy): the precision policy, the kernel and layout
    lines (the layout line ends with `threads`, set_threads' words), and our DDP / FSDP / pipeline stages
    behind one interface (parallel/engine.py)."""
    dtype = parse_dtype(cfg.dtype)
    slow_dtype = low_precision_cpu_warning(info.device, dtype)
    if slow_dtype:
        log(f"[warning] {slow_dtype}")
    model_cfg = model.cfg
    if model_cfg.flash_attn:
        flash_attn_functions(info.device)  # detected (and logged) once
    forced = fa4_forced_error(model_cfg, info.device, dtype)  # model_config's fa4=true where FA4 cannot run
    if forced:
        raise TrainingError(forced, EXIT_BAD_CONFIG)
    ops = describe_choice(info.device, model_cfg.kernel_backend, cfg.compile, fused=model_cfg.fused_rmsnorm,
                          capped=model_cfg.final_softcap is not None)
    log(f"[kernels] attention: {describe_attention(info.device, model_cfg, dtype, cfg.compile)}; {ops}")
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    arch = "" if not model_cfg.kv_lora_rank else (
        f", multi-head latent attention (kv latent {model_cfg.kv_lora_rank}, q latent {model_cfg.q_lora_rank or 'none'}"
        f", {model_cfg.n_heads} heads of {model_cfg.qk_nope_head_dim} + {model_cfg.qk_rope_head_dim} RoPE / "
        f"{model_cfg.v_head_dim} values)")
    gpt_oss = [what for what, on in (("attention sinks", model_cfg.attn_sinks), ("o_proj bias", model_cfg.o_bias),
                                     ("router bias", model_cfg.moe_router_bias),
                                     ("expert biases", model_cfg.moe_expert_biases),
                                     ("gpt-oss's clamped SwiGLU experts", model_cfg.moe_act == "gpt_oss")) if on]
    gpt_oss += [f"{what} soft-capped at {v:g}" for what, v in (("attention scores", model_cfg.attn_softcap),
                                                              ("logits", model_cfg.final_softcap)) if v is not None]
    arch += f", {', '.join(gpt_oss)}" if gpt_oss else ""
    log(f"[model] {n_params / 1e6:.2f}M parameters ({n_train / 1e6:.2f}M trainable), {model_cfg.n_layers} layers, "
        f"dim {model_cfg.dim}{arch}, vocab {model_cfg.vocab_size}, dtype {cfg.dtype}, device {info.device}, "
        f"world {info.world_size}")
    if cfg.neftune_noise_alpha > 0:  # (on the module: pipeline stages and compile keep it)
        add_neftune(model, cfg.neftune_noise_alpha)
        log(f"[neftune] noise alpha {cfg.neftune_noise_alpha:g} on the input embeddings of training forwards (uniform in "
            f"+-alpha / sqrt(row length x {model_cfg.dim}))")
    try:  # the engine casts the model to its precision policy and moves what this rank runs to the device
        engine = build_engine(model, cfg, device=info.device)
    except ValueError as e:  # a layout that cannot run (e.g. a checkpoint's layers do not split into stages)
        raise TrainingError(f"bad parallel configuration: {one_line(e)}", EXIT_BAD_CONFIG) from e
    engine.stat_keys = tuple((task or get_task(cfg)).stat_keys)  # the task's statistics ride in every step row
    log(describe_layout(cfg, engine, info.world_size) + (f"; {threads}" if threads else ""))
    if cfg.optimizer == "muon":
        experts = "" if not getattr(getattr(engine.module, "cfg", None), "moe_num_experts", 0) else \
            (" and each MoE expert's" if cfg.muon_experts else "; adamw on the MoE experts (--muon_experts=false)")
        log(f"[optimizer] muon on the blocks' 2-D matrices{experts} (lr {cfg.muon_lr or cfg.learning_rate:g}, "
            f"momentum {cfg.muon_momentum:g}, weight decay {cfg.muon_weight_decay:g}, --muon_adjust_lr="
            f"{cfg.muon_adjust_lr}); adamw on the embedding, LM head and norms")
    if ref_model is not None:  # DPO: the frozen reference, sharded like the policy under fsdp
        ref_model = engine.place_reference(ref_model, info.device, dtype)
        log(f"[{cfg.task_type}] reference model: {engine.reference_layout()} on each of {engine.dp_size} rank(s), "
            f"{cfg.dtype}, frozen")
    return engine, ref_model


def trainer_state(cfg: TrainConfig, p: Progress, data_cursor: dict, val_loss: Optional[float], init_info: dict,
                  lr: float, evaluated: Optional[dict], guard, early, task) -> dict:
    """A checkpoint's trainer_state.json (what `restore` reads back): the loop's counters, the data cursor, the
    validation values, the spike guard's window, the early stop's count and the task's own state."""
    state = {"data_cursor": data_cursor, "best_val_loss": None if p.best_val == float("inf") else p.best_val,
             "val_loss": val_loss, "tokens_seen": p.tokens_seen, "init_info": init_info, "lr": lr,
             "task_type": cfg.task_type, "data_step": p.data_step,
             "skip_data_steps": sorted(p.skip_steps)}  # a resume skips them too
    if evaluated and isinstance(evaluated.get("val_reward"), (int, float)):
        state["val_reward"] = float(evaluated["val_reward"])
    if p.max_iters_from is not None:  # which flag set max_iters: a resume decides the same way
        state["max_iters_from"] = p.max_iters_from
    if guard is not None:  # the running window: a resumed run judges its steps as an uninterrupted one
        state["spike_guard"] = guard.state_dict()
    if early.patience:
        state["early_stopping"] = early.state_dict()
    if task is not None and (task_state := task.state_dict()) is not None:  # (bco_pair's running mean)
        state["task"] = task_state
    return state


def restore(cfg: TrainConfig, info: DistInfo, engine, checkpoints, train_loader, start: Start, log,
            task=None) -> Progress:
    """A continued run's weights, optimizer (sharded under ZeRO), comm-hook state, data cursor, the loop's counters
    and `task`'s own state; a new run's counters at zero. --skip_data_steps joins the saved skip list."""
    progress = Progress()
    if start.resume_dir is not None:
        resume_dir, saved = start.resume_dir, start.saved_state
        saved_cfg = start.saved_cfg = read_json(os.path.join(resume_dir, RUN_CONFIG))
        saved_dp = parallel_section(SimpleNamespace(**saved_cfg)).data_parallel_size(int(saved["world_size"]))
        problem = global_batch_problem(saved_cfg, cfg.batch_size, cfg.gradient_accumulation_steps, saved_dp,
                                       engine.dp_size) \
            or checkpoints.resume_problem(resume_dir, int(saved["world_size"]))
        if problem:
            raise TrainingError(f"cannot resume {resume_dir}: {problem}", EXIT_BAD_CONFIG)
        saved_opt = saved_cfg.get("optimizer", "adamw")  # runs older than --optimizer were AdamW's
        if saved_opt != cfg.optimizer:  # the saved state is the other optimizer's: nothing to continue
            raise TrainingError(f"cannot resume {resume_dir}: it was trained with --optimizer={saved_opt}, this run "
                                f"has --optimizer={cfg.optimizer}; switching the optimizer on resume is refused",
                                EXIT_BAD_CONFIG)
        extra = _load_checkpoint(cfg, info, checkpoints, resume_dir, saved, saved_cfg)
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
        if isinstance(saved.get("early_stopping"), dict):
            progress.saved_early_stop = saved["early_stopping"]
        if "task" in saved and task is not None:  # the task's own state (Task.state_dict: bco_pair's running mean)
            if not isinstance(saved["task"], dict):
                raise TrainingError(f"checkpoint {resume_dir}: trainer_state.json: 'task' is not an object",
                                    EXIT_BAD_CHECKPOINT)
            task.load_state_dict(saved["task"], f"checkpoint {resume_dir}: trainer_state.json")
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


def _load_checkpoint(cfg: TrainConfig, info: DistInfo, checkpoints, resume_dir: str, saved: dict,
                     saved_cfg: dict) -> Optional[dict]:
    """CheckpointManager.load of a continued checkpoint; its extra state (RNG), or None when extra_rank{r}.pt is
    missing (logged). A damaged file raises CheckpointError naming it (exit 5); weights that do not fit
    the model are exit 5, or exit 2 naming the --lora_* / --trainable flags changed since the run began."""
    try:
        return checkpoints.load(resume_dir, int(saved["world_size"]),
                                log=lambda m: print(m if info.is_main else f"[rank {info.rank}] {m}", flush=True))
    except CheckpointMismatchError as e:  # other tensor names or shapes than this model's
        changed = [f"--{k}" for k in ("lora_rank", "lora_targets", "lora_train_embeddings", "trainable")
                   if k in saved_cfg and saved_cfg[k] != getattr(cfg, k)]
        if not changed:  # the run's own configuration builds this model: the file, not the flags, is wrong
            raise CheckpointError(f"{one_line(e)} (the model is built from the checkpoint's own "
                                  "model_config.json and config.json: the file is damaged)") from e
        raise TrainingError(f"the weights in {resume_dir} do not fit the model this configuration builds "
                            f"({', '.join(changed)} changed since the run started): {one_line(e)}",
                            EXIT_BAD_CONFIG) from e


def set_threads(cfg: TrainConfig, info: DistInfo, log) -> tuple[str, Any]:
    """The CPU compute threads of this process (utils/threads.py), set now: --threads, else OMP_NUM_THREADS
    as torchrun sets it, else the usable cores, and then (CPU runs, not --deterministic) a ThreadTuner that
    trains on one thread while that is measured faster (other processes compete for the cores). Warns once
    (rank 0) when the machine is oversubscribed. Returns (the words of the [layout] line, the tuner or None)."""
    plan = plan_threads(cfg.threads, cpu=info.device.type == "cpu", fixed=cfg.deterministic)
    torch.set_num_threads(plan.start)
    if plan.warning:
        log(f"[warning] threads: {plan.warning}")
    return describe_threads(plan.choice, adaptive=plan.tuner is not None), plan.tuner
