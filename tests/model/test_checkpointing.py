"""model/checkpointing.py: the block checkpointing policies (full, op, every N-th block) give the gradients of no
checkpointing bit for bit on the CPU (dropout replayed), keep what they say they keep, and recompute what they say
they recompute; the flags choose them and refuse what is not one."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model.checkpointing as checkpointing
from model import ModelConfig, Transformer

LAYERS = 4
POLICIES = ("full", "op", "1", "2", "3")


def _cfg(policy=None, **kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=97, dim=32, n_layers=LAYERS, n_heads=4, n_kv_heads=2, multiple_of=16,
                                 max_seq_len=16), **kw},
                       gradient_checkpointing=policy is not None, checkpoint_policy=policy or "full")


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _step(policy, x, **kw):
    """(loss, gradients, bytes kept for the backward, matmuls the backward ran) of one forward and backward; the
    bytes are the autograd graph's saved tensors plus what selective checkpointing stored."""
    torch.manual_seed(0)
    model = Transformer(_cfg(policy, **kw))
    kept = [0]

    def pack(t):
        kept[0] += t.numel() * t.element_size()
        return t
    torch.manual_seed(1)  # the dropout draws
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x, labels=x)
    kept[0] += sum(_stored_bytes(s) for s in _STORES)
    _KEPT_OPS[:] = [{str(f): len(v) for f, v in _kept(s).items() if v} for s in _STORES]  # (the backward consumes)
    with _CountMatmuls() as count:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, kept[0], count.n


_STORES: list = []  # the storages of the selective contexts made since the last clear (see `stores`)
_KEPT_OPS: list = []  # {op: outputs kept} of each of them after the last `_step`'s forward


def _kept(storage) -> dict:
    """{op: its outputs kept} of one selective context's storage: {op: {call index: the output, or a marker object
    where the op is recomputed}} (torch.utils.checkpoint's)."""
    return {key: [v for v in calls.values() if type(v) is not object] for key, calls in storage.items()}


def _stored_bytes(storage) -> int:
    total = 0
    for outs in _kept(storage).values():
        for out in outs:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                t = getattr(t, "val", t)  # (torch keeps each output in a version-checking wrapper)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


@pytest.fixture
def stores(monkeypatch):
    """Records the storage of every selective checkpoint context (one per block call): what `op` kept."""
    real = checkpointing.create_selective_checkpoint_contexts

    def recording(policy_fn, *a, **kw):
        fwd, recompute = real(policy_fn, *a, **kw)
        _STORES.append(fwd.storage)
        return fwd, recompute
    monkeypatch.setattr(checkpointing, "create_selective_checkpoint_contexts", recording)
    _STORES.clear()
    yield _STORES
    _STORES.clear()


@pytest.mark.parametrize("extra", [{}, dict(attn_dropout=0.1, resid_dropout=0.1),
                                   dict(moe_num_experts=4, moe_top_k=2, moe_first_dense_layers=1),
                                   dict(n_kv_heads=None, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
                                        qk_rope_head_dim=8, v_head_dim=8)],
                         ids=["plain", "dropout", "moe", "latent-attention"])
def test_every_policy_gives_the_gradients_of_no_checkpointing(stores, extra):
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    loss0, grads0, _, _ = _step(None, x, **extra)
    for policy in POLICIES:
        stores.clear()
        loss, grads, _, _ = _step(policy, x, **extra)
        assert torch.equal(loss, loss0), policy
        for n, g in grads0.items():
            assert torch.equal(grads[n], g), (policy, n)


def test_what_each_policy_keeps_and_recomputes(stores):
    """Kept bytes: none > every 2nd block > op > full. op's storage, per block call: the attention's output and 2 of
    the block's 4 matmuls (fused q/k/v, o, fused gate/up, down: the 1st and 3rd); its backward recomputes the others
    that the backward needs (1 or 2 a block, whether torch stops a recomputation early or not), full's 3 or 4, every
    2nd block's half of full's."""
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    runs = {}
    for policy in (None, "full", "op", "2"):
        stores.clear()
        runs[policy] = _step(policy, x)[2:]
        if policy == "op":
            assert len(stores) == len(_KEPT_OPS) == LAYERS
            for kept in _KEPT_OPS:
                attention = [f for f in kept if "scaled_dot_product" in f]
                assert len(attention) == 1 and kept[attention[0]] == 1, kept
                assert kept["aten.mm.default"] == 2 and len(kept) == 2, kept
    # the GPU's attention kernels and sequence parallelism's reduce-scatters are kept too (this build has their ops)
    assert {torch.ops.aten._scaled_dot_product_flash_attention.default, torch.ops.aten._flash_attention_forward.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default} <= checkpointing.saved_ops()
    (kept0, mm0), (full, mm_full), (op, mm_op), (half, mm_half) = (runs[p] for p in (None, "full", "op", "2"))
    assert kept0 > half > op > full, runs
    extra_full, extra_op, extra_half = mm_full - mm0, mm_op - mm0, mm_half - mm0
    assert 3 * LAYERS <= extra_full <= 4 * LAYERS and LAYERS <= extra_op <= 2 * LAYERS, runs
    assert extra_half * 2 == extra_full, runs


