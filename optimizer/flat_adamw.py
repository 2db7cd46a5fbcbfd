"""AdamW over a whole flat parameter buffer in ONE launch: clip, weight decay, the moments, the update and the
write-back to the low-precision model parameters (issue "GPU speed, third pass", item 4).

Why: our DDP keeps every parameter of a dtype in one flat buffer, and the unsharded optimizer keeps one flat
fp32 master per buffer. torch's fused AdamW still walks per-parameter tensors through multi_tensor_apply, which
launches a kernel per 320 x 64K elements (6 at 124M, 53 at 1B), and the step around it made three more passes
over memory: the clip (`grads *= coef`, always, since the coefficient lives on the device), the update, and the
copy of the masters into the bf16 parameters. Here one Triton program per BLOCK elements reads the gradient,
master, moments and a decay flag, and writes master, moments and the bf16 parameter: 31 bytes per parameter
instead of 42, and one launch whatever the model size. In one process with the gradients read from the
parameters (`ParamGrads`) it is 28: the bf16 gradient (2), the fp32 master read and written (8), the moments (16),
the bf16 parameter (2), the decay flag read once per block; 20 with bf16 moments (--optimizer_state_dtype=bf16,
rounded stochastically: `_round_bf16_stochastic` here, its torch side optimizer/bf16_rounding.py). The clip
coefficient and the overflow skip are read from the squared norm on the device (no host decision before the
launch); a non-finite norm writes nothing.

The math is torch's AdamW (decoupled weight decay), in fp32: p -= lr*wd*p (decayed elements);
m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g*g; p -= (lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps), with
g = grad * min(1, max_norm/(norm + 1e-6)). Not bit-equal to torch's kernel (another instruction order and FMA
contraction): `adamw_flat_reference` is the same formula in torch ops, what the CPU runs when this path is
asked for there, and what the Triton kernel is tested against (in the interpreter on CPU, tests/optimizer/
test_flat_adamw.py); both are tested against torch.optim.AdamW within its own float32 error.

ZeRO-1's form (`adamw_segments`, `sumsq_segments`): a rank's shards are ranges scattered over the buffer; its
masters, moments and decay flags are kept one after another, and a row table (built once) gives each program its
block's compact and buffer offsets, so one launch still covers every shard.

Owns: the kernels, their reference and the launches (the step path that calls them: optimizer/one_launch_step.py).
Must never: write anything when the norm is non-finite, or read a value back to the host.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from optimizer.bf16_rounding import bf16_round_stochastic, state_seeds
from utils.device import to_device

try:  # optional: CUDA machines have it; the CPU runs it only in the interpreter (tests)
    import triton
    import triton.language as tl
    TRITON_AVAILABLE = True
except Exception:  # noqa: BLE001 - any import failure means: no Triton
    TRITON_AVAILABLE = False

BLOCK = 1024  # with 8 warps: 4 elements per thread, 40-48 registers on sm_90 (2048 took 115 in a compile without
# the launcher's specialization, by scripts/check_triton_cuda.py: a third of the occupancy)
# table rows per program of the sum-of-squares kernels. One row a program made the 1B step's norm kernel 865K
# programs of 2 KB each: 1.33 ms for 1.8 GB of bf16 gradients on an H200 (1.3 TB/s; measured by make gpu-report),
# the programs' start-up, not the memory, its cost. 8 rows: 16-32 KB a program, like the AdamW kernel's 28 KB a row;
# measured on an H200 at the 1B shape: 0.755 ms (2.35 TB/s) against 1.179 ms with one row and 0.941 ms for torch's
# _foreach_norm (measured by bench/bench_optimizer_gpu.py; docs/benchmarks.md).
SUMSQ_ROWS = 8


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernel can run for tensors on `device`: CUDA with Triton, or the CPU interpreter."""
    if not TRITON_AVAILABLE:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


