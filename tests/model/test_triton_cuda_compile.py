"""The Triton kernels (the model's, and the optimizer's one-launch AdamW) compile for real NVIDIA GPUs, on a
machine without one.

The other Triton tests run the kernels in the CPU interpreter, which accepts code that the GPU
compiler rejects and says nothing about registers. scripts/check_triton_cuda.py --quick compiles the
largest specialisation of every kernel and mode (bf16 activations, D=8192, 64 heads, vocab 128256)
through Triton's whole pipeline to a cubin for sm_90 (H100) and sm_80 (A100), with the ptxas that
ships in the triton wheel, and reports ptxas's register and spill counts.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICK_VARIANTS = 24  # rms fwd x2, rms bwd x2, rope x2, swiglu x2 + the packed backward, linear+CE x3, the
# optimizer's one-launch AdamW, its ZeRO-1 form over a rank's shards and their sum of squares, its one-process form
# reading the parameters' gradients at their addresses and their sum of squares (the last four each also
# unaligned), and the three AdamW forms with bf16 moments (per architecture)


def _triton_version() -> tuple[int, ...]:
    try:
        import triton
        return tuple(int(p) for p in triton.__version__.split(".")[:2])
    except Exception:
        return (0, 0)


# Known and asserted as such: Triton 3.7 (the release torch 2.13.0's CUDA build requires, requirements-dev.txt)
# compiles the one-process sum of squares of bf16 gradients with one-element accesses even where its rows are
# aligned: the alignment hints that 3.8+ turn into vectors have no effect on that kernel there (aligned and
# unaligned compile to the same cubin). A newer Triton vectorizes it; the assertion below then says to drop it.
_SCALAR_ON_THIS_TRITON = {"sumsq_param_grads grad=bf16"} if _triton_version() < (3, 8) else set()


def _run_without_interpreter(script: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """Run a script of the repo with the kernels compiled for real (TRITON_INTERPRET unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    return subprocess.run([sys.executable, os.path.join(ROOT, script), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return os.path.exists(get_ptxas(90).path)
    except Exception:
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="triton with its NVIDIA backend (bundled ptxas) is not installed")
def test_every_kernel_compiles_for_h100_and_a100_without_spills():
    r = _run_without_interpreter("scripts/check_triton_cuda.py", "--quick", "--json", "--archs", "90,80", timeout=1200)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    failed = [row for row in rows if "error" in row]
    assert not failed, failed
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted({row["arch"] for row in rows}) == [80, 90]
    assert len(rows) == 2 * QUICK_VARIANTS, [row["variant"] for row in rows]
    for row in rows:
        # a kernel that spills at these sizes would run from local memory: a performance bug
        assert row["spill_bytes"] == 0, row
        assert 0 < row["registers"] <= 255, row
        # compiled as the launcher specializes them (pointers 16-byte aligned, sizes multiples of 16), the kernels
        # that stream memory read and write it in vectors; the optimizer's table-driven ones (ZeRO shards, the
        # gradients at their addresses) only where their rows are aligned (Segments.aligned,
        # GradAddresses.aligned: without it every access is one element)
        if row["variant"] in _SCALAR_ON_THIS_TRITON:
            assert row["vector_accesses"] == 0, ("vectorized now: drop it from _SCALAR_ON_THIS_TRITON", row)
            continue
        assert (row["vector_accesses"] == 0) == ("unaligned" in row["variant"]), row
    aligned = {r["variant"]: r for r in rows if r["arch"] == 90}
    for name in ("adamw_param_grads grad=bf16 clip=True", "sumsq_param_grads grad=bf16",
                 "adamw_segments out=bf16 clip=True", "sumsq_segments"):
        if name in _SCALAR_ON_THIS_TRITON:
            continue
        # the aligned form: one vector where the unaligned one issues an element at a time
        assert aligned[name]["scalar_accesses"] < aligned[name + " unaligned"]["scalar_accesses"], aligned


@pytest.mark.skipif(not _ptxas_available(), reason="triton with its NVIDIA backend is not installed")
@pytest.mark.parametrize("mode", ["fp32", "fp16-autocast"])
def test_gpu_registration_of_the_whole_model_traces_and_partitions(mode):
    """The triton_op + wrap_triton path (what a GPU runs, never executed by the interpreter tests)
    traced through AOTAutograd with Inductor's min-cut partitioner, kernels analysed for an sm_90
    target: every fused op of a 2-layer model is a Triton kernel node in the graphs (none fell back)."""
    r = _run_without_interpreter("tests/trace_gpu_path.py", mode, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    layers = 2
    # forward: input_layernorm per layer (rms_norm), post-attention add+norm per layer, the final norm
    assert out["forward"] == {"_rms_norm_fwd_kernel": 2 * layers + 1, "_rope_kernel": layers,
                              "_swiglu_fwd_kernel": layers, "myllm.linear_cross_entropy.default": 1}, out
    # backward: one norm backward per norm, RoPE's inverse rotation, SwiGLU's backward (the packed gate/up one:
    # the fused projection's output, one gradient buffer); the loss's
    # gradients were computed in its forward (reduction "mean"): no loss op in backward
    assert out["backward"] == {"_rms_norm_bwd_kernel": 2 * layers + 1, "_rope_kernel": layers,
                               "_swiglu_packed_bwd_kernel": layers}, out
    assert out["grads"] == out["params"]
    assert out["loss_dtype"] == "torch.float32"
