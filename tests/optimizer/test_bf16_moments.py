"""--optimizer_state_dtype=bf16: AdamW's moments kept in bfloat16 and stored with stochastic rounding by the one-launch
AdamW (optimizer/flat_adamw.py).

The rounding's random bits are a hash of each element's buffer offset and the step, so the checks here are exact:
the Triton helper (run in the interpreter, TRITON_INTERPRET=1, tests/conftest.py) against its torch twin bit for
bit; ZeRO-1's shards against the whole buffer bit for bit; a resumed run against an uninterrupted one bit for bit.
Against fp32 moments the comparisons are statistical, with bounds derived from the fp32 run of the same inputs.
"""
from __future__ import annotations

import pytest
import torch

from optimizer.flat_adamw import (BLOCK, Segments, adamw_flat, adamw_segments, bf16_round_stochastic, state_seeds,
                                  triton_runs_on)
from tests.optimizer.test_flat_adamw import _engine, _params, _problem, _steps

needs_interpreter = pytest.mark.skipif(not triton_runs_on(torch.device("cpu")),
                                       reason="needs Triton and TRITON_INTERPRET=1")
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
# the kernel in the CPU interpreter, and compiled on a GPU (`make test-gpu`)
KERNEL_DEVICES = [pytest.param("cpu", id="interpreter"),
                  pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
                      not torch.cuda.is_available(), reason="needs CUDA")])]


def _kernel_runs(device: str) -> None:
    if not triton_runs_on(torch.device(device)):
        pytest.skip("needs Triton and TRITON_INTERPRET=1" if device == "cpu" else "needs Triton")


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The distance from each bf16 value to the next one away from zero (its unit in the last place)."""
    bits = x.to(torch.bfloat16).view(torch.int16)
    return ((bits + 1).view(torch.bfloat16).float() - x.to(torch.bfloat16).float()).abs()


if triton_runs_on(torch.device("cpu")):
    import triton
    import triton.language as tl

    from optimizer.flat_adamw import _round_bf16_stochastic

    @triton.jit
    def _rounding(x_ptr, out_ptr, n, base, seed, BLOCK: tl.constexpr):
        """The kernels' rounding helper alone, at buffer offsets base, base + 1, ..."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        tl.store(out_ptr + offs, _round_bf16_stochastic(x, offs.to(tl.int64) + base, seed).to(tl.bfloat16),
                 mask=offs < n)


@needs_interpreter
def test_the_kernels_rounding_is_its_torch_twin_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    n = 3000
    x = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)  # both signs, 60 orders of magnitude
    x[:3] = torch.tensor([0.0, -0.0, 1.0])  # zeros, an exact bf16 value (no subnormals: the interpreter flushes them)
    for base, seed in ((0, state_seeds(1, 0)[0]), (2 ** 32 + 77, state_seeds(123456, 3)[1])):  # offsets past 2^32
        out = torch.empty(n, dtype=torch.bfloat16)
        _rounding[(triton.cdiv(n, 1024),)](x, out, n, base, seed, BLOCK=1024)
        twin = bf16_round_stochastic(x, torch.arange(base, base + n), seed)
        assert torch.equal(out.view(torch.int16), twin.view(torch.int16))
        # each value lands on one of the two bf16 values around it
        lo = x.to(torch.bfloat16).float()  # (round to nearest: one of the two)
        assert bool(((twin.float() - x).abs() <= _bf16_step(lo)).all())
        assert torch.equal(twin[2:3], x[2:3].to(torch.bfloat16))  # an exact bf16 value is kept
    # the seeds' hash (Python ints) is the offsets' (int64 tensors)
    from optimizer.bf16_rounding import _hash32_, hash32
    values = [0, 1, 2 ** 31 + 7, 2 ** 32 - 1, *state_seeds(9, 2)]
    assert [hash32(v) for v in values] == _hash32_(torch.tensor(values, dtype=torch.int64)).tolist()


