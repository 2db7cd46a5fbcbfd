"""The supervisor's command line: its options before `--`, the training command (kept verbatim, an argument list)
after it, and the paths that follow from the command's --out_dir. Parses only: starts nothing."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from monitor.restarts import flag_value

SPIKE_SKIP_CHOICES = ("since_checkpoint", "step")


@dataclass
class MonitorConfig:
    out_dir: Optional[str]
    log_file: Optional[str]
    summary_file: Optional[str]
    max_restarts: int
    count_only_stalled_restarts: bool
    backoff_base: float
    backoff_max: float
    hang_timeout: float
    startup_timeout: float
    kill_grace: float
    poll_interval: float
    spike_skip: str = "since_checkpoint"
    max_spike_events: int = 10


def parse_args(argv: list[str]) -> tuple[MonitorConfig, list[str]]:
    """Split argv at the first `--`: monitor options before it, the command (kept verbatim) after."""
    from utils.cli import DefaultsHelpFormatter, Parser, add_bool
    # the commands' convention (utils/cli.py): no prefix guessing (`--max_restart=2` is refused with a hint, not
    # taken as --max_restarts), `--a-b` == `--a_b`, booleans as --name[=true|false]
    p = Parser(
        prog="monitor_process.py", usage="%(prog)s [options] -- <training command ...>",
        formatter_class=DefaultsHelpFormatter,
        epilog="example: python monitor_process.py --max_restarts=20 --hang_timeout=900 -- "
               "torchrun --standalone --nproc_per_node=8 train_my_ddp.py --out_dir=out/pre ...",
        description="Run a training command, restart it on crashes and hangs, report what happened. "
                    "Exit 0 and exit codes 2 (bad config), 3 (bad data), 4 (non-finite loss), "
                    "5 (unusable checkpoint) are never restarted; 75 (interrupted after saving) stops the monitor too; "
                    "76 (a loss spike, train_my_ddp.py --spike_guard=true) rolls back to the checkpoint before it, "
                    "replays once, and skips the data if the spike comes back (docs/monitor.md).")
    p.add_argument("--out_dir", help="the run's out_dir (default: the command's --out_dir=)")
    p.add_argument("--log_file", help="tee file for the output (default: <out_dir>/monitor.log)")
    p.add_argument("--summary_file", help="default: <out_dir>/monitor_summary.json")
    p.add_argument("--max_restarts", type=int, default=10)
    add_bool(p, "count_only_stalled_restarts", False,
             "count a restart against --max_restarts only if the attempt before it made no progress (no new step "
             "in metrics.jsonl, no newer checkpoint)")
    p.add_argument("--backoff_base", type=float, default=5.0, help="seconds before the first restart")
    p.add_argument("--backoff_max", type=float, default=300.0, help="cap of the doubling backoff")
    p.add_argument("--hang_timeout", type=float, default=600.0,
                   help="seconds without a heartbeat/metrics update before the run is killed (0: off)")
    p.add_argument("--startup_timeout", type=float, default=1800.0,
                   help="grace before the first heartbeat of each attempt (imports, data, compile)")
    p.add_argument("--kill_grace", type=float, default=30.0, help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--poll_interval", type=float, default=1.0)
    p.add_argument("--spike_skip", choices=SPIKE_SKIP_CHOICES, default="since_checkpoint",
                   help="data skipped after a loss spike that reproduced: since_checkpoint (default: every data "
                        "step from the checkpoint the replay resumed from up to the spike, as PaLM did) or step "
                        "(only the spike step's data)")
    p.add_argument("--max_spike_events", type=int, default=10,
                   help="loss spikes handled (rollback + replay) before giving up; these restarts do not count "
                        "against --max_restarts")
    if "--" not in argv:
        if any(x in ("-h", "--help") for x in argv):
            p.parse_args(["--help"])  # prints the help and exits 0
        p.error("the training command must follow `--` (see --help)")
    cut = argv.index("--")
    own, command = argv[:cut], argv[cut + 1:]
    a = p.parse_args(own)
    if not command:
        p.error("no training command after `--`")
    out_dir = a.out_dir or flag_value(command, "--out_dir") or flag_value(command, "--output_dir")
    log_file = a.log_file or (os.path.join(out_dir, "monitor.log") if out_dir else None)
    summary = a.summary_file or (os.path.join(out_dir, "monitor_summary.json") if out_dir else None)
    cfg = MonitorConfig(out_dir, log_file, summary, a.max_restarts, a.count_only_stalled_restarts,
                        a.backoff_base, a.backoff_max, a.hang_timeout, a.startup_timeout,
                        a.kill_grace, a.poll_interval, a.spike_skip, a.max_spike_events)
    return cfg, command

