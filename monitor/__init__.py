"""The supervisor of unattended training runs (`monitor_process.py` is its command): start, watch, restart, report.

What it owns, module by module:
- `config.py`: the command line (`MonitorConfig`, `parse_args`: options before `--`, the training command after it,
  kept verbatim as an argument list, never a string split on spaces).
- `restarts.py`: what an exit means (utils/constants.py: 0 is done and is NEVER restarted; 2/3/4/5/6/7 are
  non-retryable and are reported; 75 means the run was interrupted after saving; 76 is a loss spike; anything
  else, including death by a signal, is a crash that is restarted after an exponential backoff, up to
  --max_restarts) and the command of the next attempt: the original one, since the trainer continues the run in
  its out_dir by itself (`--resume=auto`); only a command that says `--resume=never` gets `--resume=always`, once
  the run recorded its start (run_start.json or a checkpoint).
- `run_files.py`: reading the trainer's progress (metrics.jsonl steps, complete checkpoints, torchrun's report).
- `hang.py`: hang detection from the mtime of <out_dir>/heartbeat and <out_dir>/metrics.jsonl.
- `spikes.py`: loss spikes (exit 76): move the checkpoints at or after the spike aside, replay from the newest one
  before it; a spike that comes back at the same step is the data's fault and its data window is skipped
  (`--skip_data_steps=` on every later restart), one that does not is the machine's and is only logged.
- `process.py`: the process tree it started (its own session, stdout/stderr teed to the terminal and the log file,
  killed whole: all ranks, also torchrun workers in their own sessions) and the log file (`RunLog`).
- `record.py`: the record of the supervision (attempts, restarts, causes, steps lost, final status) and its report
  (stdout and <out_dir>/monitor_summary.json).
- `supervisor.py`: the loop (`Monitor`): one attempt after another, SIGINT/SIGTERM forwarded to the training's
  process group and then no restart.
- `cli.py`: `main`, which holds the run directory's lock (utils/run_lock.py) for the whole supervision.
A full disk (or quota, or a file-size limit) under its own writes: the log file or the summary that does not fit
ends the supervision with exit 7 and one line naming the file (utils/disk_space.py), and nothing more is started.

What it must never do:
- Restart a run that exited 0 or with a non-retryable code (trap 15), or split the command on spaces (trap 16).
- Import torch or anything of the training stack: it must keep working when those are broken (it imports only
  utils/ modules that are torch-free).
- Write anything in out_dir besides its log, summary and run.lock; checkpoints belong to the trainer. The one
  exception: after a loss spike it MOVES checkpoints it must not resume into checkpoints_after_spike/ (never
  deletes them).
- Signal processes it did not start.
"""
