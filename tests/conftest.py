"""Shared pytest setup: repo root on sys.path, few threads so parallel tests stay fair on 2 cores.

Tests mirror the packages (tests/model/ for model/, tests/trainer/ for train_my_ddp.py and its modules, ...).
`make test` runs them with pytest-xdist, one worker more than cores (Makefile); each worker then computes
on one thread, so the workers do not fight over the cores' threads. Trainer runs and project scripts that
need a real process are forked from one preloaded server per worker (tests/forked_ranks.py)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Inductor compiles in this process instead of starting a pool of compile workers (each a fresh interpreter
# importing torch): on 2 cores shared by 2 pytest workers the pool costs more CPU than it saves (measured on
# the cold-compile test: 98 s of CPU with the pool, 84 s without). Subprocesses inherit it.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# OpenMP threads sleep while they wait: a test run's spinning threads would slow the other workers' processes on
# the shared cores (docs/training.md "CPU threads"). Read when torch loads libgomp.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
# the trainer takes its thread count from OMP_NUM_THREADS when set (else every usable core): runs in this
# process and the processes the tests start get this worker's share of the cores
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, min(2, (os.cpu_count() or 1) // _WORKERS))))

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():
    # Triton kernels are tested on CPU tensors in Triton's interpreter; it must be chosen before triton is
    # imported. On a GPU machine the kernels compile for real (and the CPU-interpreter tests skip).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

from tests.forked_ranks import can_fork_with, run_ranks, run_script  # noqa: E402
from tests.gpu_order import expected_seconds, spread_longest_first  # noqa: E402

PY = sys.executable


TRAIN = os.path.join(ROOT, "train_my_ddp.py")


class TrainCommand(list):
    """The command line of a train_my_ddp.py run (a plain list: subprocess takes it as is), which also
    remembers its flags and process count so that `run_cmd` can run a one-process run in this process."""

    def __init__(self, args: list[str], nproc: int = 1):
        cmd = [PY, TRAIN, *args] if nproc == 1 else \
            [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", TRAIN, *args]
        super().__init__(cmd)
        self.args, self.nproc = list(args), nproc


def child_env(**extra: str) -> dict:
    """The environment of a trainer or command the tests start: one OpenMP thread per process (two cores are
    shared by several ranks and xdist workers), unbuffered output (a failure's lines are not lost), and `extra`."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def toy_dpo_pairs(path, n: int = 24):
    """The first `n` preference pairs of the bundled DPO data written to `path` (a Path): a toy set for short runs."""
    with open(os.path.join(ROOT, "data", "dpo", "dpo_pairs.jsonl"), encoding="utf-8") as f:
        path.write_text("".join(line for _, line in zip(range(n), f)), encoding="utf-8")
    return path


def train_cmd(args: list[str], nproc: int = 1) -> TrainCommand:
    return TrainCommand(args, nproc)


# Faults that end the process itself (os._exit, a hang, SIGKILL in a save) need a real process.
_PROCESS_FAULTS = ("crash@", "hang@", "kill_in_save@")


def _in_process_ok(cmd, env: dict | None) -> bool:
    if not isinstance(cmd, TrainCommand) or cmd.nproc != 1 or any(a.startswith("--compile=t") for a in cmd.args):
        return False  # several processes, or torch.compile (its caches would outlive the run in this process)
    fault = (env or {}).get("MYLLM_FAULT", "")
    return not fault.startswith(_PROCESS_FAULTS)


def _run_trainer_here(cmd: TrainCommand, env: dict | None) -> subprocess.CompletedProcess:
    """train_my_ddp.main(args) in this process, as the subprocess would run it: the command's environment,
    one compute thread (the subprocesses get OMP_NUM_THREADS=1, so results are bit-identical), stdout /
    stderr and the library's log lines captured; every global it touches is put back afterwards."""
    import contextlib
    import io
    import logging
    import signal

    import train_my_ddp
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_threads = dict(os.environ), torch.get_num_threads()
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    saved_det = torch.are_deterministic_algorithms_enabled()
    root = logging.getLogger()
    handler, saved_level = logging.StreamHandler(err), root.level
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = train_my_ddp.main(cmd.args)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        root.removeHandler(handler)
        root.setLevel(saved_level)
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(saved_threads)
        torch.use_deterministic_algorithms(saved_det)
        for s, h in saved_signals.items():
            signal.signal(s, h)
    return subprocess.CompletedProcess(list(cmd), code, out.getvalue(), err.getvalue())


def _forked_ok(cmd, env: dict | None) -> bool:
    """A run whose process(es) can be forked from a server that has imported torch and the trainer
    (tests/forked_ranks.py): no hang to wait out (the monitor tests run those under torchrun) and the
    same import-time environment."""
    if not isinstance(cmd, TrainCommand):
        return False
    return not (env or {}).get("MYLLM_FAULT", "").startswith("hang@") and can_fork_with(env)


def run_trainer(cmd: TrainCommand, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """A train_my_ddp.py run (`train_cmd(flags, nproc)`) in real processes, reported as
    `subprocess.run(cmd, capture_output=True, text=True)` would: each rank is forked from a server that
    has imported torch and the trainer (tests/forked_ranks.py: the torchrun environment without torchrun,
    ~7 s of CPU saved per 2-rank run, ~2 s per one-process run); crashes (os._exit, SIGKILL in a save)
    end that rank's process as they would. A run that hangs on purpose, or one with another import-time
    environment, runs the real command (torchrun for several ranks)."""
    if _forked_ok(cmd, env):
        return run_ranks(cmd.args, cmd.nproc, env=env, timeout=timeout, cmd=list(cmd))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _python_script(args) -> bool:
    """`python <script.py> ...` or `python -m <module> ...` of this project (not torchrun, which starts
    its own processes, and not `python -c`)."""
    if len(args) < 2 or args[0] not in (PY, sys.executable):
        return False
    if args[1] == "-m":
        return len(args) > 2 and args[2].split(".")[0] in _PROJECT_PACKAGES
    return args[1].endswith(".py") and os.path.abspath(os.path.join(ROOT, args[1])).startswith(ROOT + os.sep)


_PROJECT_PACKAGES = {name for name in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, name, "__init__.py"))}