if TRITON_AVAILABLE:
    @triton.jit
    def _hash32(x):
        """A 32-bit integer hash (Chris Wellons' "lowbias32"): uint32 in, uint32 out, wrapping arithmetic."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _round_bf16_stochastic(x, idx, seed):
        """fp32 `x` rounded to bfloat16 stochastically (up with probability = the dropped low 16 bits / 2^16:
        unbiased), as fp32 holding the bf16 value (the cast to bf16 after it is exact). The random bits are
        `_hash32(idx ^ seed)` of each element's buffer offset `idx` (int64, its low 32 bits) and the step's
        `seed`: the same on every device, in every layout (ZeRO shards use their buffer offsets) and after a
        resume. `bf16_round_stochastic` is the same in torch ops."""
        r = _hash32(idx.to(tl.uint32) ^ seed.to(tl.uint32)) & 0xFFFF
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + r) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _adamw_block(master_ptr, grad_ptr, m_ptr, v_ptr, wd, out_ptr, s, moffs, goffs, coffs, hoffs, mask,
                     gmask, beta1, beta2, eps, max_norm, step_size, bc2_sqrt, seed_m, seed_v,
                     HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr, CLIP: tl.constexpr, STATE_BF16: tl.constexpr):
        """One block's update (fp32): the master at `moffs`, the gradient and the low-precision parameter at
        `goffs`, the moments at `coffs`; `wd` = lr x weight decay where the element decays, else 0 (per element, or
        one value for a block of one parameter); the gradient is read where `gmask` (else 0). The other
        loads stay next to their first use (fewer live registers: 47-48 on sm_90 and sm_80 with the decay flag read
        by the caller, as with bf16 moments, registers being allocated 8 at a time; with every load first 48-50,
        one variant spilling). STATE_BF16: the moments are stored as bfloat16 (read widened, the update made with
        their fp32 values, then stored rounded stochastically at the buffer offsets `hoffs`)."""
        g = tl.load(grad_ptr + goffs, mask=gmask, other=0.0).to(tl.float32)
        if CLIP:
            coef = tl.minimum(tl.div_rn(max_norm, tl.sqrt_rn(s) + 1e-6), 1.0)
            g = g * coef
        p = tl.load(master_ptr + moffs, mask=mask, other=0.0)
        p = p - wd * p
        m = tl.load(m_ptr + coffs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + coffs, mask=mask, other=0.0).to(tl.float32)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * (g * g)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(master_ptr + moffs, p, mask=mask)
        if STATE_BF16:
            m = _round_bf16_stochastic(m, hoffs, seed_m)
            v = _round_bf16_stochastic(v, hoffs, seed_v)
        tl.store(m_ptr + coffs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + coffs, v.to(v_ptr.dtype.element_ty), mask=mask)
        if HAS_OUT:
            if OUT_BF16:  # round to nearest even by hand (the interpreter truncates), then an exact cast
                bits = p.to(tl.uint32, bitcast=True)
                bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # (no 32-bit mask literal)
                p = bits.to(tl.float32, bitcast=True)
            tl.store(out_ptr + goffs, p.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["seed_m", "seed_v"])
    def _adamw_flat_kernel(master_ptr, grad_ptr, m_ptr, v_ptr, decay_ptr, out_ptr, sumsq_ptr, n,
                           lr_wd, beta1, beta2, eps, max_norm, step_size, bc2_sqrt, seed_m, seed_v,
                           HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr, CLIP: tl.constexpr,
                           STATE_BF16: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        s = tl.load(sumsq_ptr).to(tl.float32)
        # s * 0 is 0 for a finite norm, nan for inf and nan: then no element is in range, nothing is written
        limit = tl.where((s * 0.0) == 0.0, n, 0)
        mask = offs < limit
        wd = tl.where(tl.load(decay_ptr + offs, mask=mask, other=0) != 0, lr_wd, 0.0)
        _adamw_block(master_ptr, grad_ptr, m_ptr, v_ptr, wd, out_ptr, s, offs, offs, offs, offs, mask, mask,
                     beta1, beta2, eps, max_norm, step_size, bc2_sqrt, seed_m, seed_v, HAS_OUT, OUT_BF16, CLIP,
                     STATE_BF16)

    @triton.jit(do_not_specialize=["seed_m", "seed_v"])
    def _adamw_segments_kernel(master_ptr, grad_ptr, m_ptr, v_ptr, decay_ptr, out_ptr, sumsq_ptr, table_ptr,
                               lr_wd, beta1, beta2, eps, max_norm, step_size, bc2_sqrt, seed_m, seed_v,
                               MASTER_COMPACT: tl.constexpr, HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr,
                               CLIP: tl.constexpr, STATE_BF16: tl.constexpr, ALIGNED: tl.constexpr,
                               BLOCK: tl.constexpr):
        """ZeRO: this rank's shards are segments of the DDP buffer. Program i reads row i of `table` (compact
        start, buffer start, count <= BLOCK): the moments and the decay flags are compact (the shards one
        after another), the gradients and the low-precision parameters are read/written at the buffer's own
        offsets, the fp32 master is compact (MASTER_COMPACT) or the buffer's fp32 parameters themselves.
        ALIGNED (Segments.aligned): every row's starts and count are multiples of 16 elements, told to the compiler
        for 16-byte vector accesses (as in _adamw_param_grads_kernel)."""
        row = table_ptr + tl.program_id(0).to(tl.int64) * 3
        c0 = tl.load(row)
        b0 = tl.load(row + 1)
        cnt = tl.load(row + 2)
        if ALIGNED:  # (inline: see _adamw_param_grads_kernel)
            c0, b0, cnt = tl.multiple_of(c0, 16), tl.multiple_of(b0, 16), tl.multiple_of(cnt, 16)
        s = tl.load(sumsq_ptr).to(tl.float32)
        r = tl.arange(0, BLOCK)
        mask = r < tl.where((s * 0.0) == 0.0, cnt, 0)  # nothing written for a non-finite norm
        coffs = c0 + r
        boffs = b0 + r
        if MASTER_COMPACT:
            moffs = coffs
        else:
            moffs = boffs
        wd = tl.where(tl.load(decay_ptr + coffs, mask=mask, other=0) != 0, lr_wd, 0.0)
        _adamw_block(master_ptr, grad_ptr, m_ptr, v_ptr, wd, out_ptr, s, moffs, boffs, coffs, boffs, mask, mask,
                     beta1, beta2, eps, max_norm, step_size, bc2_sqrt, seed_m, seed_v, HAS_OUT, OUT_BF16, CLIP,
                     STATE_BF16)

    @triton.jit
    def _table_row(table_ptr, k, n_rows, ROWS: tl.constexpr, WIDTH: tl.constexpr):
        """Row p*ROWS + k of a row table of WIDTH int64 columns (p: this program) as a pointer to it, and whether
        it exists (past n_rows: the last row's pointer, for loads that stay in bounds; the caller counts none of
        it)."""
        i = tl.program_id(0).to(tl.int64) * ROWS + k
        return table_ptr + tl.minimum(i, n_rows - 1) * WIDTH, i < n_rows

    @triton.jit
    def _sumsq_segments_kernel(grad_ptr, table_ptr, out_ptr, n_rows, ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
                               ROWS: tl.constexpr):
        """out[p] = the sum of squares of the gradients of table rows p*ROWS .. p*ROWS+ROWS-1 (the rows past
        n_rows count nothing; see _adamw_segments_kernel and SUMSQ_ROWS), the rows unrolled. ALIGNED: see
        Segments.aligned."""
        r = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(ROWS):
            row, exists = _table_row(table_ptr, k, n_rows, ROWS, 3)
            b0 = tl.load(row + 1)
            cnt = tl.load(row + 2)
            if ALIGNED:  # (inline: see _adamw_param_grads_kernel)
                b0, cnt = tl.multiple_of(b0, 16), tl.multiple_of(cnt, 16)
            cnt = tl.where(exists, cnt, 0)
            g = tl.load(grad_ptr + b0 + r, mask=r < cnt, other=0.0).to(tl.float32)
            acc += g * g
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))

    @triton.jit
    def _grad_pointer(ptrs_ptr, j, GRAD_BF16: tl.constexpr):
        """Parameter j's gradient this step: its address (0: none) and that address as a typed pointer."""
        addr = tl.load(ptrs_ptr + j)
        if GRAD_BF16:  # (a constexpr: one branch is compiled, so one return type)
            gp = addr.to(tl.pointer_type(tl.bfloat16), bitcast=True)
        else:
            gp = addr.to(tl.pointer_type(tl.float32), bitcast=True)
        return addr, gp

    @triton.jit(do_not_specialize=["seed_m", "seed_v"])
    def _adamw_param_grads_kernel(master_ptr, ptrs_ptr, m_ptr, v_ptr, decay_ptr, out_ptr, sumsq_ptr, table_ptr,
                                  lr_wd, beta1, beta2, eps, max_norm, step_size, bc2_sqrt, seed_m, seed_v,
                                  GRAD_BF16: tl.constexpr, HAS_OUT: tl.constexpr, OUT_BF16: tl.constexpr,
                                  CLIP: tl.constexpr, STATE_BF16: tl.constexpr, ALIGNED: tl.constexpr,
                                  BLOCK: tl.constexpr):
        """One process, gradients where autograd left them (see ParamGrads). Row i of `table` is (buffer start,
        parameter index j, start within the parameter, count <= BLOCK): the master, the moments and the
        low-precision parameters are read and written at the buffer's offsets, the gradient at ptrs[j] + start
        (ptrs[j] == 0: no gradient reached the parameter this step, read as zeros, like the buffer path's zeroed
        main_grad), and the decay flag once per row, parameter j's (`decay_ptr`: one byte a parameter, not one an
        element as the other kernels read it). ALIGNED (GradAddresses.aligned): every row's buffer start, start
        within the parameter and count are multiples of 16 elements and the gradient's address of 16 bytes, told to
        the compiler, which then reads and writes 16-byte vectors (the PTX is checked in the tests); without it
        every access is one element an instruction. One row a program: 4 rows a program ran
        at 0.84x of this at the 1B shape and 0.89x at 124M on an H200 (measured by bench/bench_optimizer_gpu.py)."""
        row = table_ptr + tl.program_id(0).to(tl.int64) * 4
        b0 = tl.load(row)
        j = tl.load(row + 1)
        o0 = tl.load(row + 2)
        cnt = tl.load(row + 3)
        addr, gp = _grad_pointer(ptrs_ptr, j, GRAD_BF16)
        if ALIGNED:  # (inline: a hint returned from a @triton.jit helper is lost, and with it the vectors)
            b0, o0, cnt = tl.multiple_of(b0, 16), tl.multiple_of(o0, 16), tl.multiple_of(cnt, 16)
            gp = tl.multiple_of(gp, 16)
        s = tl.load(sumsq_ptr).to(tl.float32)
        r = tl.arange(0, BLOCK)
        limit = tl.where((s * 0.0) == 0.0, cnt, 0)  # nothing written for a non-finite norm
        boffs = b0 + r
        # the gradient at (gp + o0) + r, the low-precision parameter at (out_ptr + b0) + r
        wd = tl.where(tl.load(decay_ptr + j) != 0, lr_wd, 0.0)
        _adamw_block(master_ptr, gp + o0, m_ptr, v_ptr, wd, out_ptr + b0, s, boffs, r, boffs, boffs,
                     r < limit, r < tl.where(addr != 0, limit, 0), beta1, beta2, eps, max_norm, step_size,
                     bc2_sqrt, seed_m, seed_v, HAS_OUT, OUT_BF16, CLIP, STATE_BF16)

    @triton.jit
    def _sumsq_param_grads_kernel(ptrs_ptr, table_ptr, out_ptr, n_rows, GRAD_BF16: tl.constexpr,
                                  ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """out[p] = the sum of squares of the gradient elements of table rows p*ROWS .. p*ROWS+ROWS-1 (the rows
        past n_rows count nothing; see _adamw_param_grads_kernel and SUMSQ_ROWS). The rows are unrolled
        (static_range): their table reads and gradient loads can all be in flight at once."""
        r = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for k in tl.static_range(ROWS):
            row, exists = _table_row(table_ptr, k, n_rows, ROWS, 4)
            j = tl.load(row + 1)
            o0 = tl.load(row + 2)
            cnt = tl.load(row + 3)
            addr, gp = _grad_pointer(ptrs_ptr, j, GRAD_BF16)
            if ALIGNED:  # (see _adamw_param_grads_kernel)
                o0, cnt, gp = tl.multiple_of(o0, 16), tl.multiple_of(cnt, 16), tl.multiple_of(gp, 16)
            cnt = tl.where(exists & (addr != 0), cnt, 0)
            g = tl.load(gp + o0 + r, mask=r < cnt, other=0.0).to(tl.float32)
            acc += g * g
        tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def _state_dtype_flag(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
    """Whether the moments are bf16 (STATE_BF16); else fp32 (or the reference's float64 in tests); both alike."""
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise ValueError(f"AdamW moments: exp_avg {exp_avg.dtype}, exp_avg_sq {exp_avg_sq.dtype} (one dtype)")
    return exp_avg.dtype == torch.bfloat16


# the reference step works through the buffer in chunks of this many elements: on CPU its temporaries stay in cache
# (a 10M-element step with bf16 moments: 2.2 s whole, 0.32 s in chunks, on 2 cores); on a GPU (a run whose one-launch
# kernel cannot be built, or a test) ~10 fp32 temporaries of 16M elements, not of the whole buffer
CPU_CHUNK, DEVICE_CHUNK = 1 << 16, 1 << 24


def adamw_flat_reference(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         decay: torch.Tensor, param_out, sumsq: torch.Tensor, *, lr: float, beta1: float,
                         beta2: float, eps: float, weight_decay: float, max_norm: float, bc1: float,
                         bc2_sqrt: float, offset: int = 0, seeds: tuple[int, int] = (0, 0)) -> None:
    """The kernel's formula in torch ops, in place (fp32); the step is dropped on the device when `sumsq` is
    non-finite (no host read). bf16 moments: computed in fp32, stored rounded stochastically (`seeds`; the elements
    are at buffer offsets `offset`, `offset` + 1, ...). In chunks (CPU_CHUNK / DEVICE_CHUNK elements: the same
    values)."""
    s = sumsq.reshape(()).to(torch.float32)
    ok = (s * 0).eq(0)
    coef = torch.clamp(max_norm / (s.sqrt() + 1e-6), max=1.0) if max_norm > 0 else None
    bf16 = _state_dtype_flag(exp_avg, exp_avg_sq)
    n = master.numel()
    chunk = CPU_CHUNK if master.device.type == "cpu" else DEVICE_CHUNK
    for lo in range(0, n, chunk):
        sl = slice(lo, min(lo + chunk, n))
        g = grad[sl].float()
        if coef is not None:
            g = g * coef
        p = master[sl] - torch.where(decay[sl] != 0, lr * weight_decay, 0.0) * master[sl]
        m = beta1 * exp_avg[sl].float() + (1.0 - beta1) * g
        v = beta2 * exp_avg_sq[sl].float() + (1.0 - beta2) * (g * g)
        p = p - (lr / bc1) * (m / (v.sqrt() / bc2_sqrt + eps))
        if bf16:
            idx = torch.arange(offset + sl.start, offset + sl.stop, dtype=torch.int64, device=m.device)
            m, v = bf16_round_stochastic(m, idx, seeds[0]), bf16_round_stochastic(v, idx, seeds[1])
        for dst, new in ((master[sl], p), (exp_avg[sl], m), (exp_avg_sq[sl], v)):
            dst.copy_(torch.where(ok, new, dst))
        if param_out is not None:
            param_out[sl].copy_(torch.where(ok, p, param_out[sl].float()))


def _bias_corrections(beta1: float, beta2: float, step: int) -> tuple[float, float]:
    """(1 - beta1^step, sqrt(1 - beta2^step)) for step = 1, 2, ..."""
    return 1.0 - beta1 ** step, (1.0 - beta2 ** step) ** 0.5


def _launch_args(param_out, exp_avg, exp_avg_sq, *, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, max_norm: float, step: int, salt: int) -> tuple[tuple, dict]:
    """Every AdamW kernel's trailing scalars (lr_wd, beta1, beta2, eps, max_norm, step_size, bc2_sqrt, seed_m,
    seed_v) and its output / clip / moment-dtype constexprs, plus the launch options."""
    bc1, bc2_sqrt = _bias_corrections(beta1, beta2, step)
    has_out = param_out is not None
    return ((lr * weight_decay, beta1, beta2, eps, max_norm, lr / bc1, bc2_sqrt, *state_seeds(step, salt)),
            dict(HAS_OUT=has_out, OUT_BF16=has_out and param_out.dtype == torch.bfloat16, CLIP=max_norm > 0,
                 STATE_BF16=_state_dtype_flag(exp_avg, exp_avg_sq), BLOCK=BLOCK, num_warps=8))


def adamw_flat(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
               decay: torch.Tensor, param_out, sumsq: torch.Tensor, *, lr: float, beta1: float, beta2: float,
               eps: float, weight_decay: float, max_norm: float, step: int, use_triton: bool, salt: int = 0) -> None:
    """One AdamW step (`step` = 1, 2, ...: the bias corrections) of flat fp32 `master` (and its low-precision
    copy `param_out`, or None) from the flat `grad`, clipped to `max_norm` (0: no clipping) by the global
    squared norm `sumsq` (a device tensor), skipped where that is non-finite. `decay`: uint8, 1 where the
    element's parameter decays. The moments: fp32, or bf16 (stochastic rounding seeded by `step` and `salt`,
    the buffer's number). All flat, contiguous, the same length."""
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, max_norm=max_norm)
    if not use_triton:
        bc1, bc2_sqrt = _bias_corrections(beta1, beta2, step)
        adamw_flat_reference(master, grad, exp_avg, exp_avg_sq, decay, param_out, sumsq, bc1=bc1, bc2_sqrt=bc2_sqrt,
                             seeds=state_seeds(step, salt), **hyper)
        return
    n = master.numel()
    scalars, options = _launch_args(param_out, exp_avg, exp_avg_sq, step=step, salt=salt, **hyper)
    _adamw_flat_kernel[(triton.cdiv(n, BLOCK),)](
        master, grad, exp_avg, exp_avg_sq, decay, param_out if param_out is not None else master, sumsq, n,
        *scalars, **options)


# ------------------------------------------------------------------------------------------ ZeRO: segments
class Segments:
    """This rank's shards of one DDP buffer for the ZeRO step: `spans` = (compact start, buffer start, length)
    per owned bucket range, in order; `table` = the same cut into rows of at most BLOCK elements (int64
    [rows, 3] on `device`, built once): one Triton program per row, so one launch covers every shard."""

    def __init__(self, spans: list[tuple[int, int, int]], device: torch.device) -> None:
        self.spans = [(int(c), int(b), int(n)) for c, b, n in spans if n > 0]
        rows = [torch.stack((c + k, b + k, (n - k).clamp(max=BLOCK)), dim=1)
                for c, b, n in self.spans for k in (torch.arange(0, n, BLOCK, dtype=torch.int64),)]
        self.table = (torch.cat(rows) if rows else torch.zeros(0, 3, dtype=torch.int64)).to(device)
        self.numel = sum(n for _, _, n in self.spans)
        # the kernels' ALIGNED: every row's compact start, buffer start and count a multiple of 16 elements (the
        # buckets are padded to world_size x pad_alignment, 64 by default, so the shards usually are)
        self.aligned = all(c % 16 == 0 and b % 16 == 0 and n % 16 == 0 for c, b, n in self.spans)


def sumsq_segments(grad: torch.Tensor, segs: Segments, use_triton: bool) -> torch.Tensor:
    """The sum of squares (fp32, a 0-d device tensor) of `grad` over the segments' buffer ranges: two launches
    (per-row partial sums, their sum) whatever the number of shards."""
    if not segs.spans:
        return torch.zeros((), dtype=torch.float32, device=grad.device)
    if not use_triton:
        return torch.cat([grad[b:b + n] for _, b, n in segs.spans]).float().square().sum()
    rows = segs.table.shape[0]
    programs = triton.cdiv(rows, SUMSQ_ROWS)
    partial = torch.empty(programs, dtype=torch.float32, device=grad.device)
    _sumsq_segments_kernel[(programs,)](grad, segs.table, partial, rows, ALIGNED=segs.aligned, BLOCK=BLOCK,
                                        ROWS=SUMSQ_ROWS, num_warps=8)
    return partial.sum()


def adamw_segments(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   decay: torch.Tensor, param_out, sumsq: torch.Tensor, segs: Segments, *, master_compact: bool,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, max_norm: float,
                   step: int, use_triton: bool, salt: int = 0) -> None:
    """`adamw_flat` over a ZeRO rank's shards in one launch: `exp_avg`, `exp_avg_sq`, `decay` (and `master`
    when `master_compact`) hold the shards one after another; `grad`, `param_out` (and `master` otherwise: the
    fp32 parameters) are the whole DDP buffer, read and written at the segments' buffer offsets only."""
    if not segs.spans:
        return
    hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, max_norm=max_norm)
    if not use_triton:
        bc1, bc2_sqrt = _bias_corrections(beta1, beta2, step)
        seeds = state_seeds(step, salt)
        for c, b, n in segs.spans:
            mo = c if master_compact else b
            adamw_flat_reference(master[mo:mo + n], grad[b:b + n], exp_avg[c:c + n], exp_avg_sq[c:c + n],
                                 decay[c:c + n], param_out[b:b + n] if param_out is not None else None, sumsq,
                                 bc1=bc1, bc2_sqrt=bc2_sqrt, offset=b, seeds=seeds, **hyper)
        return
    scalars, options = _launch_args(param_out, exp_avg, exp_avg_sq, step=step, salt=salt, **hyper)
    _adamw_segments_kernel[(segs.table.shape[0],)](
        master, grad, exp_avg, exp_avg_sq, decay, param_out if param_out is not None else master, sumsq,
        segs.table, *scalars, MASTER_COMPACT=master_compact, ALIGNED=segs.aligned, **options)


