"""Compile every Triton kernel of the model (and the optimizer's one-launch AdamW) for real NVIDIA GPUs, without a GPU.

The CPU tests run the kernels in Triton's interpreter, which accepts code that the GPU compiler
rejects (loop-carried values whose type changes, unsupported casts, block shapes over the limits) and
says nothing about registers, spills or shared memory. This script compiles each kernel, in every
specialisation the model launches at real sizes (dtypes, constexpr flags, block sizes and warp
counts computed by the launchers' own rules), through Triton's full pipeline: TTIR -> TTGIR -> LLVM
-> PTX -> cubin with the ptxas bundled in the triton wheel, for the chosen architectures (default
sm_90 = H100, sm_80 = A100), with pointer arguments 16-byte aligned and integer arguments multiples of 16, as
Triton's launcher specializes them for torch's allocations and the model's sizes (compiled without that, nothing
is known aligned: every access is one element and the register counts differ, e.g. 123 instead of 64 for the
softmax kernel). It prints one row per kernel variant: registers per thread, spill
bytes and static shared memory from `ptxas -v`, and the PTX's global loads and stores that are vectors
(ld.global.v4.b32, ...) and those that move one element. Exit status 1 if any variant fails to compile.

    python scripts/check_triton_cuda.py                    # sm_90 and sm_80, all variants
    python scripts/check_triton_cuda.py --archs 90 --json  # machine-readable rows
    python scripts/check_triton_cuda.py --quick            # the largest specialisation of each kernel and mode

Must be run without TRITON_INTERPRET=1 (it re-executes itself without it): interpreted kernels
cannot be compiled.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_TY = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


def _variants():
    """(name, kernel, signature, constexprs, num_warps) for every specialisation used at real sizes."""
    import triton

    import model.triton_norm as tn
    import model.triton_rope as tr
    import model.triton_swiglu as tsw
    from model.triton_ops import num_warps
    import model.triton_loss as tlo

    out = []
    # activations in bf16/fp16/fp32; weights fp32 (autocast over fp32 params) or the activations' dtype
    act_w = [("bf16", "fp32"), ("bf16", "bf16"), ("fp16", "fp32"), ("fp32", "fp32")]
    for dim in (768, 2048, 4096, 8192):
        block = triton.next_power_of_2(dim)
        warps = num_warps(block)
        for a, w in act_w:
            y = "fp32" if "fp32" in (a, w) else a  # torch.result_type(x, weight)
            for res in (False, True):
                sig = dict(X=f"*{a}", R=f"*{a}", W=f"*{w}", Y=f"*{y}", H=f"*{a}", RSTD="*fp32", x_stride="i32",
                           r_stride="i32", y_stride="i32", h_stride="i32", D="i32", eps="fp32",
                           HAS_RESIDUAL="constexpr", BLOCK="constexpr")
                out.append((f"rms_norm_fwd D={dim} x={a} w={w} residual={res}", tn._rms_norm_fwd_kernel, sig,
                            dict(HAS_RESIDUAL=res, BLOCK=block), warps))
                sig = dict(G=f"*{y}", GH=f"*{a}", X=f"*{a}", W=f"*{w}", RSTD="*fp32", DX=f"*{a}", DW="*fp32",
                           g_stride="i32", gh_stride="i32", x_stride="i32", dx_stride="i32", n_rows="i32", D="i32",
                           rows_per_program="i32", HAS_GH="constexpr", BLOCK="constexpr", BLOCK_ROWS="constexpr")
                rows = tn._bwd_block_rows(block)  # a 2-D tile of rows x the padded row
                out.append((f"rms_norm_bwd D={dim} x={a} w={w} gh={res}", tn._rms_norm_bwd_kernel, sig,
                            dict(HAS_GH=res, BLOCK=block, BLOCK_ROWS=rows), num_warps(block * rows)))
    # RoPE: (heads, kv heads, head_dim) of the 124M, 1B, Llama-2-7B and Llama-3-8B/70B shapes
    for h, hkv, hd in ((12, 12, 64), (16, 8, 128), (32, 32, 128), (32, 8, 128), (64, 8, 128)):
        bh, bkv, bhalf = (triton.next_power_of_2(v) for v in (h, hkv, hd // 2))
        for a in ("bf16", "fp16", "fp32"):
            for inverse in (False, True):
                sig = dict(Q=f"*{a}", K=f"*{a}", COS="*fp32", SIN="*fp32", QO=f"*{a}", KO=f"*{a}", T="i32", H="i32",
                           HKV="i32", q_sb="i32", q_st="i32", q_sh="i32", k_sb="i32", k_st="i32", k_sh="i32",
                           c_sb="i32", c_st="i32", qo_sb="i32", qo_st="i32", qo_sh="i32", ko_sb="i32", ko_st="i32",
                           ko_sh="i32", HALF="i32", INVERSE="constexpr", BLOCK_H="constexpr",
                           BLOCK_HKV="constexpr", BLOCK_HALF="constexpr")
                out.append((f"rope H={h} Hkv={hkv} D={hd} {a} inverse={inverse}", tr._rope_kernel, sig,
                            dict(INVERSE=inverse, BLOCK_H=bh, BLOCK_HKV=bkv, BLOCK_HALF=bhalf),
                            num_warps(bh * bhalf)))
    for a in ("bf16", "fp16", "fp32"):
        # gate/up read in place from the fused gate+up matmul output: row strides are arguments
        sig = dict(GATE=f"*{a}", UP=f"*{a}", Y=f"*{a}", n_cols="i32", g_stride="i32", u_stride="i32",
                   y_stride="i32", BLOCK="constexpr")
        out.append((f"swiglu_fwd {a}", tsw._swiglu_fwd_kernel, sig, dict(BLOCK=tsw._SWIGLU_BLOCK), 4))
        sig = dict(DY=f"*{a}", GATE=f"*{a}", UP=f"*{a}", DGATE=f"*{a}", DUP=f"*{a}", n_cols="i32",
                   dy_stride="i32", g_stride="i32", u_stride="i32", dg_stride="i32", du_stride="i32",
                   BLOCK="constexpr")
        out.append((f"swiglu_bwd {a}", tsw._swiglu_bwd_kernel, sig, dict(BLOCK=tsw._SWIGLU_BLOCK), 4))
        sig = dict(DY=f"*{a}", GU=f"*{a}", DGU=f"*{a}", n_cols="i32", dy_stride="i32", gu_stride="i32",
                   dgu_stride="i32", BLOCK="constexpr")
        out.append((f"swiglu_packed_bwd {a}", tsw._swiglu_packed_bwd_kernel, sig, dict(BLOCK=tsw._SWIGLU_BLOCK), 4))
    # linear + CE: the three modes the op launches (forward with and without gradients, backward of "none")
    for vocab in (32000, 128256):
        block = min(tlo.MAX_BLOCK_V, triton.next_power_of_2(vocab))
        warps = tlo._num_warps_for(block)
        for a in ("bf16", "fp16", "fp32"):
            for lse_in, write_loss, write_grad in ((False, True, True), (False, True, False), (True, False, True)):
                out.append((f"ce V={vocab} {a} lse_in={lse_in} loss={write_loss} grad={write_grad}",
                            tlo._ce_chunk_kernel, _ce_sig(a),
                            dict(LSE_IN=lse_in, WRITE_LOSS=write_loss, WRITE_GRAD=write_grad, BLOCK_V=block), warps))
    # the GPU per-op bench's A/B of the tile (bench/bench_kernels_gpu.py LOSS_TILES): 4096 with 8 warps and 8192
    # with 16, bf16 logits
    for tile in (4096, 8192):
        out.append((f"ce V=32000 bf16 tile={tile} lse_in=False loss=True grad=True", tlo._ce_chunk_kernel,
                    _ce_sig("bf16"), dict(LSE_IN=False, WRITE_LOSS=True, WRITE_GRAD=True, BLOCK_V=tile),
                    tlo._num_warps_for(tile)))
    return out + _optimizer_variants()


def _adamw_sig(kernel, **types) -> dict:
    """An AdamW kernel's signature in its argument order: `types` for the pointers and sizes that differ between
    variants, the hyperparameters (fp32), the bf16-moment seeds (i32) and every constexpr filled in."""
    common = dict(lr_wd="fp32", beta1="fp32", beta2="fp32", eps="fp32", max_norm="fp32", step_size="fp32",
                  bc2_sqrt="fp32", seed_m="i32", seed_v="i32", decay_ptr="*u8", sumsq_ptr="*fp32", master_ptr="*fp32")
    merged = {**common, **types}
    return {a: merged.get(a, "constexpr") for a in kernel.arg_names}


def _sumsq_sig(kernel, **types) -> dict:
    """A sum-of-squares kernel's signature in its argument order: `types` for the pointers that differ between
    variants (the gradients, or their address table), the table, the partial sums and the row count, every
    constexpr filled in."""
    merged = dict(table_ptr="*i64", out_ptr="*fp32", n_rows="i32", **types)
    return {a: merged.get(a, "constexpr") for a in kernel.arg_names}


def _ce_sig(a: str) -> dict:
    """model/triton_loss.py _ce_chunk_kernel's signature for logits of dtype `a`."""
    return dict(logits_ptr=f"*{a}", logits_stride="i32", labels_ptr="*i64", scale_ptr="*fp32", scale_stride="i32",
                loss_ptr="*fp32", lse_ptr="*fp32", n_cols="i32", ignore_index="i32", z_loss="fp32",
                LSE_IN="constexpr", WRITE_LOSS="constexpr", WRITE_GRAD="constexpr", BLOCK_V="constexpr")


