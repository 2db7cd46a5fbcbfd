"""Train a Llama2-style model: pretraining, SFT or DPO, on one process or many (torchrun).

    python train_my_ddp.py [config.py ...] --out_dir=out/run --data_dir=... --tokenizer_dir=...
    torchrun --standalone --nproc_per_node=2 train_my_ddp.py ...        (same flags)

    torchrun --standalone --nproc_per_node=4 train_my_ddp.py ... --pipeline_parallel_size=2   (2 stages x 2 dp)

One loop for every task, world size and engine: the same wrapper, optimizer, clipping, loss scaler and
precision policy whether or not the run is distributed; our DDP, FSDP2 (--parallel=fsdp) and pipeline
stages (--pipeline_parallel_size) sit behind parallel/ (the engine's `forward_backward`, `evaluate`,
`save`, `load`); what differs between pretraining, SFT and DPO (data, loss, units, validation figures)
is trainer/tasks/' (one module per task); where weights come from (Hugging Face, our checkpoints, LoRA bases) is
trainer/weights.py's. Read trainer/loop.py `train()` top to bottom: configuration -> where the run starts (`decide_start`)
-> model (`build_model`, `choose_trainable`, `dpo_reference`) -> engine + optimizer (`place_on_engine`)
-> data -> resumed state (`restore`) -> the loop (`Loop.step`: lr, micro-batches, token-normalised
loss, optimizer step, queued; `Loop.finish`: the loss and norm read, a step later unless something must see
the step finished; `Loop.log_step`: metrics, evaluation, samples; `Loop.save`) -> the end.

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
(trainer/precheck.py), with the same line and exit code as below.

This file is the command only;
the trainer's pieces are the trainer/ package (config, start, loop, task, weights, samples, faults).
"""
from __future__ import annotations

import contextlib
import os
import sys

PROG = "train_my_ddp.py"
if __name__ == "__main__":  # answered in a second: --help, typos, bad values, missing paths (no torch yet)
    from trainer.precheck import precheck
    precheck(sys.argv[1:], title=__doc__.strip().splitlines()[0], prog=PROG)

from trainer.config import TrainConfig, continues_run, imply_engine, one_line, parallel_section  # noqa: E402 (after the pre-check)
from trainer.loop import train  # noqa: E402
from utils import run_lock  # noqa: E402
from utils.configurator import ConfigError, help_text, parse_config  # noqa: E402
from utils.constants import EXIT_BAD_CONFIG, EXIT_OK  # noqa: E402
from utils.dist import destroy, init_distributed  # noqa: E402
from utils.errors import exit_code_for  # noqa: E402
from checkpoint.select import resolve_resume_config  # noqa: E402


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
            print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
            return EXIT_BAD_CONFIG
        except run_lock.REFUSALS as e:
            code, msg = exit_code_for(e)
            print(f"[rank {rank}] error: {msg}", file=sys.stderr, flush=True)
            return code
        try:
            info = init_distributed(cfg.device, need_group=parallel_section(cfg).needs_process_group())
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



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