# ------------------------------------------------------------------------------------------ one process: .grad
class ParamGrads:
    """The unsharded step's gradients where autograd left them. One process with one micro-batch per step has
    nothing to reduce or accumulate, so the DDP buffer's fp32 gradients would only be a copy: the step reads
    each parameter's `.grad` instead (no copy, no gradient buffer, no hook per parameter: DistributedDataParallel.
    keep_grads_on_params). For one DDP buffer: its parameters and their offsets in it, `table`, one row per
    BLOCK elements of a parameter: (buffer start, parameter index, start within the parameter, count), and
    `decay`, one flag a parameter (from the buffer's per-element `decay`), built once.
    Each step the gradients' addresses reach the device in one small copy from pinned memory (`addresses`)."""

    def __init__(self, params: list, numel: int, device: torch.device, decay: torch.Tensor) -> None:
        self.params = [p for p, _ in params]
        self.starts = [int(s) for _, s in params]
        self.numel, self.device = int(numel), device
        # one decay flag a parameter (uint8, on the device): the flat per-element flags at each parameter's start
        self.decay = decay[torch.tensor([min(s, max(decay.numel() - 1, 0)) for s in self.starts],
                                        dtype=torch.int64, device=decay.device)].to(device)
        self.dtype = self.params[0].dtype
        if self.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"ParamGrads: {self.dtype} parameters (bf16 or fp32 only)")
        # the kernels' ALIGNED, less the gradients' own addresses (GradAddresses.aligned, each step): every row
        # starts (s + k*BLOCK in the buffer, k*BLOCK in the parameter) and counts a multiple of 16 elements
        self.aligned = all(s % 16 == 0 for s in self.starts) and all(p.numel() % 16 == 0 for p in self.params)
        rows = []
        for j, (p, start) in enumerate(params):
            k = torch.arange(0, p.numel(), BLOCK, dtype=torch.int64)
            rows.append(torch.stack((start + k, torch.full_like(k, j), k, (p.numel() - k).clamp(max=BLOCK)), dim=1))
        self.table = torch.cat(rows).to(device)

    def grads(self) -> list:
        """This step's gradients, contiguous in the parameters' dtype (autograd's already are); None where no
        gradient reached a parameter. The caller keeps the list until the step's kernels are queued."""
        out = []
        for p in self.params:
            g = p.grad
            if g is not None and (g.dtype != self.dtype or not g.is_contiguous()):
                g = g.to(self.dtype).contiguous()
            out.append(g)
        return out

    def addresses(self, grads: list) -> "GradAddresses":
        """The gradients' addresses (0 for None), int64 on the device, copied without making the host wait, and
        whether the kernels may read them as 16-byte vectors (every address a multiple of 16 bytes, and the
        table's rows aligned: `aligned`)."""
        ptrs = [g.data_ptr() if g is not None else 0 for g in grads]
        host = torch.tensor(ptrs, dtype=torch.int64)
        return GradAddresses(to_device(host, self.device), self.aligned and all(a % 16 == 0 for a in ptrs))

    def gathered(self, grads: list) -> torch.Tensor:
        """The gradients laid out like the DDP buffer (zeros in its gaps and for parameters without one): what
        the buffer path's step reads, for the torch reference."""
        flat = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for g, p, s in zip(grads, self.params, self.starts):
            if g is not None:
                flat[s:s + p.numel()].copy_(g.reshape(-1))
        return flat