def _optimizer_variants():
    """The optimizer's AdamW kernels (optimizer/flat_adamw.py), as `_variants` lists them."""
    out = []
    # the optimizer's one-launch AdamW (optimizer/flat_adamw.py): bf16 parameters written back, or fp32 ones
    # (the masters themselves); clipping on and off; n as i32 and i64 (a buffer of more than 2^31 elements)
    import optimizer.flat_adamw as fa
    for out_ty, has_out in (("bf16", True), ("fp32", False)):
        for clip in (True, False):
            for n_ty in ("i32", "i64"):
                sig = _adamw_sig(fa._adamw_flat_kernel, grad_ptr="*fp32", m_ptr="*fp32", v_ptr="*fp32",
                                 out_ptr=f"*{out_ty}", n=n_ty)
                out.append((f"adamw_flat out={out_ty if has_out else 'none'} clip={clip} n={n_ty}",
                            fa._adamw_flat_kernel, sig,
                            dict(HAS_OUT=has_out, OUT_BF16=has_out and out_ty == "bf16", CLIP=clip, STATE_BF16=False,
                                 BLOCK=fa.BLOCK), 8))
    # ZeRO: the same step over a rank's shards (a row table), and the shards' sum of squares
    for out_ty, has_out in (("bf16", True), ("fp32", False)):
        for clip in (True, False):
            sig = _adamw_sig(fa._adamw_segments_kernel, grad_ptr="*fp32", m_ptr="*fp32", v_ptr="*fp32",
                             out_ptr=f"*{out_ty}", table_ptr="*i64")
            out.append((f"adamw_segments out={out_ty if has_out else 'none'} clip={clip}", fa._adamw_segments_kernel,
                        sig, dict(MASTER_COMPACT=has_out, HAS_OUT=has_out, OUT_BF16=has_out and out_ty == "bf16",
                                  CLIP=clip, STATE_BF16=False, ALIGNED=True, BLOCK=fa.BLOCK), 8))
    # shards whose boundaries are not multiples of 16 elements (Segments.aligned False): one element an access
    out.append(("adamw_segments out=bf16 clip=True unaligned", fa._adamw_segments_kernel,
                _adamw_sig(fa._adamw_segments_kernel, grad_ptr="*fp32", m_ptr="*fp32", v_ptr="*fp32", out_ptr="*bf16",
                           table_ptr="*i64"),
                dict(MASTER_COMPACT=True, HAS_OUT=True, OUT_BF16=True, CLIP=True, STATE_BF16=False, ALIGNED=False,
                     BLOCK=fa.BLOCK), 8))
    for aligned in (True, False):
        out.append(("sumsq_segments" + ("" if aligned else " unaligned"), fa._sumsq_segments_kernel,
                    _sumsq_sig(fa._sumsq_segments_kernel, grad_ptr="*fp32"),
                    dict(ALIGNED=aligned, BLOCK=fa.BLOCK, ROWS=fa.SUMSQ_ROWS), 8))
    # bf16 gradient buffers (--grad_reduce_in_fp32=false): the same kernels, the gradients widened as they are read
    sig = _adamw_sig(fa._adamw_flat_kernel, grad_ptr="*bf16", m_ptr="*fp32", v_ptr="*fp32", out_ptr="*bf16", n="i64")
    out.append(("adamw_flat grad=bf16 out=bf16 clip=True n=i64", fa._adamw_flat_kernel, sig,
                dict(HAS_OUT=True, OUT_BF16=True, CLIP=True, STATE_BF16=False, BLOCK=fa.BLOCK), 8))
    sig = _adamw_sig(fa._adamw_segments_kernel, grad_ptr="*bf16", m_ptr="*fp32", v_ptr="*fp32", out_ptr="*bf16",
                     table_ptr="*i64")
    out.append(("adamw_segments grad=bf16 out=bf16 clip=True", fa._adamw_segments_kernel, sig,
                dict(MASTER_COMPACT=True, HAS_OUT=True, OUT_BF16=True, CLIP=True, STATE_BF16=False, ALIGNED=True,
                     BLOCK=fa.BLOCK), 8))
    out.append(("sumsq over segments, grad=bf16", fa._sumsq_segments_kernel,
                _sumsq_sig(fa._sumsq_segments_kernel, grad_ptr="*bf16"),
                dict(ALIGNED=True, BLOCK=fa.BLOCK, ROWS=fa.SUMSQ_ROWS), 8))
    # one process: the gradients read at their addresses (a table of int64, cast to typed pointers in the kernel)
    for grad_bf16, out_ty, has_out in ((True, "bf16", True), (False, "fp32", False)):
        for clip in (True, False):
            sig = _adamw_sig(fa._adamw_param_grads_kernel, ptrs_ptr="*i64", m_ptr="*fp32", v_ptr="*fp32",
                             out_ptr=f"*{out_ty}", table_ptr="*i64")
            out.append((f"adamw_param_grads grad={'bf16' if grad_bf16 else 'fp32'} clip={clip}",
                        fa._adamw_param_grads_kernel, sig,
                        dict(GRAD_BF16=grad_bf16, HAS_OUT=has_out, OUT_BF16=has_out and out_ty == "bf16", CLIP=clip,
                             STATE_BF16=False, ALIGNED=True, BLOCK=fa.BLOCK), 8))
        for aligned in (True, False):
            out.append((f"sumsq_param_grads grad={'bf16' if grad_bf16 else 'fp32'}"
                        + ("" if aligned else " unaligned"), fa._sumsq_param_grads_kernel,
                        _sumsq_sig(fa._sumsq_param_grads_kernel, ptrs_ptr="*i64"),
                        dict(GRAD_BF16=grad_bf16, ALIGNED=aligned, BLOCK=fa.BLOCK, ROWS=fa.SUMSQ_ROWS), 8))
    # a step whose gradients or parameter sizes are not multiples of 16 (GradAddresses.aligned False): one element
    # an access
    sig = _adamw_sig(fa._adamw_param_grads_kernel, ptrs_ptr="*i64", m_ptr="*fp32", v_ptr="*fp32", out_ptr="*bf16",
                     table_ptr="*i64")
    out.append(("adamw_param_grads grad=bf16 clip=True unaligned", fa._adamw_param_grads_kernel, sig,
                dict(GRAD_BF16=True, HAS_OUT=True, OUT_BF16=True, CLIP=True, STATE_BF16=False, ALIGNED=False,
                     BLOCK=fa.BLOCK), 8))
    # --optimizer_state_dtype=bf16: the moments read and written as bf16, stored with stochastic rounding
    for name, kernel, types, consts in (
            ("adamw_flat", fa._adamw_flat_kernel, dict(grad_ptr="*fp32", n="i64"), {}),
            ("adamw_segments", fa._adamw_segments_kernel, dict(grad_ptr="*fp32", table_ptr="*i64"),
             dict(MASTER_COMPACT=True, ALIGNED=True)),
            ("adamw_param_grads", fa._adamw_param_grads_kernel, dict(ptrs_ptr="*i64", table_ptr="*i64"),
             dict(GRAD_BF16=True, ALIGNED=True))):
        sig = _adamw_sig(kernel, m_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", **types)
        out.append((f"{name} moments=bf16", kernel, sig,
                    dict(HAS_OUT=True, OUT_BF16=True, CLIP=True, STATE_BF16=True, BLOCK=fa.BLOCK, **consts), 8))
    return out


_QUICK = ("D=8192 x=bf16 w=fp32", "H=64 Hkv=8 D=128 bf16", "swiglu_fwd bf16", "swiglu_bwd bf16",
          "swiglu_packed_bwd bf16", "V=128256 bf16", "adamw_flat out=bf16 clip=True n=i64",
          "adamw_segments out=bf16 clip=True", "sumsq_segments", "adamw_param_grads grad=bf16 clip=True",
          "sumsq_param_grads grad=bf16", "adamw_flat moments=bf16", "adamw_segments moments=bf16",
          "adamw_param_grads moments=bf16")
_PTXAS_LINE = re.compile(r"Used (\d+) registers")
_GLOBAL_ACCESS = re.compile(r"\b(?:ld|st)\.global(?:\.[a-z]+)*?(\.v[248])?\.b(?:8|16|32|64)\b")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SMEM = re.compile(r"(\d+) bytes smem")


def compile_variant(kernel, signature: dict, constexprs: dict, num_warps: int, arch: int) -> dict:
    """Compile one specialisation to a cubin for sm_<arch>; registers/spills/smem from ptxas -v."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    # pointer arguments 16-byte aligned and integer ones multiples of 16, as Triton's launcher specializes them at
    # run time for torch's allocations and the model's sizes (its "D" attribute; an integer that is not a multiple
    # of 16 there compiles another specialization): without it the compile assumes nothing and no access is ever
    # a vector
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if str(signature.get(a, "")).startswith(("*", "i"))}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    ptx = k.asm["ptx"]
    widths = [m.group(1) for m in _GLOBAL_ACCESS.finditer(ptx)]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{'a' if arch >= 90 else ''}", path,
                            "-o", os.path.join(tmp, "k.o")], capture_output=True, text=True, check=True)
    log = r.stderr + r.stdout
    regs = int(_PTXAS_LINE.search(log).group(1))
    spill = _SPILL.search(log)
    smem = _SMEM.search(log)
    return dict(registers=regs, spill_bytes=int(spill.group(1)) + int(spill.group(2)) if spill else 0,
                smem_bytes=int(smem.group(1)) if smem else 0, cubin_bytes=len(k.asm["cubin"]),
                shared_launch=int(getattr(k.metadata, "shared", 0)),
                # global loads/stores in the PTX: vector ones (ld.global.v4.b32, ...) and one element each
                vector_accesses=sum(1 for w in widths if w), scalar_accesses=sum(1 for w in widths if not w))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--archs", default="90,80", help="comma list of compute capabilities (90 = H100, 80 = A100)")
    p.add_argument("--only", default="", help="compile only variants whose name contains this text")
    p.add_argument("--json", action="store_true", help="one JSON object per variant instead of a table")
    p.add_argument("--quick", action="store_true",
                   help="only the largest specialisation of each kernel and mode (bf16 activations, fp32 weights, "
                        "D=8192, 64 heads, vocab 128256): the ones with the most registers")
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":  # kernels must be JITFunctions: start again without it
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        return subprocess.call([sys.executable, *sys.argv], env=env)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: nothing to compile", file=sys.stderr)
        return 1
    failures = 0
    if not args.json:
        print("| arch | kernel variant | warps | registers | spill bytes | shared memory | global accesses: vector / "
              "scalar |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
    for arch in (int(a) for a in args.archs.split(",")):
        for name, kernel, sig, constexprs, warps in _variants():
            if args.only and args.only not in name:
                continue
            if args.quick and not any(q in name for q in _QUICK):
                continue
            try:
                row = dict(arch=arch, variant=name, warps=warps, **compile_variant(kernel, sig, constexprs, warps, arch))
            except Exception as e:  # a compile error is the finding: report it and go on
                failures += 1
                msg = str(e).strip().splitlines()
                row = dict(arch=arch, variant=name, warps=warps, error=(msg[0] if msg else type(e).__name__)[:300])
            if args.json:
                print(json.dumps(row), flush=True)
            elif "error" in row:
                print(f"| sm_{arch} | {name} | {warps} | FAILED: {row['error']} | | | |", flush=True)
            else:
                print(f"| sm_{arch} | {name} | {warps} | {row['registers']} | {row['spill_bytes']} | "
                      f"{max(row['smem_bytes'], row['shared_launch'])} | {row['vector_accesses']} / "
                      f"{row['scalar_accesses']} |", flush=True)
    if failures:
        print(f"{failures} kernel variant(s) failed to compile", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
