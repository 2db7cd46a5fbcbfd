"""optimizer/flat_adamw.py and its step path (optimizer/one_launch_step.py): AdamW over a whole DDP buffer in one
launch.

The kernel runs here in the Triton interpreter (TRITON_INTERPRET=1, tests/conftest.py) and is compared with
its torch reference and with torch.optim.AdamW + clip_grad_norm_, all within float32's own error against a
float64 run of the same formula. The optimizer's wiring (masters, moments as views, decay mask, step count,
skip, state dicts, op count) is checked through a real engine with the path forced on; on CUDA it is the
default (`OptimizerConfig.one_launch = "auto"`, optimizer/one_launch_step.py), checked by the GPU test
at the end against torch's fused AdamW.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

from optimizer.flat_adamw import adamw_flat, triton_runs_on

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _problem(n=5003, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g, dtype=dtype) * 0.02
    decay = (torch.rand(n, generator=g) < 0.7).to(torch.uint8)
    grads = [torch.randn(n, generator=g, dtype=dtype) * s for s in (3.0, 0.01, 1.0)]  # clipped, not, clipped
    return master, decay, grads


def _run(master, decay, grads, use_triton, max_norm=1.0, out_dtype=None):
    master = master.clone()
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    out = torch.zeros(master.shape, dtype=out_dtype) if out_dtype is not None else None
    for step, grad in enumerate(grads, 1):
        sumsq = grad.double().square().sum().to(master.dtype)
        adamw_flat(master, grad.to(master.dtype), m, v, decay, out, sumsq, max_norm=max_norm, step=step,
                   use_triton=use_triton, **HYPER)
    return master, m, v, out


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
def test_the_kernel_equals_its_reference_and_torch_adamw_within_float32s_own_error():
    m64, decay, grads = _problem()
    exact = _run(m64, decay, grads, use_triton=False)[0]  # the formula in float64
    ref = _run(m64.float(), decay, grads, use_triton=False)[0]
    tri, _, _, out = _run(m64.float(), decay, grads, use_triton=True, out_dtype=torch.bfloat16)
    budget = (ref.double() - exact).abs().max().item()  # float32's own error on this problem
    assert 0 < budget < 1e-6
    assert (tri.double() - exact).abs().max().item() <= 4 * budget
    assert torch.equal(out, tri.to(torch.bfloat16))  # the low-precision copy written from the new master
    # torch's AdamW on the same problem: per-parameter groups (decayed / not), clip_grad_norm_ first
    p_dec = torch.nn.Parameter(m64.float()[decay.bool()].clone())
    p_no = torch.nn.Parameter(m64.float()[~decay.bool()].clone())
    opt = torch.optim.AdamW([{"params": [p_dec], "weight_decay": HYPER["weight_decay"]},
                             {"params": [p_no], "weight_decay": 0.0}], lr=HYPER["lr"],
                            betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"], foreach=False)
    for grad in grads:
        p_dec.grad, p_no.grad = grad.float()[decay.bool()].clone(), grad.float()[~decay.bool()].clone()
        torch.nn.utils.clip_grad_norm_([p_dec, p_no], 1.0)
        opt.step()
    torch_flat = torch.empty_like(ref)
    torch_flat[decay.bool()], torch_flat[~decay.bool()] = p_dec.detach(), p_no.detach()
    assert (torch_flat.double() - exact).abs().max().item() <= 4 * budget


@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
def test_a_non_finite_norm_writes_nothing(use_triton):
    if use_triton and not triton_runs_on(torch.device("cpu")):
        pytest.skip("needs Triton and TRITON_INTERPRET=1")
    master, decay, grads = _problem(n=300, dtype=torch.float32)
    m, v = torch.rand(300), torch.rand(300)
    out = torch.zeros(300, dtype=torch.bfloat16)
    before = [t.clone() for t in (master, m, v, out)]
    for bad in (float("inf"), float("nan")):
        adamw_flat(master, grads[0], m, v, decay, out, torch.tensor(bad), max_norm=1.0, step=3,
                   use_triton=use_triton, **HYPER)
        assert all(torch.equal(a, b) for a, b in zip((master, m, v, out), before))


# ------------------------------------------------------------------------------------------ in the optimizer
def _engine(flat, monkeypatch, dtype="bf16", grads_on_params="off", **flags):
    """A 2-layer engine with the one-launch AdamW `flat` (OptimizerConfig.one_launch: auto | on | off; None: the
    config's default, so MYLLM_FLAT_ADAMW applies); its gradients in DDP's buffers (grads_on_params="off": what
    these tests check) or, where they can, on the parameters ("auto": the default of one process with one
    micro-batch a step, tests/optimizer/test_grads_on_params.py)."""
    from model import ModelConfig, Transformer
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    _optimizer_fields(monkeypatch, fused=True, grads_on_params=grads_on_params == "auto",
                      **({} if flat is None else {"one_launch": flat}))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16,
                                    max_seq_len=16))
    cfg = TrainConfig(**{**dict(device="cpu", dtype=dtype, learning_rate=1e-2, grad_clip=0.5, weight_decay=0.1,
                                bucket_size=3000), **flags})
    return build_engine(model, cfg, device=torch.device("cpu"))


def _optimizer_fields(monkeypatch, **fields):
    """The engines parallel.build builds from here on get their OptimizerConfig with `fields` over the flags'."""
    import dataclasses

    from parallel import build
    real = build.optimizer_config
    monkeypatch.setattr(build, "optimizer_config", lambda f: dataclasses.replace(real(f), **fields))


def _steps(engine, n, seed=0, poison_at=None, step=None):
    """n steps on random batches (NaN gradients on step `poison_at`); each step's result: `step(engine)`, by
    default `engine.optimizer.step()`."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        x = torch.randint(0, 64, (2, 16), generator=g)
        engine.optimizer.zero_grad()
        engine.forward_backward([{"input_ids": x, "labels": x}],
                                lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {}), 32.0)
        if i == poison_at:
            p = next(iter(engine.model.param_to_bucket))
            (p.grad if engine.model.grads_on_params else p.main_grad).fill_(float("nan"))
        out.append(step(engine) if step is not None else engine.optimizer.step())
    return out


def _zero_batch_backward(e):
    """Gradients of one all-zeros batch, ready for a counted step."""
    e.optimizer.zero_grad()
    e.forward_backward([{"input_ids": torch.zeros(2, 16, dtype=torch.long),
                         "labels": torch.zeros(2, 16, dtype=torch.long)}],
                       lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {}), 32.0)


def _params(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
def test_the_optimizer_in_one_launch_follows_torchs_fused_adamw(monkeypatch):
    """fp32 parameters (their own masters), two buckets, clipping active: 4 steps with the one-launch path forced
    on follow torch's fused AdamW path within float32 rounding, with the same state dict (keys, moments, step
    count). bf16 parameters (fp32 masters): the decay mask is the pieces' own, and every bf16 parameter is its
    master rounded to bf16, written by the kernel."""
    flat = _engine("on", monkeypatch, dtype="fp32")
    assert flat.optimizer.flat is not None and len(flat.model.buckets) >= 2
    ref = _engine("off", monkeypatch, dtype="fp32")
    assert ref.optimizer.flat is None
    rf, rr = _steps(flat, 4), _steps(ref, 4)
    assert all(s for s, _ in rf) and [n for _, n in rf] == pytest.approx([n for _, n in rr], rel=1e-5)
    pf, pr = _params(flat), _params(ref)
    for k in pr:
        torch.testing.assert_close(pf[k], pr[k], rtol=1e-5, atol=1e-6)
    sf, sr = flat.optimizer.state_dict(), ref.optimizer.state_dict()
    assert sf["params"].keys() == sr["params"].keys()
    for name, e in sr["params"].items():
        assert sf["params"][name]["step"] == e["step"] == 4.0
        torch.testing.assert_close(sf["params"][name]["exp_avg"], e["exp_avg"], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(sf["params"][name]["exp_avg_sq"], e["exp_avg_sq"], rtol=1e-4, atol=1e-9)

    low = _engine("on", monkeypatch)
    fl = low.optimizer.flat
    assert fl is not None and len(fl.buffers) == 1 and fl.buffers[0].param_out is not None
    covered = torch.zeros_like(fl.buffers[0].decay)
    for pc in low.optimizer.pieces:
        lo = pc.main.storage_offset() - fl.buffers[0].master.storage_offset()
        assert bool((fl.buffers[0].decay[lo:lo + pc.main.numel()] == int(pc.decay)).all()), pc.name
        covered[lo:lo + pc.main.numel()] = 1
    assert int(fl.buffers[0].decay[covered == 0].sum()) == 0  # alignment gaps: no decay
    assert any(pc.decay for pc in low.optimizer.pieces) and not all(pc.decay for pc in low.optimizer.pieces)
    _steps(low, 3)
    masters = low.optimizer.state_dict()["params"]
    for name, p in low.module.named_parameters():
        assert torch.equal(p.detach().reshape(-1), masters[name]["main"].to(torch.bfloat16)), name


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
def test_resume_skip_and_a_constant_number_of_launches(monkeypatch):
    """3 steps, state dict, a new optimizer loads it and takes 2 more = 5 steps uninterrupted, bit for bit; the
    state also loads into torch's fused path; a NaN gradient skips the step on the device (nothing changes,
    the step count stays); the step is the same few ops for a bigger model."""
    from tests.optimizer.test_step_launches import CountLaunches
    a = _engine("on", monkeypatch)
    _steps(a, 5)
    b = _engine("on", monkeypatch)
    _steps(b, 3)
    sd = b.optimizer.state_dict()
    c = _engine("on", monkeypatch)
    c.optimizer.load_state_dict(sd)
    _steps(c, 2, seed=1)
    _steps(b, 2, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(_params(b).values(), _params(c).values()))
    d = _engine("off", monkeypatch)
    d.optimizer.load_state_dict(sd)
    assert d.optimizer.state_dict()["params"].keys() == sd["params"].keys()
    before = _params(c)
    steps_before = c.optimizer.flat.steps
    (stepped, norm), = _steps(c, 1, seed=2, poison_at=0)
    assert not stepped and norm == float("inf") and c.optimizer.flat.steps == steps_before
    assert all(torch.equal(x, y) for x, y in zip(before.values(), _params(c).values()))

    counts = []
    for flags in ({}, {"n_layers": 4, "dim": 64}):
        e = _engine("on", monkeypatch)
        if flags:
            from model import ModelConfig, Transformer
            from parallel.build import build_engine
            from trainer.config import TrainConfig
            torch.manual_seed(0)
            e = build_engine(Transformer(ModelConfig(vocab_size=64, n_heads=4, n_kv_heads=2, multiple_of=16,
                                                     max_seq_len=16, **flags)),
                             TrainConfig(device="cpu", dtype="bf16", grad_clip=0.5, bucket_size=3000),
                             device=torch.device("cpu"))
            assert e.optimizer.flat is not None and len(e.model.buckets) > 2
        _steps(e, 1)
        _zero_batch_backward(e)
        kernels = []  # the kernel's launches, counted apart (the interpreter runs many torch ops inside one)
        monkeypatch.setattr("optimizer.one_launch_step.adamw_flat", lambda *a, **k: kernels.append(1))
        with CountLaunches() as launches:
            e.optimizer.step()
        monkeypatch.undo()
        counts.append(len(launches.ops) + len(kernels))
    # the norm (vector_norm, its square), the kernel, the host copy of the norm: the same for any model size
    assert counts[0] == counts[1] <= 6, counts


def test_zero1_step_is_a_few_ops_for_any_model_size(monkeypatch):
    """ZeRO-1 with the one-launch step: the shards' sum of squares (its two launches counted as such), the
    norm's all-reduce copy, the kernel, the host copy, and the parameter all-gathers (none at world 1): the same
    count for 2 layers in 2 buckets and 4 layers in many."""
    import optimizer.one_launch_step as ols
    from model import ModelConfig, Transformer
    from parallel.build import build_engine
    from tests.optimizer.test_step_launches import CountLaunches
    from trainer.config import TrainConfig
    counts = []
    for layers, bucket in ((2, 3000), (4, 1500)):
        _optimizer_fields(monkeypatch, fused=True, one_launch="on")
        torch.manual_seed(0)
        e = build_engine(Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2,
                                                 multiple_of=16, max_seq_len=16)),
                         TrainConfig(device="cpu", dtype="bf16", grad_clip=0.5, bucket_size=bucket,
                                     use_distributed_optimizer=True), device=torch.device("cpu"))
        assert e.optimizer.flat is not None and len(e.model.buckets) >= 2 + (layers > 2)
        _steps(e, 1)
        _zero_batch_backward(e)
        kernels = []
        monkeypatch.setattr(ols, "adamw_segments", lambda *a, **k: kernels.append(1))
        monkeypatch.setattr(ols, "sumsq_segments", lambda g, segs, t: kernels.extend((1, 1)) or torch.ones(()))
        with CountLaunches() as launches:
            e.optimizer.step()
        monkeypatch.undo()
        counts.append(len(launches.ops) + len(kernels))
    assert counts[0] == counts[1] <= 8, counts


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("moments", ["fp32", "bf16"])
def test_the_trainer_with_it_resumes_exactly(tiny_pretrain_run_args, tmp_path, moments):
    """train_my_ddp.py --dtype=bf16 with the one-launch AdamW forced on (MYLLM_FLAT_ADAMW=on; the kernel in the
    interpreter; one process, so the gradients stay on the parameters): a crash at step 5 resumed from the step-3
    checkpoint gives the uninterrupted run's losses and weights bit for bit (the moments and the step count travel
    through the checkpoint; --optimizer_state_dtype=bf16: saved as bf16, their rounding seeded by the step)."""
    import os

    from tests.conftest import child_env, run_trainer, train_cmd
    from checkpoint.files import load_model_state
    from checkpoint.verify import find_latest_valid
    from utils.metrics import dedupe_by_step, read_metrics
    args = [*tiny_pretrain_run_args, "--max_iters=6", "--dtype=bf16", "--grad_clip=0.5",
            f"--optimizer_state_dtype={moments}"]
    env = child_env(MYLLM_FLAT_ADAMW="on")
    ref, crashed = tmp_path / "ref", tmp_path / "crashed"
    proc = run_trainer(train_cmd([*args, f"--out_dir={ref}"]), env)
    said = "AdamW in one launch per parameter buffer (1 buffer(s), Triton)" + \
        ("; moments in bf16, rounded stochastically" if moments == "bf16" else "\n")
    assert proc.returncode == 0 and said in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    # one process, one micro-batch a step: the gradients were read from the parameters (no gradient buffer)
    assert "gradients read from the parameters" in proc.stdout + proc.stderr
    once = tmp_path / "fired"
    proc = run_trainer(train_cmd([*args, f"--out_dir={crashed}"]),
                       dict(env, MYLLM_FAULT="crash@5", MYLLM_FAULT_ONCE_FILE=str(once)))
    assert proc.returncode != 0 and once.exists()
    assert run_trainer(train_cmd([*args, f"--out_dir={crashed}"]), env).returncode == 0
    losses = [{s: r["loss"] for s, r in dedupe_by_step(read_metrics(os.path.join(d, "metrics.jsonl"))).items()}
              for d in (ref, crashed)]
    assert losses[0] == losses[1] and sorted(losses[0]) == [1, 2, 3, 4, 5, 6]
    a, b = (load_model_state(find_latest_valid(str(d))) for d in (ref, crashed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    saved = torch.load(os.path.join(find_latest_valid(str(crashed)), "optimizer_rank0.pt"), weights_only=True)
    entries = saved["params"]
    assert {e["exp_avg_sq"].dtype for e in entries.values()} == {dict(fp32=torch.float32, bf16=torch.bfloat16)[moments]}


def test_where_one_launch_applies(monkeypatch):
    """"auto" is CUDA only; ZeRO-1 takes it (over the rank's shards); ZeRO-2, PowerSGD, Muon, fp16 and the
    overlapped step keep torch's AdamW."""
    assert _engine("auto", monkeypatch).optimizer.flat is None  # CPU
    assert _engine("on", monkeypatch, dtype="fp32").optimizer.flat is not None  # fp32: the params are the masters
    zero1 = _engine("on", monkeypatch, use_distributed_optimizer=True).optimizer.flat
    assert zero1 is not None and all(b.segments is not None for b in zero1.buffers)
    for flags in ({"use_distributed_optimizer": True, "zero_stage": 2}, {"optimizer": "muon"},
                  {"overlap_optim_step": True}):
        assert _engine("on", monkeypatch, **flags).optimizer.flat is None, flags
    assert _engine("on", monkeypatch, dtype="fp16").optimizer.flat is None
    assert _engine("on", monkeypatch, comm_hook="powersgd", powersgd_rank=1).optimizer.flat is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("zero", [False, True], ids=["ddp", "zero1"])
def test_cuda_default_is_one_launch_and_follows_torchs_fused_adamw(zero):
    """On a GPU the trainer's optimizer takes the one-launch path by itself (the kernel compiled for real). fp32
    parameters: 4 steps follow torch's fused AdamW (the same model with the path turned off) within float32
    rounding, both fed the same gradients each step (the flat run's: two backward passes may differ in their
    last bits, e.g. by cuBLAS's choice for differently aligned buffers, and Adam's m / sqrt(v) turns such
    a difference on a near-zero gradient into a visible one). bf16 parameters: every parameter is its fp32
    master rounded to bf16, written by the kernel. zero1: the same through ZeRO-1's kernel over the rank's
    shards (at world 1 the whole buffer, cut into the row table). ddp: one process, one micro-batch a step, so
    the gradients stay on the parameters (the kernel reads them at their addresses)."""
    import dataclasses

    from model import ModelConfig, Transformer
    from parallel import build
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    device = torch.device("cuda")
    real = build.optimizer_config

    def engine(flat, dtype):
        build.optimizer_config = lambda f: dataclasses.replace(real(f), one_launch=flat)
        try:
            torch.manual_seed(0)
            model = Transformer(ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=64))
            return build_engine(model.to(device), TrainConfig(device="cuda", dtype=dtype, grad_clip=0.5,
                                                              learning_rate=1e-2, bucket_size=20000,
                                                              use_distributed_optimizer=zero), device=device)
        finally:
            build.optimizer_config = real

    def backward(e, x):
        e.optimizer.zero_grad()
        e.forward_backward([{"input_ids": x, "labels": x}],
                           lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {}), 256.0)

    def step(e):
        stepped, norm = e.optimizer.step()
        assert stepped and math.isfinite(norm)

    def params(e):
        return {n: p.detach().float().cpu() for n, p in e.module.named_parameters()}

    flat, ref = engine("auto", "fp32"), engine("off", "fp32")
    assert flat.optimizer.flat is not None and flat.optimizer.flat.use_triton and ref.optimizer.flat is None
    assert all((b.segments is not None) == zero for b in flat.optimizer.flat.buffers)
    assert flat.model.grads_on_params != zero and not ref.model.grads_on_params
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        x = torch.randint(0, 256, (4, 64), generator=g).to(device)
        backward(flat, x)
        backward(ref, x)
        for pf, pr in zip(flat.module.parameters(), ref.module.parameters()):
            pr.main_grad.copy_(pf.grad if flat.model.grads_on_params else pf.main_grad)
        step(flat)
        step(ref)
    pf, pr = params(flat), params(ref)
    assert flat.optimizer.flat is not None  # the kernel ran (a failure to build it falls back, logged)
    for k in pr:
        torch.testing.assert_close(pf[k], pr[k], rtol=1e-5, atol=1e-5)
    low = engine("auto", "bf16")
    assert low.model.grads_on_params != zero
    for _ in range(4):
        backward(low, torch.randint(0, 256, (4, 64), generator=g).to(device))
        step(low)
    assert low.optimizer.flat is not None
    masters = low.optimizer.state_dict()["params"]
    for name, p in low.module.named_parameters():
        assert torch.equal(p.detach().reshape(-1).cpu(), masters[name]["main"].to(torch.bfloat16)), name


