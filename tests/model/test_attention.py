"""Attention backends (model/attention.py): the choice is made from which inputs are present (no host
sync, no graph break), packed documents equal each document run alone on every backend that runs on
CPU, forward and backward, eager and compiled, and GQA never materialises keys/values."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from dataset.dataset_sft import packed_collate
from model import ModelConfig, Transformer
from model import attention as A

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ([5, 7, 4], [9, 6])  # document lengths per packed row; the rest of each row is padding
L = 20


def tiny(**kw) -> ModelConfig:
    base = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                hidden_dim=96, loss_chunk_size=7)
    base.update(kw)
    return ModelConfig(**base)


def packed_batch(seed: int = 0) -> dict:
    """Two rows of packed documents, as dataset/dataset_sft.py's PackedSFTDataset + packed_collate make them."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for lengths in DOCS:
        it = {"input_ids": torch.zeros(L, dtype=torch.long), "labels": torch.full((L,), -100),
              "attention_mask": torch.zeros(L, dtype=torch.long), "position_ids": torch.zeros(L, dtype=torch.long),
              "doc_ids": torch.full((L,), -1)}
        pos = 0
        for d, n in enumerate(lengths):
            it["input_ids"][pos:pos + n] = torch.randint(0, 128, (n,), generator=g)
            it["labels"][pos:pos + n] = torch.randint(0, 128, (n,), generator=g)
            it["attention_mask"][pos:pos + n] = 1
            it["position_ids"][pos:pos + n] = torch.arange(n)
            it["doc_ids"][pos:pos + n] = d
            pos += n
        items.append(it)
    return packed_collate(items)


def documents(batch: dict):
    """(row, start, end) of every document of the batch."""
    for b, lengths in enumerate(DOCS):
        s = 0
        for n in lengths:
            yield b, s, s + n
            s += n


DOC_INPUTS = {  # the ways a caller can say where documents are (the trainer passes the first)
    "position_ids": lambda bt: dict(position_ids=bt["position_ids"], attention_mask=bt["attention_mask"]),
    "doc_ids": lambda bt: dict(doc_ids=bt["doc_ids"], attention_mask=bt["attention_mask"]),
    "cu_seqlens": lambda bt: dict(cu_seqlens=bt["cu_seqlens"], max_seqlen=int(bt["max_seqlen"])),
}


class SyncCounter(TorchDispatchMode):
    """Records every op that reads a tensor's value back to the host (a device-to-host sync on a GPU):
    `.item()`/`bool()`/`int()` (_local_scalar_dense) and ops whose output shape depends on values."""
    SYNCING = ("_local_scalar_dense", "aten.nonzero", "aten.unique", "aten._unique", "masked_select", "is_nonzero")

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(s in str(func) for s in self.SYNCING):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))


class KVCopyCounter(TorchDispatchMode):
    """Records every op (attention kernels excepted) that turns a tensor the size of k or v
    ([B, n_kv_heads, T, D], last dim D) into one the size of the query heads ([B, n_heads, T, D], last dim D):
    a GQA expansion
    (repeat_interleave, repeat, expand + reshape copy, index_select, ...), in forward or backward."""

    def __init__(self, kv_numel: int, full_numel: int, head_dim: int):
        super().__init__()
        self.kv, self.full, self.d, self.hits = kv_numel, full_numel, head_dim, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "attention" not in str(func):
            ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor) and a.ndim
                   and a.shape[-1] == self.d]
            outs = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.ndim and o.shape[-1] == self.d]
            if any(i.numel() == self.kv for i in ins) and any(o.numel() == self.full for o in outs):
                self.hits.append(str(func))
        return out


def _grads(m) -> dict:
    return {n: p.grad.clone() for n, p in m.named_parameters()}


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy from logits in plain PyTorch (the project's chunked loss has a CPU-only
    `.item()` of its own; the sync counters here look at attention)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


def _separate(m, bt):
    """Logits of each document run alone, the sum of their summed losses, and its parameter gradients."""
    m.zero_grad(set_to_none=True)
    logits, total = {}, 0.0
    for b, s, e in documents(bt):
        out = m(bt["input_ids"][b:b + 1, s:e])
        loss = _ce_sum(out, bt["labels"][b:b + 1, s:e])
        loss.backward()
        logits[(b, s)] = out[0].detach()
        total += float(loss.detach())
    return logits, total, _grads(m)


# ---------------------------------------------------------------------------------------- choice
def _fake_flash():
    """flash-attn's signatures and [B, T, H, D] / [N, H, D] layouts, computed by the reference."""
    def func(q, k, v, dropout_p=0.0, causal=True):
        return A.attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None).transpose(1, 2)

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=True):
        assert isinstance(max_q, int) and max_q == max_k
        outs = [func(q[None, s:e], k[None, s:e], v[None, s:e])[0] for s, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist())]
        return torch.cat(outs)
    return func, varlen


