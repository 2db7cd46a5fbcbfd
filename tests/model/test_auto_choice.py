"""kernel_backend="auto"'s per-mode choices (model/kernels.py AUTO_EAGER / AUTO_UNDER_COMPILE) as the model
and the loss apply them. A CUDA tensor is stood in for by an object that says it is one (nothing launches:
only the choice is asked), and "compiled" by torch.compiler.is_compiling patched to True."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from model import kernels, loss

pytest.importorskip("triton")


def _cuda_like(dtype=torch.bfloat16):
    return SimpleNamespace(is_cuda=True, dtype=dtype, device=SimpleNamespace(type="cuda"))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_cuda_projections_concatenated_eagerly_separate_when_compiled(monkeypatch, compiled):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiled)
    x = _cuda_like()
    assert kernels.concat_projections(x, "auto") is (not compiled)
    assert kernels.concat_projections(x, "triton")  # an explicit backend keeps the one matmul
    assert kernels.choose("cross_entropy", x, "auto") == ("reference" if compiled else "triton")
    assert kernels.concat_projections(torch.empty(2, 2), "auto")  # CPU: unchanged in both modes


def test_float64_never_takes_a_triton_kernel(monkeypatch):
    """The kernels compute in fp32 at most: a float64 model on a GPU (exactness checks) runs the torch paths."""
    for compiled in (False, True):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda c=compiled: c)
        for op in ("rms_norm", "rope", "swiglu", "cross_entropy"):
            assert kernels.choose(op, _cuda_like(torch.float64), "auto") == "torch", (op, compiled)
            assert kernels.choose(op, _cuda_like(torch.float64), "triton") == "torch", (op, compiled)


def test_compiled_loss_takes_the_full_logits_only_within_the_budget(monkeypatch):
    """Where auto picks "reference" for the loss, the full-logits loss runs while tokens x vocab x 4 bytes fit
    REFERENCE_LOSS_MAX_LOGITS_BYTES, else the Triton op (whose chunks do not grow with the vocabulary)."""
    calls = []

    class _StubTriton:
        @staticmethod
        def linear_cross_entropy_triton(h, w, y, reduction, chunk):
            calls.append(h.shape)
            return loss.linear_cross_entropy_ref(h, w, y, reduction)

    monkeypatch.setattr(loss, "choose", lambda op, t, backend: "reference")
    monkeypatch.setattr(loss, "load_triton", lambda name: _StubTriton)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 8, 16, generator=g), torch.randn(40, 16, generator=g)
    y = torch.randint(0, 40, (2, 8), generator=g)
    cfg = SimpleNamespace(fused_cross_entropy=True, kernel_backend="auto", loss_chunk_size=4)
    expected = loss.linear_cross_entropy_ref(h, w, y, "sum")
    logits_bytes = 2 * 8 * 40 * 4
    monkeypatch.setattr(loss, "REFERENCE_LOSS_MAX_LOGITS_BYTES", logits_bytes)
    assert torch.equal(loss.lm_head_loss(h, w, y, "sum", cfg), expected) and calls == []
    monkeypatch.setattr(loss, "REFERENCE_LOSS_MAX_LOGITS_BYTES", logits_bytes - 1)
    assert torch.equal(loss.lm_head_loss(h, w, y, "sum", cfg), expected) and len(calls) == 1


def test_the_start_up_line_says_what_runs_compiled_on_cuda(monkeypatch):
    monkeypatch.setattr(kernels, "choose", lambda op, t, backend: kernels.AUTO_EAGER[op])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    line = kernels.describe_choice(torch.device("cpu"), "auto", compiled=True)
    assert "q/k/v and gate/up separate matmuls" in line and "rms_norm reference" in line
    assert "cross_entropy full logits" in line
    eager = kernels.describe_choice(torch.device("cpu"), "auto", compiled=False)
    assert "one matmul each" in eager and "rms_norm Triton" in eager
