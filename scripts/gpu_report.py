r"""`make gpu-report`: the project's verdict on one CUDA GPU, in one markdown report, in one run of <= 9 minutes.

A GPU is lent rarely and briefly (15 minutes in all, start-up included), so the default run measures what
decides the goals first and the rest in the time the deadline leaves (`--full` runs every row and trainer
setting, ~24 min). The goals (one H100 or H200, bf16 unless named): best ours >= 1.15x torchtitan at 124M and 1B,
>= 1.5x HF compiled at 124M, MFU >= 50% at 124M and >= 60% at 1B (attention FLOPs counted whole, as
PaLM / nanoGPT; the tables print the causal-half MFU beside it), FP8 at 1B >= 1.25x our bf16 with a loss curve
that follows bf16's, 0 GPU test failures. The verdict:
  tests       `pytest -m gpu tests` (xdist workers when installed; each failure's reason printed as it
              happens), and beside it, while nothing is being timed: the bench stages' compiles run once
              to fill Inductor's on-disk caches (bench/bench_model_gpu.py --prewarm, three at a time, the
              first needed and longest first); the longest tests start first (tests/gpu_order.py)
  bench-124m  bench/bench_model_gpu.py, every row in its own process (VERDICT_BENCH_ROWS): ours as the trainer
              runs it (bf16 params + fp32 master) compiled, torchtitan with its own recipe, HF compiled (autocast
              = HF Trainer --bf16, gradients clipped at 1.0 as its Trainer does), HF + Liger-Kernel compiled,
              HF with bf16 weights in our engine, and ours without FlashAttention-4 (its A/B: where FA4 is
              installed `--fa4=auto`, the default, uses it)
  bench-1b    ours compiled, ours with FP8 tensorwise and rowwise (CURVE_STEPS timed steps each: the FP8 rows'
              loss curves against bf16's), torchtitan
then, in the time the deadline leaves:
  profile     torch.profiler over two back-to-back COMPILED trainer-precision steps of the 124m model (after
              3 steps): the top 15 kernels by self CUDA time and CUDA time by kind, per step (attention apart
              from matmuls; profiler annotations are not kernels), the device timeline's idle gaps, and what
              the speed goal leaves for the kernels this project writes (goal_budget: the step the strictest
              goal needs against the matmuls' and attention's time)
  train       train_my_ddp.py, 25 steps of the bench's 124M shape on the bundled corpus, --fused_kernels=auto,
              eager and --compile=true; tokens/s and MFU read from each run's metrics.jsonl, and their
              ratio to the bench rows of the same model, precision and mode
  optimizer   bench/bench_optimizer_gpu.py, the optimizer step's kernels (gradient norm, AdamW with fp32 and
              bf16 moments) at the 1B and 124M parameter shapes, ours beside torch's, with the bytes each
              moves and its GB/s
  kernels     bench/bench_kernels_gpu.py (each fused op alone, every implementation, eager and compiled:
              whether our kernels beat the references in the mode they run in), as far as the time goes
  profile-1b  the same profile of the 1B step (each kind's largest kernels)
  bench-ab    the A/B rows of choices no GPU has measured yet (AB_BENCH_ROWS), shown in the bench tables
              beside the rows they are compared with; a second call with `--only bench-ab` on the same
              --out-dir runs the rows the first did not measure

Output (--out-dir, default out/gpu_report): report.md, report.json (raw: every row, run, test) and
log.txt (every stage's output). Work files (data, runs, checkpoints) go to --work-dir (default
out/gpu_report_work), never to --out-dir. Running a part again merges into the report already in
--out-dir (bench rows by (config, model, precision, mode); other stages replaced);
`--merge A/report.json B/report.json` merges reports written by separate calls (no GPU needed).

    make gpu-report                       # the verdict: <= 9 min on one H100 (--deadline-s 540 by default)
    make gpu-report PART=tests            # one part: tests | bench | bench-124m | bench-1b | train | profile |
                                          #   optimizer | kernels | profile-1b | bench-ab
    python scripts/gpu_report.py --full   # every row and four trainer runs (~24 min: split it over calls)
    python scripts/gpu_report.py --dry-run-cpu                 # every stage at tiny size on CPU (plumbing)
    python scripts/gpu_report.py --dry-run-cpu --dry-compile=off   # the same without Inductor (faster)

Without CUDA (and without --dry-run-cpu / --merge) it prints one line saying so and exits 0.

On a device lent for minutes (each call may start from a bare machine with an empty $OUT): `make gpu-wheels`
here first (the extras as carried wheels, .whl/: docs/benchmarks.md), then one call of the device tool with
carry [".whl"] and timeout_s 600:
    PYTHONUNBUFFERED=1 python3 scripts/gpu_report.py --wheels .whl --out-dir $OUT/r --work-dir /tmp/grw \
        --deadline-s 570 --git-rev REV
(REV: `git rev-parse --short HEAD` here: the device's copy of the tree may have no .git). --deadline-s ends
the last stage in time to write the report (the report is rewritten after every stage: a call killed at its
limit still returns what ran). A lent GPU's 15 minutes hold one such call and its start-up, not two. `--full` splits over calls with --only, and the reports merge
here with --merge. Two calls on one warm machine can share one report: give both `--out-dir /tmp/grr` (it
stays on the machine between calls) and copy it under $OUT after each (`cp -r /tmp/grr $OUT/r`); the second
(`--only bench-ab,kernels`) then leaves out the A/B rows the first measured.
"""
from __future__ import annotations

import argparse
import importlib.util
import datetime
import functools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import xml.etree.ElementTree as ET
from typing import Any, Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from utils.checkpoint_layout import checkpoint_root  # noqa: E402
from scripts.corpus_slice import write_corpus_slice  # noqa: E402
from utils.publish import atomic_write_text  # noqa: E402
from utils.proc_tree import become_subreaper, command_line, kill_tree, process_table  # noqa: E402
STAGES = ("tests", "bench-124m", "bench-1b", "profile", "train", "optimizer", "kernels", "profile-1b", "bench-ab")
VERDICT_STAGES = ("tests", "bench-124m", "bench-1b")  # what decides the goals; the others run in the time left
PARTS = {"tests": ["tests"], "bench": ["bench-124m", "bench-1b"], "bench-124m": ["bench-124m"],
         "bench-1b": ["bench-1b"], "train": ["train"], "profile": ["profile", "profile-1b"],
         "profile-1b": ["profile-1b"], "bench-ab": ["bench-ab"], "optimizer": ["optimizer"], "kernels": ["kernels"],
         "all": list(STAGES)}
# the verdict (default): what decides the goals, in one device call of <= 9 minutes on one H100.
# The stage budgets, from what the stages took in `make gpu-report` calls on an H100 and an H200: a bench row
# 25-36 s when its compile is in the cache (process start, imports, build, compile from the cache, steps), +30-45 s
# cold (FP8 at 1B: > 87 s cold on an H200); the tests run on 6 workers (xdist_args), and their 50 tests took
# 107 s (the prewarm beside them, which gets the tests' time less 15 s), hence 120 s. bench-124m has six rows
# (~200 s warm), bench-1b four, three of them with CURVE_STEPS timed steps (~85 ms a step at 1B: +17 s each).
# The trainer runs (the trainer was 1.04x its bench row on an H200) and the profiles decide no goal: they run
# after the verdict, in what the deadline leaves, as do the optimizer's and the kernels' benches and bench-ab.
TIMEOUTS = {"tests": 120, "bench-124m": 210, "bench-1b": 200, "train": 105, "profile": 30, "profile-1b": 45,
            "bench-ab": 150, "optimizer": 45, "kernels": 40}
FULL_TIMEOUTS = {"tests": 280, "bench-124m": 380, "bench-1b": 330, "train": 360, "profile": 90, "profile-1b": 120,
                 "bench-ab": 300, "optimizer": 120, "kernels": 120}  # --full: 35 min
# the bench rows that decide the goals, per config, in the order they run (a row the stage's budget does not reach
# is "not run"): ours as the trainer runs it compiled (with FlashAttention-4 where it is installed), torchtitan with
# its own recipe on one GPU (TITAN_ROW, bench/titan_peer.py: torchtitan 0.2.2, the newest that imports on the GPU
# image's torch 2.11; bf16 autocast over fp32 parameters, causal SDPA, per-block and loss compile, fused AdamW,
# clipping at 1.0), HF compiled (the 1.5x goal's peer), HF + Liger-Kernel compiled (its fused linear-CE failed
# under compile with torch 2.11 in an earlier pass: the row then says why), HF with bf16 weights in our engine,
# and ours without FA4 (the A/B that decides whether `auto` keeps FA4; "not installed" without it, in no time).
# At 1B: ours, ours with FP8 tensorwise and rowwise (each CURVE_STEPS timed steps, their loss curves against
# bf16's), torchtitan. Left out of the verdict: HF at 1B (no goal compares with it; in bench-ab), our references
# compiled, ours with CUDA graphs at 124M (compile-cg; 1% over plain compile on an H200: 485,292 vs 480,157
# tokens/s); ask with e.g. `--bench-rows "124m=ours:trainer:compile-cg,ours-concat:trainer:compile"`.
TITAN_ROW = "titan:titan:compile"
VERDICT_BENCH_ROWS = {
    "bench-124m": f"ours:trainer:compile,{TITAN_ROW},hf:autocast:compile,hf-liger:autocast:compile,"
                  "hf:trainer:compile,ours-nofa4:trainer:compile",
    "bench-1b": f"ours:trainer:compile,ours-fp8:trainer:compile,ours-fp8r:trainer:compile,{TITAN_ROW}",
}
CURVE_STEPS = 200  # timed steps of the 1B bf16 and FP8 rows: the FP8 loss curves' length (the issue's 200 steps)
# bench-ab: after the verdict, in the time the deadline leaves, the A/B rows of choices no GPU has measured yet
# (config:model:precision:mode, in priority order; a row that does not fit is "not run"). Their rows join the
# bench tables, beside the verdict's `ours` rows they are compared with (bench/bench_model_gpu.py's ratios).
# Measured and so left out: at 124M ours-gradbuf (ours 1.02x), ours-tce and compile-cg (ties; H100),
# ours-fp8 (0.94x of ours-sync; H200); on an H200 ours-sync at 124M (ours 1.01x), ours-bf16m (1.01x at both
# sizes: 98,671 vs 97,537 at 1B) and ours-gradbuf at 1B (ours 1.03x) (docs/benchmarks.md). In order: FA4's A/B at
# 1B (attention is a smaller part of the 1B step, 9.7 of 82 ms, than of the 124M one); ours at 1B with CUDA graphs
# (compile-cg, never measured at 1B: the device sat idle 1.66 ms of the 1B step in gaps between kernels, what CUDA
# graphs remove); the optimizer off the end of the 1B step (ours-overlap = --overlap_optim_step: each bucket's
# AdamW as its gradients are ready, clipped with the previous step's norm; AdamW and the norm were 7.5 of the 82 ms
# step's kernels); HF compiled at 1B (the second peer there); the Triton linear+CE with its softmax kernel in
# 4096-element tiles at 124M (ours-tce4k: the end-to-end side of the kernels stage's tile A/B); ours compiled with
# Inductor's coordinate-descent tuning (compile-cdt = --compile_tuning=true); last the Triton linear+CE under
# compile at 1B.
AB_BENCH_ROWS = ("1b:ours-nofa4:trainer:compile,1b:ours:trainer:compile-cg,1b:ours-overlap:trainer:compile,"
                 "1b:hf:autocast:compile,124m:ours-tce4k:trainer:compile,124m:ours:trainer:compile-cdt,"
                 "1b:ours-tce:trainer:compile")
