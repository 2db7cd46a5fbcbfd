"""--compile_mode: torch.compile's mode reaches the compile transform, a bad value is refused in one line,
and with a CUDA-graph mode (reduce-overhead, max-autotune) the engine marks the start of every micro-batch
(forward+backward and evaluation), so Inductor's cudagraph trees never overwrite a graph output the
engine still reads. torch.compile is replaced by a recorder here (what it is given is what is tested;
compiling itself is covered by the compile tests); on a GPU the bench row `ours:trainer:compile-cg` runs
the real thing."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer
from parallel.build import build_engine
from parallel.config import ParallelConfig
from trainer.config import TrainConfig
from trainer.task import task_of


def test_a_bad_compile_mode_is_refused_in_one_line():
    problems = ParallelConfig(compile_mode="fastest").problems(1)
    assert len(problems) == 1 and problems[0].startswith("--compile_mode='fastest'")
    assert "reduce-overhead" in problems[0]
    assert ParallelConfig(compile_mode="reduce-overhead").problems(1) == []
    tp = ParallelConfig(compile=True, compile_mode="reduce-overhead", parallel="fsdp", tensor_parallel_size=2)
    assert [p for p in tp.problems(2) if "--compile_mode" in p] == [
        "--compile_mode=reduce-overhead cannot be combined with --tensor_parallel_size=2 yet (CUDA graphs are marked "
        "per micro-batch of the whole-model compile; per-block and per-stage compiles are not)"]
    assert ParallelConfig(compile=True, compile_mode="max-autotune-no-cudagraphs", parallel="fsdp",
                          tensor_parallel_size=2).problems(2) == []


def test_another_backend_reaches_torch_compile_and_refuses_inductors_options(monkeypatch):
    """--compile_backend=aot_eager|eager is torch.compile's backend (HF's --torch_compile_backend names it too); a
    bad name, and Inductor's mode or tuning beside another backend, are refused in one line each."""
    from parallel.transforms.compile import compile_kwargs
    from utils.configurator import parse_config
    assert compile_kwargs(ParallelConfig()) == {}
    for backend in ("aot_eager", "eager"):
        assert compile_kwargs(ParallelConfig(compile_backend=backend)) == {"backend": backend}
        assert ParallelConfig(compile=True, compile_backend=backend).problems(1) == []
    assert ParallelConfig(compile_backend="tvm").problems(1) == ["--compile_backend='tvm' (inductor | aot_eager | eager)"]
    for bad in (dict(compile_mode="max-autotune"), dict(compile_tuning=True)):
        problems = ParallelConfig(compile_backend="eager", **bad).problems(1)
        assert len(problems) == 1 and problems[0].startswith("--compile_backend=eager: --compile_mode and"), problems
    hf = parse_config(TrainConfig(), ["--torch_compile_backend=aot_eager", "--torch_compile_mode=max-autotune"])
    assert (hf.compile_backend, hf.compile_mode) == ("aot_eager", "max-autotune")
    seen = []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: (seen.append(kw), model)[1])
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=16))
    build_engine(model, TrainConfig(device="cpu", compile=True, compile_backend="aot_eager"), device=torch.device("cpu"))
    assert seen == [{"backend": "aot_eager"}]


# (mode, --compile_tuning, the marks, torch.compile's keywords): tuning passes the mode's own Inductor options with
# coordinate-descent tuning added (torch.compile takes a mode or options, not both); max-autotune has it already
MODE_CASES = [
    ("default", False, False, {}), ("reduce-overhead", False, True, {"mode": "reduce-overhead"}),
    ("max-autotune", False, True, {"mode": "max-autotune"}),
    ("max-autotune-no-cudagraphs", False, False, {"mode": "max-autotune-no-cudagraphs"}),
    ("default", True, False, {"options": {"coordinate_descent_tuning": True}}),
    ("reduce-overhead", True, True, {"options": {"triton.cudagraphs": True, "coordinate_descent_tuning": True}}),
    ("max-autotune", True, True, {"mode": "max-autotune"}),
]