@pytest.mark.parametrize("fp32_grads", [True, False], ids=["fp32-grads", "bf16-grads"])
def test_a_kernel_that_cannot_be_built_falls_back_to_torchs_adamw_once(monkeypatch, caplog, fp32_grads):
    """A first launch that raises (no writes yet) is logged once and the step is torch's fused AdamW's, from then
    on; the same error after a launch succeeded is raised (never a half-applied step, never a silent switch).
    bf16 gradient buffers: the kernel read them in place; torch's AdamW gets its fp32 copies from the hand-over."""
    import optimizer.one_launch_step as mpo
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no kernel here")
    flat = _engine("on", monkeypatch, grad_reduce_in_fp32=fp32_grads)
    ref = _engine("off", monkeypatch, grad_reduce_in_fp32=fp32_grads)
    assert all(fb.grad_store is None for fb in flat.optimizer.flat_buckets.values())
    assert all((fb.grad_store is None) == fp32_grads for fb in ref.optimizer.flat_buckets.values())
    monkeypatch.setattr(mpo, "adamw_flat", broken)
    with caplog.at_level("WARNING", logger="optimizer.one_launch_step"):
        rf, rr = _steps(flat, 2), _steps(ref, 2)
    assert calls == [1] and flat.optimizer.flat is None and "one-launch AdamW off" in caplog.text
    assert all((fb.grad_store is None) == fp32_grads for fb in flat.optimizer.flat_buckets.values())
    assert rf == rr and all(torch.equal(a, b) for a, b in zip(_params(flat).values(), _params(ref).values()))
    again = _engine("on", monkeypatch)
    monkeypatch.setattr(mpo, "adamw_flat", lambda *a, **k: None)
    _steps(again, 1)
    monkeypatch.setattr(mpo, "adamw_flat", broken)
    with pytest.raises(RuntimeError, match="no kernel here"):
        _steps(again, 1)


