"""Shared pytest setup: repo root on sys.path, few threads so parallel tests stay fair on 2 cores.

Tests mirror the packages (tests/model/ for model/, tests/trainer/ for train_my_ddp.py and its modules, ...).
`make test` runs them on every core with pytest-xdist (`-n auto`); each worker then computes on one
thread, so two workers on two cores do not fight over them."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
if not torch.cuda.is_available():
    # Triton kernels are tested on CPU tensors in Triton's interpreter; it must be chosen before triton is
    # imported. On a GPU machine the kernels compile for real (and the CPU-interpreter tests skip).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

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


def run_cmd(args: list[str], cwd: str = ROOT, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run a project command; on failure the assertion shows its output. A one-process trainer run
    (`train_cmd(flags)`) that needs no real process runs in this process: same flags, environment and
    thread count, about 4 s of interpreter and import start-up saved per run."""
    if cwd == ROOT and _in_process_ok(args, env):
        proc = _run_trainer_here(args, env)
    else:
        proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


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
             f"--max_seq_len={seq}", "--val_ratio=0.1"])
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


# Seconds the longest tests took in one `make test` (2 xdist workers on 2 busy cores): by node id prefix, or
# for a whole module (the key ends with "::"; its tests share module fixtures and are handed out as one
# block). Only the order the tests are handed out in depends on these figures (_heavy_first), no result.
_HEAVY_S = {
    "tests/commands/test_gpu_report.py::test_cpu_dry_run": 85,
    "tests/model/test_compile_cold.py::test_inductor": 84,
    "tests/model/test_compile_cold.py::test_every": 82,
    "tests/model/test_attention.py::test_compiled_fullgraph_from_fresh": 72,
    "tests/model/test_model_on_triton.py::test_trainer_triton": 68,
    "tests/model/test_hf_interop_and_lora.py::test_compiled_model": 28,
    "tests/monitor/test_real_trainer.py::test_sigkill_the_ranks": 77,
    "tests/monitor/test_real_trainer.py::test_sigkill_during": 73,
    "tests/monitor/test_real_trainer.py::test_sigkill_at_random": 60,
    "tests/monitor/test_fault_injection.py::test_torchrun_hang": 30,
    "tests/trainer/test_spike_guard.py::test_reproducible": 69,
    "tests/trainer/test_spike_guard.py::test_one_off": 49,
    "tests/trainer/test_resume_topology.py::test_resume_at_another_layout_follows_the_uninterrupted_run[zero2": 69,
    "tests/trainer/test_resume_topology.py::test_resume_at_another_layout_follows_the_uninterrupted_run[pipeline": 66,
    "tests/trainer/test_resume_topology.py::test_resume_at_another_layout_follows_the_uninterrupted_run[fsdp": 59,
    "tests/trainer/test_resume_topology.py::test_resume_at_another_layout_follows_the_uninterrupted_run[ddp": 27,
    "tests/trainer/test_day_to_day.py::test_optimizer_state_resumes_across_layouts[unsharded": 68,
    "tests/trainer/test_day_to_day.py::test_dpo_under_fsdp": 51,
    "tests/trainer/test_day_to_day.py::test_fsdp_trains_like_ddp_and_resumes_exactly[2]": 48,
    "tests/trainer/test_day_to_day.py::test_fsdp_with_compile": 39,
    "tests/trainer/test_end_to_end.py::test_resume_is_exact[2proc-powersgd]": 67,
    "tests/trainer/test_end_to_end.py::test_resume_is_exact[2proc-zero1]": 43,
    "tests/trainer/test_end_to_end.py::test_zero_checkpoint_resumes": 44,
    "tests/trainer/test_end_to_end.py::test_powersgd_loss": 39,
    "tests/trainer/test_samples.py::test_two_ranks": 57,
    "tests/trainer/test_continued_pretraining.py::test_export_grown": 50,
    "tests/trainer/test_tensor_parallel_runs.py::test_tp2": 79,
    "tests/trainer/test_tensor_parallel_runs.py::test_layouts": 31,
    "tests/data_preprocess/test_dpo_pretokenized.py::test_trainer_reads": 54,
    "tests/parallel/test_ddp_compile.py::test_compiled_forward_waits": 28,
    "tests/parallel/test_fsdp_multinode.py::test_two_node": 40,
    "tests/parallel/test_tensor_parallel.py::": 262,
    "tests/trainer/test_pipeline_runs.py::": 189,
    "tests/parallel/test_pipeline.py::": 59,
    "tests/parallel/test_fsdp.py::": 52,
}


def _heavy_first(config, items: list) -> None:
    """Under pytest-xdist, hand the long tests out first, spread over the workers (`--dist worksteal` gives
    each worker a contiguous share of the list, then idle workers steal from the ends of the others'):
    a long test that starts last would otherwise end the run late. Tests that share a module-scoped
    fixture stay together (split over two workers, the fixture would be built twice); the other tests
    keep their order. Each worker computes the same order (xdist checks that they collected the same)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if workers < 2 or len(items) < 2 * workers:
        return
    module_of = [it.nodeid.split("::")[0] for it in items]
    # blocks of item indices with their estimated seconds: a whole module for a "module::" entry; else a
    # heavy test with every test of its module that shares one of its module fixtures
    taken: set[int] = set()
    blocks: list[tuple[float, list[int]]] = []
    for key, secs in _HEAVY_S.items():
        if key.endswith("::"):
            members = [i for i, m in enumerate(module_of) if m + "::" == key and i not in taken]
            if members:
                taken.update(members)
                blocks.append((secs, members))
    for i, it in enumerate(items):
        if i in taken:
            continue
        secs = max((s for k, s in _HEAVY_S.items() if not k.endswith("::") and it.nodeid.startswith(k)), default=0)
        if not secs:
            continue
        defs = getattr(getattr(it, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
        mod_fix = {n for n, d in defs.items() if d and d[-1].scope == "module"}
        members = [i] + [j for j, other in enumerate(items) if j != i and j not in taken and module_of[j] ==
                         module_of[i] and mod_fix & set(getattr(other, "fixturenames", ()))]
        taken.update(members)
        blocks.append((secs, sorted(members)))
    if not blocks:
        return
    # the shares xdist's worksteal scheduler hands out: len(pending) // workers_left, in turn
    sizes, left = [], len(items)
    for w in range(workers):
        sizes.append(left // (workers - w))
        left -= sizes[-1]
    heads: list[list[int]] = [[] for _ in range(workers)]
    load = [0.0] * workers
    for secs, b in sorted(blocks, key=lambda sb: -sb[0]):  # longest first, each to the least loaded share
        fits = [k for k in range(workers) if len(heads[k]) + len(b) <= sizes[k]]
        if not fits:
            return  # cannot place: leave the order as it is
        w = min(fits, key=lambda k: load[k])
        heads[w] += b
        load[w] += secs
    rest = iter(i for i in range(len(items)) if i not in taken)
    order: list[int] = []
    for w in range(workers):
        order += heads[w]
        order += [next(rest) for _ in range(sizes[w] - len(heads[w]))]
    items[:] = [items[i] for i in order]


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped without it (`make test-gpu` selects only them). Under
    pytest-xdist the long tests are handed out first (_heavy_first)."""
    if not (config.pluginmanager.hasplugin("randomly") and config.getoption("randomly_reorganize", default=False)):
        _heavy_first(config, items)  # not when pytest-randomly shuffles the order (`-p randomly`)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
