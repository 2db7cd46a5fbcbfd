"""The training loop: `train()` checks the configuration, `_set_up` builds what a run needs top to bottom (start ->
model -> engine -> data -> resumed state -> schedule -> loggers), `_run_steps` steps to the end or a graceful stop,
and `Loop` runs one optimizer step at a time.

Owns: the order of a step (lr, micro-batches, token-normalised loss through the engine, optimizer step,
spike guard), the log line, evaluation, samples, checkpoints, the graceful stop on SIGTERM/SIGINT; and when a
step's device values are read: one step late (`Loop.step` queues step s+1, then reads step s: the host never
waits for the device between steps), at once where evaluation, samples, a checkpoint or the end need it.
Must never: branch on the engine (parallel/ hides which one runs) or on the task (trainer/tasks/: ask the task).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import sys
import time
from typing import Any, Optional

import torch
from tqdm import tqdm

from data_preprocess.shard_format import DataError
from dataset.prefetch import PrefetchLoader
from model.flops import flops_per_token, mfu_from, resolve_peak_flops
from parallel.engine import StepStats
from trainer.config import TrainConfig, TrainingError, max_iters_for_epochs, one_line, resolve_warmup
from trainer.early_stop import EarlyStopping
from trainer.faults import fire_step_faults, fires, save_fault_hook, spike_fault, spiked, step_fault_due
from trainer.console import line_due, rank0_log
from trainer.side_losses import SideLosses
from trainer.samples import build_sampler
from trainer.start import (Progress, build_model, choose_trainable, decide_start, dpo_reference, place_on_engine,
                           restore, set_threads, trainer_state)
from trainer.task import (build_data, build_task_evaluator, count_tokens, evaluate, evaluate_start, prefetch_depth,
                          task_of, values_text)
from trainer.validation import run_tokenizer_meta, validate_config
from checkpoint.files import write_run_start
from checkpoint.manager import CheckpointManager
from checkpoint.rng import restore_rng_state
from utils.checkpoint_layout import RUN_CONFIG
from utils import run_lock
from utils.configurator import save_config_json
from utils.constants import EXIT_BAD_DATA, EXIT_INTERRUPTED, EXIT_LOSS_SPIKE, EXIT_NONFINITE_LOSS, EXIT_OK
from utils.device import HostCopy, StepTimer, is_accelerator, memory_stats, parse_dtype, seed_everything, synchronize
from utils.dist import DistInfo, all_reduce_max, barrier
from utils.lr_schedule import lr_at, schedule_warnings
from utils.metrics import MetricsLogger, Throughput, format_line
from utils.spike_guard import SPIKE_FILE, SpikeDetector, format_data_steps, write_spike_record

TIMING_WARMUP_STEPS = 2  # steps of each process left out of the logged rate and MFU (Throughput)


def train(cfg: TrainConfig, info: DistInfo, continues: Optional[bool] = None, max_iters_given: bool = False,
          log_interval_given: bool = False) -> int:
    """One run (main() has parsed and resolved `cfg`): set up, then step until --max_iters or a stop. max_iters_given:
    --max_iters was set explicitly (command line or config file), so it wins over --num_train_epochs;
    log_interval_given: --log_interval too, so no extra time-based lines are printed between the lines it asks for."""
    log = rank0_log(info)
    if info.is_main:  # library modules report optional-accelerator detection through logging
        logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    validate_config(cfg, world_size=info.world_size)
    if cfg.deterministic:
        torch.use_deterministic_algorithms(True)
    t_start = time.time()
    loop, start = _set_up(cfg, info, continues, max_iters_given, log)
    loop.quiet_lines = not log_interval_given
    loop.announce(saved_max_iters=int(start.saved_cfg.get("max_iters") or 0))
    return _run_steps(loop, start, log, t_start)


def _set_up(cfg: TrainConfig, info: DistInfo, continues: Optional[bool], max_iters_given: bool, log):
    """Where from, the model, what trains, DPO's reference, the engine, the data, the resumed state, the final
    schedule and the loggers, in that order: (the Loop ready to step, the start decision)."""
    threads, tuner = set_threads(cfg, info, log)
    os.makedirs(cfg.out_dir, exist_ok=True)
    tok_meta = run_tokenizer_meta(cfg)  # TrainingError: a damaged file (3), a missing one or role (2)
    start = decide_start(cfg, info, continues, log)
    seed_everything(cfg.seed)  # identical initial weights on every rank (and DDP broadcasts anyway)
    model, init_info = build_model(cfg, info, start, tok_meta, log)
    model_cfg = model.cfg
    lora_base = choose_trainable(cfg, model, init_info, start, log)
    task = task_of(cfg)  # trainer/tasks/: the loss, units and statistics of --task_type; one instance for the run
    ref = dpo_reference(cfg, init_info, log, task, model_cfg,  # (DPO's reference, distillation's teacher)
                        vocab=int(tok_meta["vocab_size"]))
    engine, ref_model = place_on_engine(cfg, info, model, ref, log, threads, task=task)
    del model, ref  # the engine holds what this rank runs (under pp the other stages' layers are freed)
    engine.lora_base = lora_base
    try:
        train_loader, make_val_loader = build_data(cfg, engine.dp_rank, engine.dp_size, tok_meta,
                                                   fixed_shape=engine.fixed_batch_shape, log=log, task=task)
    except (DataError, ValueError, OSError) as e:  # DataError includes StaleIndexError
        raise TrainingError(f"data: {' '.join(str(e).split())}", EXIT_BAD_DATA) from e
    depth = prefetch_depth(cfg, info.device)
    if depth:  # the next batches drawn (and pinned for a GPU) on a thread while the step runs: same batches, cursor
        train_loader = PrefetchLoader(train_loader, depth, pin=is_accelerator(info.device), device=info.device)
    # the engine's, the optimizer's and this loop's state in checkpoints (checkpoint/manager.py)
    checkpoints = CheckpointManager(engine, cfg.out_dir, rank=info.rank, world_size=info.world_size,
                                    device=info.device, keep_last=cfg.keep_last, async_writes=cfg.async_checkpoint,
                                    log=log, barrier=barrier)
    progress = restore(cfg, info, engine, checkpoints, train_loader, start, log, task)
    if cfg.num_train_epochs > 0:  # max_iters from the epochs, unless --max_iters was given (now or when the run began)
        given = max_iters_given or start.saved_state.get("max_iters_from") == "max_iters"
        cfg.max_iters, line = max_iters_for_epochs(cfg.num_train_epochs, train_loader.num_samples,
                                                   train_loader.samples_per_step, cfg.max_iters, given,
                                                   task.steps_per_draw())
        progress.max_iters_from = "max_iters" if given else "num_train_epochs"
        log(line)
    if cfg.warmup_iters < 0:  # auto: resolved once max_iters is final, then saved (a resume keeps these steps)
        cfg.warmup_iters, how = resolve_warmup(cfg.warmup_iters, cfg.warmup_ratio, cfg.max_iters, cfg.task_type)
        log(f"[schedule] warmup {cfg.warmup_iters} steps ({how})")
    if info.is_main:
        save_config_json(cfg, os.path.join(cfg.out_dir, RUN_CONFIG))
    metrics = MetricsLogger(cfg.out_dir, enabled=info.is_main, tensorboard=cfg.tensorboard, log=log,
                            wandb=cfg.wandb, wandb_project=cfg.wandb_project, wandb_run_name=cfg.wandb_run_name,
                            run_config=dataclasses.asdict(cfg),
                            resume_step=progress.step if start.continues else None)
    loop = Loop(cfg, info, engine, checkpoints, ref_model, model_cfg, train_loader, make_val_loader, metrics, progress,
                init_info, log, task)
    loop.tuner = tuner
    return loop, start


def _run_steps(loop: "Loop", start, log, t_start: float) -> int:
    """The steps until --max_iters (exit 0) or a graceful stop: on SIGTERM/SIGINT, when the supervisor whose
    attempt this is has exited (utils/run_lock.py: a run never goes on writing its directory unsupervised), or once
    --exit_duration_in_mins have passed since `t_start` (train()'s start), the step finishes, is saved, and the run
    exits 75."""
    cfg, info, progress, engine = loop.cfg, loop.info, loop.progress, loop.engine
    stop = {"requested": False, "why": "signal"}
    supervisor = run_lock.SupervisorWatch()

    def on_signal(signum, frame):
        stop["requested"] = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)

    if start.run_start is not None and info.is_main:  # only now: a start that fails in set-up leaves no trace
        write_run_start(cfg.out_dir, start.run_start)
    if progress.rng is not None:  # last thing before the loop: set-up above may draw random numbers
        restore_rng_state(progress.rng, info.device)
    if cfg.eval_on_start and progress.step == 0:  # the starting weights' validation: the curve's step-0 row
        loop.metrics.write({"step": 0, **evaluate_start(loop)})
    engine.model.train()
    try:
        while progress.step < cfg.max_iters and not loop.early.due:
            loop.step()  # queues this step, then finishes the one before it if that was left pending
            do_eval = (cfg.eval_interval > 0 and progress.step % cfg.eval_interval == 0) or \
                progress.step == cfg.max_iters
            if not stop["requested"] and (gone := supervisor.gone()):
                log(f"[train] {gone}")
                stop.update(requested=True, why="the supervisor's exit")
            if not stop["requested"] and cfg.exit_duration_in_mins and progress.step < cfg.max_iters and \
                    time.time() - t_start >= 60.0 * cfg.exit_duration_in_mins:
                stop.update(requested=True, why=f"--exit_duration_in_mins={cfg.exit_duration_in_mins:g} (the same "
                                                "command continues the run)")
            stop_now = all_reduce_max(1.0 if stop["requested"] else 0.0, info.device) > 0
            save_now = progress.step % cfg.checkpoint_interval == 0 or progress.step == cfg.max_iters or stop_now
            if do_eval or save_now or not loop.may_defer(progress.step):
                loop.finish(do_eval)  # read now: evaluation, samples and checkpoints see a finished step
            save_now = save_now or (do_eval and loop.early.due)  # (then the loop ends)
            if save_now:
                loop.save(progress.last_val if do_eval else None, loop.last_eval if do_eval else None)
            loop.restart_clock()  # evaluation and checkpoint time is not charged to the next step's tokens/s
            if stop_now:
                loop.finish_saves()  # --async_checkpoint: the checkpoint is on disk before the exit
                log(f"[train] stop requested by {stop['why']}: saved step {progress.step}, "
                    f"exiting with {EXIT_INTERRUPTED}")
                loop.close()
                return EXIT_INTERRUPTED
        loop.finish_saves()
        if loop.early.due:
            log(f"[train] early stop at step {progress.step}: {loop.early.describe()} (--early_stopping_patience="
                f"{cfg.early_stopping_patience})")
    except BaseException:
        loop.write_pending_row()  # a step queued before the failure still gets its metrics row
        loop.finish_saves(failing=True)
        raise
    loop.close()
    engine.optimizer.finish_param_sync()
    synchronize(info.device)
    barrier()  # let the last asynchronous collectives drain before the process group goes away
    if progress.last_val is None and loop.last_eval:  # a task whose validation has no loss (GRPO's rewards)
        log(f"[train] done: {progress.step} steps, final " + values_text(loop.last_eval))
    else:
        last = progress.last_val if progress.last_val is not None else float("nan")
        log(f"[train] done: {progress.step} steps, final val_loss {last:.4f}, best {progress.best_val:.4f}")
    return EXIT_OK


@dataclasses.dataclass
class _Pending:
    """A step queued and not read yet (Loop.step / Loop.finish)."""
    rec: dict  # its metrics row so far: what the host knew when it queued the step
    sums: HostCopy  # the step's loss (and DPO) sums, on their way to the host
    verdict: Any  # the optimizer's (stepped, grad_norm): a tuple, or a StepVerdict read when unpacked
    global_units: float
    data_step: int  # the data it trained on
    side: Any = None  # the model's side losses (MoE, MTP): the step's statistics on their way to the host


class Loop:
    """One optimizer step at a time: learning rate, this rank's micro-batches, forward + backward
    through the engine, the optimizer step, the spike guard, the log line, evaluation, samples and
    checkpoints. The same for every task and engine (parallel/engine.py hides which one runs)."""

    def __init__(self, cfg: TrainConfig, info: DistInfo, engine, checkpoints: CheckpointManager, ref_model, model_cfg,
                 train_loader, make_val_loader, metrics: MetricsLogger, progress: Progress, init_info: dict, log,
                 task) -> None:
        self.cfg, self.info, self.engine, self.ref_model, self.model_cfg = cfg, info, engine, ref_model, model_cfg
        self.checkpoints = checkpoints
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
        self.early = EarlyStopping(cfg.early_stopping_patience, cfg.early_stopping_threshold, progress.saved_early_stop)
        self.sampler = build_sampler(cfg)  # --sample_every: prompts and tokenizer checked on every rank
        self.task_eval = build_task_evaluator(cfg) if info.is_main else None  # --eval_tasks: files read now
        self.resumed_from = {"step": progress.step, "data_step": progress.data_step}
        self.task = task
        self.last_eval: dict = {}  # the last validation's values (the final line names them when there is no loss)
        self.loss_fn = lambda model, batch: task.micro_batch_loss(model, ref_model, batch, info.device)  # noqa: E731
        # the model's own losses (the engine's side loss): MoE balancing (bias update, load metrics) and multi-token
        # prediction, each with its step metrics
        self.side = SideLosses.of(cfg, engine.module, task.count_units)
        engine.side_loss = self.side
        self.pbar = None
        # the step queued last, not read yet (`step` leaves it for one step, `finish` reads it): its metrics row
        # without the device's values, the copies of those values on their way to the host, the optimizer's verdict
        self.pending: Optional[_Pending] = None
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
        cfg, p, log = self.cfg, self.progress, self.log
        for warning in schedule_warnings(max_iters=cfg.max_iters, warmup_iters=cfg.warmup_iters,
                                         lr_decay_iters=cfg.lr_decay_iters, schedule=cfg.lr_schedule,
                                         resumed_at=p.step, saved_max_iters=saved_max_iters):
            log(f"[warning] schedule: {warning}")
        layout = self.engine.parallel.describe_ranks(self.engine.dp_size)
        log(f"[train] {cfg.task_type}: {cfg.max_iters} steps x {cfg.gradient_accumulation_steps} micro-batches x "
            f"{cfg.batch_size} samples x {layout}, seq {cfg.max_seq_len}; MFU against {self.peak.describe()} per device")
        if p.skip_steps:
            log(f"[data] data steps never trained on: {format_data_steps(p.skip_steps)} (drawn and discarded; "
                f"{sum(d > p.data_step for d in p.skip_steps)} of them still ahead, at data step {p.data_step})")
        if self.guard is not None:
            log(f"[spike_guard] exit {EXIT_LOSS_SPIKE} when a loss is non-finite or above {cfg.spike_factor:g} x "
                f"the median of the previous {cfg.spike_window} steps ({len(self.guard.recent)} known)")
        if self.info.is_main and cfg.progress and sys.stdout.isatty():  # a bar in a terminal; lines in log files
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

    def step(self) -> None:
        """Queue one optimizer step, then finish the step before it when that was left pending (`may_defer`):
        its loss and gradient norm are read only now, when the device has long computed them, so the host
        never waits for the device between steps and queues each step while the previous one still runs.
        The caller finishes this step at once (`finish`) when something must see it finished."""
        cfg, info, engine, p = self.cfg, self.info, self.engine, self.progress
        if step_fault_due(p.step + 1):  # (test hook) the step before a crash / hang is finished, as without one
            self.finish()
        fire_step_faults(p.step + 1)
        if self.tuner is not None and self.tuner.threads_for_next_step() != torch.get_num_threads():
            torch.set_num_threads(self.tuner.threads_for_next_step())
        lr = lr_at(p.step, **self.lr_kw)
        engine.optimizer.set_lr(lr)
        batches, skipped = self.task.before_step(self, self._draw)  # GRPO's rollouts; others: the data drawn
        counts = engine.sum_over_data([float(sum(self.task.count_units(b) for b in batches)),
                                       float(sum(count_tokens(b) for b in batches))], info.device)
        global_units, step_tokens = max(1.0, float(counts[0])), float(counts[1])
        engine.optimizer.zero_grad()
        poison = fires("nan_loss", p.step + 1)  # test hook: this step's loss (and gradients) become NaN
        spike = spike_fault(p.data_step, batches)  # test hook: a loss spike on this step's data
        # forward + backward of every micro-batch (gradient accumulation, or the pipeline schedule); the
        # gradients are those of (all ranks' loss sums) / global_units
        sums = engine.forward_backward(batches, spiked(self.loss_fn, *spike) if spike else self.loss_fn,
                                       global_units, poison=poison)
        step_sums = engine.sum_over_data(sums, info.device, to_host=False)  # the step's sums over the ranks
        self.task.after_step(step_sums, engine.stat_keys, global_units)  # (bco_pair's running mean, on the device)
        sums_copy = HostCopy(step_sums)  # copied to the host behind the backward, read in `finish`
        verdict = engine.optimizer.step()  # clips, skips and steps on the device; its verdict is read in `finish`
        side = self.side.after_step(engine, info.device) if self.side is not None else None
        p.step += 1
        p.tokens_seen += self.task.tokens_seen(global_units, step_tokens)  # target tokens, or the tokens read (DPO)
        self.metrics.heartbeat()
        if self.pbar is not None:
            self.pbar.update(1)
        now = time.time()
        dt, self.t_last = max(1e-9, now - self.t_last), now  # this step on the host clock (the raw, per-step rate)
        tps_avg = self.throughput.add(self.timer.lap(step_tokens))  # the window's rate, warm-up steps excluded
        if self.tuner is not None:
            self._tune_threads(dt, step_tokens)
        rec: dict[str, Any] = {"step": p.step, "lr": lr, "tokens_per_sec": step_tokens / dt,
                               "tokens_seen": p.tokens_seen}
        if tps_avg is not None:  # None during the warm-up steps: no rate or MFU is claimed for them
            rec.update(tokens_per_sec_avg=tps_avg, mfu_is_estimate=self.peak.is_estimate,
                       mfu=mfu_from(self.flops_per_token * tps_avg / info.world_size, self.peak))
        if p.skip_steps or self.guard is not None:
            rec["data_step"] = p.data_step  # the data this step trained on
        if skipped:
            rec["skipped_data_steps"] = skipped  # drawn and discarded before it
        if p.step % cfg.log_interval == 0 or p.step <= TIMING_WARMUP_STEPS + 1:
            rec.update(memory_stats(info.device))  # the allocator's statistics: built anew on each call
        previous, self.pending = self.pending, None
        if previous is not None:  # queued a step ago: reading it now waits for nothing
            self._finish(previous, do_eval=False)  # (a spike there: this step, after it, gets no row either)
        self.pending = _Pending(rec, sums_copy, verdict, global_units, p.data_step, side)

    def may_defer(self, step: int) -> bool:
        """Whether step `step`, just queued, may be finished a step later: not when samples are due after it
        (evaluation and checkpoints the caller knows of)."""
        return self.sampler is None or not self.sampler.due(step)

    def finish(self, do_eval: bool = False) -> None:
        """Read the pending step (the one queued last) now: its loss checked, its row logged (`log_step`)."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._finish(pending, do_eval)

    def _finish(self, pending: "_Pending", do_eval: bool) -> None:
        """A queued step's device values read (`_read`), its loss checked (a spike or a non-finite loss raises
        here, before anything of a later step is saved), then its row logged."""
        rec = self._read(pending)
        self._check_loss(rec["loss"], rec["step"], pending.data_step)
        self.log_step(rec, do_eval)

    def _read(self, pending: "_Pending") -> dict:
        """The queued step's row completed with what the device computed: the loss (and DPO) sums per unit,
        and the optimizer's verdict (stepped, grad_norm)."""
        rec = pending.rec
        stats = StepStats.from_tensor(pending.sums.get(), self.engine.stat_keys).per_unit(pending.global_units)
        stepped, grad_norm = pending.verdict
        rec.update(loss=stats["loss"], grad_norm=grad_norm, stepped=bool(stepped), **self.task.step_metrics(stats))
        if pending.side is not None:
            rec.update(self.side.read(pending.side))
        return rec

    def write_pending_row(self) -> None:
        """The run is failing: the pending step's row as far as it can be read (no loss check), best effort."""
        pending, self.pending = self.pending, None
        if pending is None or not self.info.is_main:
            return
        try:
            self.metrics.write(self._read(pending))
        except Exception as e:  # noqa: BLE001 - the failure in flight is the one to report
            self.log(f"[train] step {pending.rec['step']}: its metrics row could not be read ({one_line(e)})")

    def _tune_threads(self, seconds: float, tokens: float) -> None:
        """Feed this step's time to the ThreadTuner; a switch it keeps is one log line."""
        kept = len(self.tuner.changes)
        self.tuner.record(seconds, tokens)
        if len(self.tuner.changes) > kept:
            _, old, new, r_old, r_new = self.tuner.changes[-1]
            self.log(f"[threads] {old} -> {new} thread{'s' if new != 1 else ''} at step {self.progress.step}: "
                     f"{r_old:,.0f} -> {r_new:,.0f} tokens/s measured (measured again now and then)")

    def _check_loss(self, loss: float, step: int, data_step: int) -> None:
        """--spike_guard: a spike records the step and exits 76 (the supervisor rolls back); a non-finite
        loss without fp16 loss scaling exits 4. `step`, `data_step`: the step whose loss this is and the data
        it trained on (a later step may be queued already: nothing is saved before its loss is checked)."""
        cfg, p = self.cfg, self.progress
        spike = self.guard.check(loss, nonfinite_is_spike=cfg.dtype != "fp16") if self.guard is not None else None
        if spike is not None:  # the rollback is the supervisor's: record the step, save nothing, exit 76
            if self.info.is_main:
                write_spike_record(cfg.out_dir, dict(spike, step=step, data_step=data_step, loss=loss,
                                                     factor=cfg.spike_factor, window=cfg.spike_window,
                                                     resumed_from=self.resumed_from,
                                                     skip_data_steps=sorted(p.skip_steps), time=time.time()))
            barrier()  # no rank exits before the record is on disk
            why = "is non-finite" if spike["reason"] == "non_finite" else \
                f"> {cfg.spike_factor:g} x the running median {spike['median']:.4g}"
            raise TrainingError(f"loss spike at step {step} (data step {data_step}): loss {loss:.4g} {why}; "
                                f"recorded in {os.path.join(cfg.out_dir, SPIKE_FILE)}, nothing saved after it",
                                EXIT_LOSS_SPIKE)
        if not math.isfinite(loss) and cfg.dtype != "fp16":
            raise TrainingError(f"non-finite loss {loss} at step {step}; the last good checkpoint in "
                                f"{cfg.out_dir}/checkpoints is intact (lower "
                                f"{'--learning_rate or --muon_lr' if cfg.optimizer == 'muon' else '--learning_rate'} "
                                "or use --dtype=fp16 with loss scaling)", EXIT_NONFINITE_LOSS)

    def log_step(self, rec: dict, do_eval: bool) -> None:
        """Evaluate when due, write the metrics row, print the line when due, then samples (--sample_every).
        `rec` is the row of step rec["step"]: the step queued last, or (finished a step later) the one before."""
        p, step = self.progress, rec["step"]
        if do_eval:
            ev = evaluate(self.cfg, self.engine, self.ref_model, self.make_val_loader, self.info, self.task)
            if ev is not None:
                rec.update(ev)
                self.last_eval = ev
            if ev is not None and "val_loss" in ev:  # a task's own validation may have no loss (GRPO's rewards)
                p.last_val = ev["val_loss"]
                p.best_val = min(p.best_val, p.last_val)
            if ev is not None:
                self.early.update(ev, step)
            if self.task_eval is not None:  # rank 0, the whole model (validate_config refuses fsdp / pipeline)
                self.engine.optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
                scores = self.task_eval.run(self.engine.module, self.info.device)
                rec.update(scores)
                self.log(f"[eval_tasks] step {step}: " + ", ".join(
                    f"{k[len('val_'):]} {v:.4f}" for k, v in scores.items()))
        self.metrics.write(rec)
        if self.info.is_main and line_due(step % self.cfg.log_interval == 0 or do_eval or step == 1,
                                           quiet_lines=self.quiet_lines):
            self.log(format_line(rec, total=self.cfg.max_iters, elapsed=time.time() - self.t_loop_start,
                                 eta=self._eta(step)))
        if self.info.is_main and self.sampler is not None and self.sampler.due(step):  # RNG untouched
            self.engine.optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
            self.metrics.write_samples(self.sampler.sample(self.engine.module, step, self.info.device))

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

    def save(self, val_loss: Optional[float], evaluated: Optional[dict] = None) -> None:
        """A checkpoint of this step (CheckpointManager.save: every rank, atomic publish, keep_last). `evaluated`:
        this step's validation values; a held-out reward among them is saved too (`best` of a run without a
        validation loss, checkpoint/verify.py selection_score)."""
        cfg, p = self.cfg, self.progress
        state = trainer_state(cfg, p, self.train_loader.state_dict(), val_loss, self.init_info,
                              lr_at(max(0, p.step - 1), **self.lr_kw), evaluated, self.guard, self.early, self.task)
        background = self.checkpoints.writer is not None
        fault = save_fault_hook(p.step, background, lambda: os.kill(os.getpid(), signal.SIGKILL))
        t0 = time.perf_counter()
        path = self.checkpoints.save(p.step, trainer_state=state, model_config=self.model_cfg.to_dict(),
                                     run_config=dataclasses.asdict(cfg), fault_hook=fault)
        if not background:
            self.log(f"[checkpoint] step {p.step} -> {path}")
        else:  # the writer thread logs the publish
            waited = self.checkpoints.last_wait_s
            self.log(f"[checkpoint] step {p.step}: waited {waited:.2f} s for the previous write, state copied to host "
                     f"memory in {time.perf_counter() - t0 - waited:.2f} s, writing {path} in the background")

    def finish_saves(self, failing: bool = False) -> None:
        """--async_checkpoint: wait for the write in flight (end of the run, SIGTERM); a failed write raises
        here (DiskFullError exit 7, else a crash). failing: the run is already ending on another error, so
        the write is waited for (a newer checkpoint for the restart) and its error only logged."""
        self.checkpoints.wait(failing)

    def close(self) -> None:
        close_loader = getattr(self.train_loader, "close", None)  # --prefetch_batches: its thread
        if close_loader is not None:
            close_loader()
        self.checkpoints.close()  # waited for already (finish_saves); frees the host buffers
        if self.pbar is not None:
            self.pbar.close()
        self.metrics.close()