def test_every_nth_block_counts_global_indexes():
    """The N-th, 2N-th, ... block by its global index: a pipeline stage's blocks choose as the whole model's."""
    calls = []
    real = checkpointing.checkpoint
    checkpointing.checkpoint = lambda block, *a, **kw: (calls.append(checkpointing.block_index(block)),
                                                       real(block, *a, **kw))[1]
    try:
        torch.manual_seed(0)
        model = Transformer(_cfg("3", n_layers=7))
        model(torch.randint(0, 97, (1, 8)), labels=torch.randint(0, 97, (1, 8))).backward()
        assert calls == [2, 5]
        calls.clear()
        stage = Transformer.pruned(model, range(4, 7), embedding=False, head=False)
        stage(torch.randn(1, 8, 32, requires_grad=True)).sum().backward()
        assert calls == [5]
    finally:
        checkpointing.checkpoint = real


def test_a_policy_that_is_not_one_is_refused():
    for bad in ("selective", "0", "-1", "half", ""):
        with pytest.raises(ValueError, match="checkpoint_policy"):
            ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, checkpoint_policy=bad)


def test_op_under_compile_equals_eager():
    """The whole model compiled (aot_eager: Dynamo traces the selective context into the graph) with `op`: the
    loss and gradients of eager no checkpointing, to the compiled graph's summation order (here exact)."""
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    loss0, grads0, _, _ = _step(None, x, n_layers=2)
    torch.manual_seed(0)
    model = Transformer(_cfg("op", n_layers=2))
    model.compile(backend="aot_eager")
    loss = model(x, labels=x)
    loss.backward()
    assert torch.allclose(loss, loss0, rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, grads0[n], rtol=1e-5, atol=1e-7), n


def _kept_compiled(run, x, weights) -> tuple[torch.Tensor, int]:
    """(loss, the bytes run(x)'s forward leaves for the backward: each storage once, not those of `weights`, the
    model's parameters), after the backward."""
    seen, total = {w.untyped_storage().data_ptr() for w in weights}, [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total[0] += t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run(x)
    loss.backward()
    return loss, total[0]


def test_per_block_compile_traces_each_blocks_checkpoint():
    """Per-block compile (parallel/transforms/compile.py compile_blocks: tensor parallelism, pipeline stages, our DDP
    over ranks) compiles each checkpointed block's checkpoint with it (aot_eager here), so the compiled graphs keep
    what the policy says: bytes kept none > every 2nd block > op > full; the checkpointed blocks are marked as
    checkpointing themselves (the model's loop calls them as they are), the others not; loss, gradients and a no-grad
    evaluation as eager no checkpointing's."""
    from parallel.transforms.compile import compile_blocks
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    loss0, grads0, _, _ = _step(None, x, n_layers=2)
    kept = {}
    for policy in (None, "full", "op", "2"):
        torch.manual_seed(0)
        model = Transformer(_cfg(policy, n_layers=2))
        compile_blocks(model, backend="aot_eager")
        marked = [getattr(b, checkpointing.CHECKPOINTS_ITSELF, False) for b in model.layers]
        assert marked == {None: [False, False], "2": [False, True]}.get(policy, [True, True]), policy
        loss, kept[policy] = _kept_compiled(lambda b: model(b, labels=b), x, model.parameters())
        assert torch.allclose(loss, loss0, rtol=1e-6, atol=0), policy
        for n, p in model.named_parameters():
            assert torch.allclose(p.grad, grads0[n], rtol=1e-5, atol=1e-7), (policy, n)
        with torch.no_grad():
            assert torch.allclose(model.eval()(x, labels=x), loss0, rtol=1e-6, atol=0), policy
    assert kept[None] > kept["2"] > kept["op"] > kept["full"], kept


def test_memory_budget_keeps_less_the_smaller_it_is_and_only_inside_the_call():
    """--activation_checkpoint=memory_budget through the engine (one process: the whole model compiled, aot_eager
    here, whose partitioner is Inductor's min-cut one): budget 0 keeps less than 0.5, which keeps less than 1 (the
    compiler's default); the loss is eager's; the budget is set only during the compiled call (torch's global
    default is what it was after it, so no other compile in the process sees it)."""
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    import torch._functorch.config as functorch_config
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(2))
    loss0 = _step(None, x, n_layers=2)[0]
    before = functorch_config.activation_memory_budget
    kept = {}
    for budget in (1.0, 0.5, 0.0):
        torch._dynamo.reset()
        torch.manual_seed(0)
        cfg = TrainConfig(device="cpu", compile=True, compile_backend="aot_eager", activation_checkpoint="memory_budget",
                          activation_memory_budget=budget)
        engine = build_engine(Transformer(_cfg(n_layers=2)), cfg, device=torch.device("cpu"))
        loss, kept[budget] = _kept_compiled(lambda b: engine.forward_model(b, labels=b), x,
                                            engine.module.parameters())
        assert torch.allclose(loss.detach(), loss0, rtol=1e-6, atol=0), budget
        assert functorch_config.activation_memory_budget == before
    torch._dynamo.reset()
    assert kept[1.0] > kept[0.5] > kept[0.0], kept


