"""Constants shared by every stage: the ignore index and the documented exit codes."""

IGNORE_INDEX = -100

# sample.py's sampling defaults, also written into an exported model's generation_config.json
# (model/hf_interop.py), so that `transformers` generate samples as sample.py does. top_p None: no nucleus cut.
SAMPLE_MAX_NEW_TOKENS = 64
SAMPLE_TEMPERATURE = 0.8
SAMPLE_TOP_K = 50
SAMPLE_TOP_P = None

# --distill_loss's divergences (model/distill_head.py computes them; trainer/config.py checks the flag)
DISTILL_LOSSES = ("forward_kl", "reverse_kl", "jsd")

# The most optimizer steps a run may take (--max_iters and the step flags, trainer/config.py) and so the most a
# checkpoint's trainer_state.json may record (utils/checkpoint_json.py); --num_train_epochs' bound.
MAX_STEPS = 10 ** 9
MAX_EPOCHS = 10 ** 6

# Exit codes of train_my_ddp.py and the preprocessing commands; monitor_process.py reads them.
EXIT_OK = 0
EXIT_BAD_CONFIG = 2      # unknown flag, wrong type, impossible combination: never retried
EXIT_BAD_DATA = 3        # malformed or stale input files, shards of another tokenizer: never retried
EXIT_NONFINITE_LOSS = 4  # NaN/inf loss without fp16 loss scaling: never retried
EXIT_BAD_CHECKPOINT = 5  # a checkpoint or weights directory that cannot be loaded: never retried
EXIT_RUN_DIR_BUSY = 6    # --out_dir is held by another live run (utils/run_lock.py): never retried
EXIT_DISK_FULL = 7       # a save did not fit (disk or quota full, a file-size limit; utils/disk_space.py): the
                         # partial step_N.tmp is removed, older checkpoints intact; so does any other write of the
                         # run directory (metrics, heartbeat, config.json, the supervisor's log); never retried (a
                         # restart would fill the same disk again)
EXIT_INTERRUPTED = 75    # SIGTERM/SIGINT: finished the step, saved a checkpoint, exited
# --spike_guard=true: a step's loss was non-finite or above --spike_factor x its running median; the step
# is recorded in <out_dir>/spike.json and nothing was saved after it. Neither a crash nor non-retryable:
# monitor_process.py rolls back to a checkpoint before the step, replays it once, and skips its data if
# the spike comes back (docs/monitor.md "Loss spikes").
EXIT_LOSS_SPIKE = 76
NON_RETRYABLE_EXIT_CODES = frozenset({EXIT_BAD_CONFIG, EXIT_BAD_DATA, EXIT_NONFINITE_LOSS, EXIT_BAD_CHECKPOINT,
                                      EXIT_RUN_DIR_BUSY, EXIT_DISK_FULL})
