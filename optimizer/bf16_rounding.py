"""bf16 AdamW moments (--optimizer_state_dtype=bf16): the torch side of their stochastic rounding, which the
one-launch AdamW's Triton kernels (optimizer/flat_adamw.py `_round_bf16_stochastic`) do on the device.

Owns: the 32-bit hash (lowbias32) of an element's buffer offset and the step's seed, the seeds per step and buffer,
and the rounding in torch ops (the kernels' reference). Must never: draw from a generator's state (every layout,
device and resumed run must round alike).
"""
from __future__ import annotations

import torch

# --optimizer_state_dtype=bf16: exp_avg and exp_avg_sq kept in bfloat16 (8 bytes a parameter less to keep, read and
# write), stored with stochastic rounding so that small updates are not lost on average (rounded to nearest, a
# second moment with beta2 = 0.999 stops moving: its per-step change is below half a bf16 step). DeepSeek-V3 keeps
# its AdamW moments in bf16 the same way (arXiv:2412.19437, section 3.3.2). The random bits are a hash of each
# element's buffer offset and the step, so every layout (unsharded, ZeRO-1, gradients on the parameters), every
# device and a resumed run round alike. The torch side holds uint32 values in int64 tensors (no uint32 shifts on CPU).
_U32 = 0xFFFFFFFF


def _mul32_(x: torch.Tensor, c: int, tmp: torch.Tensor) -> torch.Tensor:
    """x <- (x * c) mod 2^32, in place, for uint32 values held in int64 (c split into 16-bit halves: no product
    overflows int64); `tmp`: scratch shaped like x."""
    torch.mul(x, c >> 16, out=tmp)
    tmp.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return x.mul_(c & 0xFFFF).add_(tmp).bitwise_and_(_U32)


# lowbias32's rounds (shift, multiplier): x ^= x >> shift; x *= multiplier (mod 2^32); then x ^= x >> 16
_HASH_ROUNDS = ((16, 0x7FEB352D), (15, 0x846CA68B))


def _hash32_(x: torch.Tensor) -> torch.Tensor:
    """The kernels' `_hash32` (lowbias32), in place, on uint32 values held in an int64 tensor."""
    t = torch.empty_like(x)
    for shift, mul in _HASH_ROUNDS:
        torch.bitwise_right_shift(x, shift, out=t)
        x.bitwise_xor_(t)
        _mul32_(x, mul, t)
    torch.bitwise_right_shift(x, 16, out=t)
    return x.bitwise_xor_(t)


def hash32(x: int) -> int:
    """The same hash of one uint32 value, in Python ints (the seeds: no tensor, so nothing read back from one)."""
    x &= _U32
    for shift, mul in _HASH_ROUNDS:
        x = ((x ^ (x >> shift)) * mul) & _U32
    return x ^ (x >> 16)


def state_seeds(step: int, salt: int) -> tuple[int, int]:
    """Step `step`'s two seeds (exp_avg's, exp_avg_sq's) for the moments' stochastic rounding in buffer `salt`:
    31-bit (a kernel's int argument stays int32)."""
    base = hash32(((step & _U32) * 0x9E3779B1 ^ (salt & _U32) * 0x85EBCA77) & _U32)
    return hash32(base ^ 1) & 0x7FFFFFFF, hash32(base ^ 2) & 0x7FFFFFFF


def bf16_round_stochastic(x: torch.Tensor, idx: torch.Tensor, seed: int) -> torch.Tensor:
    """The kernels' `_round_bf16_stochastic` in torch ops: fp32 `x` to bfloat16, rounded up with probability equal
    to the dropped 16 bits / 2^16, the random bits `hash32(idx ^ seed)` of the int64 offsets `idx` (low 32 bits).
    In place on its own temporaries (the CPU's AdamW step calls it on cache-sized chunks)."""
    r = _hash32_(idx.bitwise_and(_U32).bitwise_xor_(seed)).bitwise_and_(0xFFFF)
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    # the uint32 pattern plus r, wrapped to 32 bits as the kernel's, then its top 16 bits: the bf16 pattern
    bits.bitwise_and_(_U32).add_(r).bitwise_and_(_U32).bitwise_right_shift_(16)
    return bits.sub_((bits >= 2 ** 15).to(torch.int64) << 16).to(torch.int16).view(torch.bfloat16)
