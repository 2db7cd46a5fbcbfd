"""Gemma 2's final-logit soft-cap (z -> cap * tanh(z / cap), model/softcap.py) in the heads that form their logits and
gradients by hand: the chunked linear + cross-entropy (model/loss.py, eager and under torch.compile, and
`lm_head_loss` reading `cfg.final_softcap`), the per-token log-probabilities (model/token_logprobs.py) and, in two
gloo processes, the vocabulary-parallel loss (model/vocab_parallel_loss.py) and token_logprobs on a vocabulary
shard.

The truth is the formula written out in float64 with autograd (whole logits, torch.tanh(z / cap) * cap,
F.cross_entropy / log_softmax). Heads that accumulate in fp64 for fp64 inputs (token_logprobs, the vocabulary-
parallel loss) must match it to 1e-12 relative there; otherwise a head may be 10x the error of the same formula run
in fp32, plus 4 fp32 ulps of the value's scale: the chunked linear + CE keeps its statistics and loss in fp32 by
design, also for fp64 inputs (its logits rounded to fp32), so it gets that tolerance at both input dtypes. The cap
(2.0) is small against the logits (std ~4), so the tanh is far from linear: the cap changes the loss, and a gradient
missing the cap's derivative differs from the truth, by far more than the tolerances (both asserted, so each
comparison can fail)."""
from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

import model.loss as loss_mod
from model.loss import linear_cross_entropy, linear_cross_entropy_ref, lm_head_loss
from model.token_logprobs import token_logprobs
from utils.constants import IGNORE_INDEX

CAP = 2.0
VOCAB, DIM = 50, 16
CHUNK = 5  # 21 tokens: chunks of 5, 5, 5, 5, 1
EPS32 = torch.finfo(torch.float32).eps


def _data(dtype: torch.dtype, seed: int = 0):
    """hidden [3, 7, D], weight [V, D] (logits of std ~4), labels with ignored positions, an upstream gradient."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(3, 7, DIM, generator=g, dtype=torch.float64)
    w = torch.randn(VOCAB, DIM, generator=g, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (3, 7), generator=g)
    y[0, :3] = IGNORE_INDEX
    y[2, 5] = IGNORE_INDEX
    up = torch.randn(3, 7, generator=g, dtype=torch.float64)
    return h.to(dtype), w.to(dtype), y, up.to(dtype)


def _capped(z: torch.Tensor, cap, derivative: bool = True) -> torch.Tensor:
    """The soft-cap written out; derivative=False: the same values with the cap's gradient taken as 1 (the bug the
    tests must catch)."""
    if cap is None:
        return z
    c = torch.tanh(z / cap) * cap
    return c if derivative else z + (c - z).detach()


def _ce_formula(h, w, y, reduction: str, cap=CAP, derivative: bool = True) -> torch.Tensor:
    z = _capped(h @ w.t(), cap, derivative)
    per = F.cross_entropy(z.reshape(-1, VOCAB), y.reshape(-1), ignore_index=IGNORE_INDEX,
                          reduction="none").reshape(y.shape)
    if reduction == "none":
        return per
    return per.sum() / ((y != IGNORE_INDEX).sum() if reduction == "mean" else 1)


def _logprobs_formula(h, w, y, temperature: float, cap=CAP, derivative: bool = True):
    la = torch.log_softmax(_capped(h @ w.t(), cap, derivative) / temperature, dim=-1)
    return la.gather(-1, y[..., None])[..., 0], -(la.exp() * la).sum(-1)


def _loss_and_grads(fn, h, w, up, reduction: str):
    """(value, d hidden, d weight) of fn(h, w): backward of the scalar, or of sum(loss * up) for "none"."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    out = fn(h, w)
    (out * up if reduction == "none" else out).sum().backward()
    return out.detach(), h.grad, w.grad