def test_the_rounding_is_unbiased_where_round_to_nearest_stalls():
    """A second moment with beta2 = 0.999 rising from 1 towards g^2 = 2: its per-step change (0.001) is below half
    a bf16 step at 1 (0.0039), so rounded to nearest it never moves. Through the kernel's torch reference with bf16
    moments (lr 0: only the moments move), 1,000 steps of 4,096 elements follow the fp32 moment on average."""
    n, steps = 4096, 1000
    beta2 = 0.999
    hyper = dict(HYPER, lr=0.0, beta2=beta2, weight_decay=0.0, max_norm=0.0)
    grad = torch.full((n,), 2.0 ** 0.5)
    master, decay = torch.zeros(n), torch.zeros(n, dtype=torch.uint8)
    m32, v32 = torch.zeros(n), torch.ones(n)
    m16, v16 = torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
    nearest = torch.ones(n, dtype=torch.bfloat16)
    sumsq = torch.tensor(2.0 * n)
    for step in range(1, steps + 1):
        adamw_flat(master, grad, m32, v32, decay, None, sumsq, step=step, use_triton=False, **hyper)
        adamw_flat(master, grad, m16, v16, decay, None, sumsq, step=step, use_triton=False, **hyper)
        nearest = (beta2 * nearest.float() + (1 - beta2) * 2.0).to(torch.bfloat16)
    target = v32[0].item()
    assert target == pytest.approx(2 - beta2 ** steps, rel=1e-4)  # 1.632
    assert torch.equal(nearest, torch.ones(n, dtype=torch.bfloat16))  # stalled at 1
    # the mean of n stochastic roundings: each element's accumulated rounding noise has a standard deviation of at
    # most half a bf16 step (2^-8 at [1, 2)) / sqrt(1 - beta2^2) = 0.087; the mean's is 64 times smaller: 7 of those
    spread = 2.0 ** -8 / (1 - beta2 ** 2) ** 0.5
    assert abs(v16.float().mean().item() - target) < 7 * spread / n ** 0.5
    assert float((v16.float() - target).abs().max()) < 7 * spread  # no element strays far
    assert bool((m16.float() - m32).abs().max() <= _bf16_step(m32).max())  # m's own changes are large: close
    assert len({state_seeds(s, b)[k] for s in range(1, 200) for b in range(3) for k in range(2)}) == 199 * 3 * 2


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_the_kernel_with_bf16_moments_follows_its_reference(device):
    """One step from the same bf16 moments through the kernel (interpreter) and its torch reference: the masters
    within float32's own error on this problem (the step uses the moments' fp32 values, rounded only when stored),
    the stored moments the same bf16 values except where float32's last bit differs across the rounding boundary
    (1 in 65,536 per such element: at most a handful here), and those by one bf16 step."""
    _kernel_runs(device)
    m64, decay, grads = (x.to(device) if torch.is_tensor(x) else [t.to(device) for t in x] for x in _problem())
    g = torch.Generator().manual_seed(1)
    m0 = (torch.randn(m64.numel(), generator=g) * 1e-2).to(device, torch.bfloat16)
    v0 = (torch.rand(m64.numel(), generator=g) * 1e-3).to(device, torch.bfloat16)
    grad = grads[0].float()
    sumsq = grads[0].double().square().sum().float()
    hyper = dict(HYPER, max_norm=1.0, step=4)
    runs = {}
    for name, use_triton, state in (("exact", False, torch.float64), ("ref32", False, torch.float32),
                                    ("ref", False, torch.bfloat16), ("tri", True, torch.bfloat16)):
        dt = torch.float64 if name == "exact" else torch.float32
        master, m, v = m64.to(dt).clone(), m0.to(state).clone(), v0.to(state).clone()
        adamw_flat(master, grad.to(dt), m, v, decay, None, sumsq.to(dt), use_triton=use_triton, salt=2, **hyper)
        runs[name] = (master, m, v)
    budget = (runs["ref32"][0].double() - runs["exact"][0]).abs().max().item()
    assert 0 < budget < 1e-6
    for name in ("ref", "tri"):
        assert (runs[name][0].double() - runs["exact"][0]).abs().max().item() <= 4 * budget
    for k in (1, 2):
        a, b = runs["tri"][k], runs["ref"][k]
        assert a.dtype == b.dtype == torch.bfloat16
        differ = a != b
        assert int(differ.sum()) <= 5
        assert bool(((a.float() - b.float()).abs()[differ] <= _bf16_step(b.float())[differ]).all())
        exact = runs["exact"][k]  # and each is one of the two bf16 values around the exact one
        assert bool(((b.double() - exact).abs() <= _bf16_step(exact.float()).double() * 1.0001).all())


