"""FlashAttention-4: flash-attn-4's CuTe-DSL kernels (Hopper sm90, Blackwell sm100) behind SDPA's flash backend
and torch's `varlen_attn`, through torch's flash-attention registry.

Owns: whether FA4 can run for a model, a device and a compute dtype, and the one-line reason when it cannot
(`problem`); activating it once per process (`prepare`, from Transformer.__init__ and Transformer._apply); and
what a batch may use (`plan`: None, or how to call `varlen_attn`). model/attention.py runs the kernels.

How FA4 is reached: `torch.nn.attention.activate_flash_attention_impl("FA4")` registers FA4's forward and
backward as the CUDA implementations of aten's flash-attention ops (`_scaled_dot_product_flash_attention`,
`_flash_attention_forward`, and their backwards). So F.scaled_dot_product_attention, restricted to its flash
backend, and `torch.nn.attention.varlen.varlen_attn` run FA4's kernels, and torch.compile traces them as the
aten ops they override (no Python autograd.Function, no graph break). torchtitan activates it the same way.
The override is process-wide and has no fallback of its own: once active, every SDPA call that picks the
flash backend on CUDA runs FA4, whichever model makes it (FA4 refuses dropout and head dims it lacks; the
model never activates it for those). The model's switch is `ModelConfig.fa4` (auto | true | false).

Checks, cheapest first: a CUDA device; "FA4" in torch's registry (torch 2.11 may lack it); `flash_attn.cute`
found; then the GPU is queried only where this process has initialised CUDA or the caller says the model runs on
the GPU (a model built and run on the CPU of a GPU machine never initialises CUDA; one built on the CPU is checked
again when it moves, DESIGN.md trap 17): compute capability 9.x or 10.x of the current device; `flash_attn.cute`
imports. Then per model: a head_dim FA4 compiles for that architecture, no attention dropout. Per batch: a CUDA
tensor in fp16/bf16, no dropout while training.

Must never: import a package, query a device or activate inside a forward (`plan` and `problem(...,
check=False)` only read what `prepare` cached, so they are safe while Dynamo traces), activate for a model
whose switch is "false", or vendor FA4's code.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from utils.device import accelerator_available, is_accelerator
from utils.errors import one_line

log = logging.getLogger(__name__)

CHOICES = ("auto", "true", "false")
HALF = (torch.float16, torch.bfloat16)
ARCHS = (9, 10)  # compute capability majors FA4's kernels and torch's FA4 override accept
# what this process found (filled once by `machine_problem`; tests swap the whole dict)
_STATE: dict = {}


@dataclass(frozen=True)
class VarlenCall:
    """How to call this torch's `varlen_attn` causally (its signature changed between releases)."""
    fn: Callable
    causal: dict        # {"window_size": (-1, 0)} (torch >= 2.11) or {"is_causal": True}
    gqa: bool           # takes `enable_gqa` (fewer kv heads than query heads); without it GQA models fall back


@dataclass(frozen=True)
class FA4Plan:
    """What a batch may use with FA4 active: the dense kernel always, varlen when `varlen` is not None."""
    varlen: Optional[VarlenCall]


# ------------------------------------------------------------------ the probes (monkeypatched by tests)
def _registry_impls() -> list:
    try:
        from torch.nn.attention import list_flash_attention_impls
    except ImportError:  # a torch without the registry
        return []
    return list(list_flash_attention_impls())


def _cute_found() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError, AttributeError):
        return False


def _cuda_ready() -> bool:
    return torch.cuda.is_initialized()  # False in a child forked from a CUDA process, too


def _capability() -> tuple:
    return tuple(torch.cuda.get_device_capability())  # the current device: the process's GPU


def _import_cute() -> None:
    importlib.import_module("flash_attn.cute")


def _current_impl() -> Optional[str]:
    from torch.nn.attention import current_flash_attention_impl
    return current_flash_attention_impl()


def _activate(name: str) -> None:
    from torch.nn.attention import activate_flash_attention_impl
    activate_flash_attention_impl(name)


def _varlen_call() -> Optional[VarlenCall]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return VarlenCall(varlen_attn, causal, "enable_gqa" in params)


# ---------------------------------------------------------------------------------------- checks
def machine_problem(check: bool = True, on_gpu: bool = False) -> Optional[str]:
    """Why this process cannot run FA4 (one line), or None. Probed once (`check`=False: only read the
    result, "not checked" when nothing was probed yet). on_gpu: the caller runs a model on the GPU, so
    querying it may initialise CUDA."""
    if "problem" not in _STATE:
        if not check:
            return "not checked"
        why, final = _probe(on_gpu)
        if not final:  # asked again when the model reaches the GPU
            return why
        _STATE["problem"] = why
    return _STATE["problem"]