class GradAddresses(NamedTuple):
    """One step's gradient addresses (ParamGrads.addresses): `tensor` for the kernels; `aligned`, their ALIGNED:
    every row's offsets, count and gradient address multiples of 16 (elements; bytes for the address), which the
    compiler is told so that it reads and writes 16-byte vectors (on sm_90 without it every access of these
    kernels compiled to one element per instruction: tests/optimizer/test_flat_adamw.py reads the PTX)."""
    tensor: torch.Tensor
    aligned: bool


def sumsq_param_grads(pg: ParamGrads, addrs: GradAddresses) -> torch.Tensor:
    """The Triton path's sum of squares (fp32, 0-d, on the device) of one buffer's parameter gradients: partial
    sums of SUMSQ_ROWS table rows each, then their sum (two launches)."""
    rows = pg.table.shape[0]
    programs = triton.cdiv(rows, SUMSQ_ROWS)
    partial = torch.empty(programs, dtype=torch.float32, device=pg.device)
    _sumsq_param_grads_kernel[(programs,)](addrs.tensor, pg.table, partial, rows,
                                           GRAD_BF16=pg.dtype == torch.bfloat16, ALIGNED=addrs.aligned, BLOCK=BLOCK,
                                           ROWS=SUMSQ_ROWS, num_warps=8)
    return partial.sum()


def adamw_param_grads(master: torch.Tensor, pg: ParamGrads, addrs: GradAddresses, exp_avg: torch.Tensor,
                      exp_avg_sq: torch.Tensor, param_out, sumsq: torch.Tensor, *, lr: float,
                      beta1: float, beta2: float, eps: float, weight_decay: float, max_norm: float,
                      step: int, salt: int = 0) -> None:
    """`adamw_flat`'s Triton kernel with the gradients read at `addrs` (ParamGrads.addresses) instead of from a
    flat buffer and the decay flags per parameter (`pg.decay`); `master`, the moments and `param_out` are the flat
    buffers as in `adamw_flat` (the alignment gaps, which no row covers, keep their zeros)."""
    scalars, options = _launch_args(param_out, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                    weight_decay=weight_decay, max_norm=max_norm, step=step, salt=salt)
    _adamw_param_grads_kernel[(pg.table.shape[0],)](
        master, addrs.tensor, exp_avg, exp_avg_sq, pg.decay, param_out if param_out is not None else master, sumsq,
        pg.table, *scalars, GRAD_BF16=pg.dtype == torch.bfloat16, ALIGNED=addrs.aligned, **options)