@pytest.mark.parametrize("use_triton, device", [(False, "cpu"), (True, "cpu"), pytest.param(
    True, "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])],
    ids=["reference", "interpreter", "cuda"])
def test_zero1_shards_round_like_the_whole_buffer(use_triton, device):
    """Two ranks' shards covering a buffer (segments cut at other places than the blocks) stepped by adamw_segments
    are adamw_flat over the whole buffer, bit for bit: the rounding is seeded by buffer offsets, so ZeRO-1 and the
    unsharded step keep the same bf16 moments."""
    if use_triton:
        _kernel_runs(device)
    g = torch.Generator().manual_seed(5)
    n = 2 * BLOCK + 700
    grad = torch.randn(n, generator=g).to(device)
    params = (torch.randn(n, generator=g) * 0.02).to(device)
    m = (torch.randn(n, generator=g) * 1e-2).to(device, torch.bfloat16)
    v = (torch.rand(n, generator=g) * 1e-3).to(device, torch.bfloat16)
    decay = (torch.rand(n, generator=g) < 0.5).to(device, torch.uint8)
    sumsq = torch.tensor(40.0, device=device)
    hyper = dict(HYPER, max_norm=1.0, step=3, salt=1, use_triton=use_triton)
    whole = [params.clone(), m.clone(), v.clone(), params.to(torch.bfloat16)]
    adamw_flat(whole[0], grad, whole[1], whole[2], decay, whole[3], sumsq, **hyper)
    cut = [(0, 300), (300, BLOCK + 911), (BLOCK + 911, n)]  # rank 0 owns ranges 0 and 2, rank 1 range 1
    out_params, out_m, out_v = params.clone(), m.clone(), v.clone()
    low = params.to(torch.bfloat16)
    for ranges in ([cut[0], cut[2]], [cut[1]]):
        spans, c = [], 0
        for lo, hi in ranges:
            spans.append((c, lo, hi - lo))
            c += hi - lo
        segs = Segments(spans, torch.device(device))
        idx = torch.cat([torch.arange(lo, hi) for lo, hi in ranges]).to(device)
        master, sm, sv = params[idx].clone(), m[idx].clone(), v[idx].clone()
        adamw_segments(master, grad, sm, sv, decay[idx].clone(), low, sumsq, segs, master_compact=True, **hyper)
        out_params[idx], out_m[idx], out_v[idx] = master, sm, sv
    assert torch.equal(out_m.view(torch.int16), whole[1].view(torch.int16))
    assert torch.equal(out_v.view(torch.int16), whole[2].view(torch.int16))
    assert torch.equal(out_params, whole[0]) and torch.equal(low, whole[3])
    assert not torch.equal(out_m, m)  # (the step did change them)


def _held_out_loss(engine) -> float:
    """The mean token loss of one fixed batch the steps never see."""
    x = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        return float(engine.module(x, labels=x, reduction="sum")) / x.numel()


def test_training_with_bf16_moments_follows_fp32_moments(monkeypatch):
    """The same 2-layer bf16 engine, the one-launch AdamW on both (its torch reference on CPU), moments in fp32 and
    in bf16: the moments are stored as bf16 (4 bytes a parameter less, counted by state_bytes and kept so in the
    state dict), and after 25 steps the held-out loss is the fp32 run's within 2% of how far that run brought it
    down (here from 4.17 to 0.95)."""
    runs = {}
    for state in ("fp32", "bf16"):
        e = _engine("on", monkeypatch, optimizer_state_dtype=state)
        start = _held_out_loss(e)
        _steps(e, 25)
        runs[state] = (e, start, _held_out_loss(e))
    e32, start, end32 = runs["fp32"]
    e16, start16, end16 = runs["bf16"]
    assert start == start16 and end32 < start
    assert abs(end16 - end32) <= 0.02 * (start - end32), (start, end32, end16)
    assert all(b.exp_avg.dtype == b.exp_avg_sq.dtype == torch.bfloat16 for b in e16.optimizer.flat.buffers)
    numel = sum(p.numel() for p in e16.module.parameters())  # two moments, 2 bytes less each
    assert e32.optimizer.state_bytes() - e16.optimizer.state_bytes() == 2 * 2 * numel
    sd = e16.optimizer.state_dict()
    assert all(entry["exp_avg"].dtype == torch.bfloat16 for entry in sd["params"].values())


def test_a_resumed_run_is_bit_exact_and_states_cross_dtypes(monkeypatch):
    """3 steps, state dict, a new engine loads it, 2 more steps = 5 uninterrupted steps, bit for bit (the rounding
    is seeded by the restored step count). A checkpoint with fp32 moments loads into a bf16-moment run (rounded to
    nearest, logged) and a bf16 one into an fp32 run (widened exactly)."""
    a = _engine("on", monkeypatch, optimizer_state_dtype="bf16")
    _steps(a, 3)
    sd = a.optimizer.state_dict()
    b = _engine("on", monkeypatch, optimizer_state_dtype="bf16")
    b.optimizer.load_state_dict(sd)
    _steps(a, 2, seed=1)
    _steps(b, 2, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(_params(a).values(), _params(b).values()))
    for name, e in b.optimizer.state_dict()["params"].items():
        ea = a.optimizer.state_dict()["params"][name]
        assert torch.equal(e["exp_avg_sq"].view(torch.int16), ea["exp_avg_sq"].view(torch.int16)), name
    wide = _engine("on", monkeypatch, optimizer_state_dtype="fp32")
    wide.optimizer.load_state_dict(sd)
    for name, e in wide.optimizer.state_dict()["params"].items():
        assert e["exp_avg"].dtype == torch.float32 and torch.equal(e["exp_avg"], sd["params"][name]["exp_avg"].float())
    full = _engine("on", monkeypatch, optimizer_state_dtype="fp32")
    _steps(full, 2)
    sd32 = full.optimizer.state_dict()
    narrow = _engine("on", monkeypatch, optimizer_state_dtype="bf16")
    narrow.optimizer.load_state_dict(sd32)
    for name, e in narrow.optimizer.state_dict()["params"].items():
        assert torch.equal(e["exp_avg_sq"], sd32["params"][name]["exp_avg_sq"].to(torch.bfloat16)), name
    assert narrow.optimizer.flat.steps == 2


@pytest.mark.parametrize("flags, expect", [
    (["--optimizer=muon"], "--optimizer_state_dtype=bf16 cannot be combined with --optimizer=muon"),
    (["--dtype=fp16"], "--optimizer_state_dtype=bf16 cannot be combined with --dtype=fp16"),
    (["--comm_hook=powersgd"], "--optimizer_state_dtype=bf16 cannot be combined with --comm_hook=powersgd"),
    (["--parallel=fsdp"], "--optimizer_state_dtype=bf16"),
    (["--pipeline_parallel_size=2"], "--optimizer_state_dtype=bf16"),
])
def test_runs_bf16_moments_cannot_take_are_refused_in_one_line(flags, expect):
    from trainer.config import TrainConfig, TrainingError
    from trainer.validation import validate_config
    from utils.configurator import parse_config
    cfg = parse_config(TrainConfig(), ["--data_dir=d", "--tokenizer_dir=t", "--optimizer_state_dtype=bf16", *flags])
    with pytest.raises(TrainingError) as e:
        validate_config(cfg, world_size=2, torch_free=True)
    assert expect in str(e.value)
    validate_config(parse_config(TrainConfig(), ["--data_dir=d", "--tokenizer_dir=t", "--optimizer_state_dtype=bf16",
                                                 "--use_distributed_optimizer=true"]), world_size=2, torch_free=True)


def test_an_optimizer_that_cannot_step_bf16_moments_says_why(monkeypatch):
    """Built directly (no trainer flags), the optimizer refuses bf16 moments where the one-launch AdamW does not
    step, naming the reason; the config refuses what never can; FSDP's optimizer refuses them."""
    from optimizer import OptimizerConfig
    from optimizer.fsdp_optimizer import fsdp_optimizer_problems
    monkeypatch.setenv("MYLLM_FLAT_ADAMW", "off")
    with pytest.raises(ValueError, match=r"cannot step this run: one_launch=off \(MYLLM_FLAT_ADAMW=off\)"):
        _engine(None, monkeypatch, optimizer_state_dtype="bf16")
    with pytest.raises(ValueError, match="cannot be combined with optimizer=muon"):
        OptimizerConfig(state_dtype="bf16", optimizer="muon")
    with pytest.raises(ValueError, match="state_dtype must be fp32 or bf16"):
        OptimizerConfig(state_dtype="fp16")
    assert any("--optimizer_state_dtype=bf16" in p for p in fsdp_optimizer_problems(state_dtype="bf16"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_trainers_engine_keeps_bf16_moments_in_its_kernel():
    """On a GPU the trainer's engine (bf16 parameters, one process: the gradients read from the parameters) steps
    bf16 moments with the compiled kernel by itself, and 25 steps end at the fp32-moment engine's held-out loss
    within a tenth of how far that run brought it down (the same body on CPU, the kernel in the interpreter:
    3.308 against 3.258 from 5.581, 2.2%; lr 1e-2 on 25 random batches: the two runs part more than the CPU
    test's)."""
    from model import ModelConfig, Transformer
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    device = torch.device("cuda")
    x_eval = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(99)).to(device)
    runs = {}
    for state in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=256, dim=128, n_layers=2, n_heads=4, max_seq_len=64))
        e = build_engine(model.to(device), TrainConfig(device="cuda", dtype="bf16", grad_clip=1.0, learning_rate=1e-2,
                                                       optimizer_state_dtype=state), device=device)
        assert e.optimizer.flat is not None and e.optimizer.flat.use_triton and e.model.grads_on_params
        held_out = lambda: float(e.module(x_eval, labels=x_eval, reduction="sum")) / x_eval.numel()  # noqa: E731
        with torch.no_grad():
            start = held_out()
        g = torch.Generator().manual_seed(0)
        for _ in range(25):
            x = torch.randint(0, 256, (4, 64), generator=g).to(device)
            e.optimizer.zero_grad()
            e.forward_backward([{"input_ids": x, "labels": x}],
                               lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {}), 256.0)
            stepped, _ = e.optimizer.step()
            assert stepped
        with torch.no_grad():
            runs[state] = (start, held_out())
        dtypes = {b.exp_avg.dtype for b in e.optimizer.flat.buffers}
        assert dtypes == {torch.bfloat16 if state == "bf16" else torch.float32}
    (start, end32), (_, end16) = runs["fp32"], runs["bf16"]
    assert end32 < start and abs(end16 - end32) <= 0.1 * (start - end32), runs