def _probe(on_gpu: bool) -> tuple[Optional[str], bool]:
    """(why not or None, whether that is final for the process)."""
    if not accelerator_available():
        return "no CUDA device", True
    if "FA4" not in _registry_impls():
        return f"torch {torch.__version__} has no FA4 in torch.nn.attention's flash-attention registry", True
    if not _cute_found():
        return "flash_attn.cute is not installed (the flash-attn-4 wheel: scripts/gpu_wheels.py)", True
    if not on_gpu and not _cuda_ready():  # a model built on the CPU: querying the GPU here would initialise CUDA for nothing
        return "CUDA not initialised in this process yet (checked again when the model moves to the GPU)", False
    try:
        major, minor = _capability()[:2]
    except Exception as e:  # e.g. a process forked from one that used CUDA
        return f"the GPU cannot be queried: {one_line(e)}", False
    _STATE["major"] = major
    if major not in ARCHS:
        return f"compute capability {major}.{minor}: FA4 runs on Hopper (9.x) and Blackwell (10.x)", True
    try:
        _import_cute()
    except Exception as e:  # a broken install (CUDA bindings, cutlass DSL) must not break the model
        return f"flash_attn.cute does not import: {one_line(e)}", True
    _STATE["varlen"] = _varlen_call()
    return None, True


def model_problem(head_dim: int, attn_dropout: float) -> Optional[str]:
    """Why a model of this shape cannot use FA4 on this machine's architecture, or None."""
    if attn_dropout > 0:
        return "attention dropout (FA4 has none)"
    major = _STATE.get("major")
    if major == 9:
        ok = 8 <= head_dim <= 256 and head_dim % 8 == 0
    else:  # Blackwell: up to 128, or 256 (FA4's interface, _validate_head_dims)
        ok = (8 <= head_dim <= 128 and head_dim % 8 == 0) or head_dim == 256
    return None if ok else f"head_dim {head_dim} (FA4 on sm{major}x: multiples of 8 up to {256 if major == 9 else 128})"


def problem(cfg: Any, device: torch.device, dtype: torch.dtype, dropout: bool = False,
            check: bool = True) -> Optional[str]:
    """Why batches of `dtype` on `device` of the model `cfg` (a ModelConfig) do not run on FA4, or None when they
    do. `dropout`: attention dropout is active (training). check=False inside a forward (reads the cache only)."""
    if cfg.fa4 == "false":
        return "turned off (fa4=false)"
    if not is_accelerator(device):
        return f"not a CUDA device ({torch.device(device).type})"
    if check:  # the model runs on this GPU: check (and activate) now, even before CUDA was initialised
        prepare(cfg, on_gpu=True)
    why = machine_problem(check=False) or model_problem(cfg.head_dim, cfg.attn_dropout if dropout else 0.0)
    if why:
        return why
    if dtype not in HALF:
        return f"{str(dtype).replace('torch.', '')} compute (FA4 runs fp16/bf16)"
    if not _STATE.get("active"):
        return _STATE.get("activation_error", "not activated: no model asked for it")
    return None


def active() -> bool:
    """FA4 overrides the flash kernels in this process (pure: safe in a traced forward)."""
    return bool(_STATE.get("active"))


def plan(cfg: Any, device: torch.device, dtype: torch.dtype, dropout: bool) -> Optional[FA4Plan]:
    """The FA4 kernels a batch may use, or None. Pure (no import, no device query): safe in a traced forward."""
    if problem(cfg, device, dtype, dropout, check=False) is not None:
        return None
    return _STATE["plan"]  # made at activation: nothing is constructed while Dynamo traces


def forced_error(cfg: Any, device: torch.device, dtype: torch.dtype, dropout: bool = False,
                 check: bool = True) -> Optional[str]:
    """The one-line error when `cfg.fa4` is "true" (forced) and FA4 cannot run here, else None."""
    if cfg.fa4 != "true":
        return None
    why = problem(cfg, device, dtype, dropout, check=check)
    return None if why is None else f"fa4=true (--fa4=true) but FlashAttention-4 cannot run here: {why}"


# ------------------------------------------------------------------------------------- activation
def prepare(cfg: Any, on_gpu: bool = False) -> Optional[str]:
    """Called when a model is built and whenever it is moved or cast (Transformer._apply): activate FA4 in this
    process once if the model would use it (switch not "false", this machine and the model's head_dim and
    dropout allow it). Returns why not, or None. The GPU is queried only once this process has initialised
    CUDA (a model built on the CPU is checked when it moves to the GPU) or `on_gpu` says the model runs on
    one (`problem`'s callers: the trainer's start, the start-up line). Never raises: a forced switch that
    cannot be honoured is an error at the model's first batch and at the trainer's start, which know the device
    and dtype (`forced_error`)."""
    if cfg.fa4 not in CHOICES:
        raise ValueError(f"fa4 must be one of {CHOICES}, got {cfg.fa4!r}")
    if cfg.fa4 == "false":
        return "turned off (fa4=false)"
    why = machine_problem(on_gpu=on_gpu) or model_problem(cfg.head_dim, cfg.attn_dropout)
    if why is None and not _STATE.get("active"):
        try:
            if _current_impl() != "FA4":
                _activate("FA4")
            varlen = _STATE.get("varlen")
            _STATE.update(active=True, plan=FA4Plan(varlen))
            log.info("FlashAttention-4 active: SDPA's flash backend%s run FA4's kernels",
                     "" if varlen is None else " and varlen_attn" + ("" if varlen.gqa else " (not for GQA)"))
        except Exception as e:  # e.g. torch's override refusing this flash_attn.cute
            _STATE["activation_error"] = f"activation failed: {one_line(e)}"
            log.warning("FlashAttention-4 not activated: %s", one_line(e))
    if why is None and not _STATE.get("active"):
        why = _STATE.get("activation_error")
    return why