def test_choice_comes_from_which_inputs_are_present_without_a_sync(monkeypatch):
    bt = packed_batch()
    pos, am = bt["position_ids"], bt["attention_mask"]
    B, T = pos.shape
    flash = _fake_flash()

    def kind(**kw):
        with SyncCounter() as sc:
            spec = A.build_spec(B, T, pos, **kw)
        assert sc.syncs == [], sc.syncs
        return spec.kind

    # CPU: FlexAttention has no backward here, so padding/documents take SDPA with a dense mask
    assert kind() == "sdpa"
    assert kind(position_ids_given=True) == "sdpa_masked"
    assert kind(attention_mask=am) == "sdpa_masked"  # right padding included: values are not inspected
    assert kind(doc_ids=bt["doc_ids"]) == "sdpa_masked"
    assert kind(past=0) == "sdpa" and kind(past=5, attention_mask=torch.ones(B, T + 5)) == "sdpa_masked"
    # where FlexAttention trains (an accelerator), padding/documents take it; attention dropout keeps SDPA
    monkeypatch.setattr(A, "flex_usable", lambda device, head_dim=64: True)
    assert kind(position_ids_given=True, attention_mask=am) == "flex"
    assert kind(attention_mask=am, dropout=True) == "sdpa_masked"
    assert kind() == "sdpa" and kind(past=0) == "sdpa"
    # flash-attn: unmasked batches; varlen only with the collate's cu_seqlens (position_ids alone: flex)
    assert kind(flash=flash) == "flash"
    assert kind(flash=flash, position_ids_given=True, attention_mask=am) == "flex"
    assert kind(flash=flash, position_ids_given=True, attention_mask=am, cu_seqlens=bt["cu_seqlens"],
                max_seqlen=int(bt["max_seqlen"])) == "flash_varlen"
    assert kind(flash=flash, past=0) == "sdpa"  # the KV cache path is SDPA
    with pytest.raises(ValueError):
        A.build_spec(B, T, pos, backend="flash")  # forced but not usable
    with pytest.raises(ValueError):
        A.build_spec(B, T, pos, attention_mask=am[:, :-1])  # wrong width


def test_describe_attention_on_cpu():
    s = A.describe_attention(torch.device("cpu"), tiny(), torch.float32)
    assert s.startswith("unmasked SDPA (is_causal, enable_gqa); packed/padded SDPA with a dense [B,1,T,T] mask")
    assert "varlen" not in s


# ------------------------------------------------------------------------------- packed == alone
@pytest.mark.parametrize("source", list(DOC_INPUTS))
def test_packed_equals_documents_alone_forward_backward_no_sync(source):
    """The CPU auto path (sdpa_masked): logits at real positions, the summed loss and every parameter
    gradient equal running each document alone; forward + backward read no value back to the host."""
    torch.manual_seed(0)
    m = Transformer(tiny())
    bt = packed_batch()
    kw = DOC_INPUTS[source](bt)
    ref_logits, ref_loss, ref_grads = _separate(m, bt)
    m.zero_grad(set_to_none=True)
    with SyncCounter() as sc:
        logits = m(bt["input_ids"], **kw)
        loss = _ce_sum(logits, bt["labels"])
        loss.backward()
    assert sc.syncs == [], sc.syncs
    assert abs(float(loss) - ref_loss) < 1e-4 * max(1.0, abs(ref_loss))
    for (b, s), ref in ref_logits.items():
        assert torch.allclose(logits[b, s:s + ref.shape[0]], ref, atol=1e-5), (b, s)
    for n, g in _grads(m).items():
        assert torch.allclose(g, ref_grads[n], atol=1e-5, rtol=1e-4), n
    # and the model's own loss (labels passed in) over the packed rows is the same sum
    with torch.no_grad():
        own = float(m(bt["input_ids"], labels=bt["labels"], reduction="sum", **kw))
    assert abs(own - ref_loss) < 1e-4 * max(1.0, abs(ref_loss))