# ------------------------------------------------------------------------------------------ ZeRO-1: shards
@pytest.mark.parametrize("use_triton", [False, True], ids=["reference", "triton"])
@pytest.mark.parametrize("compact_master", [True, False], ids=["bf16-params", "fp32-params"])
def test_the_shards_step_equals_the_flat_step_on_the_gathered_shards(use_triton, compact_master):
    """adamw_segments over scattered buffer ranges (two owned ranges, one longer than a block, one shorter) is
    adamw_flat on those ranges gathered, bit for bit (the same kernel body); nothing outside them is written;
    sumsq_segments is their sum of squares."""
    from optimizer.flat_adamw import BLOCK, Segments, adamw_segments, sumsq_segments
    if use_triton and not triton_runs_on(torch.device("cpu")):
        pytest.skip("needs Triton and TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(5)
    n_buf = 3 * BLOCK + 500
    segs = Segments([(0, 100, BLOCK + 37), (BLOCK + 37, 2 * BLOCK + 300, 211)], torch.device("cpu"))
    idx = torch.cat([torch.arange(b, b + n) for _, b, n in segs.spans])
    grad = torch.randn(n_buf, generator=g)
    params = torch.randn(n_buf, generator=g) * 0.02
    m, v = torch.rand(segs.numel, generator=g) * 0.01, torch.rand(segs.numel, generator=g) * 1e-4
    decay = (torch.rand(segs.numel, generator=g) < 0.5).to(torch.uint8)
    sumsq = torch.tensor(40.0)  # norm 6.3 > max_norm: clipped
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, max_norm=1.0, step=3)
    # expected: the contiguous step on the gathered ranges
    em, ev, emaster = m.clone(), v.clone(), params[idx].clone()
    eout = torch.zeros(segs.numel, dtype=torch.bfloat16) if compact_master else None
    adamw_flat(emaster, grad[idx].clone(), em, ev, decay, eout, sumsq, use_triton=use_triton, **hyper)
    if compact_master:  # bf16 parameters in the buffer, fp32 masters compact
        master, out = params[idx].clone(), params.to(torch.bfloat16)
    else:  # fp32 parameters: the buffer is the master
        master, out = params.clone(), None
    before_master, before_out = master.clone(), out.clone() if out is not None else None
    adamw_segments(master, grad, m, v, decay, out, sumsq, segs, master_compact=compact_master,
                   use_triton=use_triton, **hyper)
    assert torch.equal(m, em) and torch.equal(v, ev)
    outside = torch.ones(n_buf, dtype=torch.bool)
    outside[idx] = False
    if compact_master:
        assert torch.equal(master, emaster) and torch.equal(out[idx], eout)
        assert torch.equal(out[outside], before_out[outside])
    else:
        assert torch.equal(master[idx], emaster) and torch.equal(master[outside], before_master[outside])
    s = sumsq_segments(grad, segs, use_triton)
    torch.testing.assert_close(s, grad[idx].double().square().sum().float(), rtol=1e-6, atol=0)


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_norm_kernels_count_every_row_once_over_several_programs(dtype):
    """The sum-of-squares kernels take SUMSQ_ROWS table rows a program: over 2 SUMSQ_ROWS + 3 rows (three
    programs, the last one short, rows shorter than a block among them) each element counts once, and a
    parameter no gradient reached counts nothing."""
    from optimizer.flat_adamw import BLOCK, SUMSQ_ROWS, ParamGrads, Segments, sumsq_param_grads, sumsq_segments
    g = torch.Generator().manual_seed(11)
    # segments (ZeRO-1): the rows of spans of 5 blocks + 7, 300, and the rest in whole blocks: 2 SUMSQ_ROWS + 3 rows
    rest = 2 * SUMSQ_ROWS + 3 - 6 - 1
    spans = [(0, 40, 5 * BLOCK + 7), (0, 6 * BLOCK + 100, 300), (0, 7 * BLOCK, rest * BLOCK)]
    segs = Segments(spans, torch.device("cpu"))
    assert segs.table.shape[0] == 2 * SUMSQ_ROWS + 3
    grad = torch.randn((7 + rest) * BLOCK, generator=g).to(dtype)
    want = torch.cat([grad[b:b + n] for _, b, n in spans]).double().square().sum()
    torch.testing.assert_close(sumsq_segments(grad, segs, True).double(), want, rtol=1e-6, atol=0)
    # gradients on the parameters: 3 blocks + 5, 200 (no gradient), the rest in whole blocks
    sizes = [3 * BLOCK + 5, 200, (2 * SUMSQ_ROWS + 3 - 4 - 1) * BLOCK]
    params, start = [], 0
    for n in sizes:
        params.append((torch.nn.Parameter(torch.zeros(n, dtype=dtype)), start))
        start += n + 11
    for (p, _), n in zip(params, sizes):
        p.grad = torch.randn(n, generator=g).to(dtype)
    params[1][0].grad = None
    pg = ParamGrads(params, start, torch.device("cpu"), torch.ones(start, dtype=torch.uint8))
    assert pg.table.shape[0] == 2 * SUMSQ_ROWS + 3
    grads = pg.grads()
    want = sum(x.double().square().sum() for x in grads if x is not None)
    torch.testing.assert_close(sumsq_param_grads(pg, pg.addresses(grads)).double(), want, rtol=1e-6, atol=0)


