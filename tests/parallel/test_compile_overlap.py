"""--compile across data-parallel ranks (our DDP): each block is compiled apart (parallel/transforms/compile.py
`per_block`), so gradient buckets are launched while the blocks below are still running their backward. With
the whole model as one graph the backward is ONE autograd node: every gradient, and every bucket launch, came
after all of it (no overlap at all). Checked at 2 gloo ranks by the order of the backward's compiled-graph nodes
and the bucket launches, and the compiled step against the eager one. Traced with the aot_eager backend
(Dynamo + AOTAutograd make the graphs; Inductor's code generation is the compile tests' subject)."""
from __future__ import annotations

import torch

from tests.dist_helpers import spawn


def _engine(compile: bool, **flags):
    from model import ModelConfig, Transformer
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=16,
                                    max_seq_len=16))
    cfg = TrainConfig(device="cpu", compile=compile, learning_rate=1e-2, bucket_size=2000, grad_clip=1.0, **flags)
    return build_engine(model, cfg, device=torch.device("cpu"))


def _backward_events(engine, x) -> list[str]:
    """'graph' when a compiled graph's backward node has run, 'launch' when a bucket's communication starts."""
    events: list[str] = []
    ddp = engine.model
    real_launch = ddp._launch

    def launch(bucket):
        events.append("launch")
        return real_launch(bucket)
    ddp._launch = launch
    loss = engine.forward_model(x, labels=x, reduction="sum")
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunctionBackward" in node.name():
            node.register_hook(lambda *_: events.append("graph"))
        stack.extend(f for f, _ in node.next_functions)
    loss.backward()
    ddp.finish_grad_sync()
    ddp._launch = real_launch
    return events


def _ranks(rank: int, world: int) -> None:
    from torch._dynamo.utils import counters
    real_compile = torch.compile
    torch.compile = lambda model=None, **kw: real_compile(model, **{**kw, "backend": "aot_eager"})
    try:
        g = torch.Generator().manual_seed(rank)
        x = torch.randint(0, 64, (2, 16), generator=g)
        compiled = _engine(True)
        events = _backward_events(compiled, x)
        graphs = [i for i, e in enumerate(events) if e == "graph"]
        launches = [i for i, e in enumerate(events) if e == "launch"]
        assert len(graphs) == 4, events  # one per block
        # a bucket of the upper blocks communicates before the lowest block's backward graph has run
        assert any(graphs[0] < i < graphs[-1] for i in launches), events
        assert counters["graph_break"] == {} or sum(counters["graph_break"].values()) == 0

        # the compiled step = the eager one (same data on each rank, 2 optimizer steps)
        losses = {}
        for name, engine in (("compiled", _engine(True)), ("eager", _engine(False))):
            seq = []
            for _ in range(2):
                engine.optimizer.zero_grad()
                sums = engine.forward_backward(
                    [{"input_ids": x, "labels": x}],
                    lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {}), 64.0)
                engine.optimizer.step()
                seq.append(float(sums[0]))
            losses[name] = (seq, [p.detach().clone() for p in engine.module.parameters()])
        (lc, pc), (le, pe) = losses["compiled"], losses["eager"]
        torch.testing.assert_close(torch.tensor(lc), torch.tensor(le), rtol=1e-5, atol=1e-5)
        for a, b in zip(pc, pe):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    finally:
        torch.compile = real_compile


def test_bucket_communication_overlaps_the_compiled_backward():
    spawn(_ranks, 2)  # a rank's failed assertion fails the spawn


def test_whole_model_compile_in_one_process_and_per_block_rules():
    """One process: one graph (nothing to overlap). The rule itself for the other layouts."""
    from types import SimpleNamespace

    from parallel.transforms.compile import per_block
    ddp2 = SimpleNamespace(kind="ddp", model=SimpleNamespace(world_size=2))
    ddp1 = SimpleNamespace(kind="ddp", model=SimpleNamespace(world_size=1))
    fsdp2 = SimpleNamespace(kind="fsdp", model=SimpleNamespace(world_size=2))
    stages = SimpleNamespace(kind="pipeline", model=SimpleNamespace(world_size=2))
    cfg = SimpleNamespace(tensor_parallel_size=1, compile_mode="default")
    assert per_block(ddp2, cfg) and not per_block(ddp1, cfg) and not per_block(fsdp2, cfg)
    assert per_block(stages, cfg)  # a stage's blocks; its schedule never calls a whole-model forward
    assert not per_block(ddp2, SimpleNamespace(tensor_parallel_size=1, compile_mode="reduce-overhead"))
    assert per_block(fsdp2, SimpleNamespace(tensor_parallel_size=2, compile_mode="default"))
    engine = _engine(True)
    assert engine.forward_model is not engine.model  # torch.compile(engine.model): the one graph