def _logprobs_and_grads(fn, h, w, up):
    """(log p, entropy, d hidden, d weight) of fn(h, w) -> (log p, entropy), backward of sum(log p * up)."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logp, ent = fn(h, w)
    (logp * up).sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _tolerances(truth, fp32_ref) -> list[float]:
    """Per compared tensor: 1e-12 relative for fp64 (fp32_ref None), else 10x the fp32 formula's own error plus 4
    fp32 ulps of the scale."""
    out = []
    for i, t in enumerate(truth):
        scale = t.abs().max().item()
        out.append(1e-12 * scale if fp32_ref is None else 10 * _err(fp32_ref[i], t) + 4 * EPS32 * scale)
    return out


def _assert_close_to(got, truth, tols, names) -> None:
    for a, t, tol, name in zip(got, truth, tols, names):
        assert _err(a, t) <= tol, (name, _err(a, t), tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_chunked_cross_entropy_with_softcap_matches_the_formula(reduction, dtype):
    h, w, y, up = _data(dtype)
    h64, w64, _, up64 = _data(torch.float64)
    truth = _loss_and_grads(lambda a, b: _ce_formula(a, b, y, reduction), h64, w64, up64, reduction)
    h32, w32, _, up32 = _data(torch.float32)  # (fp32 statistics at either input dtype: the fp32 formula's error)
    tols = _tolerances(truth, _loss_and_grads(lambda a, b: _ce_formula(a, b, y, reduction), h32, w32, up32, reduction))
    got = _loss_and_grads(lambda a, b: linear_cross_entropy(a, b, y, reduction, CHUNK, softcap=CAP), h, w, up,
                          reduction)
    _assert_close_to(got, truth, tols, ("loss", "d hidden", "d weight"))
    # the full-logits reference takes the cap too
    ref = _loss_and_grads(lambda a, b: linear_cross_entropy_ref(a, b, y, reduction, softcap=CAP), h, w, up, reduction)
    _assert_close_to(ref, truth, tols, ("ref loss", "ref d hidden", "ref d weight"))
    # the checks can fail: without the cap, or without its derivative, the numbers are far off
    uncapped = _loss_and_grads(lambda a, b: _ce_formula(a, b, y, reduction, cap=None), h64, w64, up64, reduction)
    no_deriv = _loss_and_grads(lambda a, b: _ce_formula(a, b, y, reduction, derivative=False), h64, w64, up64,
                               reduction)
    assert _err(uncapped[0], truth[0]) > 100 * tols[0]
    for i in (1, 2):
        assert _err(no_deriv[i], truth[i]) > 100 * tols[i]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softcap_none_is_the_uncapped_loss_bit_for_bit(reduction):
    """softcap=None and the op's softcap=0.0 (its default) are the loss without the keyword, values and gradients."""
    h, w, y, up = _data(torch.float32, seed=1)
    base = _loss_and_grads(lambda a, b: linear_cross_entropy(a, b, y, reduction, CHUNK), h, w, up, reduction)
    for fn in (lambda a, b: linear_cross_entropy(a, b, y, reduction, CHUNK, softcap=None),
               lambda a, b: torch.ops.myllm.chunked_linear_cross_entropy(a.reshape(-1, DIM), b, y.reshape(-1),
                                                                          reduction, CHUNK, torch.float32, True, True,
                                                                          0.0)[0].reshape(base[0].shape)):
        for name, a, b in zip(("loss", "d hidden", "d weight"), _loss_and_grads(fn, h, w, up, reduction), base):
            assert torch.equal(a, b), name
    capped = linear_cross_entropy(h, w, y, reduction, CHUNK, softcap=CAP)
    assert _err(capped, base[0]) > 0.1