@pytest.mark.parametrize("how", ["kernel-fails", "comm-hook"])
def test_bf16_moments_never_hand_over_to_torchs_adamw(monkeypatch, how):
    """With fp32 moments a kernel that cannot be built, or a comm hook registered later, hands the run to torch's
    fused AdamW (tests/optimizer/test_grads_on_params.py). torch's AdamW has no bf16 moments, so here the step stops
    with the reason, and nothing was updated."""
    import optimizer.one_launch_step as ols
    from parallel.comm_hooks import bf16_compress_wrapper, allreduce_hook
    e = _engine("on", monkeypatch, optimizer_state_dtype="bf16", grads_on_params="auto")
    e.optimizer.flat.use_triton = False
    _steps(e, 1)
    before = _params(e)
    if how == "kernel-fails":
        def broken(*a, **k):
            raise RuntimeError("no kernel here")
        monkeypatch.setattr(ols, "adamw_flat", broken)
        match = "no kernel here"
    else:
        e.model.register_comm_hook(None, bf16_compress_wrapper(allreduce_hook))
        match = "bf16 moments .*have no other AdamW"
    with pytest.raises(RuntimeError, match=match):
        _steps(e, 1)
    assert all(torch.equal(before[k], v) for k, v in _params(e).items())
    assert e.optimizer.flat is not None