DRY_AB_ROWS = "tiny:ours-gradbuf:trainer:eager"
DRY_TIMEOUTS = {"tests": 240, "bench-124m": 300, "bench-1b": 400, "train": 600, "profile": 240, "profile-1b": 240,
                "bench-ab": 300, "optimizer": 240, "kernels": 300}
REPORT_FORMAT = 1

# the trainer runs: (name, --fused_kernels, --compile)
FULL_TRAIN_RUNS = (("auto-eager", "auto", False), ("false-eager", "false", False),
                   ("auto-compile", "auto", True), ("false-compile", "false", True))
TRAIN_RUNS = (("auto-eager", "auto", False), ("auto-compile", "auto", True))  # the verdict's (--full: all four)
TRAIN_MODEL = dict(dim=768, n_layers=12, n_heads=12, vocab_size=32000, max_seq_len=1024, batch_size=16)
TRAIN_STEPS = 25  # the trainer leaves its first 2 steps out of its rate; the summary takes the last two thirds
DRY_TRAIN_MODEL = dict(dim=64, n_layers=2, n_heads=4, vocab_size=512, max_seq_len=64, batch_size=4)
DRY_TRAIN_STEPS = 4
# dry run: the bench stages run the CPU "tiny" config with a few rows each (one with compile)
DRY_BENCH = {"bench-124m": "ours:trainer:eager,hf:autocast:eager,hf-liger:autocast:eager",
             "bench-1b": "ours:trainer:compile"}
DRY_CURVE_STEPS = 20


# ------------------------------------------------------------------------------------------ helpers
def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


class Log:
    """Progress on stdout; every stage's output appended to log.txt."""

    def __init__(self, path: Optional[str]):
        self.path = path

    def __call__(self, msg: str, echo: bool = True) -> None:
        if echo:
            print(msg, flush=True)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(msg + "\n")


def stream_cmd(cmd: list[str], timeout: float, log: Log, prefix: str, env: Optional[dict] = None,
               cwd: str = ROOT, echo: bool = True) -> dict:
    """Run `cmd` in its own process group, echoing its output (prefixed; echo=False: to log.txt only) and
    keeping it; on timeout the whole tree is killed: its group and every descendant in a session of its own
    (the bench's prewarm starts each row so: killing the prewarm's group alone left its rows
    compiling and stepping on the GPU beside the next timed stage). Returns {rc, output, timed_out, seconds}."""
    t0 = time.perf_counter()
    log(f"{prefix}$ {' '.join(cmd)}  (timeout {timeout:.0f} s)")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd, env=env,
                         start_new_session=True, bufsize=1, errors="replace")
    lines: list[str] = []

    def pump() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            line = line.rstrip("\n")
            lines.append(line)
            log(f"{prefix}{line}", echo=echo)
    th = threading.Thread(target=pump, daemon=True)
    th.start()
    timed_out = False
    try:
        p.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(p.pid)
        p.wait()
        th.join(timeout=10)
        lines.append(f"killed after {timeout:.0f} s (timeout)")
        log(f"{prefix}{lines[-1]}")
    th.join(timeout=10)
    return {"rc": p.returncode, "output": "\n".join(lines), "timed_out": timed_out,
            "seconds": round(time.perf_counter() - t0, 1)}


def end_strays(log: Log, stage: str) -> list[str]:
    """Kill, with everything below it, each process a stage left running below this one: a command's
    orphan (main makes this process their subreaper, so an orphan of a killed or careless command is
    adopted here instead of vanishing under init), or a side command still running. The next stage's
    timing must share neither the GPU nor the CPUs with them. Returns "pid command" of each, for the
    report."""
    me = os.getpid()
    killed = []
    for pid, proc in sorted(process_table().items()):
        if proc.ppid != me or proc.state == "Z":  # (a zombie is dead already)
            continue
        cmd = command_line(pid) or "?"
        below = kill_tree(pid)
        killed.append(f"{pid} {cmd}" + (f" (+{len(below)} below it)" if below else ""))
    if killed:
        log(f"[gpu-report] stage {stage} left {len(killed)} process(es) running after it ended; killed: "
            + "; ".join(killed))
    return killed


def tail(text: str, n: int = 15) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()][-n:]


def child_env(dry_compile: str = "inductor") -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # see bench/bench_model_gpu.py's docstring
    # FlashAttention-4 compiles its kernels at a process's first call and keeps them only when asked: on disk, the
    # prewarm's and the tests' compiles serve every later bench row (each its own process)
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    if dry_compile == "off":
        env["TORCH_COMPILE_DISABLE"] = "1"
    return env


def cuda_available() -> bool:
    try:
        import torch
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch or a broken CUDA install: no GPU to report on
        return False


_META_SNIPPET = r"""
import json, platform, importlib.metadata as md
out = {"python": platform.python_version()}
def ver(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
for name in ("torch", "triton", "transformers", "liger-kernel", "flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels",
             "torchtitan", "torchao"):
    out[name] = ver(name)
import torch
out["cuda_runtime"] = torch.version.cuda
out["cuda_available"] = torch.cuda.is_available()
if out["cuda_available"]:
    p = torch.cuda.get_device_properties(0)
    out["gpu"] = p.name
    out["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
    out["capability"] = "sm_%d%d" % (p.major, p.minor)
    out["gpu_count"] = torch.cuda.device_count()
print(json.dumps(out))
"""


def collect_meta(args, env: dict) -> dict:
    """Versions, GPU, driver, git revision, date: in a subprocess, so this process never holds a CUDA context."""
    meta: dict[str, Any] = {"date": now(), "host": platform.node(), "argv": sys.argv[1:],
                            "dry_run_cpu": bool(args.dry_run_cpu)}
    try:
        r = subprocess.run([sys.executable, "-c", _META_SNIPPET], capture_output=True, text=True, timeout=120,
                           env=env, cwd=ROOT)
        meta.update(json.loads(r.stdout.strip().splitlines()[-1]))
    except Exception as e:  # noqa: BLE001
        meta["meta_error"] = str(e)[:200]
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            meta["nvidia_smi"] = r.stdout.strip().splitlines()[0] if r.stdout.strip() else r.stderr.strip()[:200]
            m = re.search(r"CUDA Version:\s*([\d.]+)", subprocess.run(["nvidia-smi"], capture_output=True,
                                                                      text=True, timeout=30).stdout)
            if m:
                meta["cuda_driver"] = m.group(1)
            meta["driver"] = meta["nvidia_smi"].split(",")[1].strip() if "," in meta["nvidia_smi"] else "?"
        except Exception as e:  # noqa: BLE001
            meta["nvidia_smi"] = f"failed: {e}"[:200]
    meta["git"] = args.git_rev or git_revision()
    meta["triton_default_fp_fusion"] = env.get("TRITON_DEFAULT_FP_FUSION")
    meta["tf32"] = "on in the bench and profile (torch.set_float32_matmul_precision('high'), cudnn.allow_tf32)"
    if args.dry_run_cpu:
        meta["gpu"] = "none (CPU dry run)"
        meta["dry_compile"] = args.dry_compile
    return meta


def install_wheels(args, log: Log) -> dict:
    """The extras carried as wheels (scripts/gpu_wheels.py; `make gpu-wheels` fills .whl): installed into
    --work-dir/site before anything is measured (seconds) and put on PYTHONPATH for this process and every command
    it starts (child_env copies os.environ). A failed install is logged and shown in the header; the stages then
    run without the extras. Returns the header's "extras" entry ({} when no wheels are given)."""
    src = args.wheels
    if src is None:  # a GPU run takes .whl when it is there; a dry run installs only what it is given
        src = os.path.join(ROOT, ".whl") if not args.dry_run_cpu and os.path.isdir(os.path.join(ROOT, ".whl")) else ""
    if not src or src == "none":
        return {}
    from scripts import gpu_wheels
    try:
        res = gpu_wheels.install(os.path.abspath(src), os.path.join(args.work_dir, "site"), log=log,
                                 imports=gpu_wheels.CHECK_IMPORTS)
    except gpu_wheels.WheelsError as e:
        log(f"[gpu-report] install: gpu-wheels: {e}")
        return {"extras": f"install failed: {e}"[:300]}
    log(f"[gpu-report] install: {gpu_wheels.summary_line(res)}")
    old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(res["pythonpath"] + old)
    sys.path[1:1] = res["pythonpath"]
    return {"extras": f"{len(res['packages'])} from {os.path.relpath(os.path.abspath(src), ROOT)}, installed in "
                      f"{res['seconds']:.1f} s: " + ", ".join(res["packages"]) +
                      f"; imports: {gpu_wheels.imports_text(res)}"}


