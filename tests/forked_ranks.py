"""Trainer runs (one or several ranks) and project scripts for the tests without a fresh interpreter's
start-up cost: each process is forked from one server process that has already imported torch and the
trainer.

Why: a 2-rank `torchrun` run pays for three fresh interpreters importing torch (the launcher and two
workers, ~2 s of CPU each on the 2-core CI box) before the first step; the suite makes dozens of such
runs. Here a multiprocessing "forkserver" (started once per pytest worker, with `train_my_ddp` and
torch preloaded) forks each rank, which gets the environment torchrun would give it (RANK, LOCAL_RANK,
WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR / MASTER_PORT for `init_process_group("env://")`, OMP_NUM_THREADS=1
unless set) and calls `train_my_ddp.main(args)` as `python train_my_ddp.py args` would. The ranks are
real processes with their own process group, so the distributed code under test is unchanged; what is
not exercised is torchrun itself (its agent, rendezvous, restarts), which the tests that are about
launching keep using (tests/monitor, tests/parallel/test_*_multinode.py, the SIGKILL tests).

`run_script(["export_hf.py", ...])` / `run_script(["-m", "tokenizer.train_tokenizer", ...])` runs a
project script or module as __main__ (runpy) in such a process, as `python ...` would.

Like torchrun: when one rank exits non-zero the others are terminated; the run's exit code is the first
failing rank's; stdout / stderr are the ranks' outputs in rank order.

Must never: be used for a run whose point is a process-level fault or launcher behaviour (callers
check, see tests/conftest.py `_forked_ok`), or change what a rank computes.
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time

# imported in the server before any fork: what every rank would import first anyway. Beyond the trainer's
# own imports, what a run imports lazily: torch._dynamo (torch.optim's constructor imports it, ~1.5 s of CPU
# with sympy), FSDP2 / DTensor / distributed checkpoint, triton (model/ imports its kernels), transformers
# (HF import / export). A tiny run without these spends ~1.9 s in main(), ~0.2 s with them. A module
# that is not installed is skipped (multiprocessing ignores ImportError in a preload). A project module that
# used one of these without importing it would pass here: the real-process tests (monitor, torchrun, cold
# compiles, the gpu-report dry run) start fresh interpreters and would not.
_PRELOAD = ["torch", "torch.distributed", "tests.forked_ranks", "train_my_ddp", "trainer.loop", "torch._dynamo",
            "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint", "triton",
            "transformers", "safetensors.torch"]
# read when a module is imported: a run asking for another value than the server was started with
# cannot use the preloaded modules (model/triton_ops.py decides interpretation at import)
IMPORT_TIME_ENV = ("TRITON_INTERPRET",)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_context = None
_server_env: dict = {}


def forkserver_context():
    """The multiprocessing context whose server preloads `_PRELOAD` (started on first use, once per process)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(_PRELOAD)
        _server_env.update({k: os.environ.get(k) for k in IMPORT_TIME_ENV})
    return _context


def can_fork_with(env: dict | None) -> bool:
    """False when `env` sets an import-time variable differently from the server's (or from this process
    before the server exists), and always on a machine with CUDA: a process forked from one that has
    touched CUDA (the server's imports query the device) cannot use it, so every run there starts a fresh
    interpreter (DESIGN.md trap 17: the four CUDA trainer tests failed through this server on an H100)."""
    if cuda_machine():
        return False
    env = os.environ if env is None else env
    ref = _server_env if _context is not None else {k: os.environ.get(k) for k in IMPORT_TIME_ENV}
    return all(env.get(k) == ref.get(k) for k in IMPORT_TIME_ENV)


def cuda_machine() -> bool:
    """Whether this machine has a CUDA device (asked once; the tests' process queries it anyway)."""
    global _CUDA
    if _CUDA is None:
        import torch
        _CUDA = bool(torch.cuda.is_available())
    return _CUDA


_CUDA: bool | None = None