def test_flex_packed_equals_documents_alone_forward_and_backward(monkeypatch):
    """FlexAttention with the BlockMask of `allowed` (forced; auto uses it on accelerators). Forward:
    equal to each document alone. Backward: torch refuses FlexAttention's backward on CPU tensors, so
    its refusal is patched out and the gradients come from FlexAttention's own autograd (the
    higher-order op's reference backward, which the GPU kernel is tested against upstream); they must
    equal the dense-mask path's gradients. Building the BlockMask syncs nothing."""
    import torch.nn.attention.flex_attention as fa
    torch.manual_seed(0)
    m = Transformer(tiny(n_layers=1))
    bt = packed_batch()
    kw = DOC_INPUTS["position_ids"](bt)
    ref_logits, ref_loss, ref_grads = _separate(m, bt)
    m.attn_backend = "flex"
    m.eval()
    # building the BlockMask reads nothing back (FlexAttention itself runs under torch.compile even in
    # eager, which a dispatch mode cannot watch; under the model's compile it is one graph: the slow test)
    with SyncCounter() as sc:
        spec = A.build_spec(2, L, bt["position_ids"], attention_mask=bt["attention_mask"], position_ids_given=True,
                            backend="flex")
    assert sc.syncs == [] and spec.kind == "flex", sc.syncs
    with torch.no_grad():
        logits = m(bt["input_ids"], **kw)
    for (b, s), ref in ref_logits.items():
        assert torch.allclose(logits[b, s:s + ref.shape[0]], ref, atol=1e-5), (b, s)
    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    m.train()
    m.zero_grad(set_to_none=True)
    loss = _ce_sum(m(bt["input_ids"], **kw), bt["labels"])
    loss.backward()
    assert abs(float(loss) - ref_loss) < 1e-4 * max(1.0, abs(ref_loss))
    for n, g in _grads(m).items():
        assert torch.allclose(g, ref_grads[n], atol=1e-5, rtol=1e-4), n


def test_flash_plumbing_with_stand_ins(monkeypatch):
    """With flash-attn usable (stand-ins on CPU under bf16 autocast): unmasked batches call flash_attn_func,
    packed batches with the collate's cu_seqlens call flash_attn_varlen_func, and both equal SDPA's path."""
    import model.kernels as K
    torch.manual_seed(0)
    m = Transformer(tiny()).eval()
    bt = packed_batch()
    calls = []
    func, varlen = _fake_flash()
    monkeypatch.setattr(K, "flash_attn_functions", lambda device: (
        lambda *a, **k: calls.append("flash") or func(*a, **k),
        lambda *a, **k: calls.append("varlen") or varlen(*a, **k)))
    x = bt["input_ids"]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        plain = m(x)
        packed = m(x, position_ids=bt["position_ids"], **DOC_INPUTS["cu_seqlens"](bt))
        m.cfg.flash_attn = False
        ref_plain = m(x)
        ref_packed = m(x, **DOC_INPUTS["position_ids"](bt))
    assert calls == ["flash"] * 2 + ["varlen"] * 2  # 2 layers each
    assert torch.allclose(plain.float(), ref_plain.float(), atol=3e-2)
    real = bt["attention_mask"].bool()
    assert torch.allclose(packed.float()[real], ref_packed.float()[real], atol=3e-2)


# ------------------------------------------------------------------------------------------- GQA
def _old_expand(kv: torch.Tensor, rep: int) -> torch.Tensor:
    """What model/llama.py did before: expand the kv heads and copy them to [B, H, T, D]."""
    B, Hkv, T, D = kv.shape
    return kv[:, :, None].expand(B, Hkv, rep, T, D).reshape(B, Hkv * rep, T, D)


@pytest.mark.parametrize("masked", [False, True])
def test_gqa_never_materialises_keys_values(masked):
    cfg = tiny()
    B, T = 2, L
    torch.manual_seed(0)
    m = Transformer(cfg)
    bt = packed_batch()
    kw = DOC_INPUTS["position_ids"](bt) if masked else {}
    kv_numel = B * cfg.n_kv_heads * T * cfg.head_dim
    full = B * cfg.n_heads * T * cfg.head_dim
    with KVCopyCounter(kv_numel, full, cfg.head_dim) as cc:
        m(bt["input_ids"], labels=bt["labels"], reduction="sum", **kw).backward()
    assert cc.hits == [], cc.hits
    # the counter does catch both materialisations GQA used to need
    k = torch.randn(B, cfg.n_kv_heads, T, cfg.head_dim)
    with KVCopyCounter(kv_numel, full, cfg.head_dim) as cc:
        _old_expand(k, 2)
        k.repeat_interleave(2, dim=1)
    assert len(cc.hits) >= 2, cc.hits