def git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                             timeout=20).stdout.strip()
        if not rev:
            return "unknown (no git repository here: pass --git-rev)"
        dirty = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=ROOT, timeout=60).stdout.strip()
        return rev + (f" + {len(dirty.splitlines())} modified files" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown (pass --git-rev)"


# ------------------------------------------------------------------------------------------ stages
class Ctx:
    def __init__(self, args, log: Log, env: dict):
        self.args, self.log, self.env = args, log, env
        self.py = sys.executable
        self.dry = bool(args.dry_run_cpu)
        self.device = "cpu" if self.dry else "cuda"
        self.work = args.work_dir
        self.timeout = 0.0  # of the stage being run
        self.deadline = 0.0  # perf_counter() by which the stage must end
        self.names: list[str] = []  # the stages this invocation runs
        self.supervise = False  # end what a stage left running (end_strays): the command line's run only
        self.measured: set = set()  # row keys (_row_key) measured by an earlier call whose report this one resumes


def _side_work(ctx: Ctx) -> tuple[list[threading.Thread], dict]:
    """While the GPU tests run (no timing then): fill Inductor's caches with the later stages' compiles
    (bench/bench_model_gpu.py --prewarm, PREWARM_PARALLEL rows at a time, PREWARM_FIRST first: a cold 124M/1B
    compile took most of a bench row), prepare the trainer runs' data and compile the compiled trainer run's
    graphs. Threads; their results land in the returned dict."""
    out: dict = {}
    threads = []
    later = set(ctx.names)
    if not ctx.dry and later & {"bench-124m", "bench-1b", "profile", "train"}:
        configs = [c for c in ("124m", "1b") if f"bench-{c}" in later or (c == "124m" and later & {"profile", "train"})]
        rows = prewarm_rows_spec(ctx.args, configs)
        if rows and "bench-ab" in later:  # after the verdict's rows: the A/B rows, where the prewarm gets to them
            rows += "," + ",".join(r for r in AB_BENCH_ROWS.split(",") if r.split(":")[0] in configs)
        rows = prewarm_order(rows)

        def prewarm() -> None:
            out_json = os.path.join(ctx.work, "prewarm.json")
            cmd = [ctx.py, "bench/bench_model_gpu.py", "--prewarm", "--parallel", str(PREWARM_PARALLEL),
                   "--configs", ",".join(configs),
                   "--device", ctx.device, "--json-out", out_json, "--budget-s", str(int(ctx.timeout - 15))]
            # (the stage waits for it until its own end, tests done or not; a row still compiling at the budget's
            # end is killed, the graphs it finished stay in the cache)
            if rows:
                cmd += ["--rows", rows]
            r = stream_cmd(cmd, max(10.0, ctx.deadline - time.perf_counter() - 5), ctx.log, "[prewarm] ", env=ctx.env)
            out["prewarm"] = {"rc": r["rc"], "seconds": r["seconds"], "timed_out": r["timed_out"]}
            if os.path.exists(out_json):
                out["prewarm"]["rows"] = load_json(out_json).get("prewarm", [])
        threads.append(threading.Thread(target=prewarm, daemon=True))
    if not ctx.dry and "kernels" in later and not ctx.args.deadline_s:
        # (only without a deadline: under one the kernels stage gets what is left after the optimizer's (~40 s on an
        # H200), and this prewarm took 63 s of the CPUs the model rows' prewarm compiles on; its eager
        # rows, the mode our Triton kernels run in, need no compile)
        def kernels() -> None:  # the per-op bench's small graphs, compiled once into the caches
            cmd = [ctx.py, "bench/bench_kernels_gpu.py", "--device", ctx.device, "--iters", "1", "--warmup", "0"]
            r = stream_cmd(cmd, max(10.0, ctx.deadline - time.perf_counter() - 5), ctx.log, "[prewarm kernels] ",
                           env=ctx.env, echo=False)
            out["prewarm_kernels"] = {"rc": r["rc"], "seconds": r["seconds"], "timed_out": r["timed_out"]}
        threads.append(threading.Thread(target=kernels, daemon=True))
    if "train" in later and not ctx.args.deadline_s:  # (under a deadline the train stage runs after the verdict,
        # if at all: its data and compile would take CPU time from the prewarm of the verdict's rows)
        def data() -> None:
            try:
                model = DRY_TRAIN_MODEL if ctx.dry else TRAIN_MODEL
                out["train_data"] = prepare_data(ctx, model["max_seq_len"])
            except Exception as e:  # noqa: BLE001 - the train stage tries again and reports it
                out["train_data"] = {"error": str(e)[:300]}
                return
            # the compiled trainer run's graphs into the cache (cold, its first step compiled for 29 s of the train
            # stage's 90: the trainer's graph is not the bench's); 2 steps, nothing measured
            for name, fused, compile_ in TRAIN_RUNS:
                if compile_:
                    warm_dir = os.path.join(ctx.work, "train-prewarm")
                    shutil.rmtree(warm_dir, ignore_errors=True)
                    cmd = train_cmd(ctx, out["train_data"], model, warm_dir, fused, compile_, steps=2)
                    r = stream_cmd(cmd, max(10.0, ctx.deadline - time.perf_counter() - 5), ctx.log,
                                   f"[prewarm train {name}] ", env=ctx.env, echo=False)
                    out["prewarm_train"] = {"rc": r["rc"], "seconds": r["seconds"], "timed_out": r["timed_out"]}
                    shutil.rmtree(warm_dir, ignore_errors=True)
        threads.append(threading.Thread(target=data, daemon=True))
    for t in threads:
        t.start()
    return threads, out


# The prewarm's rows, PREWARM_PARALLEL at a time, in this order first (the rest as listed). On an H100 two at a
# time in config order compiled only the 124M rows before the tests stage ended, and the 1B rows then compiled cold
# inside their timed stage; three at a time on an H200 took 53, 71, 61 s each. So: the 124M `ours` row (the first
# timed row), the longest cold compile (FP8 at 1B: > 87 s), torchtitan at 124M (its per-block compile is a graph
# of its own), rowwise FP8 at 1B, HF at 124M, ours at 1B, torchtitan at 1B; then the rest of the verdict's rows
# and the A/B rows, as far as the time goes. Peak memory of 124M rows ~7-11 GiB, of 1B rows ~21-23 GiB: at most
# ~70 GiB at once, beside the GPU tests (the largest, the real-size loss tests, a few GiB each) on an 80 GiB H100.
PREWARM_FIRST = ("124m:ours:trainer:compile", "1b:ours-fp8:trainer:compile", f"124m:{TITAN_ROW}",
                 "1b:ours-fp8r:trainer:compile", "124m:hf:autocast:compile", "1b:ours:trainer:compile",
                 f"1b:{TITAN_ROW}")
PREWARM_PARALLEL = 3


def prewarm_order(rows: str) -> str:
    """`rows` (config:model:precision:mode,...) with PREWARM_FIRST's rows first, in its order; "" stays ""."""
    listed = [r for r in rows.split(",") if r]
    first = [r for r in PREWARM_FIRST if r in listed]
    return ",".join(first + [r for r in listed if r not in first])


def prewarm_rows_spec(args, configs: list[str]) -> str:
    """The --rows of the prewarm: each config's own rows as config:model:precision:mode (the stages' rows, not
    every row at every config); "" (the whole matrix) with --full and no --bench-rows."""
    per_config = [bench_rows_for(args.bench_rows, f"bench-{c}") or
                  ("" if args.full else VERDICT_BENCH_ROWS[f"bench-{c}"]) for c in configs]
    if "" in per_config:
        return ""
    return ",".join(f"{c}:{r}" for c, rs in zip(configs, per_config) for r in rs.split(","))


def bench_rows_for(spec: str, stage: str) -> str:
    """--bench-rows for one bench stage: "ROWS" (every config) or "124m=ROWS;1b=ROWS" (a config left out: its
    default rows); ROWS = model:precision:mode,..."""
    if "=" not in spec:
        return spec
    per = dict(part.split("=", 1) for part in filter(None, spec.split(";")))
    unknown = set(per) - {s.removeprefix("bench-") for s in STAGES if s.startswith("bench-")}
    if unknown:
        raise SystemExit(f"gpu_report: --bench-rows: unknown config(s) {sorted(unknown)}")
    return per.get(stage.removeprefix("bench-"), "")


def xdist_args() -> list[str]:
    """pytest-xdist's arguments for the GPU tests: 6 workers (16 cores on the lent machines; 4 took 116-119 s,
    the longest test alone ~59 s) sharing the tests out as they free up (worksteal, xdist >= 3.2; else xdist's
    default); none without xdist."""
    if importlib.util.find_spec("xdist") is None:
        return []
    try:
        import importlib.metadata as md
        version = tuple(int(x) for x in md.version("pytest-xdist").split(".")[:2])
    except Exception:  # noqa: BLE001 - an unreadable version: the default distribution
        version = (0, 0)
    return ["-n", "6"] + (["--dist", "worksteal"] if version >= (3, 2) else [])


def stage_tests(ctx: Ctx) -> dict:
    """pytest -m gpu (xdist workers when pytest-xdist is there), each failure's reason printed the moment it
    happens (MYLLM_FAILURES_NOW=1, tests/conftest.py); per-test outcomes from the -v lines (kept even when
    the stage is killed) and the junit XML when pytest finishes. Beside it: `_side_work`."""
    threads, side = _side_work(ctx)
    junit = os.path.join(ctx.work, "tests_junit.xml")
    if os.path.exists(junit):
        os.remove(junit)
    target = ["tests/model/test_gpu.py"] if ctx.dry else ["tests"]
    workers = [] if ctx.dry else xdist_args()
    cmd = [ctx.py, "-m", "pytest", "-v", *workers, "-m", "gpu", *target, f"--junitxml={junit}", "-rfE",
           "--durations=10", "-p", "no:cacheprovider"]
    r = stream_cmd(cmd, ctx.timeout, ctx.log, "[tests] ", env=dict(ctx.env, MYLLM_FAILURES_NOW="1"))
    for t in threads:  # the side work ends by the stage's deadline (its commands carry their own timeouts)
        t.join(max(0.0, ctx.deadline - time.perf_counter()))
    tests: dict[str, dict] = {}
    for m in re.finditer(r"^(tests/\S+::\S+)\s+(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)", r["output"], re.M):
        tests[m.group(1)] = {"outcome": m.group(2).lower()}
    # xdist's -v lines: "[gw0] [ 12%] PASSED tests/...::name"
    for m in re.finditer(r"^\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+::\S+)",
                         r["output"], re.M):
        tests[m.group(2)] = {"outcome": m.group(1).lower()}
    if os.path.exists(junit):
        for tc in ET.parse(junit).getroot().iter("testcase"):
            cls = tc.get("classname", "").replace(".", "/")
            name = f"{cls}.py::{tc.get('name')}"
            t = tests.setdefault(name, {})
            t["seconds"] = round(float(tc.get("time") or 0), 2)
            for kind in ("failure", "error", "skipped"):
                el = tc.find(kind)
                if el is not None:
                    t["outcome"] = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                    t["message"] = (el.get("message") or el.text or "").strip().splitlines()[0][:300] \
                        if (el.get("message") or el.text) else ""
                    break
            else:
                t.setdefault("outcome", "passed")
    for m in re.finditer(r"^(FAILED|ERROR) (tests/\S+::\S+)(?: - (.*))?$", r["output"], re.M):
        t = tests.setdefault(m.group(2), {"outcome": m.group(1).lower()})
        if m.group(3) and not t.get("message"):
            t["message"] = m.group(3)[:300]
    counts: dict[str, int] = {}
    for t in tests.values():
        o = {"failure": "failed"}.get(t.get("outcome", "?"), t.get("outcome", "?"))
        counts[o] = counts.get(o, 0) + 1
    summary = next((ln for ln in reversed(r["output"].splitlines())
                    if re.search(r"\d+ (passed|failed|skipped|error)", ln)), "")
    ok = r["rc"] == 0 and not r["timed_out"]
    status = "ok" if ok else ("timed out" if r["timed_out"] else "failed")
    note = ""
    # pytest's last line ("49 passed, 2 skipped in 104.28s") came, then the stage's time ran out while the
    # process exited (xdist's workers, CUDA teardown; seen at 104 s of 110): every outcome is in
    if r["timed_out"] and re.search(r"\bin [\d.]+s\b", summary):
        ok = not (counts.get("failed") or counts.get("error"))
        status = "ok" if ok else "failed"
        note = "pytest printed its summary; the process was still exiting when the stage's time ran out"
    out = {"status": status, "rc": r["rc"], "cmd": " ".join(cmd),
           "data": {"counts": counts, "tests": tests, "summary": summary.strip("= "), "side": side},
           "error_tail": [] if ok else tail(r["output"], 25)}
    if note:
        out["note"] = note
    return out


def _bench_stage(ctx: Ctx, name: str, configs: str = "", rows: Optional[str] = None, curve_steps: int = 0) -> dict:
    """One bench/bench_model_gpu.py call: `configs` (default: the stage's own) and `rows` (default: --bench-rows
    or the verdict's / the dry run's rows for the stage); curve_steps: timed steps of the rows whose loss curves
    are compared (bf16 and FP8 ours), the others keep the bench's default."""
    config = "tiny" if ctx.dry else configs or name.split("-", 1)[1]
    out_json = os.path.join(ctx.work, f"{name}.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = [ctx.py, "bench/bench_model_gpu.py", "--configs", config, "--device", ctx.device,
           "--json-out", out_json, "--budget-s", str(max(10, int(ctx.timeout - 15))),
           "--timeout", str(int(ctx.args.bench_row_timeout))]
    if rows is None:
        rows = bench_rows_for(ctx.args.bench_rows, name) or (DRY_BENCH[name] if ctx.dry else "" if ctx.args.full
                                                             else VERDICT_BENCH_ROWS[name])
    if rows:
        cmd += ["--rows", rows]
    if ctx.dry:
        cmd += ["--steps", "2", "--warmup", "1"]
    if curve_steps:
        cmd += ["--curve-steps", str(curve_steps)]
    r = stream_cmd(cmd, ctx.timeout, ctx.log, f"[{name}] ", env=ctx.env)
    data: dict[str, Any] = {"meta": {}, "rows": []}
    if os.path.exists(out_json):
        with open(out_json, encoding="utf-8") as f:
            data = json.load(f)
    data.pop("tables", None)  # re-rendered from the merged rows
    measured = [x for x in data.get("rows", []) if "tokens_per_s" in x]
    failed_rows = [x for x in data.get("rows", []) if "error" in x]
    ok = r["rc"] == 0 and not r["timed_out"] and data.get("done")
    status = "ok" if ok and not failed_rows else ("timed out" if r["timed_out"] else
                                                  "partial" if measured else "failed")
    return {"status": status, "rc": r["rc"], "cmd": " ".join(cmd), "data": data,
            "error_tail": [] if ok else tail(r["output"], 25)}


def stage_bench_124m(ctx: Ctx) -> dict:
    return _bench_stage(ctx, "bench-124m")


def stage_bench_1b(ctx: Ctx) -> dict:
    return _bench_stage(ctx, "bench-1b", curve_steps=DRY_CURVE_STEPS if ctx.dry else CURVE_STEPS)


def ab_rows_left(rows: str, measured: set) -> str:
    """The A/B rows (config:model:precision:mode,...) an earlier call of the report being resumed has not measured:
    a second call on the same --out-dir goes on where the first one's time ran out."""
    return ",".join(r for r in rows.split(",") if r and tuple(r.split(":")) not in measured)


def stage_bench_ab(ctx: Ctx) -> dict:
    """The A/B rows (AB_BENCH_ROWS) in the time left, those a resumed report measured left out: each beside the
    verdict's row it is compared with."""
    planned = DRY_AB_ROWS if ctx.dry else AB_BENCH_ROWS
    rows = ab_rows_left(planned, ctx.measured)
    done = [r for r in planned.split(",") if r not in rows.split(",")]
    if done:
        ctx.log(f"[bench-ab] measured by an earlier call of this report, not run again: {', '.join(done)}")
    if not rows:
        return {"status": "ok", "rc": 0, "cmd": "", "data": {"meta": {}, "rows": []}, "error_tail": []}
    return _bench_stage(ctx, "bench-ab", configs="124m,1b", rows=rows)


def prepare_data(ctx: Ctx, seq: int) -> dict:
    """{tokenizer_dir, data_dir}: demo_out/'s tokenizer and shards when `make demo` made them (an index for
    `seq` is added), else a tokenizer + shards of the bundled corpus built once under the work dir (the
    dry run: a slice of it, like tests/conftest.py)."""
    demo_tok, demo_shards = os.path.join(ROOT, "demo_out", "tokenizer"), os.path.join(ROOT, "demo_out", "pretok")
    if not ctx.dry and os.path.isfile(os.path.join(demo_tok, "tokenizer_meta.json")) and os.path.isdir(demo_shards):
        tok, shards = demo_tok, demo_shards
        source = "demo_out/ (make demo)"
    else:
        base = os.path.join(ctx.work, "data_dry" if ctx.dry else "data")
        tok, shards = os.path.join(base, "tokenizer"), os.path.join(base, "shards")
        source = f"the bundled corpus{' (a slice)' if ctx.dry else ''}, prepared in {base}"
        if not os.path.isfile(os.path.join(base, "ready")):
            shutil.rmtree(base, ignore_errors=True)
            corpus = os.path.join(ROOT, "data", "pretrain")
            if ctx.dry:
                corpus = write_corpus_slice(os.path.join(base, "corpus"))
            vocab = 384 if ctx.dry else 2048
            for cmd in ([ctx.py, "-m", "tokenizer.train_tokenizer", f"--data_dir={corpus}", f"--output_dir={tok}",
                         f"--vocab_size={vocab}", "--tokenizer_type=hf_bbpe", "--overwrite=true"],
                        [ctx.py, "-m", "data_preprocess.pretokenize_pretrain_data", f"--data_dir={corpus}",
                         f"--tokenizer_dir={tok}", f"--output_dir={shards}", "--num_workers=2", "--no_progress"]):
                r = stream_cmd(cmd, max(30.0, ctx.deadline - time.perf_counter()), ctx.log, "[train/data] ",
                               env=ctx.env)
                if r["rc"] != 0:
                    raise RuntimeError(f"data preparation failed: {' '.join(cmd[:3])}: "
                                       + " | ".join(tail(r["output"], 5)))
            with open(os.path.join(base, "ready"), "w") as f:
                f.write(now())
    if not os.path.isfile(os.path.join(shards, f"index_L{seq}", "index_meta.json")):
        cmd = [ctx.py, "-m", "data_preprocess.build_pretrain_sample_index_map", f"--data_dir={shards}",
               f"--max_seq_len={seq}", "--val_ratio=0.05"]
        r = stream_cmd(cmd, max(30.0, ctx.deadline - time.perf_counter()), ctx.log, "[train/data] ", env=ctx.env)
        if r["rc"] != 0:
            raise RuntimeError("building the sample index failed: " + " | ".join(tail(r["output"], 5)))
    return {"tokenizer_dir": tok, "data_dir": shards, "source": source}


def summarize_metrics(path: str, tokens_per_step: int) -> dict:
    """tokens/s and MFU of a trainer run from its metrics.jsonl: the median per-step rate over the steps
    after the first third (compile and warm-up excluded), the trainer's own 20-step window at the last
    step, and the first step's seconds (for --compile: the compile)."""
    recs = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss" in r and "tokens_per_sec" in r:
                recs.append(r)
    if not recs:
        return {}
    n = len(recs)
    steady = [r["tokens_per_sec"] for r in recs[n // 3:]] or [recs[-1]["tokens_per_sec"]]
    med = statistics.median(steady)
    last = recs[-1]
    out = {"steps": n, "tokens_per_s_median": round(med),
           "tokens_per_s_window": round(last.get("tokens_per_sec_avg", 0)),
           "mfu_window": last.get("mfu"), "mfu_is_estimate": last.get("mfu_is_estimate"),
           "first_step_s": round(tokens_per_step / recs[0]["tokens_per_sec"], 2) if recs[0]["tokens_per_sec"] else None,
           "loss_first": round(recs[0]["loss"], 4), "loss_last": round(last["loss"], 4),
           "steady_from_step": recs[n // 3]["step"] if n > 1 else 1}
    win = last.get("tokens_per_sec_avg") or 0
    if out["mfu_window"] is not None and win:
        out["mfu_median"] = out["mfu_window"] * med / win  # the window's MFU rescaled to the median rate
    for k in ("mem_peak_mib", "rss_mib"):
        peaks = [r[k] for r in recs if k in r]
        if peaks:
            out[k] = round(max(peaks), 1)
    return out


def train_cmd(ctx: Ctx, data: dict, model: dict, out_dir: str, fused: str, compile_: bool, steps: int) -> list[str]:
    """One trainer run of the train stage (and its prewarm, beside the tests)."""
    cmd = [ctx.py, "train_my_ddp.py", f"--out_dir={out_dir}", f"--data_dir={data['data_dir']}",
           f"--tokenizer_dir={data['tokenizer_dir']}", *[f"--{k}={v}" for k, v in model.items()],
           f"--max_iters={steps}", "--dtype=bf16", f"--device={ctx.device}", f"--fused_kernels={fused}",
           f"--compile={str(compile_).lower()}", "--eval_interval=0", "--eval_iters=1",
           f"--log_interval={max(1, steps // 6)}", "--checkpoint_interval=100000", "--keep_last=1",
           "--warmup_iters=2", "--learning_rate=6e-4", "--progress=false", "--resume=never", "--seed=1337"]
    if ctx.dry:
        cmd.append("--peak_flops=1e11")  # no CPU peak measurement per run; MFU against a stated figure
    return cmd


def stage_train(ctx: Ctx) -> dict:
    model = DRY_TRAIN_MODEL if ctx.dry else TRAIN_MODEL
    steps = DRY_TRAIN_STEPS if ctx.dry else TRAIN_STEPS
    seq = model["max_seq_len"]
    data = prepare_data(ctx, seq)
    runs: list[dict] = []
    failed: list[str] = []
    train_runs = FULL_TRAIN_RUNS if ctx.args.full else TRAIN_RUNS
    for i, (name, fused, compile_) in enumerate(train_runs):
        out_dir = os.path.join(ctx.work, "train", name)
        shutil.rmtree(out_dir, ignore_errors=True)
        left = ctx.deadline - time.perf_counter()
        later = len(train_runs) - i - 1
        timeout = left - 20 * later  # leave each later run a chance to start and fail fast
        run: dict[str, Any] = {"name": name, "fused_kernels": fused, "compile": compile_}
        if timeout < 15:
            run["skipped"] = "not run: the stage's time was spent"
            runs.append(run)
            continue
        cmd = train_cmd(ctx, data, model, out_dir, fused, compile_, steps)
        r = stream_cmd(cmd, timeout, ctx.log, f"[train {name}] ", env=ctx.env)
        run.update(rc=r["rc"], wall_s=r["seconds"], cmd=" ".join(cmd))
        for prefix in ("[kernels]", "[model]"):
            line = next((ln for ln in r["output"].splitlines() if prefix in ln), "")
            run[prefix.strip("[]")] = line[line.find(prefix):][:400] if line else ""
        metrics = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(metrics):
            run.update(summarize_metrics(metrics, model["batch_size"] * seq))
        finished = "[train] done:" in r["output"]  # every step ran and was logged
        if r["timed_out"] and finished:  # seen once with --compile on an H100: no exit within the stage's time
            run["note"] = (f"did not exit within {timeout:.0f} s after its '[train] done' line (killed); "
                           "its steps are measured")
        elif r["rc"] != 0 or r["timed_out"]:
            run["error"] = f"timed out after {timeout:.0f} s" if r["timed_out"] else f"exit code {r['rc']}"
            run["error_tail"] = tail(r["output"], 15)
            failed.append(name)
        runs.append(run)
        shutil.rmtree(checkpoint_root(out_dir), ignore_errors=True)  # GBs at 124M; metrics stay
    measured = [r for r in runs if "tokens_per_s_median" in r and "error" not in r]
    status = "ok" if len(measured) == len(train_runs) else "partial" if measured else "failed"
    return {"status": status, "data": {"runs": runs, "data": data, "model": model, "steps": steps},
            "error_tail": [f"{r['name']}: {r.get('error')}: " + " | ".join(r.get("error_tail", [])[-3:])
                           for r in runs if "error" in r]}


def stage_profile(ctx: Ctx, config: str = "124m") -> dict:
    """Two compiled trainer-precision steps of `config` under torch.profiler (the dry run: tiny, eager)."""
    tag = "profile" if config == "124m" else f"profile-{config}"
    out_json = os.path.join(ctx.work, f"{tag}.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = [ctx.py, "bench/bench_model_gpu.py", "--profile", "tiny" if ctx.dry else config, "--device", ctx.device,
           "--json-out", out_json, "--profile-rows", "15", "--profile-mode", "eager" if ctx.dry else "compile"]
    r = stream_cmd(cmd, ctx.timeout, ctx.log, f"[{tag}] ", env=ctx.env)
    data = {}
    if os.path.exists(out_json):
        with open(out_json, encoding="utf-8") as f:
            data = json.load(f)
    # the JSON is written whole (atomically) after the profile: there, a timeout came while the process exited
    # (seen on an H200: the 124M profile's results printed, the process killed at the stage's 30 s)
    ok = bool(data) and (r["rc"] == 0 or r["timed_out"])
    out = {"status": "ok" if ok else ("timed out" if r["timed_out"] else "failed"), "rc": r["rc"],
           "cmd": " ".join(cmd), "data": data, "error_tail": [] if ok else tail(r["output"], 25)}
    if ok and r["timed_out"]:
        out["note"] = "its results were written; the process was still exiting when the stage's time ran out"
    return out


def _json_bench_stage(ctx: Ctx, name: str, script: str, args: list[str], dry_args: list[str], measured: str) -> dict:
    """One bench script that writes its rows to --json-out (`done` once finished): ok when it finished, else
    "timed out", "partial" (some rows have `measured`) or "failed", as the model bench stages say it."""
    out_json = os.path.join(ctx.work, f"{name}.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    cmd = [ctx.py, script, "--device", ctx.device, "--json-out", out_json] + args + (dry_args if ctx.dry else [])
    r = stream_cmd(cmd, ctx.timeout, ctx.log, f"[{name}] ", env=ctx.env)
    data = load_json(out_json) if os.path.exists(out_json) else {}
    ok = r["rc"] == 0 and bool(data.get("done"))
    some = any(measured in x for x in data.get("rows", []))
    return {"status": "ok" if ok else ("timed out" if r["timed_out"] else "partial" if some else "failed"),
            "rc": r["rc"], "cmd": " ".join(cmd), "data": data, "error_tail": [] if ok else tail(r["output"], 15)}


def stage_kernels(ctx: Ctx) -> dict:
    """bench/bench_kernels_gpu.py: each fused op, forward + backward, every implementation, eager and compiled."""
    return _json_bench_stage(ctx, "kernels", "bench/bench_kernels_gpu.py",
                             ["--budget-s", str(max(5, int(ctx.timeout - 15)))],
                             ["--configs", "tiny", "--iters", "2", "--warmup", "1"], measured="us")


def stage_optimizer(ctx: Ctx) -> dict:
    """bench/bench_optimizer_gpu.py: the optimizer step's kernels (gradient norm, AdamW) at the 1B and 124M
    models' parameter shapes, ours beside torch's."""
    return _json_bench_stage(ctx, "optimizer", "bench/bench_optimizer_gpu.py", [],
                             ["--configs", "tiny", "--iters", "1", "--warmup", "0"], measured="ms")


STAGE_FUNCS: dict[str, Callable[[Ctx], dict]] = {
    "tests": stage_tests, "bench-124m": stage_bench_124m, "bench-1b": stage_bench_1b, "bench-ab": stage_bench_ab,
    "train": stage_train, "profile": stage_profile, "profile-1b": lambda ctx: stage_profile(ctx, "1b"),
    "optimizer": stage_optimizer, "kernels": stage_kernels}


def run_stages(names: list[str], ctx: Ctx, timeouts: dict, deadline_s: float, run_index: int,
               on_done: Optional[Callable[[str, dict], None]] = None) -> dict:
    """Run the stages in order; each one's failure (or exception here) is recorded and the next runs.
    on_done(name, result) after each stage (main writes the report then: a killed call keeps what ran)."""
    results = {}
    t_start = time.perf_counter()
    for k, name in enumerate(names):
        left = deadline_s - (time.perf_counter() - t_start) - 10 if deadline_s else None
        timeout = float(timeouts[name]) if left is None else min(float(timeouts[name]), left)
        started = now()
        if left is not None and left < 20:
            results[name] = {"status": "not run", "error_tail": [f"not run: --deadline-s {deadline_s:.0f} reached"],
                             "seconds": 0, "started": started, "run": run_index}
            ctx.log(f"[gpu-report] stage {k + 1}/{len(names)} {name}: not run (deadline)")
            if on_done:
                on_done(name, results[name])
            continue
        ctx.log(f"[gpu-report] stage {k + 1}/{len(names)} {name} (timeout {timeout:.0f} s) started {started}")
        ctx.timeout = timeout
        ctx.deadline = time.perf_counter() + timeout
        t0 = time.perf_counter()
        try:
            res = STAGE_FUNCS[name](ctx)
        except Exception as e:  # noqa: BLE001 - the report's own code failing must not stop the other stages
            res = {"status": "failed", "data": {}, "error_tail": tail(traceback.format_exc(), 12) or [repr(e)]}
        strays = end_strays(ctx.log, name) if ctx.supervise else []
        if strays:
            res["strays_killed"] = strays
        res.update(seconds=round(time.perf_counter() - t0, 1), timeout_s=round(timeout), started=started,
                   run=run_index)
        if res.get("status") != "ok" and not res.get("error_tail"):
            res["error_tail"] = [f"{res.get('status')}, with no output"]
        results[name] = res
        ctx.log(f"[gpu-report] stage {name}: {res['status']} in {res['seconds']:.0f} s")
        if on_done:
            on_done(name, res)
    return results


# ------------------------------------------------------------------------------------------ merge
def _row_key(r: dict) -> tuple:
    return (r.get("config"), r.get("model"), r.get("precision"), r.get("mode"))


def merge_stage(old: Optional[dict], new: dict, name: str) -> dict:
    """A re-run stage replaces the old one; bench rows merge by key (a measured row is never replaced
    by one that was not run)."""
    if not old or not name.startswith("bench") or new.get("status") == "not run":
        return new if new.get("status") != "not run" or not old else old
    rows = {_row_key(r): r for r in old.get("data", {}).get("rows", [])}
    for r in new.get("data", {}).get("rows", []):
        k = _row_key(r)
        if k in rows and "tokens_per_s" in rows[k] and "tokens_per_s" not in r:
            continue
        rows[k] = r
    merged = dict(new)
    merged["data"] = dict(new.get("data", {}), rows=list(rows.values()))
    if not merged["data"].get("meta"):
        merged["data"]["meta"] = old.get("data", {}).get("meta", {})
    return merged


def merge_reports(base: dict, other: dict) -> dict:
    """Merge `other` (a report.json) into `base`: its runs are appended, its stages merged."""
    out = {"format": REPORT_FORMAT, "runs": list(base.get("runs", [])), "stages": dict(base.get("stages", {}))}
    offset = len(out["runs"])
    out["runs"] += other.get("runs", [])
    for name, st in other.get("stages", {}).items():
        st = dict(st, run=st.get("run", 0) + offset)
        out["stages"][name] = merge_stage(out["stages"].get(name), st, name)
    return out


# ------------------------------------------------------------------------------------------ render
@functools.lru_cache(maxsize=None)
def _bench_module(script: str = "bench/bench_model_gpu.py"):
    """A bench script (path from the repository root) loaded as a module, for its markdown tables and configs:
    once per process (the report is rendered after every stage, and reads the model bench up to three times)."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(script))[0],
                                                  os.path.join(ROOT, script))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def _fmt(v: Any, spec: str = "") -> str:
    if v is None or v == "":
        return "-"
    try:
        return format(v, spec) if spec else str(v)
    except (TypeError, ValueError):
        return str(v)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def render(report: dict) -> str:
    runs, stages = report.get("runs", []), report.get("stages", {})
    dry = any(r.get("dry_run_cpu") for r in runs)
    L = ["# GPU report", ""]
    if dry:
        L += ["**CPU DRY RUN**: every stage ran at tiny size on the CPU to check the report's plumbing. "
              "These numbers are not GPU measurements.", ""]
    L += [f"Written {now()} by `scripts/gpu_report.py`. Stages ran in {len(runs)} invocation(s):", ""]
    keys = [("date", "date"), ("gpu", "GPU"), ("capability", "compute capability"),
            ("gpu_memory_gib", "GPU memory GiB"), ("driver", "driver"), ("cuda_driver", "CUDA (driver)"),
            ("cuda_runtime", "CUDA (torch build)"), ("torch", "torch"), ("triton", "triton"),
            ("transformers", "transformers"), ("liger-kernel", "liger-kernel"), ("flash-attn-4", "flash-attn-4"),
            ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl"), ("quack-kernels", "quack-kernels"),
            ("torchtitan", "torchtitan"), ("torchao", "torchao"), ("extras", "carried wheels (--wheels)"), ("python", "python"),
            ("git", "git revision"), ("host", "host"), ("triton_default_fp_fusion", "TRITON_DEFAULT_FP_FUSION"),
            ("tf32", "TF32"), ("dry_compile", "dry run: compile"), ("seconds", "invocation wall s"),
            ("argv", "arguments")]
    L += ["| | " + " | ".join(f"invocation {i}" for i in range(len(runs))) + " |",
          "| --- |" + " --- |" * len(runs)]
    for k, label in keys:
        vals = [r.get(k) for r in runs]
        if all(v in (None, "") for v in vals):
            continue
        L.append(f"| {label} | " + " | ".join(_fmt(" ".join(v) if isinstance(v, list) else v) for v in vals) + " |")
    L += ["", "## Stages", "", "| stage | status | wall s | timeout s | invocation | started |",
          "| --- | --- | --- | --- | --- | --- |"]
    for name in STAGES:
        st = stages.get(name)
        if st is None:
            L.append(f"| {name} | not run yet | | | | |")
        else:
            status = st.get("status") + (f" ({st['note']})" if st.get("note") else "")
            L.append(f"| {name} | {status} | {_fmt(st.get('seconds'))} | {_fmt(st.get('timeout_s'))} | "
                     f"{_fmt(st.get('run'))} | {_fmt(st.get('started'))} |")
    total = sum(st.get("seconds", 0) or 0 for st in stages.values())
    L += ["", f"Sum of the stages' wall times: {total:.0f} s ({total / 60:.1f} min).", ""]
    for name in STAGES:
        strays = (stages.get(name) or {}).get("strays_killed")
        if strays:
            L += [f"**Stage {name} left {len(strays)} process(es) running after it ended** (killed then; a stage "
                  "timed while they ran shared the GPU and the CPUs with them): " +
                  "; ".join(f"`{x}`" for x in strays), ""]
    L += render_tests(stages.get("tests"))
    L += render_bench(stages.get("bench-124m"), stages.get("bench-1b"), stages.get("bench-ab"))
    L += render_train(stages.get("train"), stages.get("bench-124m"))
    bench_rows = [r for name in ("bench-124m", "bench-1b", "bench-ab")
                  for r in (stages.get(name) or {}).get("data", {}).get("rows", [])]
    L += render_profile(stages.get("profile"), stages.get("profile-1b"), bench_rows)
    L += render_optimizer(stages.get("optimizer"))
    L += render_kernels(stages.get("kernels"))
    L += render_failures(stages)
    return "\n".join(L) + "\n"


def _not_run(st: Optional[dict]) -> list[str]:
    if st is None:
        return ["Not run yet.", ""]
    return []


def render_tests(st: Optional[dict]) -> list[str]:
    L = ["## 1. GPU tests (`pytest -m gpu tests`, = `make test-gpu`)", ""] + _not_run(st)
    if st is None:
        return L
    d = st.get("data", {})
    counts = d.get("counts", {})
    L += [f"Status: {st.get('status')}, {st.get('seconds')} s. pytest: {d.get('summary') or '-'}"
          + (f" ({st['note']})" if st.get("note") else ""), "", "| outcome | tests |", "| --- | --- |"]
    for k in ("passed", "failed", "error", "skipped", "xfail", "xpass"):
        if k in counts or k in ("passed", "failed", "skipped"):
            L.append(f"| {k} | {counts.get(k, 0)} |")
    bad = [(n, t) for n, t in d.get("tests", {}).items() if t.get("outcome") in ("failed", "error")]
    if bad:
        L += ["", "| failed test | message |", "| --- | --- |"]
        L += [f"| `{n}` | {t.get('message', '').replace('|', '/')[:300]} |" for n, t in bad]
    slow = sorted(((n, t["seconds"]) for n, t in d.get("tests", {}).items() if t.get("seconds")),
                  key=lambda x: -x[1])[:10]
    if slow:
        L += ["", "| slowest tests | s |", "| --- | --- |"] + [f"| `{n}` | {s} |" for n, s in slow]
    return L + [""]


def render_bench(a: Optional[dict], b: Optional[dict], ab: Optional[dict] = None) -> list[str]:
    L = ["## 2. Benchmark (`bench/bench_model_gpu.py`, every row in its own process)", ""]
    if a is None and b is None and ab is None:
        return L + ["Not run yet.", ""]
    rows, meta = [], {}
    for name, st in (("bench-124m", a), ("bench-1b", b), ("bench-ab", ab)):
        if st is None and name == "bench-ab":
            continue
        if st is None:
            L.append(f"- {name}: not run yet")
            continue
        L.append(f"- {name}: {st.get('status')}, {st.get('seconds')} s")
        rows += st.get("data", {}).get("rows", [])
        meta = meta or st.get("data", {}).get("meta", {})
    L.append("")
    if meta:
        L += [f"Device {meta.get('device')}, torch {meta.get('torch')}; MFU against "
              f"{(meta.get('peak_table_flops') or 0) / 1e12:.4g} TFLOP/s ({meta.get('peak_table_source')}) and against "
              f"the measured bf16 matmul peak {(meta.get('peak_measured_flops') or 0) / 1e12:.4g} TFLOP/s; "
              f"{meta.get('steps')} timed steps after the first step, "
              + (f"one device sync per window of {meta['window']} steps, the median window's rate "
                 if meta.get("window") else "back to back with no device sync until the last, each timed by CUDA "
                 "events at the steps' ends (as the trainer times its steps), the median step "
                 if "window" in meta else "a device sync after each, the median step ")
              + f"(and {meta.get('warmup')} warm-up steps before them); "
              f"TF32 {'on' if meta.get('tf32') else 'n/a (CPU)'}; "
              f"TRITON_DEFAULT_FP_FUSION={meta.get('triton_default_fp_fusion')}. Precision "
              "\"bf16 params + fp32 master (trainer)\" is train_my_ddp.py --dtype=bf16's engine and optimizer "
              "(HF models inside the same engine: `hf` there is HF with bf16 weights); \"autocast (fp32 params)\" is "
              "HF Trainer's --bf16, gradients clipped to norm 1.0 as its Trainer does (torchtitan's row: its own "
              "recipe, see bench/titan_peer.py). MFU counts attention FLOPs whole (PaLM / nanoGPT: the goals' "
              "convention); the causal-half column counts what a causal kernel computes; FP8 rows have none.", ""]
    if rows:
        bench = _bench_module()
        peak_t = meta.get("peak_table_flops") or 989e12
        peak_m = meta.get("peak_measured_flops") or 0
        L += bench.markdown_tables(rows, peak_t, peak_m).splitlines()
        walls = [r.get("wall_s") for r in rows if r.get("wall_s")]
        L += ["", f"Row wall times (process start, build, compile, steps): {', '.join(f'{w:.0f}' for w in walls)} s."]
        parts = [r for r in rows if r.get("in_process_s") is not None and r.get("wall_s")]
        if parts:  # where a row's fixed cost goes: 124M rows took 25 s warm with 10 s in build + steps
            L += ["Of each row's wall time (s): imports and set-up before the build / build / first step / outside "
                  "the process (start-up, exit): " + "; ".join(
                      f"{r['config']} {r['model']} {r['mode']}: "
                      f"{_row_setup_s(r):.1f} / {r.get('build_s', 0):.1f} / {r.get('first_step_s', 0):.1f} / "
                      f"{r['wall_s'] - r['in_process_s']:.1f}" for r in parts) + "."]
    return L + [""]


def _row_setup_s(r: dict) -> float:
    """A bench row's seconds in its process outside the build, the first step, the warm-up and the timed steps:
    imports, CUDA start-up, the peak and memory queries."""
    steps = (r.get("step_ms") or 0) / 1e3 * (r.get("steps") or 0)
    return max(0.0, r["in_process_s"] - (r.get("build_s") or 0) - (r.get("first_step_s") or 0)
               - (r.get("warmup_s") or 0) - steps)


def render_train(st: Optional[dict], bench: Optional[dict] = None) -> list[str]:
    L = ["## 3. Trainer (`train_my_ddp.py`, bf16, tokens/s and MFU from metrics.jsonl)", ""] + _not_run(st)
    if st is None:
        return L
    d = st.get("data", {})
    m, data = d.get("model", {}), d.get("data", {})
    L += [f"Status: {st.get('status')}, {st.get('seconds')} s. {d.get('steps')} steps of "
          f"{', '.join(f'{k} {v}' for k, v in m.items())}; data: {data.get('source', '-')}. tokens/s: the median "
          "step over the steps after the first third (compile excluded) and the trainer's own 20-step window at "
          "the last step (device-timed; the process's first 2 steps are never in it); MFU at that median "
          "rate and the window's, against the trainer's peak (model/flops.py).", "",
          "| run | --fused_kernels | --compile | tokens/s (median) | tokens/s (window) | MFU (median) | MFU (window) | "
          "first step s (compile) | peak MiB | loss first -> last | wall s |",
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = {}
    for r in d.get("runs", []):
        by[r["name"]] = r
        if "tokens_per_s_median" not in r:
            why = r.get("skipped") or f"failed: {r.get('error', '?')}"
            L.append(f"| {r['name']} | {r['fused_kernels']} | {r['compile']} | {why} | | | | | | | "
                     f"{_fmt(r.get('wall_s'))} |")
            continue
        est = " (estimate)" if r.get("mfu_is_estimate") else ""
        mfu_m, mfu_w = (f"{v:.1%}{est}" if isinstance(v, (int, float)) else "-"
                        for v in (r.get("mfu_median"), r.get("mfu_window")))
        mem = r.get("mem_peak_mib", r.get("rss_mib"))
        err = f" (then failed: {r['error']})" if "error" in r else f" ({r['note']})" if r.get("note") else ""
        L.append(f"| {r['name']} | {r['fused_kernels']} | {r['compile']} | {r['tokens_per_s_median']:,}{err} | "
                 f"{r['tokens_per_s_window']:,} | {mfu_m} | {mfu_w} | {_fmt(r.get('first_step_s'))} | {_fmt(mem)} | "
                 f"{r.get('loss_first')} -> {r.get('loss_last')} | {_fmt(r.get('wall_s'))} |")
    tps = {n: r.get("tokens_per_s_median", 0) for n, r in by.items()}
    ratios = [f"| fused auto / false, eager | {_ratio(tps.get('auto-eager'), tps.get('false-eager'))} |",
          f"| fused auto / false, compile | {_ratio(tps.get('auto-compile'), tps.get('false-compile'))} |",
          f"| compile / eager, auto | {_ratio(tps.get('auto-compile'), tps.get('auto-eager'))} |",
          f"| compile / eager, false | {_ratio(tps.get('false-compile'), tps.get('false-eager'))} |"]
    wins = {n: r.get("tokens_per_s_window", 0) for n, r in by.items()}
    rows = {(r.get("model"), r.get("precision"), r.get("mode")): r.get("tokens_per_s", 0)
            for r in (bench or {}).get("data", {}).get("rows", []) if r.get("config") == "124m"}
    for mode in ("eager", "compile"):  # same model shape (TRAIN_MODEL = the bench's 124m), precision and mode
        b = rows.get(("ours", "trainer", mode))
        if b and f"auto-{mode}" in by:
            ratios.append(f"| trainer / bench row ours-trainer-{mode}, 124m (median; window) | "
                          f"{_ratio(tps.get(f'auto-{mode}'), b)}; {_ratio(wins.get(f'auto-{mode}'), b)} |")
    L += ["", "| ratio (median tokens/s) | value |", "| --- | --- |"] + [r for r in ratios if not r.endswith("| - |")]
    L.append("")
    kern = [(n, r.get("kernels")) for n, r in by.items() if r.get("kernels")]
    if kern:
        L += ["What each run chose (its `[kernels]` line):", ""] + [f"- {n}: `{k}`" for n, k in kern] + [""]
    return L


def render_profile(st: Optional[dict], st_1b: Optional[dict] = None, bench_rows: Optional[list] = None) -> list[str]:
    mode = (st or {}).get("data", {}).get("mode", "eager")
    n = (st or {}).get("data", {}).get("steps", 1)
    L = [f"## 4. Profile (`torch.profiler`, {n} back-to-back {mode} trainer step(s) of ours, after 3 warm-up steps;"
         " times per step)", ""] + _not_run(st)
    if st is not None:
        L += _profile_body(st) + goal_budget(st.get("data", {}), bench_rows or [])
    if st_1b is not None:  # in the time the deadline left (the stage `profile-1b`)
        L += ["### The 1B step", ""] + _profile_body(st_1b) + goal_budget(st_1b.get("data", {}), bench_rows or [])
    return L


# the speed goals per bench config: (peer models, ratio our best bf16 row must reach, compiled peer rows only)
GOALS = {"124m": ((("titan",), 1.15, False), (("hf", "hf-liger"), 1.5, True)),
         "1b": ((("titan",), 1.15, False),)}
FIXED_KINDS = ("matmul (cuBLAS / CUTLASS)", "attention (SDPA)")  # library kernels: cuBLAS, cuDNN / flash


def goal_budget(prof: dict, rows: list) -> list[str]:
    """What the strictest speed goal leaves for the kernels we write: the step time it needs (tokens per step over
    its ratio x its peer's best tokens/s in the bench rows; GOALS, the smallest such step of those whose peer ran),
    against the profiled step's matmul and attention time (library kernels this project does not write) and the
    rest (Inductor's, ours, the optimizer's, copies) plus the time the device sat idle in the bench's step of the
    profiled mode. [] without the rows it needs."""
    config, mode = prof.get("config"), prof.get("mode", "compile")
    shape = _bench_module().CONFIGS.get(config or "", {})
    ours = [r for r in rows if _row_key(r) == (config, "ours", prof.get("precision", "trainer"), mode)
            and r.get("step_ms")]
    kernels_ms = prof.get("total_self_ms") or 0
    if not (shape and ours and kernels_ms and prof.get("time_kind", "CUDA") == "CUDA"):
        return []
    tokens = shape["batch"] * shape["seq"]
    needs = []  # (step ms the goal needs, ratio, peer row)
    for models, ratio, compiled_only in GOALS.get(config or "", ()):
        peers = [r for r in rows if r.get("config") == config and r.get("model") in models and r.get("tokens_per_s")
                 and not (compiled_only and r.get("mode") == "eager")]
        if peers:
            peer = max(peers, key=lambda r: r["tokens_per_s"])
            needs.append((tokens / (ratio * peer["tokens_per_s"]) * 1e3, ratio, peer))
    if not needs:
        return []
    need, goal, peer = min(needs, key=lambda n: n[0])
    step = ours[0]["step_ms"]
    fixed = sum(c["ms"] for c in prof.get("categories", []) if c.get("category") in FIXED_KINDS)
    rest = kernels_ms - fixed + max(0.0, step - kernels_ms)
    head = (f"**What the goal leaves** ({config}, the strictest goal whose peer ran: {goal}x {peer['model']} "
            f"{peer['mode']} at "
            f"{peer['tokens_per_s']:,} tokens/s): a step of {need:.2f} ms for {tokens:,} tokens; ours ({mode}, bench "
            f"row) took {step:.2f} ms. Matmuls and attention (cuBLAS, cuDNN) took {fixed:.2f} ms of the profiled "
            f"step's {kernels_ms:.2f} ms of kernels; the rest, with the {max(0.0, step - kernels_ms):.2f} ms the "
            f"device sat idle in the bench's step, {rest:.2f} ms. ")
    if need <= fixed:
        return [head + "Matmuls and attention alone exceed the goal's step: no work on the other kernels reaches "
                "it; it needs faster matmuls or attention (FP8, another attention kernel).", ""]
    if need >= step:
        return [head + "The goal is met by this step.", ""]
    return [head + f"For the goal the rest must fit {need - fixed:.2f} ms: {step - need:.2f} ms less "
            f"({(step - need) / rest:.0%} of it).", ""]


def _profile_body(st: dict) -> list[str]:
    L: list[str] = []
    d = st.get("data", {})
    if not d:
        return L + [f"Status: {st.get('status')}: no profile (see Failures).", ""]
    n = d.get("steps", 1)
    kind = d.get("time_kind", "CUDA")
    L += [f"Status: {st.get('status')}, {st.get('seconds')} s. Config {d.get('config')}, "
          f"precision {d.get('precision')}, "
          f"device {d.get('device')}; the profiled step took {d.get('step_wall_ms')} ms of wall time, "
          f"{d.get('total_self_ms')} ms of self {kind} time in all.", "",
          f"| kind of kernel | self {kind} ms | % | its largest (ms per step, calls) |", "| --- | --- | --- | --- |"]
    L += [f"| {c['category']} | {c['ms']} | {c['pct']} | "
          + "; ".join(f"`{m['name'][:60]}` {m['self_ms']} ({m['calls']:g})" for m in c.get("largest", [])[:3]) + " |"
          for c in d.get("categories", [])]
    L += ["", f"| top {d.get('what', 'ops')} by self {kind} time | self ms | % | calls | kind |",
          "| --- | --- | --- | --- | --- |"]
    L += [f"| `{t['name'][:90]}` | {t['self_ms']} | {t['pct']} | {t['calls']} | {t['category']} |"
          for t in d.get("top", [])]
    tl = d.get("timeline")
    if tl:
        L += ["", f"Device timeline over the {n} steps: span {tl['span_ms']} ms, kernels busy {tl['busy_ms']} ms, "
              f"idle {tl['idle_ms']} ms, of which {tl['gaps']} gaps of >= 20 us add up to {tl['gaps_ms']} ms "
              "(the device waiting for the host).", "",
              "| idle gap us | kernel before | kernel after |", "| --- | --- | --- |"]
        L += [f"| {g['gap_us']} | `{g['before']}` | `{g['after']}` |" for g in tl.get("longest", [])]
    if d.get("table"):
        L += ["", "<details><summary>torch.profiler key_averages() table (all steps)</summary>", "", "```",
              d["table"].rstrip(),
              "```", "", "</details>"]
    return L + [""]


def _bench_section(title: str, st: Optional[dict], how: str, script: str) -> list[str]:
    """A section that shows a bench script's rows as that script's own `markdown(rows)` renders them."""
    L = [title, ""] + _not_run(st)
    if st is None:
        return L
    L += [f"Status: {st.get('status')}, {st.get('seconds')} s. {how}", ""]
    rows = st.get("data", {}).get("rows")
    if rows:
        L += _bench_module(script).markdown(rows).splitlines()
    return L + [""]


def render_optimizer(st: Optional[dict]) -> list[str]:
    return _bench_section("## 5. Optimizer kernels (`bench/bench_optimizer_gpu.py`: gradient norm and AdamW, ours "
                          "and torch's)", st, "Median of CUDA-event-timed calls at the models' parameter shapes; GB/s "
                          "from the bytes each call must move.", "bench/bench_optimizer_gpu.py")


def render_kernels(st: Optional[dict]) -> list[str]:
    return _bench_section("## 6. Kernels (`bench/bench_kernels_gpu.py`: each fused op, forward + backward, bf16)", st,
                          "Median of CUDA-event-timed iterations; the last column is each implementation against "
                          "the fastest of its mode (what `--fused_kernels=auto` should pick).",
                          "bench/bench_kernels_gpu.py")


def render_failures(stages: dict) -> list[str]:
    L = ["## Failures", ""]
    any_ = False
    for name in STAGES:
        st = stages.get(name)
        if not st:
            continue
        if st.get("status") not in ("ok",) and st.get("error_tail"):
            any_ = True
            L += [f"### {name}: {st.get('status')}", "", "```"] + [ln[:300] for ln in st["error_tail"]] + ["```", ""]
        for r in st.get("data", {}).get("rows", []) if name.startswith("bench") else []:
            if "error" in r:
                any_ = True
                L += [f"### {name} row {r['model']} / {r['precision']} / {r['mode']}: {r['error'][:200]}", "", "```"]
                L += [ln[:300] for ln in r.get("error_tail", [])] + ["```", ""]
    if not any_:
        L += ["None.", ""]
    return L


# ------------------------------------------------------------------------------------------ main
def load_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_report(report: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    for name, text in (("report.json", json.dumps(report, indent=1)), ("report.md", render(report))):
        atomic_write_text(os.path.join(out_dir, name), text)
    return os.path.join(out_dir, "report.md")


def parse_timeouts(spec: str, base: dict) -> dict:
    out = dict(base)
    for item in filter(None, spec.split(",")):
        k, _, v = item.partition("=")
        if k not in out:
            raise SystemExit(f"gpu_report: --timeouts: unknown stage {k!r} (stages: {', '.join(STAGES)})")
        out[k] = float(v)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="", help="comma list of parts: " + ", ".join(PARTS) + " (default: all)")
    p.add_argument("--out-dir", default="", help="report.md, report.json, log.txt (default out/gpu_report; "
                   "dry run: out/gpu_report_cpu_dry_run)")
    p.add_argument("--work-dir", default="", help="data, runs, raw stage files (default out/gpu_report_work)")
    p.add_argument("--fresh", action="store_true", help="ignore a report.json already in --out-dir")
    p.add_argument("--merge", nargs="+", default=None, metavar="REPORT_JSON",
                   help="merge these report.json files into --out-dir's report and render it; runs nothing")
    p.add_argument("--dry-run-cpu", action="store_true", help="every stage at tiny size on the CPU (plumbing check)")
    p.add_argument("--dry-compile", choices=("inductor", "off"), default="inductor",
                   help="dry run: compile rows/runs with Inductor (C++ on CPU, minutes) or with torch.compile disabled")
    p.add_argument("--timeouts", default="", help="stage=seconds,... overriding the per-stage timeouts "
                   + str(TIMEOUTS))
    p.add_argument("--deadline-s", type=float, default=None, help="end this invocation's stages within this many seconds "
                   "(a stage gets min(its timeout, what is left); default 540 = 9 min, 0 with --full or --dry-run-cpu: none)")
    p.add_argument("--bench-rows", default="", help="bench stages: run only these rows (model:precision:mode,...), "
                   "or per config: '124m=ROWS;1b=ROWS'")
    p.add_argument("--bench-row-timeout", type=float, default=300, help="seconds per bench row")
    p.add_argument("--git-rev", default="", help="the revision to print when this tree has no .git")
    p.add_argument("--wheels", default=None, metavar="DIR", help="install the wheels in DIR first "
                   "(scripts/gpu_wheels.py install: into WORK_DIR/site, on PYTHONPATH for every stage); default: "
                   ".whl when it exists (`make gpu-wheels`; a dry run: none); `none`: skip")
    p.add_argument("--full", action="store_true", help="every bench row (ours/ours-ref/HF/HF+Liger x precision x "
                   "mode) and four trainer runs, with the longer timeouts (~24 min); default: the verdict in <= 9 min")
    return p


def main(argv: Optional[list[str]] = None, supervise: bool = False) -> int:
    """supervise (the command line): adopt the stages' orphans and kill what a stage left running before the
    next one starts (end_strays); an in-process caller (a test) keeps its own children."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.deadline_s is None:  # the verdict fits the 9 minutes a lent GPU allows; --full and dry runs take longer
        args.deadline_s = 0 if args.full or args.dry_run_cpu else 540

    default_out = "gpu_report_cpu_dry_run" if args.dry_run_cpu else "gpu_report"
    args.out_dir = os.path.abspath(args.out_dir or os.path.join(ROOT, "out", default_out))
    args.work_dir = os.path.abspath(args.work_dir or os.path.join(ROOT, "out", default_out + "_work"))
    report_path = os.path.join(args.out_dir, "report.json")

    if args.merge is not None:
        report: dict = {"format": REPORT_FORMAT, "runs": [], "stages": {}}
        if os.path.exists(report_path) and not args.fresh:
            report = load_json(report_path)
        for path in args.merge:
            report = merge_reports(report, load_json(path))
        print(f"gpu-report: merged {len(args.merge)} report(s) -> {write_report(report, args.out_dir)}")
        return 0

    if not args.dry_run_cpu and not cuda_available():
        print("gpu-report: no CUDA device here (torch.cuda.is_available() is False): nothing measured; "
              "`python scripts/gpu_report.py --dry-run-cpu` checks the report's plumbing on CPU")
        return 0

    names: list[str] = []
    for part in filter(None, (args.only or "all").split(",")):
        if part not in PARTS:
            p.error(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
        names += [n for n in PARTS[part] if n not in names]
    names = [n for n in STAGES if n in names]
    timeouts = parse_timeouts(args.timeouts, DRY_TIMEOUTS if args.dry_run_cpu else FULL_TIMEOUTS if args.full
                              else TIMEOUTS)
    os.makedirs(args.out_dir, exist_ok=True)
    os.makedirs(args.work_dir, exist_ok=True)
    log = Log(os.path.join(args.out_dir, "log.txt"))
    if supervise and not become_subreaper():  # (Linux): the stages' orphans are adopted here (end_strays)
        log("[gpu-report] could not become the subreaper of its commands (not Linux?): an orphan of a command "
            "is not found after its stage")
    t0 = time.perf_counter()
    extras = install_wheels(args, log)  # before child_env: every command gets the extras' PYTHONPATH
    env = child_env(args.dry_compile if args.dry_run_cpu else "inductor")
    log(f"[gpu-report] {now()}: stages {', '.join(names)} (timeouts "
        f"{', '.join(f'{n} {timeouts[n]:.0f} s' for n in names)}; "
        f"at most {sum(timeouts[n] for n in names) / 60:.1f} min"
        f"{f', deadline {args.deadline_s:.0f} s' if args.deadline_s else ''}); report in {args.out_dir}")
    meta = collect_meta(args, env)
    meta.update(extras)
    log(f"[gpu-report] {meta.get('gpu', '?')}, driver {meta.get('driver', '-')}, torch {meta.get('torch')} "
        f"(CUDA {meta.get('cuda_runtime')}), triton {meta.get('triton')}, transformers {meta.get('transformers')}, "
        f"liger-kernel {meta.get('liger-kernel')}, git {meta.get('git')}")

    report = {"format": REPORT_FORMAT, "runs": [], "stages": {}}
    if os.path.exists(report_path) and not args.fresh:
        try:
            report = load_json(report_path)
        except (OSError, json.JSONDecodeError) as e:
            log(f"[gpu-report] {report_path} unreadable ({e}): starting a new report")
    run_index = len(report.get("runs", []))
    report.setdefault("runs", []).append(meta)
    ctx = Ctx(args, log, env)
    ctx.names = names
    ctx.supervise = supervise
    deadline = args.deadline_s - (time.perf_counter() - t0) if args.deadline_s else 0
    old_stages = dict(report.get("stages", {}))
    ctx.measured = {_row_key(r) for name, st in old_stages.items() if name.startswith("bench")
                    for r in st.get("data", {}).get("rows", []) if "tokens_per_s" in r}

    def on_done(name: str, st: dict) -> None:
        report["stages"][name] = merge_stage(old_stages.get(name), st, name)
        meta["seconds"] = round(time.perf_counter() - t0, 1)
        write_report(report, args.out_dir)
    results = run_stages(names, ctx, timeouts, deadline, run_index, on_done)
    meta["seconds"] = round(time.perf_counter() - t0, 1)
    path = write_report(report, args.out_dir)
    log(f"[gpu-report] done in {meta['seconds']:.0f} s: " +
        ", ".join(f"{n} {results[n]['status']}" for n in names) + f"\n[gpu-report] report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(supervise=True))