def test_the_flags_choose_the_policy_and_refuse_what_is_not_one():
    from parallel.config import ParallelConfig
    from parallel.transforms.activation_checkpoint import apply, checkpoint_policy, describe, describe_policy
    from trainer.config import TrainConfig
    from trainer.validation import validate_config
    cases = {(False, "none", "op"): None, (True, "none", "op"): "full", (False, "full", "op"): "full",
             (False, "selective", "op"): "op", (False, "selective", "2"): "2", (True, "selective", " 4 "): "4"}
    for (on, mode, option), want in cases.items():
        pc = ParallelConfig(gradient_checkpointing=on, activation_checkpoint=mode, selective_ac_option=option)
        assert checkpoint_policy(pc) == want
        model = Transformer(_cfg())
        apply(model, None, pc)
        assert (model.cfg.gradient_checkpointing, model.cfg.checkpoint_policy) == (want is not None, want or "full")
    assert checkpoint_policy(ParallelConfig(activation_checkpoint="memory_budget")) is None
    assert describe(ParallelConfig(activation_checkpoint="memory_budget", activation_memory_budget=0.25)) == \
        "by the compiled graphs' memory budget (0.25)"
    assert [describe_policy(p) for p in (None, "full", "op", "1", "2", "3", "4")] == [
        "off", "full (each block)", "selective per op (attention and every other matmul kept)", "full (each block)",
        "every 2nd block", "every 3rd block", "every 4th block"]
    base = dict(data_dir="d", tokenizer_dir="t", device="cpu")
    validate_config(TrainConfig(**base, activation_checkpoint="selective", selective_ac_option="2"), torch_free=True)
    validate_config(TrainConfig(**base, activation_checkpoint="memory_budget", compile=True), torch_free=True)
    for bad, words in ((dict(activation_checkpoint="some"), "--activation_checkpoint='some' (none | full | selective | memory_budget)"),
                       (dict(activation_checkpoint="selective", selective_ac_option="0"),
                        "--selective_ac_option=0: op (per operation) or a positive integer N (every N-th block)"),
                       (dict(selective_ac_option="2"),
                        "--selective_ac_option=2 is --activation_checkpoint=selective's option: add that flag"),
                       (dict(activation_checkpoint="memory_budget"),
                        "--activation_checkpoint=memory_budget needs --compile=true"),
                       (dict(activation_checkpoint="memory_budget", compile=True, activation_memory_budget=1.5),
                        "--activation_memory_budget=1.5: must be in [0, 1]"),
                       (dict(gradient_checkpointing=True, activation_checkpoint="selective"),
                        "--gradient_checkpointing=true (each block recomputed whole) contradicts "
                        "--activation_checkpoint=selective: keep one of them")):
        with pytest.raises(Exception) as e:
            validate_config(TrainConfig(**base, **bad), torch_free=True)
        assert words in str(e.value), str(e.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_op_under_inductor_follows_eager_in_bf16():
    """On a GPU in bf16 autocast: the whole model compiled by Inductor with `op` (the attention kernel SDPA's flash
    one, kept) gives eager no-checkpointing's loss and gradients within bf16's rounding."""
    device = torch.device("cuda")
    x = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2)).to(device)

    def run(policy, compiled):
        torch.manual_seed(0)
        model = Transformer(_cfg(policy)).to(device)
        if compiled:
            model.compile()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x, labels=x)
        loss.backward()
        return loss.float(), {n: p.grad.float() for n, p in model.named_parameters()}
    (l0, g0), (l1, g1) = run(None, False), run("op", True)
    assert abs(float(l1 - l0)) <= 2e-2 * abs(float(l0))
    for n, g in g0.items():
        assert float((g1[n] - g).norm()) <= 5e-2 * float(g.norm()) + 1e-6, n
