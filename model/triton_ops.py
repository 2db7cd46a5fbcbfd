"""The machinery behind the Triton kernel modules (model/triton_norm.py, triton_rope.py, triton_swiglu.py): whether
Triton is there (`TRITON_AVAILABLE`, never a hard import failure) and can run on a tensor (`supported`), and how a
kernel's Python body becomes a `myllm::*` torch.library op with its autograd: a `torch.library.triton_op` on a GPU,
so torch.compile (Inductor) sees the Triton kernels themselves; under the Triton CPU interpreter
(TRITON_INTERPRET=1, used by the tests) `wrap_triton` cannot be traced, so the same bodies are registered as opaque
`torch.library.custom_op`s with explicit fake (shape) functions instead; the choice is made once, at import
(`INTERPRET`). An eager call runs the body as a plain autograd.Function (`call_op`).

Must never: define a kernel, decide whether a kernel is worth using (model/kernels.py dispatches), or create
parameters.
"""
from __future__ import annotations

import os

import torch


try:  # optional accelerator: the module must import without it
    import triton

    TRITON_AVAILABLE = True
except Exception:  # ImportError, or a broken install
    triton = None
    TRITON_AVAILABLE = False

# Whether the kernels run in Triton's CPU interpreter. triton.jit decides that when it decorates a kernel
# (TRITON_INTERPRET=1 in the environment at that moment, i.e. when the kernel modules are imported, right after
# this one), so it is read from a kernel decorated here, the probe below.
INTERPRET = False
if TRITON_AVAILABLE:
    @triton.jit
    def _probe_kernel(X):
        """Never launched: decorated as every kernel is, it says whether triton.jit interprets in this process."""
        pass

    INTERPRET = not isinstance(_probe_kernel, triton.runtime.jit.JITFunction)


def supported(t: torch.Tensor) -> bool:
    """True when the Triton kernels can run on t's device: a GPU, or the CPU when TRITON_INTERPRET=1
    (and was already set when this module was imported, so that the kernels are interpreted)."""
    if not TRITON_AVAILABLE:
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and INTERPRET


def require_triton() -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError("model.triton_ops: triton is not installed (pip install triton); "
                           "use the pure-PyTorch kernels in model/kernels.py instead")


def num_warps(block: int) -> int:
    return 4 if block <= 1024 else (8 if block <= 4096 else 16)


def launch(kernel):
    """`kernel[grid](...)`, through wrap_triton so that triton_op bodies trace on a GPU."""
    return torch.library.wrap_triton(kernel) if not INTERPRET else kernel


def define_op(name: str, fake=None):
    """Register fn as op `myllm::<name>`: a triton_op on a GPU; under the interpreter (where
    wrap_triton cannot be traced) a custom_op with an explicit fake function. The plain function is
    kept in _RAW for eager calls (`_EagerOp`, `raw_body`)."""
    def deco(fn):
        _RAW[name] = fn
        if INTERPRET:
            op = torch.library.custom_op(f"myllm::{name}", mutates_args=())(fn)
            op.register_fake(fake)
        else:
            op = torch.library.triton_op(f"myllm::{name}", mutates_args=())(fn)
        return op
    return deco


_RAW: dict = {}       # op name -> its Python body (launches the kernel directly)
_AUTOGRAD: dict = {}  # op name -> (setup_context, backward), as registered with the op

def register_autograd(op, name: str, backward, setup_context) -> None:
    op.register_autograd(backward, setup_context=setup_context)
    _AUTOGRAD[name] = (setup_context, backward)


try:  # a triton_op's body launches through wrap_triton, which dispatches a higher-order op per launch
    # unless told not to (~1 ms each in eager, torch's note); the op's own eager kernel turns it off
    from torch._library.triton import set_wrap_triton_enabled as _set_wrap_triton_enabled
except ImportError:  # an older torch: the launches go through the higher-order op (slower, the same result)
    _set_wrap_triton_enabled = None


def _run_raw(name: str, *args):
    """Op `name`'s Python body with plain kernel launches (as the registered op runs it in eager)."""
    if _set_wrap_triton_enabled is None or INTERPRET:
        return _RAW[name](*args)
    with _set_wrap_triton_enabled(False):
        return _RAW[name](*args)


def backward_op(ctx, name: str):
    """The backward op `name`: its Python body under `_EagerOp`, else the registered op (traced by
    torch.compile)."""
    if getattr(ctx, "eager", False):
        return lambda *args: _run_raw(name, *args)
    return getattr(torch.ops.myllm, name)


class _EagerOp(torch.autograd.Function):
    """An op's body, setup_context and backward as a plain autograd.Function: what an eager call runs.
    The custom-op dispatch around the same code cost ~0.2 ms of host time per forward + backward of
    each op in eager (an H100's profile), ~60 op calls per 124M step; torch.compile keeps
    the registered ops (`call_op`)."""

    @staticmethod
    def forward(ctx, name, *args):
        out = _run_raw(name, *args)
        setup_context, _ = _AUTOGRAD[name]
        ctx.eager, ctx.op_name = True, name
        ctx.set_materialize_grads(False)
        setup_context(ctx, args, out)
        return out

    @staticmethod
    def backward(ctx, *grads):
        _, backward = _AUTOGRAD[ctx.op_name]
        return (None, *backward(ctx, *grads))


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def call_op(name: str, *args):
    """Op `name` on args: the registered op while compiling (or for tensor subclasses), else _EagerOp."""
    if torch.compiler.is_compiling() or any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN
                                            for a in args):
        return getattr(torch.ops.myllm, name)(*args)
    return _EagerOp.apply(name, *args)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a [rows, D] matrix with unit column stride (a copy only when x is not row-major)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def raw_body(name: str):
    """Op `name`'s plain Python body (another op's body may call it, as swiglu_packed calls swiglu's)."""
    return _RAW[name]


def check_rows(name: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: weight shape {tuple(weight.shape)} does not match x's last dim {x.shape[-1]}")