def test_lm_head_loss_reads_final_softcap_from_the_config(monkeypatch):
    h, w, y, up = _data(torch.float64, seed=2)
    truth = _loss_and_grads(lambda a, b: _ce_formula(a, b, y, "mean"), h, w, up, "mean")
    h32, w32, _, up32 = _data(torch.float32, seed=2)  # fp64 inputs, fp32 statistics: the fp32 formula's error
    tols = _tolerances(truth, _loss_and_grads(lambda a, b: _ce_formula(a, b, y, "mean"), h32, w32, up32, "mean"))
    names = ("loss", "d hidden", "d weight")

    def head(cfg):
        return _loss_and_grads(lambda a, b: lm_head_loss(a, b, y, "mean", cfg), h, w, up, "mean")

    cfg = types.SimpleNamespace(final_softcap=CAP, fused_cross_entropy=True, kernel_backend="torch",
                                loss_chunk_size=CHUNK)
    _assert_close_to(head(cfg), truth, tols, names)  # the chunked path
    _assert_close_to(head(types.SimpleNamespace(**{**vars(cfg), "fused_cross_entropy": False})), truth, tols, names)
    # the Triton op has no cap: a capped model takes the chunked path where Triton would be chosen
    monkeypatch.setattr(loss_mod, "choose", lambda *a, **k: "triton")
    monkeypatch.setattr(loss_mod, "load_triton", lambda *a, **k: pytest.fail("the Triton loss ran with a cap"))
    _assert_close_to(head(cfg), truth, tols, names)
    monkeypatch.setattr(loss_mod, "choose", lambda *a, **k: "reference")  # the full logits (they fit)
    _assert_close_to(head(cfg), truth, tols, names)
    # a config without the field (or None) is uncapped
    uncapped = _loss_and_grads(lambda a, b: _ce_formula(a, b, y, "mean", cap=None), h, w, up, "mean")
    plain = types.SimpleNamespace(fused_cross_entropy=True, kernel_backend="torch", loss_chunk_size=CHUNK)
    monkeypatch.setattr(loss_mod, "choose", lambda *a, **k: "torch")
    uncapped32 = _loss_and_grads(lambda a, b: _ce_formula(a, b, y, "mean", cap=None), h32, w32, up32, "mean")
    _assert_close_to(head(plain), uncapped, _tolerances(uncapped, uncapped32), names)
    assert _err(uncapped[0], truth[0]) > 100 * tols[0]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiled_chunked_cross_entropy_with_softcap_equals_eager(reduction):
    """Under torch.compile (fullgraph) the custom op `myllm::chunked_linear_cross_entropy` runs the same chunks with
    the same cap: the same values and gradients as eager, bit for bit."""
    torch._dynamo.reset()
    h, w, y, up = _data(torch.float32, seed=3)

    def fn(a, b):
        return linear_cross_entropy(a, b, y, reduction, CHUNK, softcap=CAP)

    eager = _loss_and_grads(fn, h, w, up, reduction)
    compiled = _loss_and_grads(torch.compile(fn, backend="aot_eager", fullgraph=True), h, w, up, reduction)
    torch._dynamo.reset()
    for name, a, b in zip(("loss", "d hidden", "d weight"), compiled, eager):
        assert torch.equal(a, b), (name, _err(a, b))
    uncapped = linear_cross_entropy(h, w, y, reduction, CHUNK)
    assert _err(uncapped, eager[0]) > 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_token_logprobs_with_softcap_and_temperature_match_the_formula(dtype):
    temperature = 0.7
    h, w, _, up = _data(dtype, seed=4)
    y = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(4))
    h64, w64, _, up64 = _data(torch.float64, seed=4)
    truth = _logprobs_and_grads(lambda a, b: _logprobs_formula(a, b, y, temperature), h64, w64, up64)
    fp32_ref = None
    if dtype == torch.float32:
        fp32_ref = _logprobs_and_grads(lambda a, b: _logprobs_formula(a, b, y, temperature), h, w, up)
    tols = _tolerances(truth, fp32_ref)
    names = ("log p", "entropy", "d hidden", "d weight")
    got = _logprobs_and_grads(lambda a, b: token_logprobs(a, b, y, temperature, CHUNK, softcap=CAP), h, w, up)
    _assert_close_to(got, truth, tols, names)
    uncapped = _logprobs_and_grads(lambda a, b: _logprobs_formula(a, b, y, temperature, cap=None), h64, w64, up64)
    no_deriv = _logprobs_and_grads(lambda a, b: _logprobs_formula(a, b, y, temperature, derivative=False), h64, w64,
                                   up64)
    assert _err(uncapped[0], truth[0]) > 100 * tols[0] and _err(uncapped[1], truth[1]) > 100 * tols[1]
    for i in (2, 3):
        assert _err(no_deriv[i], truth[i]) > 100 * tols[i]