@pytest.mark.parametrize("state", [torch.float32, torch.bfloat16], ids=["fp32-moments", "bf16-moments"])
def test_the_reference_in_chunks_is_the_reference_whole(monkeypatch, state):
    """The CPU reference works through the buffer in chunks (flat_adamw.CPU_CHUNK): cut at 1,000 elements, one
    step gives the bits of the step in one piece, the rounding's offsets included."""
    import optimizer.flat_adamw as fa
    m64, decay, grads = _problem()
    g = torch.Generator().manual_seed(2)
    m0 = (torch.randn(m64.numel(), generator=g) * 1e-2).to(state)
    v0 = (torch.rand(m64.numel(), generator=g) * 1e-3).to(state)
    runs = []
    for chunk in (1 << 20, 1000):
        monkeypatch.setattr(fa, "CPU_CHUNK", chunk)
        master, m, v, out = m64.float(), m0.clone(), v0.clone(), torch.zeros(m64.numel(), dtype=torch.bfloat16)
        adamw_flat(master, grads[0].float(), m, v, decay, out, torch.tensor(9.0), step=2, use_triton=False,
                   salt=1, **HYPER, max_norm=1.0)
        runs.append([t.view(torch.int16) if t.dtype == torch.bfloat16 else t for t in (master, m, v, out)])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    assert not torch.equal(runs[0][1], m0.view(torch.int16) if state == torch.bfloat16 else m0)
