"""`make gpu-report` (scripts/gpu_report.py) without a GPU: the no-CUDA path is one line and exit 0; a stage
that fails is reported with its error and the later stages still run; parts merge into one report; the
metrics summary and the bench's row order; and (slow) the CPU dry run writes every section with numbers.
What only a GPU can show (real timings, CUDA kernels in the profile) is not tested here."""
import importlib.util
import json
import os
import re
import shutil
import subprocess
import time

import pytest

from tests.conftest import PY, ROOT

SCRIPT = os.path.join(ROOT, "scripts", "gpu_report.py")


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def gr(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the bench module sets it on import; restored after
    return _load("gpu_report_under_test", SCRIPT)


def _no_cuda_env() -> dict:
    return dict(os.environ, CUDA_VISIBLE_DEVICES="")


def test_without_cuda_it_prints_one_line_and_exits_0():
    r = subprocess.run([PY, SCRIPT], capture_output=True, text=True, env=_no_cuda_env(), cwd=ROOT, timeout=120)
    assert r.returncode == 0
    lines = (r.stdout + r.stderr).strip().splitlines()
    assert len(lines) == 1 and "no CUDA" in lines[0], lines
    if shutil.which("make"):
        r = subprocess.run(["make", "-s", "gpu-report", "PART=tests"], capture_output=True, text=True,
                           env=_no_cuda_env(), cwd=ROOT, timeout=120)
        assert r.returncode == 0
        lines = (r.stdout + r.stderr).strip().splitlines()
        assert len(lines) == 1 and "no CUDA" in lines[0], lines


def test_a_failing_stage_is_reported_and_the_next_stage_still_runs(gr, tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("boom: the tests stage broke")

    def fake_profile(ctx):
        return {"status": "ok", "data": {"config": "tiny", "precision": "trainer", "device": "cpu", "time_kind": "CPU",
                                         "what": "ops", "step_wall_ms": 12.5, "total_self_ms": 10.0,
                                         "top": [{"name": "aten::mm", "self_ms": 6.0, "pct": 60.0, "calls": 4,
                                                  "category": "matmul (cuBLAS / CUTLASS)"}],
                                         "categories": [{"category": "matmul (cuBLAS / CUTLASS)", "ms": 6.0,
                                                         "pct": 60.0}]}}
    monkeypatch.setitem(gr.STAGE_FUNCS, "tests", broken)
    monkeypatch.setitem(gr.STAGE_FUNCS, "profile", fake_profile)
    monkeypatch.setitem(gr.STAGE_FUNCS, "profile-1b", lambda ctx: {"status": "failed", "data": {},
                                                                   "error_tail": ["no 1B profile"]})
    monkeypatch.setattr(gr, "collect_meta", lambda args, env: {"date": "d", "gpu": "test", "dry_run_cpu": True})
    out = tmp_path / "report"
    assert gr.main(["--dry-run-cpu", "--only", "tests,profile", "--out-dir", str(out),
                    "--work-dir", str(tmp_path / "work")]) == 0
    md = (out / "report.md").read_text()
    rep = json.loads((out / "report.json").read_text())
    assert rep["stages"]["tests"]["status"] == "failed"
    assert rep["stages"]["profile"]["status"] == "ok"
    assert "### tests: failed" in md and "boom: the tests stage broke" in md
    assert "| `aten::mm` | 6.0 | 60.0 | 4 |" in md
    # `--only profile` is both profiles; the 1B one's failure under its own heading, the 124M one's table intact
    assert rep["stages"]["profile-1b"]["status"] == "failed" and "### The 1B step" in md
    assert "### profile-1b: failed" in md and "no 1B profile" in md
    assert "| bench-124m | not run yet |" in md and "| train | not run yet |" in md
    assert (out / "log.txt").exists()

    # a second part merges into the same report; the failed stage stays until it is run again
    monkeypatch.setitem(gr.STAGE_FUNCS, "train", lambda ctx: {"status": "ok", "data": {"runs": [], "model": {},
                                                                                        "steps": 30}})
    assert gr.main(["--dry-run-cpu", "--only", "train", "--out-dir", str(out), "--work-dir", str(tmp_path / "w")]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert [rep["stages"][s]["status"] for s in ("tests", "train", "profile")] == ["failed", "ok", "ok"]
    assert len(rep["runs"]) == 2 and rep["stages"]["train"]["run"] == 1


# a command that starts a process in a session of its own (as the bench's prewarm starts its rows), writes
# that process's pid to a file, then sleeps (a command that runs on) or exits (and leaves it an orphan)
LEAVES_A_ROW = """
import subprocess, sys
row = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # {marker}"], start_new_session=True)
with open({pid_file!r}, "w") as f:
    f.write(str(row.pid))
{then}
"""


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie is dead); waits up to 10 s for a killed process to be gone."""
    from utils.proc_tree import process_info
    for _ in range(100):
        info = process_info(pid)
        if info is None or info.state == "Z":
            return False
        time.sleep(0.1)
    return True


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads the process tree from /proc (Linux)")


@needs_proc
def test_a_timed_out_command_is_killed_with_the_processes_it_started_in_sessions_of_their_own(gr, tmp_path):
    """On 2026-11-27 the prewarm, killed at its stage's end, left its rows (each in a session of its own)
    compiling and stepping on the GPU beside the next stage's timed rows. A timeout now kills the whole tree."""
    pid_file = str(tmp_path / "row.pid")
    cmd = [PY, "-c", LEAVES_A_ROW.format(marker="row-of-a-killed-command", pid_file=pid_file,
                                          then="import time\ntime.sleep(300)")]
    for _ in range(2):  # the first try's timeout may come before a slow machine started the row at all
        r = gr.stream_cmd(cmd, 8 if not os.path.exists(pid_file) else 30, gr.Log(""), "[t] ", echo=False)
        if os.path.exists(pid_file):
            break
    assert r["timed_out"], r
    row = int(open(pid_file).read())
    assert not _alive(row), f"the command's row {row} ran on after the command was killed"


@needs_proc
def test_an_orphan_a_stage_leaves_is_adopted_and_killed_before_the_next_stage(tmp_path):
    """The command line's report adopts its commands' orphans (subreaper) and kills what a stage left running,
    naming it in the report; run in a process of its own (an in-process caller keeps its children)."""
    pid_file, out = str(tmp_path / "orphan.pid"), tmp_path / "out"
    orphan_cmd = LEAVES_A_ROW.format(marker="orphan-of-a-finished-command", pid_file=pid_file, then="")
    driver = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("gpu_report_driven", {SCRIPT!r})
gr = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gr)
def stage(ctx):
    r = gr.stream_cmd([sys.executable, "-c", {orphan_cmd!r}], 120, ctx.log, "[t] ")
    return {{"status": "ok" if r["rc"] == 0 else "failed", "data": {{}}}}
gr.STAGE_FUNCS["tests"] = stage
gr.collect_meta = lambda args, env: {{"date": "d", "gpu": "test", "dry_run_cpu": True}}
sys.exit(gr.main(["--dry-run-cpu", "--only", "tests", "--out-dir", {str(out)!r}, "--work-dir",
                  {str(tmp_path / "work")!r}], supervise=True))
"""
    r = subprocess.run([PY, "-c", driver], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    orphan = int(open(pid_file).read())
    assert not _alive(orphan), f"the orphan {orphan} ran on after the report ended"
    st = json.loads((out / "report.json").read_text())["stages"]["tests"]
    assert st["status"] == "ok" and len(st["strays_killed"]) == 1, st
    assert st["strays_killed"][0].startswith(f"{orphan} ") and "orphan-of-a-finished-command" in st["strays_killed"][0]
    assert "**Stage tests left 1 process(es) running after it ended**" in (out / "report.md").read_text()


def test_a_profile_whose_results_were_written_is_ok_though_its_process_exited_late(gr, tmp_path, monkeypatch):
    """The profile writes its JSON whole after the steps; killed at the stage's end while exiting, it is ok
    (with a note), killed before writing it, timed out."""
    write = {"now": True}

    def fake_stream(cmd, *a, **k):
        if write["now"]:
            with open(cmd[cmd.index("--json-out") + 1], "w") as f:
                json.dump({"config": "124m", "top": []}, f)
        return {"rc": -9, "output": "killed after 30 s (timeout)", "timed_out": True, "seconds": 30}
    monkeypatch.setattr(gr, "stream_cmd", fake_stream)

    class Args:
        dry_run_cpu, work_dir = False, str(tmp_path)
    ctx = gr.Ctx(Args, gr.Log(""), {})
    st = gr.stage_profile(ctx)
    assert st["status"] == "ok" and "exiting" in st["note"] and st["data"]["config"] == "124m"
    write["now"] = False
    assert gr.stage_profile(ctx)["status"] == "timed out"


@needs_proc
def test_a_stopped_prewarm_takes_its_rows_with_it(tmp_path):
    """bench_model_gpu.py --prewarm starts each row in a session of its own; a SIGTERM to the prewarm ends
    those rows too (by its handler: nothing of the caller's has to know the rows)."""
    from utils.proc_tree import descendants
    bench = os.path.join(ROOT, "bench", "bench_model_gpu.py")
    p = subprocess.Popen([PY, bench, "--prewarm", "--parallel", "2", "--configs", "tiny", "--device", "cpu",
                          "--rows", "tiny:ours:trainer:compile,tiny:hf:autocast:compile"], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows: list[int] = []
    deadline = time.time() + 60
    while len(rows) < 2 and time.time() < deadline and p.poll() is None:
        rows = descendants(p.pid)
        time.sleep(0.05)
    p.terminate()
    p.wait(timeout=60)
    assert len(rows) >= 2, "the prewarm started no rows within 60 s"
    assert not [pid for pid in rows if _alive(pid)], "a row ran on after its prewarm was stopped"


def test_tests_that_all_ran_are_not_called_timed_out_when_pytest_exits_late(gr, tmp_path, monkeypatch):
    """pytest printed its summary at 104 s of the stage's 110 and was still exiting when the time ran out
    (2026-11-27): the outcomes stand. Without the summary line the stage did time out."""
    out = ("[gw0] [ 50%] PASSED tests/model/test_gpu.py::test_a\n[gw1] [100%] PASSED tests/model/test_gpu.py::test_b\n"
           "============ 2 passed, 12 warnings in 104.28s (0:01:44) ============\nkilled after 110 s (timeout)")
    monkeypatch.setattr(gr, "stream_cmd", lambda *a, **k: {"rc": -9, "output": out, "timed_out": True, "seconds": 110})

    class Args:
        dry_run_cpu, work_dir = True, str(tmp_path)
    ctx = gr.Ctx(Args, gr.Log(""), {})
    st = gr.stage_tests(ctx)
    assert st["status"] == "ok" and st["data"]["counts"] == {"passed": 2} and "exiting" in st["note"]
    out = out.replace("PASSED tests/model/test_gpu.py::test_b", "FAILED tests/model/test_gpu.py::test_b")
    out = out.replace("2 passed", "1 failed, 1 passed")
    assert gr.stage_tests(ctx)["status"] == "failed"
    out = "\n".join(out.splitlines()[:2] + ["killed after 110 s (timeout)"])  # killed before its summary
    assert gr.stage_tests(ctx)["status"] == "timed out"


def test_bench_rows_merge_by_key_and_reports_merge(gr, tmp_path):
    row = lambda model, **kw: dict(config="124m", model=model, precision="trainer", mode="eager", **kw)  # noqa: E731
    measured = row("ours", tokens_per_s=1000, step_ms=1.0, compile_s=0.1, peak_mem_gib=1.0, first_loss=10.0,
                   flops_per_token=1e9)
    a = {"runs": [{"date": "a"}], "stages": {"bench-124m": {"status": "partial", "run": 0, "data": {
        "meta": {}, "rows": [measured, row("hf", skipped="not run: budget")]}}}}
    b = {"runs": [{"date": "b"}], "stages": {"bench-124m": {"status": "ok", "run": 0, "data": {
        "meta": {}, "rows": [row("ours", skipped="not run: budget"), dict(measured, model="hf", tokens_per_s=500)]}}}}
    merged = gr.merge_reports(gr.merge_reports({}, a), b)
    rows = {r["model"]: r for r in merged["stages"]["bench-124m"]["data"]["rows"]}
    assert rows["ours"]["tokens_per_s"] == 1000  # a measured row is not replaced by a row that did not run
    assert rows["hf"]["tokens_per_s"] == 500
    assert merged["stages"]["bench-124m"]["run"] == 1 and len(merged["runs"]) == 2
    for i, rep in enumerate((a, b)):
        (tmp_path / f"r{i}.json").write_text(json.dumps(rep))
    assert gr.main(["--merge", str(tmp_path / "r0.json"), str(tmp_path / "r1.json"), "--out-dir",
                    str(tmp_path / "m")]) == 0
    md = (tmp_path / "m" / "report.md").read_text()
    assert "| 124m | ours trainer / HF autocast" not in md  # no HF autocast row: that ratio is left out
    assert "| 124m | ours / HF (trainer, eager) | 2.00x |" in md


def test_a_second_call_on_the_same_report_runs_only_the_ab_rows_not_yet_measured(gr, tmp_path, monkeypatch):
    first, second = "tiny:ours-gradbuf:trainer:eager", "tiny:ours-sync:trainer:eager"
    monkeypatch.setattr(gr, "DRY_AB_ROWS", f"{first},{second}")
    monkeypatch.setattr(gr, "collect_meta", lambda args, env: {"date": "d", "gpu": "test", "dry_run_cpu": True})
    asked, budget = [], {"rows": 1}  # each call measures this many of the rows it is given, the rest "not run"

    def fake_bench(ctx, name, configs="", rows=None):
        asked.append(rows)
        out = []
        for i, r in enumerate(rows.split(",")):
            c, m, p, md = r.split(":")
            row = dict(config=c, model=m, precision=p, mode=md)
            out.append(dict(row, tokens_per_s=100 + i, step_ms=1.0, compile_s=0.1, peak_mem_gib=0.1, first_loss=6.0,
                            flops_per_token=1e6) if i < budget["rows"] else dict(row, skipped="not run: budget"))
        return {"status": "partial", "rc": 0, "cmd": "bench", "data": {"meta": {}, "rows": out}, "error_tail": []}
    monkeypatch.setattr(gr, "_bench_stage", fake_bench)
    out = tmp_path / "report"
    call = ["--dry-run-cpu", "--only", "bench-ab", "--out-dir", str(out), "--work-dir", str(tmp_path / "w")]
    assert gr.main(call) == 0 and asked == [f"{first},{second}"]
    assert gr.main(call) == 0 and asked[1:] == [second]  # the first row was measured by the first call
    assert gr.main(call) == 0 and len(asked) == 2  # both measured: no bench command at all
    rows = json.loads((out / "report.json").read_text())["stages"]["bench-ab"]["data"]["rows"]
    assert sorted((r["model"], r["tokens_per_s"]) for r in rows) == [("ours-gradbuf", 100), ("ours-sync", 100)]
    assert "not run again: " + first in (out / "log.txt").read_text()
    assert gr.ab_rows_left(f"{first},{second}", set()) == f"{first},{second}"
    assert gr.main(call + ["--fresh"]) == 0 and asked[2:] == [f"{first},{second}"]  # a fresh report: all again


def test_the_profile_says_what_the_goal_leaves_for_the_kernels_we_write(gr, monkeypatch):
    """The H200 figures of report-1908bc2: 124M, HF compiled 436,462 tokens/s, so 1.5x needs a 25.03 ms step of
    16,384 tokens; ours ran 587,435 tokens/s (27.89 ms); matmuls 15.329 + attention 3.679 ms of 26.427 ms of kernels."""
    prof = {"config": "124m", "precision": "trainer", "mode": "compile", "time_kind": "CUDA", "total_self_ms": 26.427,
            "categories": [{"category": "matmul (cuBLAS / CUTLASS)", "ms": 15.329},
                           {"category": "other Triton (Inductor)", "ms": 5.27},
                           {"category": "attention (SDPA)", "ms": 3.679}]}
    row = lambda model, mode, tps: dict(config="124m", model=model, precision="trainer" if model == "ours"  # noqa: E731
                                        else "autocast", mode=mode, tokens_per_s=tps,
                                        step_ms=round(16384 / tps * 1e3, 2))
    rows = [row("ours", "compile", 587435), row("hf", "compile", 436462), row("hf-liger", "eager", 244539),
            row("ours", "eager", 342930)]
    text = " ".join(gr.goal_budget(prof, rows))
    assert "1.5x hf compile at 436,462 tokens/s" in text and "a step of 25.03 ms" in text
    assert "took 27.89 ms" in text and "took 19.01 ms of the profiled step's 26.43 ms" in text
    # the rest: 26.427 - 19.008 of kernels + 27.89 - 26.427 idle = 8.88 ms; it must fit 25.03 - 19.01 = 6.02 ms
    assert "idle in the bench's step, 8.88 ms" in text and "must fit 6.02 ms: 2.86 ms less (32% of it)" in text
    slow_libs = dict(prof, categories=[{"category": "matmul (cuBLAS / CUTLASS)", "ms": 25.5}])
    assert "alone exceed the goal's step" in " ".join(gr.goal_budget(slow_libs, rows))
    fast = rows[:1] + [row("hf", "compile", 380000)]
    assert "The goal is met by this step" in " ".join(gr.goal_budget(prof, fast))
    # HF + Liger's eager row is no peer of the 1.5x goal (HF compiled): without HF compiled the goal has no peer
    assert gr.goal_budget(prof, [rows[0], rows[2]]) == []
    # torchtitan's 1.15x is the stricter where titan runs faster than 1.5 / 1.15 x HF (569,300 tokens/s here):
    # at 600,000 tokens/s it needs a 23.74 ms step, HF's 1.5x 25.03 ms
    titan = dict(row("titan", "compile", 600000), precision="autocast")
    text = " ".join(gr.goal_budget(prof, rows + [titan]))
    assert "1.15x titan compile at 600,000 tokens/s" in text and "a step of 23.74 ms" in text
    assert "1.5x hf compile" in " ".join(gr.goal_budget(prof, rows + [dict(titan, tokens_per_s=300000)]))
    assert gr.goal_budget(prof, rows[1:]) == [] and gr.goal_budget(dict(prof, config="tiny"), rows) == []
    assert gr.goal_budget(dict(prof, time_kind="CPU"), rows) == []
    # the profile's kinds: cuDNN's SDPA helpers are attention, not "other"
    bench = gr._bench_module()
    for name, kind in (("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(v", "attention (SDPA)"),
                       ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, ", "attention (SDPA)"),
                       ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention (SDPA)"),
                       ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul (cuBLAS / CUTLASS)"),
                       ("triton_poi_fused__unsafe_view_mul_silu_3", "other Triton (Inductor)"),
                       ("_adamw_param_grads_kernel", "optimizer, foreach (AdamW, clip norms)")):
        assert bench._category(name, set()) == kind, name


@pytest.mark.parametrize("stage,key", [("kernels", "us"), ("optimizer", "ms")])
def test_the_json_bench_stages_say_how_they_ended(gr, tmp_path, monkeypatch, stage, key):
    """The per-op and optimizer stages, as the model bench stages: ok when the script finished its rows, else
    timed out, partial (some rows measured) or failed; the rows written so far are kept either way."""
    from types import SimpleNamespace
    ctx = gr.Ctx(SimpleNamespace(dry_run_cpu=False, work_dir=str(tmp_path)), lambda *a: None, {})
    ctx.timeout = 60.0
    cases = [(0, False, True, [{key: 1.0}], "ok"), (-9, True, False, [{key: 1.0}], "timed out"),
             (1, False, False, [{key: 1.0}, {"error": "x"}], "partial"), (1, False, False, [{"error": "x"}], "failed")]
    for rc, timed_out, done, rows, want in cases:
        def fake(cmd, timeout, log, prefix, env=None, rows=rows, done=done, rc=rc, timed_out=timed_out):
            out = cmd[cmd.index("--json-out") + 1]
            with open(out, "w") as f:
                json.dump({"rows": rows, "done": done}, f)
            return {"rc": rc, "timed_out": timed_out, "output": "tail"}
        monkeypatch.setattr(gr, "stream_cmd", fake)
        st = gr.STAGE_FUNCS[stage](ctx)
        assert st["status"] == want and st["data"]["rows"] == rows, (st, want)
        assert st["cmd"].split()[1] == f"bench/bench_{stage}_gpu.py" and (st["error_tail"] == []) == (want == "ok")


def test_metrics_summary_skips_the_compile_steps(gr, tmp_path):
    recs = [{"step": 1, "loss": 10.0, "tokens_per_sec": 100.0, "tokens_per_sec_avg": 100.0, "mfu": 0.01}]
    recs += [{"step": s, "loss": 10.0 - s / 10, "tokens_per_sec": 1000.0 + s, "tokens_per_sec_avg": 900.0,
              "mfu": 0.45, "mem_peak_mib": 100.0 + s} for s in range(2, 31)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n{torn")
    s = gr.summarize_metrics(str(path), tokens_per_step=1000)
    assert s["steps"] == 30 and s["steady_from_step"] == 11
    assert s["tokens_per_s_median"] == 1020  # median of steps 11..30 = 1020.5, rounded to even
    assert s["first_step_s"] == 10.0 and s["tokens_per_s_window"] == 900 and s["mfu_window"] == 0.45
    assert s["mem_peak_mib"] == 130.0 and s["loss_last"] == 7.0


def test_bench_runs_eager_rows_first_and_the_trainer_setup_first(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bench = _load("bench_model_gpu_under_test", os.path.join(ROOT, "bench", "bench_model_gpu.py"))

    class A:
        configs, models, modes, precisions, rows = ["124m"], list(bench.MODELS), ["compile", "eager"], \
            list(bench.PRECISIONS), []
    plan = bench.planned_rows(A)
    n = len(bench.PRIORITY)  # 10: the 8 bf16 rows, torchtitan with its recipe, then ours with FP8 (reported apart)
    assert len(plan) == 2 * n == 20 and plan[0] == ("124m", "ours", "trainer", "eager")
    assert plan[1] == ("124m", "hf", "autocast", "eager")
    assert [p[3] for p in plan] == ["eager"] * n + ["compile"] * n
    assert plan[n - 1] == ("124m", "ours-fp8", "trainer", "eager")  # the least informative row of a mode: last
    A.rows = ["hf:trainer:compile"]
    assert bench.planned_rows(A) == [("124m", "hf", "trainer", "compile")]
    A.configs, A.rows = ["124m", "1b"], ["1b:ours-fp8:trainer:compile", "hf:autocast:compile"]  # one config's row
    assert bench.planned_rows(A) == [("124m", "hf", "autocast", "compile"), ("1b", "ours-fp8", "trainer", "compile"),
                                     ("1b", "hf", "autocast", "compile")]
    # every row config-prefixed (the report's A/B rows): the order listed, not config by config; a row of a
    # config not asked for is left out
    A.rows = ["1b:ours-bf16m:trainer:compile", "124m:ours-sync:trainer:compile", "7b:ours:trainer:compile",
              "124m:ours-bf16m:trainer:compile"]
    assert bench.planned_rows(A) == [("1b", "ours-bf16m", "trainer", "compile"),
                                     ("124m", "ours-sync", "trainer", "compile"),
                                     ("124m", "ours-bf16m", "trainer", "compile")]
    # the prewarm: compiled rows only, the config-prefixed ones first in the order listed (not config by config)
    # and never a row whose compile times kernels on the GPU (the prewarm shares it with the GPU tests)
    A.rows = ["124m:ours:trainer:compile", "1b:hf:autocast:compile", "124m:hf:autocast:eager",
              "1b:ours:trainer:compile", "124m:ours:trainer:compile-cdt", "124m:hf:autocast:compile",
              "1b:ours:trainer:compile-mat", "1b:ours:trainer:compile-cg"]
    assert bench.prewarm_plan(A) == [("124m", "ours", "trainer", "compile"), ("1b", "hf", "autocast", "compile"),
                                     ("1b", "ours", "trainer", "compile"), ("124m", "hf", "autocast", "compile"),
                                     ("1b", "ours", "trainer", "compile-cg")]


def test_bench_tce_rows_set_the_loss_op_and_its_tile(monkeypatch, gr):
    """ours-tce runs the Triton linear+CE under compile in one chunk with the default tile; ours-tce4k the same
    with 4096-element tiles (each row is its own process: the settings are the module globals it leaves)."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bench = _load("bench_model_gpu_tce", os.path.join(ROOT, "bench", "bench_model_gpu.py"))
    from model import kernels, triton_loss
    default_tile, table, budget = triton_loss.MAX_BLOCK_V, dict(kernels.AUTO_UNDER_COMPILE), \
        triton_loss.LOSS_CHUNK_BUDGET_BYTES
    for name, tile in (("ours-tce", default_tile), ("ours-tce4k", 4096)):
        monkeypatch.setattr(kernels, "AUTO_UNDER_COMPILE", dict(table))
        monkeypatch.setattr(triton_loss, "MAX_BLOCK_V", default_tile)
        monkeypatch.setattr(triton_loss, "LOSS_CHUNK_BUDGET_BYTES", budget)
        assert kernels.AUTO_UNDER_COMPILE["cross_entropy"] != "triton"
        bench.make_step("tiny", name, "eager", "trainer", "cpu")
        assert kernels.AUTO_UNDER_COMPILE["cross_entropy"] == "triton", name
        assert triton_loss.MAX_BLOCK_V == tile, name
        assert triton_loss.LOSS_CHUNK_BUDGET_BYTES == kernels.REFERENCE_LOSS_MAX_LOGITS_BYTES, name
    assert default_tile != 4096
    assert "ours-tce4k" in bench.MODELS and "124m:ours-tce4k:trainer:compile" in gr.AB_BENCH_ROWS.split(",")


def test_bench_rows_per_config(gr):
    """--bench-rows "124m=ROWS;1b=ROWS" gives each bench stage its own rows (a config left out: its defaults);
    a plain list applies to every config; an unknown config is refused."""
    spec = "124m=ours:trainer:compile,hf:autocast:compile;1b=ours-fp8:trainer:compile"
    assert gr.bench_rows_for(spec, "bench-124m") == "ours:trainer:compile,hf:autocast:compile"
    assert gr.bench_rows_for(spec, "bench-1b") == "ours-fp8:trainer:compile"
    assert gr.bench_rows_for("124m=ours:trainer:eager", "bench-1b") == ""
    assert gr.bench_rows_for("ours:trainer:eager", "bench-1b") == "ours:trainer:eager"
    with pytest.raises(SystemExit, match="unknown config"):
        gr.bench_rows_for("7b=ours:trainer:eager", "bench-1b")
    from types import SimpleNamespace
    args = SimpleNamespace(bench_rows=spec, full=False)  # the prewarm compiles each config's rows only
    assert gr.prewarm_rows_spec(args, ["124m", "1b"]) == \
        "124m:ours:trainer:compile,124m:hf:autocast:compile,1b:ours-fp8:trainer:compile"
    args.bench_rows = ""
    assert gr.prewarm_rows_spec(args, ["1b"]) == ",".join("1b:" + r for r in gr.VERDICT_BENCH_ROWS["bench-1b"].split(","))
    # the prewarm's order: the 124M ours row, the longest cold compile (FP8 at 1B), then the rest as PREWARM_FIRST
    # and the list say
    both = gr.prewarm_rows_spec(args, ["124m", "1b"])
    ordered = gr.prewarm_order(both + ",124m:ours-tce:trainer:compile").split(",")
    assert ordered[:len(gr.PREWARM_FIRST)] == list(gr.PREWARM_FIRST)
    assert ordered[:2] == ["124m:ours:trainer:compile", "1b:ours-fp8:trainer:compile"]
    assert sorted(ordered) == sorted(both.split(",") + ["124m:ours-tce:trainer:compile"])
    assert ordered[-1] == "124m:ours-tce:trainer:compile" and gr.prewarm_order("") == ""


def test_bench_times_steps_back_to_back_with_one_sync_per_window(monkeypatch):
    """A row's timed steps run in windows (a step may queue its work while the one before runs, as in
    training): 5 steps in windows of 2 are 3 syncs (2, 2, 1 steps), after the build's, the first step's and
    the warm-up's; each window's time is divided by its own step count."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bench = _load("bench_model_gpu_windows", os.path.join(ROOT, "bench", "bench_model_gpu.py"))
    assert bench._windows(5, 2) == [2, 2, 1] and bench._windows(12, 4) == [4, 4, 4] and bench._windows(3, 1) == [1] * 3
    import utils.device
    calls = {"sync": 0, "step": 0}
    monkeypatch.setattr(utils.device, "synchronize", lambda device: calls.__setitem__("sync", calls["sync"] + 1))
    real_make = bench.make_step

    def counting_make(*a, **kw):
        step, model = real_make(*a, **kw)

        def counted():
            calls["step"] += 1
            return step()
        return counted, model
    monkeypatch.setattr(bench, "make_step", counting_make)
    row = bench.run_one("tiny", "ours", "eager", "trainer", "cpu", steps=5, warmup=1, window=2)
    assert calls == {"sync": 3 + 3, "step": 1 + 1 + 5}
    assert row["window"] == 2 and row["steps"] == 5 and row["tokens_per_s"] > 0
    # the default (window 0): no sync until the last timed step (on a GPU each step timed by CUDA events)
    calls.update(sync=0, step=0)
    row = bench.run_one("tiny", "ours", "eager", "trainer", "cpu", steps=5, warmup=1)
    assert calls == {"sync": 3 + 1, "step": 1 + 1 + 5} and row["window"] == 0 and row["tokens_per_s"] > 0
    # every timed step's loss, read after the last one: the model fits the one batch it sees, so the loss falls
    assert len(row["losses"]) == 5 and row["last_loss"] == row["losses"][-1] < row["first_loss"]


@pytest.mark.gpu
def test_on_cuda_the_bench_times_each_step_by_events_with_one_sync_at_the_end(monkeypatch):
    """The default timing on a GPU: the timed steps queue back to back (one sync, after the last) and each
    step's time is the device time between CUDA events: one before the first step, one at each step's end."""
    import torch
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bench = _load("bench_model_gpu_events", os.path.join(ROOT, "bench", "bench_model_gpu.py"))
    import utils.device
    real_sync, syncs = utils.device.synchronize, []
    monkeypatch.setattr(utils.device, "synchronize", lambda device: syncs.append(1) or real_sync(device))
    recorded = []
    real_event = torch.cuda.Event

    def event(*a, **kw):
        e = real_event(*a, **kw)
        recorded.append(e)
        return e
    monkeypatch.setattr(torch.cuda, "Event", event)
    row = bench.run_one("tiny", "ours", "eager", "trainer", "cuda", steps=5, warmup=1)
    assert len(syncs) == 3 + 1 and len(recorded) >= 6  # build, first step, warm-up; then the timed steps' one
    assert row["window"] == 0 and 0 < row["step_ms_min"] <= row["step_ms"] and row["tokens_per_s"] > 0


def test_the_goal_ratio_takes_our_best_bf16_row_over_the_best_peer_row_and_fp8_apart(monkeypatch):
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bench = _load("bench_model_gpu_goal", os.path.join(ROOT, "bench", "bench_model_gpu.py"))
    row = lambda model, prec, mode, tps: dict(config="1b", model=model, precision=prec, mode=mode, tokens_per_s=tps,  # noqa: E731
                                              flops_per_token=1e9, flops_per_token_causal_half=8e8, step_ms=1,
                                              compile_s=1, peak_mem_gib=1, first_loss=1)
    rows = [row("ours", "trainer", "compile", 80_000), row("ours", "trainer", "eager", 77_000),
            row("hf", "autocast", "compile", 70_000), row("hf-liger", "autocast", "eager", 72_000),
            row("ours-fp8", "trainer", "compile", 96_000), row("ours-fp8r", "trainer", "compile", 100_000),
            row("ours-nofa4", "trainer", "compile", 84_000), row("titan", "autocast", "compile", 75_000)]
    md = bench.markdown_tables(rows, 1e15, 0)
    # our best bf16 row is the one without FA4 here (84,000): the goals take it, whichever flag gives it
    assert "| 1b | GOAL (>= 1.15x): best ours (bf16) / torchtitan | 1.12x |" in md  # 84,000 / 75,000
    # against HF compiled only: HF + Liger's eager row (72,000) is not the denominator, HF compiled (70,000) is
    assert "| 1b | GOAL (>= 1.5x at 124m): best ours (bf16) / best HF compiled (HF, HF+Liger) | 1.20x |" in md
    assert "| 1b | best ours (bf16) / best of HF and HF+Liger, any mode | 1.17x |" in md  # 84,000 / 72,000
    # FP8 against our best bf16, the better recipe counting; never against HF
    assert "| 1b | GOAL (>= 1.25x at 1b): best ours with FP8 (either recipe) / best ours bf16 | 1.19x |" in md
    assert "| 1b | FP8 rowwise / FP8 tensorwise (best rows) | 1.04x |" in md
    assert "| 1b | ours / ours-nofa4 (FlashAttention-4's gain" in md and "rows) | 0.95x |" in md
    # MFU: both conventions for bf16 rows (8e13 and 6.4e13 FLOP/s of 1e15), none for FP8 rows
    assert "| 1b | ours | bf16 params + fp32 master (trainer) | compile | 80,000 | 1 | 8.0% | - | 6.4% |" in md
    assert "| 1b | ours-fp8r | bf16 params + fp32 master (trainer) | compile | 100,000 | 1 | FP8: - | FP8: - | FP8: - |" in md
    # CUDA graphs against plain compile, ours as the trainer runs it: shown only where both rows ran
    assert "compile-cg / ours compile" not in md
    md = bench.markdown_tables(rows + [row("ours", "trainer", "compile-cg", 88_000)], 1e15, 0)
    assert ("| 1b | ours compile-cg / ours compile (CUDA graphs: --compile_mode=reduce-overhead; trainer) | 1.10x |"
            in md)
    assert "| 1b | GOAL (>= 1.15x): best ours (bf16) / torchtitan | 1.17x |" in md  # 88,000 / 75,000: it counts


def test_fp8_loss_curves_are_compared_step_by_step_with_bf16s(monkeypatch):
    """An FP8 row's timed losses against the bf16 `ours` row of the same config, precision and mode: the largest
    relative gap over the common steps, the last one, and whether any loss is not finite."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bench = _load("bench_model_gpu_curves", os.path.join(ROOT, "bench", "bench_model_gpu.py"))
    ref = [10.0 - 0.1 * i for i in range(30)]
    fp8 = [v * (1.02 if i == 7 else 1.0) for i, v in enumerate(ref)]
    s = bench.curve_summary(fp8, ref)
    assert s["steps"] == 30 and abs(s["max_rel_gap"] - 0.02) < 1e-12 and s["last_rel_gap"] == 0 and s["finite"]
    assert not bench.curve_summary(fp8[:-1] + [float("nan")], ref)["finite"]
    row = lambda model, losses: dict(config="1b", model=model, precision="trainer", mode="compile",  # noqa: E731
                                     tokens_per_s=1, flops_per_token=1, step_ms=1, compile_s=1, peak_mem_gib=1,
                                     first_loss=1, losses=losses)
    md = bench.loss_curves([row("ours", ref), row("ours-fp8r", fp8), row("ours-fp8", fp8[:5])])
    assert "| 1b | ours-fp8r (rowwise) | compile | 30 | 10.0 -> 7.1 |" in md and "| 2.00% | 0.00% | yes |" in md
    assert "ours-fp8 (tensorwise)" not in md  # 5 steps: too few to call a curve
    assert bench.loss_curves([row("ours-fp8r", fp8)]) == ""  # no bf16 row to compare with


def test_the_autocast_rows_clip_the_gradients_as_hf_trainer_does(monkeypatch):
    """Every peer row clips as its trainer does by default: the autocast step (HF Trainer's --bf16) clips all
    parameters' gradients to global norm 1.0 before the optimizer step; the trainer rows clip in our engine."""
    import torch
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bench = _load("bench_model_gpu_clip", os.path.join(ROOT, "bench", "bench_model_gpu.py"))
    calls = []
    real = torch.nn.utils.clip_grad_norm_

    def clip(params, max_norm, **kw):
        params = list(params)
        calls.append((len(params), max_norm, all(p.grad is not None for p in params)))
        return real(params, max_norm, **kw)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    step, model = bench.make_step("tiny", "hf", "eager", "autocast", "cpu")
    step()
    assert calls == [(len(list(model.parameters())), 1.0, True)]
    from trainer.config import TrainConfig
    assert bench.MAX_GRAD_NORM == TrainConfig().grad_clip == 1.0


def test_the_profile_timeline_finds_where_the_device_waited(monkeypatch):
    """Overlapping kernels count once; the idle gaps between them are found, the longest first, with the
    kernels either side; gaps under 20 us are idle time but not listed."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    bench = _load("bench_model_gpu_timeline", os.path.join(ROOT, "bench", "bench_model_gpu.py"))
    kernels = [(0, 100, "mm"), (50, 150, "attn"), (160, 200, "adam"),  # 10 us gap after attn
               (1200, 1300, "embed"), (1300, 1400, "mm2"), (1450, 1500, "norm")]  # 1000 us after adam, 50 us
    tl = bench.timeline_gaps(kernels)
    assert tl["span_ms"] == 1.5 and tl["busy_ms"] == 0.44 and tl["idle_ms"] == 1.06
    assert tl["gaps"] == 2 and tl["gaps_ms"] == 1.05
    assert tl["longest"][0] == dict(gap_us=1000.0, before="adam", after="embed")
    assert tl["longest"][1] == dict(gap_us=50.0, before="mm2", after="norm")
    assert bench.timeline_gaps([])["busy_ms"] == 0.0


def _numbers_in(section: str) -> bool:
    return any(re.search(r"\|\s*[\d,]+(\.\d+)?\s*\|", ln) for ln in section.splitlines() if ln.startswith("|"))


@pytest.mark.slow
def test_cpu_dry_run_writes_every_section_with_numbers(tmp_path):
    """Every stage for real at tiny size on the CPU (~2-4 min on 2 cores): pytest -m gpu (all skip here), bench
    rows in their own processes (one compile row, torch.compile disabled to keep it short), four trainer runs
    reading metrics.jsonl, the profiler table."""
    out, work = tmp_path / "report", tmp_path / "work"
    # PEAK_FLOPS: the bench's bf16 matmul peak is a stated figure, not measured (a bf16 1024^3 matmul takes
    # ~3 s on a CPU without bf16 units, and the measurement runs 8+ of them per bench stage: ~50 s of this test)
    r = subprocess.run([PY, SCRIPT, "--dry-run-cpu", "--dry-compile=off", "--out-dir", str(out), "--work-dir",
                        str(work)], capture_output=True, text=True, cwd=ROOT, timeout=1500,
                       env=dict(os.environ, PEAK_FLOPS="1e11"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    md = (out / "report.md").read_text()
    rep = json.loads((out / "report.json").read_text())
    failures = md[md.find("## Failures"):]
    stages = ("tests", "bench-124m", "bench-1b", "train", "profile", "optimizer", "kernels", "profile-1b", "bench-ab")
    assert {n: s["status"] for n, s in rep["stages"].items()} == {n: "ok" for n in stages}, failures
    sections = re.split(r"^## ", md, flags=re.M)
    titles = [s.splitlines()[0] for s in sections[1:]]
    assert [t.split(" ")[0] for t in titles] == ["Stages", "1.", "2.", "3.", "4.", "5.", "6.", "Failures"], titles
    for s in sections[1:-1]:
        assert _numbers_in(s), s[:500]
    assert "CPU DRY RUN" in md and "torch" in md and "git revision" in md
    tests = rep["stages"]["tests"]["data"]["counts"]
    assert tests.get("skipped", 0) > 0  # the gpu tests are collected and skipped without CUDA
    rows = {(x["model"], x["precision"], x["mode"]): x for x in rep["stages"]["bench-124m"]["data"]["rows"]
            + rep["stages"]["bench-1b"]["data"]["rows"]}
    ours, hf = rows[("ours", "trainer", "eager")], rows[("hf", "autocast", "eager")]
    assert ours["tokens_per_s"] > 0 and hf["tokens_per_s"] > 0
    assert rows[("ours", "trainer", "compile")]["tokens_per_s"] > 0
    # where a row's fixed cost goes: its process's time, within the parent's wall time for it
    assert 0 < ours["in_process_s"] <= ours["wall_s"] and "outside the process (start-up, exit)" in md
    assert rows[("hf-liger", "autocast", "eager")]["skipped"] == "liger-kernel not installed"
    # the A/B stage (in the time left): its row joins the bench tables, with its ratio to the verdict's row
    ab = {(x["model"], x["precision"], x["mode"]): x for x in rep["stages"]["bench-ab"]["data"]["rows"]}
    assert ab[("ours-gradbuf", "trainer", "eager")]["tokens_per_s"] > 0
    assert "| tiny | ours-gradbuf |" in md and "| tiny | ours / ours-gradbuf (" in md
    # ours and HF start from the same weights and batch: the same first loss (bf16 rounding apart)
    assert abs(ours["first_loss"] - hf["first_loss"]) < 0.02
    runs = rep["stages"]["train"]["data"]["runs"]
    assert [x["name"] for x in runs] == ["auto-eager", "auto-compile"]  # the verdict's two (--full: four)
    assert all(x["tokens_per_s_median"] > 0 and x["mfu_window"] > 0 and x["steps"] == 4 for x in runs)
    assert "cross_entropy chunked" in runs[0]["kernels"]
    side = rep["stages"]["tests"]["data"]["side"]
    assert side["train_data"]["data_dir"]  # prepared beside the tests, and the compiled trainer run prewarmed
    assert side["prewarm_train"]["rc"] == 0 and not side["prewarm_train"]["timed_out"], side
    kern = rep["stages"]["kernels"]["data"]["rows"]  # the per-op bench: every op measured in both modes
    assert {(r["op"], r["mode"]) for r in kern if r.get("us", 0) > 0} == {
        (op, mode) for op in ("loss", "rms_norm", "add_rms_norm", "rope", "swiglu") for mode in ("eager", "compile")}
    opt = rep["stages"]["optimizer"]["data"]["rows"]  # the optimizer bench: torch's rows at least (Triton's need
    assert {r["kernel"] for r in opt} == {"grad norm", "AdamW"} and all(r["ms"] > 0 for r in opt)  # the interpreter)
    prof = rep["stages"]["profile"]["data"]
    assert prof["top"] and prof["top"][0]["self_ms"] > 0 and "Self CPU time total" in prof["table"]
    assert "## Failures\n\nNone." in md