@pytest.mark.parametrize("mode,tuning,marks,kw", MODE_CASES)
def test_the_mode_reaches_torch_compile_and_cuda_graph_modes_mark_each_micro_batch(monkeypatch, mode, tuning, marks,
                                                                                   kw):
    seen, begins = [], []
    monkeypatch.setattr(torch, "compile", lambda model, **kw: (seen.append(kw), model)[1])
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: begins.append(1))
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=16))
    cfg = TrainConfig(device="cpu", compile=True, compile_mode=mode, compile_tuning=tuning,
                      gradient_accumulation_steps=3)
    device = torch.device("cpu")
    engine = build_engine(model, cfg, device=device)
    assert seen == [kw]
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (x := torch.randint(0, 64, (2, 16), generator=g)), "labels": x.clone()}
               for _ in range(3)]
    loss_fn = lambda m, b: task_of(cfg).micro_batch_loss(m, None, b, device)  # noqa: E731
    units = float(sum(task_of(cfg).count_units(b) for b in batches))
    with torch.no_grad():  # the wrapper changes nothing: the same loss as the bare model's
        expect = sum(float(task_of(cfg).micro_batch_loss(model, None, b, device)[0]) for b in batches)
    engine.optimizer.zero_grad()
    sums = engine.forward_backward(batches, loss_fn, units)
    assert len(begins) == (3 if marks else 0)
    engine.optimizer.step()
    engine.evaluate(batches[:2], loss_fn, lambda b: task_of(cfg).count_units(b))
    assert len(begins) == (5 if marks else 0)
    assert float(sums[0]) != 0.0 and abs(float(sums[0]) - expect) < 1e-3 * abs(expect)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("micro_batches", [2, 1], ids=["grad-buffers", "grads-on-params"])
def test_on_cuda_the_cuda_graph_steps_equal_the_plain_compiled_ones(micro_batches):
    """--compile_mode=reduce-overhead on a GPU: 3 steps of 2 micro-batches or 1 (and an evaluation) replayed as CUDA
    graphs give the plain compiled run's losses, and Inductor declined no graph. One micro-batch a step: the
    gradients stay on the parameters (in the graphs' memory pool until the step reads them)."""
    from torch._dynamo.utils import counters
    device = torch.device("cuda")
    losses = {}
    for mode in ("default", "reduce-overhead"):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = Transformer(ModelConfig(vocab_size=64, dim=64, n_layers=2, n_heads=4, multiple_of=16,
                                        max_seq_len=32)).to(device)
        cfg = TrainConfig(device="cuda", compile=True, compile_mode=mode, gradient_accumulation_steps=micro_batches)
        engine = build_engine(model, cfg, device=device)
        assert engine.model.grads_on_params == (micro_batches == 1)
        loss_fn = lambda m, b: task_of(cfg).micro_batch_loss(m, None, b, device)  # noqa: E731
        g = torch.Generator().manual_seed(0)
        out = []
        for _ in range(3):
            batches = [{"input_ids": (x := torch.randint(0, 64, (2, 32), generator=g)), "labels": x.clone()}
                       for _ in range(micro_batches)]
            engine.optimizer.zero_grad()
            sums = engine.forward_backward(batches, loss_fn, float(sum(task_of(cfg).count_units(b) for b in batches)))
            engine.optimizer.step()
            out.append(float(sums[0]))
        out.append(float(engine.evaluate(batches, loss_fn, lambda b: task_of(cfg).count_units(b))[0]))
        losses[mode] = out
        if mode != "default":
            assert int(counters["inductor"].get("cudagraph_skips", 0)) == 0
    torch._dynamo.reset()
    assert losses["reduce-overhead"] == pytest.approx(losses["default"], rel=1e-5)