@pytest.mark.skipif(not triton_runs_on(torch.device("cpu")), reason="needs Triton and TRITON_INTERPRET=1")
def test_the_kernels_are_told_aligned_only_where_every_row_and_gradient_address_is():
    """GradAddresses.aligned, each step: the compiler reads 16-byte vectors where it is True (a misaligned vector
    access is a GPU fault), so it must be False for a gradient at an address that is not a multiple of 16 bytes
    (a view into another tensor) and for a parameter whose size or buffer start is not a multiple of 16 elements;
    either way the norm and the update are the same numbers."""
    from optimizer.flat_adamw import ParamGrads, adamw_param_grads, sumsq_param_grads
    g = torch.Generator().manual_seed(5)

    def build(sizes, starts):
        params = [(torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)), s) for n, s in zip(sizes, starts)]
        for p, _ in params:
            p.grad = torch.randn(p.numel(), generator=g).to(torch.bfloat16)
        return ParamGrads(params, starts[-1] + sizes[-1], torch.device("cpu"),
                          torch.ones(starts[-1] + sizes[-1], dtype=torch.uint8)), params

    pg, params = build([1024 + 32, 64], [0, 1088])
    assert pg.addresses(pg.grads()).aligned
    # the second gradient a view one element into a larger tensor: 2 bytes off a 16-byte boundary
    base = torch.randn(65, generator=g).to(torch.bfloat16)
    params[1][0].grad = base[1:]
    grads = pg.grads()
    assert grads[1].data_ptr() % 16 != 0 and not pg.addresses(grads).aligned
    odd, _ = build([1024 + 8, 64], [0, 1088])  # a parameter of 1,032 elements: its last row counts 8
    assert not odd.aligned and not odd.addresses(odd.grads()).aligned
    assert not build([1024, 64], [0, 1032])[0].aligned  # a buffer start not a multiple of 16
    # the same numbers either way (the interpreter ignores the hints; this is the kernels' shared code path)
    fresh = [p.grad.clone() for p, _ in params]  # (kept alive: the kernels read them at their addresses)
    aligned, unaligned = pg.addresses(fresh), pg.addresses(grads)
    assert aligned.aligned and not unaligned.aligned
    assert torch.equal(sumsq_param_grads(pg, aligned), sumsq_param_grads(pg, unaligned))
    outs = []
    for addrs in (aligned, unaligned):
        master = torch.zeros(pg.numel)
        m, v, out = torch.zeros(pg.numel), torch.zeros(pg.numel), torch.zeros(pg.numel, dtype=torch.bfloat16)
        adamw_param_grads(master, pg, addrs, m, v, out, torch.tensor(1.0), lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                          weight_decay=0.1, max_norm=1.0, step=1)
        outs.append((master, m, v, out))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert outs[0][0].abs().sum() > 0
    # ZeRO's shards: aligned where every start and length is a multiple of 16 elements, and the norm the same
    from optimizer.flat_adamw import Segments, sumsq_segments
    grad = torch.randn(8 * 1024, generator=g).to(torch.bfloat16)
    even, odd = Segments([(0, 0, 2048), (2048, 4096, 1040)], grad.device), Segments([(0, 8, 2048)], grad.device)
    assert even.aligned and not odd.aligned and not Segments([(0, 0, 2050)], grad.device).aligned
    for segs in (even, odd):
        want = torch.cat([grad[b:b + n] for _, b, n in segs.spans]).double().square().sum()
        torch.testing.assert_close(sumsq_segments(grad, segs, True).double(), want, rtol=1e-6, atol=0)