def _child_main(target: tuple, env: dict, cwd: str, out_path: str, err_path: str) -> None:
    """In the forked process: the environment, working directory, stdout / stderr on files, then
    `target`: ("trainer", args) calls train_my_ddp.main(args); ("argv", [script.py | -m module, *args])
    runs that script or module as __main__ (runpy), as `python argv...` would."""
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    import torch
    if "OMP_NUM_THREADS" in env:  # else the interpreter's default, as in a fresh interpreter
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    kind, argv = target
    code = 1
    try:
        if kind == "trainer":
            sys.argv = ["train_my_ddp.py", *argv]
            import train_my_ddp
            code = train_my_ddp.main(argv) or 0
        elif argv[0] == "-m":
            import runpy
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            code = 0
        else:
            import runpy
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
            code = 0
    except SystemExit as e:  # the interpreter prints a non-integer code and exits 1
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # what the interpreter would print for an uncaught exception, exit 1
        import traceback
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()  # a fresh interpreter runs these at exit; a forked child would not
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def run_script(argv: list[str], env: dict | None = None, cwd: str | None = None, timeout: float = 600,
               cmd: list[str] | None = None) -> subprocess.CompletedProcess:
    """`python argv...` (a script path or `-m module` and its arguments) in one process forked from the
    server, reported as subprocess.run(capture_output=True, text=True) would."""
    return _run_forked([("argv", list(argv))], [dict(os.environ if env is None else env)], cwd or os.getcwd(),
                       timeout, cmd or argv)


def run_ranks(args: list[str], nproc: int, env: dict | None = None, timeout: float = 600,
              cmd: list[str] | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=nproc train_my_ddp.py args` (nproc > 1) or `python
    train_my_ddp.py args` (nproc == 1), each rank forked (see the module docstring). Raises
    subprocess.TimeoutExpired (all ranks killed) after `timeout` seconds."""
    from tests.dist_helpers import free_port
    base = dict(os.environ if env is None else env)
    envs = [base]
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default for several ranks
        port = str(free_port())
        envs = [dict(base, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                     GROUP_RANK="0", ROLE_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                     TORCHELASTIC_RESTART_COUNT="0") for r in range(nproc)]
    return _run_forked([("trainer", list(args))] * nproc, envs, ROOT, timeout, cmd or args)


def _run_forked(targets: list, envs: list, cwd: str, timeout: float, cmd) -> subprocess.CompletedProcess:
    """Fork one process per target from the server, wait (a failing one stops the rest, as torchrun
    does), and report their exit code and outputs (in order) as one CompletedProcess."""
    ctx = forkserver_context()
    with tempfile.TemporaryDirectory(prefix="forked_") as d:
        procs, files = [], []
        for i, (target, env) in enumerate(zip(targets, envs)):
            out, err = os.path.join(d, f"{i}.out"), os.path.join(d, f"{i}.err")
            files.append((out, err))
            p = ctx.Process(target=_child_main, args=(target, env, cwd, out, err))
            p.start()
            procs.append(p)
        failed, timed_out = wait_for(procs, time.monotonic() + timeout)
        if failed is not None or timed_out:
            _stop(procs)
        if timed_out:
            raise subprocess.TimeoutExpired(cmd, timeout)
        code = failed.exitcode if failed is not None else 0  # < 0: killed by that signal, as subprocess says
        texts = [(_read(out), _read(err)) for out, err in files]
    return subprocess.CompletedProcess(cmd, code, "".join(t[0] for t in texts), "".join(t[1] for t in texts))


def wait_for(procs, deadline: float, poll: float = 0.05):
    """Wait until every process has exited, one has failed, or `deadline` (time.monotonic()) passes.
    Returns (the first process seen failing or None, timed out). Each pass judges failure and completion
    from one reading of the exit codes: read twice, a rank exiting with 2 between the reads looked
    finished but not failed, and the run was reported as exit 0 (seen once in a full suite)."""
    while True:
        for p in procs:
            p.join(poll)
        codes = [p.exitcode for p in procs]
        failed = next((p for p, c in zip(procs, codes) if c not in (None, 0)), None)
        if failed is not None or all(c is not None for c in codes):
            return failed, False
        if time.monotonic() > deadline:
            return None, True


def _read(path: str) -> str:
    if not os.path.exists(path):  # a process killed before it opened its files
        return ""
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _stop(procs) -> None:
    """torchrun's way: SIGTERM to every rank still running, SIGKILL to any left after a grace period."""
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    end = time.monotonic() + 10
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.exitcode is None:
            p.kill()
            p.join()