def test_compiled_token_logprobs_caps_the_whole_logits():
    """Under torch.compile token_logprobs traces the whole-logits reference: capped, then / temperature."""
    torch._dynamo.reset()
    temperature = 1.3
    h, w, _, up = _data(torch.float32, seed=5)
    y = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(5))
    h64, w64, _, up64 = _data(torch.float64, seed=5)
    truth = _logprobs_and_grads(lambda a, b: _logprobs_formula(a, b, y, temperature), h64, w64, up64)
    tols = _tolerances(truth, _logprobs_and_grads(lambda a, b: _logprobs_formula(a, b, y, temperature), h, w, up))
    fn = torch.compile(lambda a, b: token_logprobs(a, b, y, temperature, CHUNK, softcap=CAP), backend="aot_eager",
                       fullgraph=True)
    got = _logprobs_and_grads(fn, h, w, up)
    torch._dynamo.reset()
    _assert_close_to(got, truth, tols, ("log p", "entropy", "d hidden", "d weight"))


# ------------------------------------------------------------------ tensor parallelism: 2 gloo processes
def _tp_ranks(rank: int, world: int, out_path: str) -> None:
    """On a 1-D mesh of `world` ranks, the weight sharded on the vocabulary: the vocabulary-parallel loss (directly
    and through lm_head_loss) and token_logprobs, soft-capped, against the fp64 formula on the whole weight. Writes
    {what: [errors..., tolerances..., distance of the wrong variants]} (rank 0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from model.vocab_parallel_loss import vocab_parallel_lm_head_loss
    mesh = init_device_mesh("cpu", (world,))
    h, w, y, up = _data(torch.float64, seed=6)

    def grads_of(fn, results):  # the weight's gradient lands on the DTensor leaf: read it back whole
        hh = h.clone().requires_grad_()
        ww = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()
        out = fn(hh, ww)
        results.append(out)
        return hh, ww

    res: dict = {}
    cfg = types.SimpleNamespace(final_softcap=CAP, fused_cross_entropy=True, kernel_backend="torch",
                                loss_chunk_size=CHUNK)
    for reduction in ("mean", "sum", "none"):
        truth = _loss_and_grads(lambda a, b: _ce_formula(a, b, y, reduction), h, w, up, reduction)
        no_deriv = _loss_and_grads(lambda a, b: _ce_formula(a, b, y, reduction, derivative=False), h, w, up,
                                   reduction)
        for name, fn in (("vocab_parallel", lambda a, b: vocab_parallel_lm_head_loss(a, b, y, reduction, CHUNK,
                                                                                     softcap=CAP)),
                         ("lm_head_loss", lambda a, b: lm_head_loss(a, b, y, reduction, cfg))):
            outs: list = []
            hh, ww = grads_of(fn, outs)
            (outs[0] * up if reduction == "none" else outs[0]).sum().backward()
            got = (outs[0].detach(), hh.grad, ww.grad.full_tensor())
            res[f"{name}_{reduction}"] = {"err": [_err(a, t) for a, t in zip(got, truth)],
                                          "tol": _tolerances(truth, None),
                                          "no_deriv": [_err(no_deriv[i], truth[i]) for i in (1, 2)]}
    truth = _logprobs_and_grads(lambda a, b: _logprobs_formula(a, b, y.clamp(min=0), 0.7), h, w, up)
    outs = []
    hh, ww = grads_of(lambda a, b: token_logprobs(a, b, y.clamp(min=0), 0.7, CHUNK, softcap=CAP), outs)
    (outs[0][0] * up).sum().backward()
    got = (outs[0][0].detach(), outs[0][1], hh.grad, ww.grad.full_tensor())
    res["token_logprobs"] = {"err": [_err(a, t) for a, t in zip(got, truth)], "tol": _tolerances(truth, None)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(res, f)


def test_tensor_parallel_heads_cap_each_shard(tmp_path):
    from tests.dist_helpers import spawn
    out = tmp_path / "tp.json"
    spawn(_tp_ranks, 2, str(out))
    res = json.loads(out.read_text())
    assert len(res) == 7
    for name, r in res.items():
        for i, (err, tol) in enumerate(zip(r["err"], r["tol"])):
            assert err <= tol, (name, i, err, tol)
        for i, far in enumerate(r.get("no_deriv", [])):
            assert far > 100 * r["tol"][i + 1], (name, far)
