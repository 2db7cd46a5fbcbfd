"""Fused kernels, each behind one switch, each with a pure-PyTorch reference next to it.

Owns: RMSNorm, RoPE, SwiGLU, the q/k/v (gate/up) one-matmul projection (reference + hand-written
autograd versions), the AdamW factory (torch fused AdamW / apex FusedAdam when available), flash-attn
detection, and the model-compile helper.
On CPU "fused" means a custom autograd.Function that saves less for backward and recomputes the cheap
parts; the references are what the tests compare against. The cross-entropy kernel lives in
model/loss.py.

Which implementation runs (`choose`): every op has up to three, picked per call from the tensor's
device, whether torch.compile is tracing, and the model's `kernel_backend`:
- "reference": plain PyTorch (`*_ref`), what HF does; Inductor fuses it under torch.compile.
- "torch": the hand-written autograd Functions below (save less, recompute the cheap parts); CPU's path.
- "triton": model/triton_norm.py, triton_rope.py, triton_swiglu.py (on model/triton_ops.py) and model/triton_loss.py, torch.library custom ops with Triton
  forward and backward kernels, so torch.compile(fullgraph=True) traces through them without a break.
kernel_backend "auto" (default): on CUDA with Triton installed, per op and mode from AUTO_EAGER /
AUTO_UNDER_COMPILE, measured on an H100 (the tables' comment cites the report): Triton in eager mode;
under torch.compile the references for RMSNorm/RoPE/SwiGLU (Inductor fuses them with their neighbours:
the whole step was faster that way) and the Triton linear+CE (no graph break, no full logits).
On CPU and other devices: the autograd Functions (measured faster on CPU, bench/bench_model.py).
"triton" forces Triton wherever it can run (CUDA, or CPU tensors under TRITON_INTERPRET=1: tests);
"torch" forces the autograd Functions. A switch `fused_*=False` selects the reference whatever the backend.
Another GPU: `make gpu-report` measures both (its stage 5, and the ours / ours-triton / ours-ref bench rows).
The Triton modules are imported when this module is, wherever Triton can run (`load_kernel_modules`):
never during a forward, where a compiled first call would meet the import while Dynamo traces.

Must never: create or rename parameters (checkpoint keys never depend on which kernel ran, trap 11),
write accelerator literals (ask utils.device), or import a kernel package at module import time
with a hard failure (optional packages are detected once and logged once).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F

from utils.device import accelerator_available, is_accelerator, optional_import

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- RMSNorm
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm exactly as HF Llama: normalise in fp32, cast back, then scale."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


class _RMSNormFn(torch.autograd.Function):
    """Saves x and the per-row 1/rms only (no fp32 copy of x, no normalised activations)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        gf = g.float()
        gw = gf * weight.float()
        # d/dx of x*rstd: rstd * (gw - xhat * mean(gw * xhat))
        dx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        dw = None
        if ctx.needs_input_grad[1]:
            # the reference multiplies by the *rounded* xhat; match it for low-precision inputs
            dw = (gf * xhat.to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        return dx.to(x.dtype), dw, None


def _autocast_out_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """Under autocast, the dtype a norm's output is stored in by the Triton kernels: the autocast dtype.

    Every consumer of a norm's output (the q/k/v and gate/up matmuls, the lm head and the Triton loss)
    casts it to that dtype first, so storing it directly gives those ops the same values as the
    reference's fp32 output (the fp32 product w * xhat, rounded once) without an fp32 write, a read
    and a cast kernel, and its gradient arrives in that dtype. None outside autocast."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = True,
             backend: str = "auto") -> torch.Tensor:
    impl = choose("rms_norm", x, backend) if fused else "reference"
    if impl == "triton":
        return load_triton("triton_norm").rms_norm(x, weight, eps, _autocast_out_dtype(x))
    if impl == "torch":
        return _RMSNormFn.apply(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 fused: bool = True, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual add and the next norm in one Triton kernel
    where Triton runs; elsewhere the add and `rms_norm`."""
    impl = choose("add_rms_norm", x, backend) if fused else "reference"
    if impl == "triton":
        return load_triton("triton_norm").add_rms_norm(x, residual, weight, eps, _autocast_out_dtype(x))
    h = x + residual
    return rms_norm(h, weight, eps, fused=fused, backend=backend), h


# -------------------------------------------------------------------------------------------- RoPE
# Half-split ("rotate_half") layout, the same as HF Llama, so HF weights need no permutation:
# the pair rotated together is (x[i], x[i + head_dim/2]).
def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, H, T, D]; cos/sin: [B or 1, 1, T, D/2] (half width). Reference: HF's rotate_half."""
    cos2 = torch.cat((cos, cos), dim=-1)
    sin2 = torch.cat((sin, sin), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return x * cos2 + rot * sin2


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class _RoPEFn(torch.autograd.Function):
    """A rotation is orthogonal: its backward is the rotation by -theta. Saves only cos/sin."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos.to(x.dtype), sin.to(x.dtype))

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos.to(g.dtype), -sin.to(g.dtype)), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """One tensor, autograd Function or reference (the Triton kernel rotates q and k together: apply_rope_qk)."""
    if fused:
        return _RoPEFn.apply(x, cos, sin)
    return rope_ref(x, cos.to(x.dtype), sin.to(x.dtype))


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = True,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, H, D] and k [B, T, Hkv, D] rotated by cos/sin [B or 1, T, 1, D/2] (fp32): one Triton launch
    for both where Triton runs (cos/sin read in fp32, no casts), else two calls of `apply_rope`."""
    impl = choose("rope", q, backend) if fused else "reference"
    if impl == "triton":
        return load_triton("triton_rope").apply_rope(q, k, cos, sin)
    f = impl == "torch"
    return apply_rope(q, cos, sin, fused=f), apply_rope(k, cos, sin, fused=f)


# ------------------------------------------------------------------------------------------ SwiGLU
def swiglu_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _SwiGLUFn(torch.autograd.Function):
    """Saves gate and up only (autograd would also keep silu(gate)); silu is recomputed in backward."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        gate, up = ctx.saved_tensors
        d_gate = torch.ops.aten.silu_backward(g * up, gate)  # one fused pass for silu'(gate) * (g*up)
        d_up = g * F.silu(gate)
        return d_gate, d_up


def swiglu(gate: torch.Tensor, up: torch.Tensor, fused: bool = True, backend: str = "auto") -> torch.Tensor:
    impl = choose("swiglu", gate, backend) if fused else "reference"
    if impl == "triton":
        return load_triton("triton_swiglu").swiglu(gate, up)
    if impl == "torch":
        return _SwiGLUFn.apply(gate, up)
    return swiglu_ref(gate, up)


def swiglu_packed(gate_up: torch.Tensor, fused: bool = True, backend: str = "auto") -> torch.Tensor:
    """swiglu of gate_up = cat(gate, up) [..., 2H], the fused gate/up matmul's output. The Triton kernel reads
    both halves in place and its backward writes one [..., 2H] gradient; the other paths take the halves
    (autograd then concatenates their two gradients)."""
    if (choose("swiglu", gate_up, backend) if fused else "reference") == "triton":
        return load_triton("triton_swiglu").swiglu_packed(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up, fused=fused, backend=backend)


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up: Gemma's gated MLP (transformers' gelu_pytorch_tanh), plain PyTorch (no hand-written
    kernel: torch.compile fuses it, and no custom op stands in its graph)."""
    return F.gelu(gate, approximate="tanh") * up


# ------------------------------------------------------------------- q/k/v (gate/up) in one matmul
class _ConcatLinearFn(torch.autograd.Function):
    """x @ cat(weights).T in one matmul, saving x and the weights themselves (parameters, alive anyway).
    The concatenated weight is a temporary in forward and again in backward, never held in between: with
    plain autograd every block would keep a copy of its q/k/v and gate/up weights (2/3 of its parameters)
    until backward, and under FSDP an unsharded one. Under autocast the matmuls run in the forward's
    compute dtype and each gradient is returned in its input's dtype, as autocast's F.linear does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor,
                w2: Optional[torch.Tensor] = None) -> torch.Tensor:
        # fixed arity (two or three weights): a `*weights` forward failed to trace inside the model under
        # Dynamo (torch 2.13: "save_for_backward is not defined on FakeTensor")
        weights = (w0, w1) if w2 is None else (w0, w1, w2)
        y = F.linear(x, torch.cat(weights))
        ctx.save_for_backward(x, *weights)
        ctx.compute_dtype = y.dtype
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, *weights = ctx.saved_tensors
        dt = ctx.compute_dtype
        g = g.to(dt)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (g @ torch.cat([w.to(dt) for w in weights])).to(x.dtype)
        dws = [None] * len(weights)
        if any(ctx.needs_input_grad[1:]):
            dw = g.reshape(-1, g.shape[-1]).t() @ x.to(dt).reshape(-1, x.shape[-1])
            dws = [d.to(w.dtype) if need else None for d, w, need in
                   zip(dw.split([w.shape[0] for w in weights]), weights, ctx.needs_input_grad[1:])]
        return (dx, *dws) + (None,) * (3 - len(weights))


def concat_projections(x: torch.Tensor, backend: str = "auto") -> bool:
    """Do the model's q/k/v (gate/up) projections run as one matmul (`concat_linear`) for input `x`? Yes,
    except where `backend` "auto" picks the separate projections (compiled on CUDA: AUTO_UNDER_COMPILE)."""
    return choose("concat_linear", x, backend) != "reference"


def concat_linear(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """x @ cat(weights).T: the q/k/v (gate/up) projections as one matmul, parameters kept separate (the
    model's `fused_qkv=False` runs the separate projections instead, so there is no switch here)."""
    if len(weights) not in (2, 3):
        raise ValueError(f"concat_linear takes 2 or 3 weights, got {len(weights)}")
    return _ConcatLinearFn.apply(x, *weights)


# ------------------------------------------------------------------------------ implementation choice
BACKENDS = ("auto", "triton", "torch")
# kernel_backend="auto" on CUDA, per op and mode, as measured by `make gpu-report` (bench/bench_kernels_gpu.py and
# bench/bench_model_gpu.py; torch 2.11, triton 3.6) on an H100 and an H200:
# - eager: our Triton kernels for every op, and q/k/v (gate/up) as one matmul (concat_linear).
#   bench/bench_kernels_gpu.py, forward + backward of one op, bf16, us at the 124M / 1B shapes, Triton vs our
#   autograd Function vs the plain reference: rms_norm 597/718 vs 1026/1188 vs 984/1031; add_rms_norm
#   642/586 vs 1112/1173 vs 992/1060; rope 714/765 vs 1050/758 vs 983/829; swiglu (packed gate/up) 517/588
#   vs 767/1020 vs 640/800 (1B RoPE: a tie with the Function).
# - under torch.compile: Inductor's fusion of the plain references for every op. Alone, each Triton op was as
#   fast or faster than the compiled reference (e.g. 1B RoPE 426 vs 737 us), but the whole compiled trainer
#   step was slower with them (bench_model_gpu, ours-triton vs ours: 390,954 vs 420,433 tokens/s at 124M,
#   78,048 vs 78,952 at 1B): in the graph the references fuse with their neighbours (casts, the residual add,
#   the projections' epilogues). With only the Triton linear+CE and the concatenated projections left, the
#   compiled step was still slower than every reference (H100: 475,892 vs ours-ref 519,925 tokens/s at 124M;
#   78,804 vs 80,141 at 1B). Its profile: the concatenation's
#   backward is a gradient `cat` that Inductor fused with RoPE into one transposing kernel (358 us per layer
#   at 124M, the step's largest). So compiled, the projections stay separate, and the loss takes the full
#   logits while they fit REFERENCE_LOSS_MAX_LOGITS_BYTES (then the Triton op's chunks, whose memory does not
#   grow with the vocabulary). With that choice (H200): 124M 560,165 tokens/s compiled (1.30x HF compiled in the
#   same run), 1B 92,141 (53.4% MFU); which of the two switches gave how much is not measured apart (the
#   ours-concat row ran out of time). On an H100 the Triton linear+CE in ONE chunk under compile (bench row
#   ours-tce) tied with the full-logits reference at 124M: 528,381 vs 526,213 tokens/s (one call apart, same
#   machine), so the reference stays.
AUTO_EAGER = {"rms_norm": "triton", "add_rms_norm": "triton", "rope": "triton", "swiglu": "triton",
              "cross_entropy": "triton", "concat_linear": "torch"}
AUTO_UNDER_COMPILE = {"rms_norm": "reference", "add_rms_norm": "reference", "rope": "reference",
                      "swiglu": "reference", "cross_entropy": "reference", "concat_linear": "reference"}
# the compiled full-logits loss holds the fp32 logits [tokens, vocab] (and their gradient): above this the
# chunked Triton op runs instead (124M at batch 16 x 1024: 2 GiB; 1B at 4 x 2048: 1 GiB; a 128k vocab at
# 16k tokens: 8 GiB -> chunked)
REFERENCE_LOSS_MAX_LOGITS_BYTES = 4 << 30
_TRITON: dict = {}
# the Triton modules: the op machinery (and `supported`), one per op family, the linear + CE loss
_TRITON_MODULES = ("triton_ops", "triton_norm", "triton_rope", "triton_swiglu", "triton_loss")


def load_triton(name: str):
    """model.<name> (one of _TRITON_MODULES) when Triton imports, else None (checked and logged once).

    Under torch.compile nothing is imported: Dynamo cannot trace an import and would give up on the
    whole calling frame (the model split into fragments, or `fullgraph=True` raising). `load_kernel_modules`
    imports both modules when model/kernels.py is imported wherever Triton can run; a module that is
    still missing while tracing counts as unavailable (its op falls back to the autograd Functions)."""
    if name not in _TRITON:
        if torch.compiler.is_compiling():
            return None
        try:
            import importlib
            mod = importlib.import_module(f"model.{name}")
            _TRITON[name] = mod if mod.TRITON_AVAILABLE else None
        except Exception as e:  # a broken Triton install must not break the model: fall back, say so once
            log.warning("Triton kernels unavailable (%s): %s", name, e)
            _TRITON[name] = None
        if name == "triton_ops":  # debug: the trainer's start-up [kernels] line says what runs
            log.debug("Triton %s", "available: GPU kernels for RMSNorm/RoPE/SwiGLU/linear+CE"
                      if _TRITON[name] is not None else "not installed: GPU uses the PyTorch kernels")
    return _TRITON[name]


def triton_can_run() -> bool:
    """Could a Triton kernel run in this process: Triton installed, and an accelerator or the CPU
    interpreter (TRITON_INTERPRET=1, tests). Cheap: imports nothing."""
    import importlib.util
    try:
        if importlib.util.find_spec("triton") is None:
            return False
    except (ImportError, ValueError, AttributeError):  # e.g. sys.modules["triton"] = None (blocked)
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or accelerator_available()


def load_kernel_modules() -> None:
    """Import the Triton kernel modules now (once) where Triton can run, so that the first call of a
    model, compiled or not, never imports: a compiled first call would otherwise meet the import while
    tracing. Called when this module is imported; calling it again is free."""
    if triton_can_run():
        for name in _TRITON_MODULES:
            load_triton(name)




def choose(op: str, t: torch.Tensor, backend: str = "auto") -> str:
    """"triton", "torch" or "reference" for fused op `op` on tensor `t` (see the module docstring)."""
    if backend == "torch":
        return "torch"
    if backend not in BACKENDS:
        raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto" and not t.is_cuda:
        return "torch"
    if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "torch"  # float64 (exactness checks): the kernels compute in fp32 at most
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        return "torch"  # Triton runs on CUDA, or on CPU tensors in its interpreter (tests)
    mod = load_triton("triton_loss" if op == "cross_entropy" else "triton_ops")  # its `supported`
    if mod is None or not mod.supported(t):  # e.g. the interpreter was asked for after triton was imported
        return "torch"
    if backend == "auto":
        return (AUTO_UNDER_COMPILE if torch.compiler.is_compiling() else AUTO_EAGER)[op]
    return "triton"


def describe_choice(device: torch.device, backend: str, compiled: bool, fused: bool = True,
                    capped: bool = False) -> str:
    """One line for the start-up log: which implementation each op runs on `device` (`capped`: the model soft-caps its
    logits, which the Triton loss does not: model/loss.py lm_head_loss takes the chunked one instead)."""
    if not fused:
        return "reference PyTorch paths (fused kernels off)"
    t = torch.empty(0, device=device)
    parts = []
    for op in ("rms_norm", "rope", "swiglu", "cross_entropy", "concat_linear"):
        impl = choose(op, t, backend)
        if compiled and backend == "auto" and t.is_cuda and impl == AUTO_EAGER[op]:  # the table decided: compiled
            impl = AUTO_UNDER_COMPILE[op]
        if op == "concat_linear":
            parts.append("q/k/v and gate/up " + ("separate matmuls" if impl == "reference" else "one matmul each"))
            continue
        name = {"triton": "Triton", "torch": "autograd Function" if op != "cross_entropy" else "chunked",
                "reference": "reference (Inductor-fused)"}[impl]
        if op == "cross_entropy" and impl == "reference":
            name = f"full logits (Inductor-fused) up to 4 GiB of logits, else {'chunked' if capped else 'Triton'}"
        elif op == "cross_entropy" and impl == "triton" and capped:
            name = "chunked (soft-capped logits: not the Triton loss)"
        parts.append(f"{op} {name}")
    return ", ".join(parts) + f" [kernel_backend={backend}{', compiled' if compiled else ''}]"


# ------------------------------------------------------------------------------------ attention
def sdpa_dtype(device: torch.device, dtype: torch.dtype, head_dim: int = 0) -> torch.dtype:
    """The dtype F.scaled_dot_product_attention runs in for inputs of `dtype`.

    On CPU the bf16 flash-attention kernel is slower than the fp32 one at small head_dim and faster at
    64 and above (fwd+bwd, causal, 2 threads: B8 H8 T256 D32 ~21 ms bf16 vs ~15 ms fp32; B2 H8 T512 D64
    ~17 ms bf16 vs ~22 ms fp32 plus the casts). So on CPU bf16 attention with head_dim < 64 is computed
    in fp32 (the casts are cheap next to the T x T work; fp32 is also more accurate), and in bf16 from
    64 up, as HF does. Accelerators keep the dtype.
    """
    if dtype == torch.bfloat16 and not is_accelerator(device) and head_dim < 64:
        return torch.float32
    return dtype


# ------------------------------------------------------------------------------------- flash-attn
_FLASH = None
_FLASH_CHECKED = False


def detect_flash_attn() -> Optional[tuple]:
    """(flash_attn_func, flash_attn_varlen_func) when flash-attn is installed and imports, else None.
    Imports it once and logs the result once. Called by Transformer.__init__ (and the trainer's start),
    so the import never runs inside a compiled forward: there it was a graph break on a cold process."""
    global _FLASH, _FLASH_CHECKED
    if not _FLASH_CHECKED:
        _FLASH_CHECKED = True
        mod = optional_import("flash_attn") if importlib.util.find_spec("flash_attn") is not None else None
        if mod is not None and hasattr(mod, "flash_attn_func"):
            _FLASH = (mod.flash_attn_func, getattr(mod, "flash_attn_varlen_func", None))
            log.info("flash-attn %s detected: used for attention on accelerators", getattr(mod, "__version__", "?"))
        else:
            # debug: without it nothing changes on a CPU, and the trainer's [kernels] line names the attention path
            log.debug("flash-attn not installed: attention uses F.scaled_dot_product_attention")
    return _FLASH


def flash_attn_functions(device: torch.device) -> Optional[tuple]:
    """detect_flash_attn()'s functions when `device` is an accelerator, else None. Pure after the first
    detection (no import, no logging): safe inside a traced forward."""
    if not is_accelerator(device):
        return None
    return detect_flash_attn()


# Import-time loading, at the end so that everything above exists if a kernel module imports this one.
load_kernel_modules()