def _zero_engine(flat: str, dtype=torch.bfloat16, fp32_grads=True, zero=True, state_dtype="fp32", grad_clip=0.5):
    from optimizer import OptimizerConfig, build_optimizer
    from parallel import DDPConfig, DistributedDataParallel
    from tests.optimizer.test_optimizer import _net
    m = _net(dtype)
    ddp = DistributedDataParallel(m, DDPConfig(use_distributed_optimizer=zero, pad_alignment=1, param_alignment=1,
                                               bucket_size=40, grad_reduce_in_fp32=fp32_grads))  # as the trainer
    opt = build_optimizer(ddp, OptimizerConfig(precision="bf16" if dtype == torch.bfloat16 else "fp32",
                                               use_distributed_optimizer=zero, lr=1e-2, weight_decay=0.1,
                                               grad_clip=grad_clip, state_dtype=state_dtype, one_launch=flat))
    return m, ddp, opt


def _zero_steps(ddp, opt, steps, seed=3):
    from tests.optimizer.test_optimizer import _step
    g = torch.Generator().manual_seed(seed)
    return [_step(ddp, opt, torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(steps)]


def _zero_worker(rank, ws, d):
    """Per rank: ZeRO-1 with the one-launch step vs torch's AdamW (bf16 and fp32 parameters; bf16 ones also with
    bf16 gradients, reduced in bf16, with ZeRO-1 and without), 3 steps; then the one-launch run resumed from its
    step-2 state."""
    out = {}
    for name, dtype, fp32_grads, zero in _ZERO_CASES:
        m_on, ddp_on, opt_on = _zero_engine("on", dtype, fp32_grads, zero)
        m_off, ddp_off, opt_off = _zero_engine("off", dtype, fp32_grads, zero)
        out[f"{name}_flat"] = opt_on.flat is not None and opt_off.flat is None
        # the kernel reads bf16 gradients where they are; torch's AdamW gets fp32 copies
        stores = [[fb.grad_store is not None for fb in o.flat_buckets.values()] for o in (opt_on, opt_off)]
        out[f"{name}_stores"] = (any(stores[0]), all(stores[1]))
        out[f"{name}_triton"] = opt_on.flat.use_triton
        out[f"{name}_split"] = any(pc.lo > 0 or pc.hi < pc.param.numel() for pc in opt_on.pieces) or not zero
        out[f"{name}_norms"] = ([n for _, n in _zero_steps(ddp_on, opt_on, 3)],
                                [n for _, n in _zero_steps(ddp_off, opt_off, 3)])
        out[f"{name}_params"] = ([p.detach().float().clone() for p in m_on.parameters()],
                                 [p.detach().float().clone() for p in m_off.parameters()])
        sd_on, sd_off = opt_on.state_dict(), opt_off.state_dict()
        out[f"{name}_state"] = (sd_on["params"], sd_off["params"])
    # resume: 2 steps, state, a new optimizer loads it, 1 more step == 3 steps uninterrupted
    m_a, ddp_a, opt_a = _zero_engine("on")
    _zero_steps(ddp_a, opt_a, 3)
    m_b, ddp_b, opt_b = _zero_engine("on")
    _zero_steps(ddp_b, opt_b, 2)
    sd = opt_b.state_dict()
    m_c, ddp_c, opt_c = _zero_engine("on")
    m_c.load_state_dict(m_b.state_dict())
    opt_c.load_state_dict(sd)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(3)]
    from tests.optimizer.test_optimizer import _step
    _step(ddp_c, opt_c, *batches[2])
    out["resumed_equal"] = all(torch.equal(a, c) for a, c in zip(m_a.parameters(), m_c.parameters()))
    # bf16 moments, clipping off (the update then does not depend on the norm's summation order): ZeRO-1's shards and
    # the unsharded step round alike (seeded by buffer offsets), so both keep the same bits
    bf16m = {}
    for zero in (True, False):
        m_z, ddp_z, opt_z = _zero_engine("on", zero=zero, state_dtype="bf16", grad_clip=0.0)
        _zero_steps(ddp_z, opt_z, 3)
        bf16m[zero] = ([p.detach().clone() for p in m_z.parameters()], opt_z.state_dict()["params"],
                       [b.start for b in ddp_z.buckets])
    out["bf16m_layouts"] = (bf16m[True][2], bf16m[False][2])
    out["bf16m_params_equal"] = all(torch.equal(a, b) for a, b in zip(bf16m[True][0], bf16m[False][0]))
    out["bf16m_state"] = (bf16m[True][1], bf16m[False][1])
    torch.save(out, os.path.join(d, f"zero_flat_rank{rank}.pt"))