def run_python(args: list[str], cwd: str = ROOT, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`; for
    `python <project script> ...` / `python -m <project module> ...` the process is forked from the
    server that has imported torch and the trainer (tests/forked_ranks.py: ~2 s of imports saved), with
    the same arguments, environment, working directory, exit code and outputs."""
    if _python_script(args) and can_fork_with(env):
        return run_script(args[1:], env=env, cwd=cwd, timeout=timeout, cmd=list(args))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_cmd(args: list[str], cwd: str = ROOT, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a project command and require exit 0; on failure the assertion shows its output. A one-process
    trainer run that needs no real process (no fault that ends the process, no torch.compile) runs in this
    process (same flags, environment and thread count; ~4 s of start-up saved); other trainer runs go
    through `run_trainer`; `python <project script> ...` / `python -m <project module> ...` runs in a
    process forked from the preloaded server (tests/forked_ranks.py: ~2 s of imports saved)."""
    if cwd == ROOT and _in_process_ok(args, env):
        proc = _run_trainer_here(args, env)
    elif cwd == ROOT and isinstance(args, TrainCommand):
        proc = run_trainer(args, env, timeout)
    else:
        proc = run_python(args, cwd=cwd, env=env, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def sigterm_after_two_steps(flags: list[str], out, env: dict) -> tuple[int, str, str]:
    """Start train_my_ddp.py with `flags` writing to `out` (a Path), send it SIGTERM once its metrics.jsonl holds
    two rows, and wait for it to exit: (returncode, stdout, stderr)."""
    import signal
    import time
    proc = subprocess.Popen(train_cmd([*flags, f"--out_dir={out}"]), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 600  # waits for an event; only a broken run (or a very slow machine) gets near it
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=600)
    return proc.returncode, stdout, err


@pytest.fixture(scope="session")
def tiny_pretrain_data(tmp_path_factory) -> dict:
    """A real tokenizer + token shards + index built from a slice of the bundled corpus.

    Returns {"tokenizer_dir", "data_dir", "max_seq_len"}. Built once per test session (~10 s).
    """
    base = tmp_path_factory.mktemp("tiny_pretrain")
    corpus = base / "corpus"
    corpus.mkdir()
    src_dir = os.path.join(ROOT, "data", "pretrain")
    for name in sorted(os.listdir(src_dir)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(src_dir, name), encoding="utf-8") as f:
            docs = [json.loads(line)["text"] for _, line in zip(range(60), f)]
        with open(corpus / name, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d[:1500]}, ensure_ascii=False) + "\n")
    tok, shards, seq = base / "tok", base / "shards", 32
    run_cmd([PY, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--output_dir={tok}",
             "--vocab_size=384", "--tokenizer_type=hf_bbpe"])
    run_cmd([PY, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={corpus}", f"--tokenizer_dir={tok}",
             f"--output_dir={shards}", "--num_workers=1", "--no_progress"])
    run_cmd([PY, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}",
             f"--max_seq_len={seq}", "--val_ratio=0.1", "--split_by=sample"])  # the split the suite's numbers use
    return {"tokenizer_dir": str(tok), "data_dir": str(shards), "max_seq_len": seq}


@pytest.fixture(scope="session")
def tiny_pretrain_run_args(tiny_pretrain_data) -> list[str]:
    """Flags for a few-second real pretraining run of train_my_ddp.py (add --out_dir and --max_iters).

    Deterministic on CPU in fp32: same flags -> same loss sequence, which the resume tests rely on.
    """
    d = tiny_pretrain_data
    return [f"--data_dir={d['data_dir']}", f"--tokenizer_dir={d['tokenizer_dir']}",
            f"--max_seq_len={d['max_seq_len']}", "--dim=32", "--n_layers=2", "--n_heads=4", "--multiple_of=16",
            "--batch_size=4", "--learning_rate=1e-2", "--warmup_iters=2", "--eval_interval=0",
            "--eval_iters=2", "--log_interval=1", "--checkpoint_interval=3", "--progress=false",
            "--peak_flops=1e11", "--device=cpu", "--seed=7"]


@pytest.fixture(scope="session")
def pretrained(tiny_pretrain_run_args, tmp_path_factory) -> dict:
    """A 12-step pretraining run (its checkpoint seeds SFT and DPO runs), shared by tests/trainer/test_end_to_end.py
    and test_day_to_day.py: built once per test session (per xdist worker). Tests only read it."""
    out = tmp_path_factory.mktemp("pretrain") / "run"
    run_cmd(train_cmd([*tiny_pretrain_run_args, f"--out_dir={out}", "--max_iters=12", "--eval_interval=6"]),
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    return {"out": out, "args": tiny_pretrain_run_args}


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: `items` is what runs
def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped without it (`make test-gpu` selects only them). With CUDA and
    only the GPU tests selected, the longest run first, one at the head of each xdist worker's first chunk
    (tests/gpu_order.py: the report's tests stage ran out of time with two long trainer runs started last)."""
    if torch.cuda.is_available():
        if items and all("gpu" in item.keywords for item in items):
            workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
            secs = [expected_seconds(item.name, getattr(item, "originalname", item.name)) for item in items]
            items[:] = spread_longest_first(items, secs, workers)
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With MYLLM_FAILURES_NOW=1 (the GPU report's tests stage, `make test-gpu`) a failure's reason is
    printed the moment the test fails, not only in the summary: a stage that runs out of time must not
    lose why its tests failed (the last H100 run lost four)."""
    if report.failed and os.environ.get("MYLLM_FAILURES_NOW") == "1":
        text = report.longreprtext or ""
        sys.stderr.write(f"\n[failed now] {report.nodeid} ({report.when}):\n{text[-3000:]}\n")
        sys.stderr.flush()
