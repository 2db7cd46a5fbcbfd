"""Supervisor for unattended training runs: start, watch, restart, report (the `monitor/` package; its header
says what the supervisor owns and must never do; docs/monitor.md).

    python monitor_process.py [options] -- <training command ...>

Exit codes: the training's when it ends the run (0 done, 2-7 non-retryable, 75 stopped after saving, 76 loss
spikes given up on), 6 when the run directory is in use, 7 when the supervisor's own log or summary does not fit,
127 when the command cannot be started (docs/monitor.md). Imports no torch: it must keep working when the training
stack is broken.
"""
import sys

# The monitor/ package lives next to this script, so this import works from any working directory when the
# script is run by path (sys.path[0] is the script's directory).
from monitor.cli import main

if __name__ == "__main__":
    sys.exit(main())