def test_gqa_equals_materialised_computation():
    """Each backend's GQA equals the materialised computation: per op against attention_ref (forward and
    input gradients), and the whole model against the same model with its kv heads copied (an MHA model)."""
    torch.manual_seed(0)
    B, H, Hkv, T, D = 2, 4, 2, L, 16
    bt = packed_batch()
    docs = A.documents_from_positions(bt["position_ids"])
    mask = A.dense_mask(T, 0, torch.device("cpu"), docs, bt["attention_mask"].bool())
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    g = torch.randn(B, H, T, D)
    for spec, m_ref in ((A.AttnSpec("sdpa"), None), (A.AttnSpec("sdpa_masked", is_causal=False, mask=mask), mask)):
        outs = []
        for fn in (lambda a, b, c: A.sdpa_attention(a, b, c, spec), lambda a, b, c: A.attention_ref(a, b, c, m_ref)):
            a, b, c = (t.clone().requires_grad_() for t in (q, k, v))
            y = fn(a, b, c)
            y.backward(g)
            outs.append((y, a.grad, b.grad, c.grad))
        for x, y in zip(*outs):
            assert torch.allclose(x, y, atol=1e-5)
    # whole model: GQA vs MHA with each kv head's weights copied to its query heads
    cfg = tiny()
    torch.manual_seed(0)
    gqa = Transformer(cfg)
    mha = Transformer(tiny(n_kv_heads=cfg.n_heads))
    rep, hd = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim
    sd = gqa.state_dict()
    for n in list(sd):
        if n.endswith(("k_proj.weight", "v_proj.weight")):
            sd[n] = sd[n].view(cfg.n_kv_heads, hd, -1).repeat_interleave(rep, dim=0).reshape(cfg.n_heads * hd, -1)
    mha.load_state_dict(sd)
    kw = DOC_INPUTS["position_ids"](bt)
    for m in (gqa, mha):
        m(bt["input_ids"], labels=bt["labels"], reduction="sum", **kw).backward()
    with torch.no_grad():
        assert torch.allclose(gqa(bt["input_ids"], **kw), mha(bt["input_ids"], **kw), atol=1e-5)
    for (n, p), p2 in zip(gqa.named_parameters(), mha.parameters()):
        g2 = p2.grad
        if n.endswith(("k_proj.weight", "v_proj.weight")):  # the copies' gradients add up
            g2 = g2.view(cfg.n_kv_heads, rep, hd, -1).sum(1).reshape(p.shape)
        assert torch.allclose(p.grad, g2, atol=1e-5, rtol=1e-4), n


# ------------------------------------------------------------------------------------ compiled
_COMPILED_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from tests.model.test_attention import DOC_INPUTS, packed_batch, tiny, _ce_sum, _separate
    from model import Transformer
    out = {{}}
    torch.manual_seed(0)
    m = Transformer(tiny())
    bt = packed_batch()

    def step(ids, labels, **kw):  # the model's logits and a plain-PyTorch loss (model/loss.py is tested apart)
        return _ce_sum(m(ids, **kw), labels)

    # 1. torch.compile(fullgraph=True) as the very first call: forward + backward equal each document
    #    alone (auto backend on CPU: sdpa_masked). aot_eager: the masks are built and traced in the graph; the same
    #    packed first call through Inductor is tests/model/test_compile_cold.py's (one cold Inductor compile less)
    kw = DOC_INPUTS["position_ids"](bt)
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(bt["input_ids"], bt["labels"], **kw)
    loss.backward()
    g_c = {{n: p.grad.clone() for n, p in m.named_parameters()}}
    ref_logits, ref_loss, ref_grads = _separate(m, bt)
    out["loss"] = [float(loss.detach()), ref_loss]
    out["grad_err"] = max(float((g_c[n] - ref_grads[n]).abs().max()) for n in g_c)
    # 2. graphs and graph breaks with packed documents (each way of passing them) and with padding only
    out["explain"] = {{}}
    for name, how in list(DOC_INPUTS.items()) + [("padding", lambda b: {{"attention_mask": b["attention_mask"]}})]:
        torch._dynamo.reset()
        e = torch._dynamo.explain(step)(bt["input_ids"], bt["labels"], **how(bt))
        out["explain"][name] = [e.graph_count, e.graph_break_count]
    # 3. FlexAttention compiled on CPU, packed documents (forward only: torch has no CPU backward for it)
    torch._dynamo.reset()
    m1 = Transformer(tiny(n_layers=1)).eval()
    m1.attn_backend = "flex"
    with torch.no_grad():
        logits = torch.compile(m1, fullgraph=True)(bt["input_ids"], **kw)
    m1.attn_backend = "auto"
    ref, _, _ = _separate(m1, bt)
    out["flex_err"] = max(float((logits[b, s:s + r.shape[0]] - r).abs().max()) for (b, s), r in ref.items())
    print("RESULT " + json.dumps(out))
""")


@pytest.mark.slow
def test_compiled_fullgraph_from_fresh_process_packed_equals_alone_no_graph_break():
    script = _COMPILED_SCRIPT.format(root=ROOT)
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    import json
    out = json.loads(lines[-1][len("RESULT "):])
    loss, ref_loss = out["loss"]
    assert abs(loss - ref_loss) < 1e-4 * max(1.0, abs(ref_loss))
    assert out["grad_err"] < 1e-4
    assert out["explain"] == {name: [1, 0] for name in ("position_ids", "doc_ids", "cu_seqlens", "padding")}
    assert out["flex_err"] < 1e-4