# (name, parameter dtype, fp32 gradient buffers, ZeRO-1)
_ZERO_CASES = (("bfloat16", torch.bfloat16, True, True), ("float32", torch.float32, True, True),
               ("bfloat16_bf16grads", torch.bfloat16, False, True),
               ("bfloat16_bf16grads_ddp", torch.bfloat16, False, False))


def test_zero1_two_ranks_one_launch_follows_torchs_adamw_and_resumes(tmp_path):
    """ZeRO-1 at 2 ranks (shards cutting parameters): the one-launch step over each rank's shards (in the
    interpreter when TRITON_INTERPRET=1, else its torch reference) follows torch's AdamW step within float32
    rounding (norms, every parameter after the all-gather, the saved moments), for bf16 parameters with fp32
    masters and for fp32 ones; both ranks hold the same parameters; a resume from step 2 is bit-exact. bf16
    gradients (--grad_reduce_in_fp32=false), with ZeRO-1 and unsharded: the kernel reads them in place (no fp32
    gradient store, which torch's AdamW needs) and follows torch's AdamW the same way."""
    from tests.dist_helpers import spawn
    spawn(_zero_worker, 2, str(tmp_path))
    res = [torch.load(tmp_path / f"zero_flat_rank{r}.pt", weights_only=True) for r in range(2)]
    for r, out in enumerate(res):
        for name, _, fp32_grads, _ in _ZERO_CASES:
            assert out[f"{name}_flat"] and out[f"{name}_split"], (r, name)
            assert out[f"{name}_stores"] == (False, not fp32_grads), (r, name)
            assert out[f"{name}_triton"] == triton_runs_on(torch.device("cpu")), (r, name)  # the kernel, if it can
            on, off = out[f"{name}_norms"]
            assert on == pytest.approx(off, rel=1e-5), (r, name)
            tol = dict(rtol=0, atol=8e-3) if name.startswith("bfloat16") else dict(rtol=1e-5, atol=1e-6)  # 1 ulp
            for a, b in zip(*out[f"{name}_params"]):
                torch.testing.assert_close(a, b, **tol)
            st_on, st_off = out[f"{name}_state"]
            assert st_on.keys() == st_off.keys()
            for k, e in st_off.items():
                assert st_on[k]["step"] == e["step"] == 3.0 and (st_on[k]["lo"], st_on[k]["hi"]) == (e["lo"], e["hi"])
                for key in ("main", "exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(st_on[k][key], e[key], rtol=1e-4, atol=1e-7)
        assert out["resumed_equal"], r
        layouts = out["bf16m_layouts"]
        assert layouts[0] == layouts[1] and out["bf16m_params_equal"], (r, layouts)
        sharded, whole = out["bf16m_state"]
        for k, e in sharded.items():  # this rank's [lo, hi) of each parameter
            assert e["exp_avg"].dtype == torch.bfloat16
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(e[key], whole[k][key][e["lo"]:e["hi"]]), (r, k, key)
    for name, *_ in _ZERO_CASES:
        assert all(torch.equal(a, b) for a, b in zip(res[0][f"{name}_params"][0], res[1][f"{name}_params"][0]))
