"""What every optimizer of this package shares: the step skeleton, loss scaling, the learning rate, and the
scaler / lr / previous-norm part of the state dict.

Owns: the one order of a step for MixedPrecisionOptimizer, DistributedOptimizer (ZeRO) and FSDPOptimizer, in its
two forms, which an optimizer's step path picks once (optimizer/step_paths.py):
  finish the gradient sync -> unscale (fp16) -> the squared gradient norm over every rank holding a part
  of the model (the optimizer's own reduction, then a SUM over `norm_groups`: pipeline stages) -> one
  host read of it, which is also the overflow decision (an inf/nan anywhere makes it non-finite
  everywhere: the same verdict on every rank, no separate flag collective) -> scaler update -> skip, or
  clip by the global norm, step the updates, write the masters back.
`host_decided_step()` reads the norm before the update; `device_decided_step()`, for an optimizer whose every
update takes a device flag (fused AdamW's `found_inf`), decides the clip and the skip on the device (a coefficient
tensor, the flag) and the one host read comes after the update's launches and waits for the norm alone, with the
same result bit for bit. That read is a `StepVerdict`, made when the caller unpacks it or by the next step at the
latest (`settle_steps`), so a training loop may queue the next step before reading this one's.
Each optimizer provides the hooks (`_sync_grads`, `_grads`, `_sumsq`, `_update` / `_update_on_device`,
`_drop_grads`, `_adamws`, and optionally `_report_verdict`); `clip_coefficient` is shared with the overlapped step.
Must never: read a tensor on the host more than once per step, decide to skip from a value that not
every rank saw, clip with a norm that is not global (trap 8), or know which engine holds the gradients
(the hooks do).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optimizer.grad_scaler import ConstantScaler, DynamicGradScaler
from optimizer.optimizer_config import OptimizerConfig
from utils.device import HostCopy


class StepVerdict:
    """One optimizer step's (stepped, grad_norm), read from the device when first asked for: `get()`, or
    unpacking `stepped, norm = opt.step()` (which reads it at once, as before). Until then the host has not
    waited for anything, so a training loop that reads it a step later (trainer/loop.py) queues the next
    step while the device still runs this one. Reading it also runs what the verdict decides on the host
    (`settle`: the scaler, the comm hook, the step counter), once; the optimizer reads every verdict left
    unread at its next step, state dict or load (`settle_steps`), so nothing later ever runs on a step count
    that does not know about a skip."""
    __slots__ = ("_s_host", "_settle", "_value")

    def __init__(self, s_host: HostCopy, settle: Callable[[bool], None]) -> None:
        self._s_host, self._settle = s_host, settle
        self._value: Optional[tuple[bool, float]] = None

    @property
    def read(self) -> bool:
        """Whether the value has been read (and settled) yet."""
        return self._value is not None

    def get(self) -> tuple[bool, float]:
        """(True, norm), or (False, inf) when the norm was non-finite and the device skipped the update; waits
        for the norm's copy on the first call only."""
        if self._value is None:
            global_sumsq = float(self._s_host.get())
            stepped = math.isfinite(global_sumsq)
            self._value = (True, math.sqrt(global_sumsq)) if stepped else (False, float("inf"))
            settle, self._settle = self._settle, None
            settle(stepped)
        return self._value

    def __iter__(self) -> Iterator:
        return iter(self.get())

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        return self.get()[i]

    def __eq__(self, other) -> bool:
        if isinstance(other, (tuple, StepVerdict)):
            return tuple(self.get()) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepVerdict({self._value if self._value is not None else 'not read yet'})"


def make_scaler(config: OptimizerConfig) -> Union[ConstantScaler, DynamicGradScaler]:
    """Dynamic loss scaling for fp16, the identity for bf16 / fp32."""
    if config.precision == "fp16":
        return DynamicGradScaler(config.initial_loss_scale, config.min_loss_scale,
                                 config.loss_scale_growth_interval, config.hysteresis)
    return ConstantScaler()


def moment_bytes(adamws: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of this rank's Adam moments (the local shards of DTensors; `step` counters excluded)."""
    total = 0
    for opt in adamws:
        for st in opt.state.values():
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    loc = v.to_local() if isinstance(v, DTensor) else v
                    total += loc.numel() * loc.element_size()
    return total


def clip_coefficient(max_norm: float, norm: Optional[float]) -> float:
    """The factor that brings gradients of global norm `norm` down to at most `max_norm`; 1.0 when clipping
    is off (max_norm 0) or there is no finite norm to clip by."""
    if max_norm <= 0 or norm is None or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


class GlobalNormOptimizer:
    """The API the trainer sees (zero_grad, scale_loss, loss_scale, set_lr, step -> (stepped, grad_norm),
    finish_param_sync, state_dict / load_state_dict) and the step skeleton behind it."""
    sharded = False
    # Muon beside AdamW (optimizer/muon.py), when --optimizer=muon: its own update over the hidden matrices
    muon = None
    # dtype the squared norm is summed in over norm_groups (the other pipeline stages)
    norm_sum_dtype: torch.dtype = torch.float64

    def _init_scaling(self, config: OptimizerConfig, norm_groups: Sequence) -> None:
        """norm_groups: process groups whose ranks hold OTHER parameters of the same model (a pipeline's
        stages): the squared gradient norm is summed, and the skip decided, over them too."""
        self.config = config
        self.norm_groups = list(norm_groups)
        self.scaler = make_scaler(config)
        self.lr = float(config.lr)
        self.prev_grad_norm: Optional[float] = None
        self._clip_numerator_cache: Optional[tuple] = None  # (key, 0-d tensor): `_clip_numerator`
        self._unread_verdicts: list[StepVerdict] = []  # the steps whose verdict nobody has read yet (`settle_steps`)

    # ------------------------------------------------------------------ the step skeleton
    def _unscaled_grads(self) -> list[torch.Tensor]:
        """The start of both forms of the step: earlier verdicts settled, the gradient sync finished, the
        gradients unscaled (fp16)."""
        self.settle_steps()
        self._sync_grads()
        grads = self._grads()
        if isinstance(self.scaler, DynamicGradScaler) and grads:
            torch._foreach_mul_(grads, 1.0 / self.scaler.scale)
        return grads

    def host_decided_step(self) -> tuple[bool, float]:
        """Finish the gradient sync, unscale, skip on inf/nan (any rank, every rank alike), clip by the
        global norm, step, write the masters back, the host deciding from the norm it reads before the update.
        Returns (stepped, grad_norm); (False, inf) when skipped."""
        grads = self._unscaled_grads()
        # The global sum of squares is non-finite iff some rank's gradients hold an inf/nan (or the sum
        # overflowed): reading it is the overflow decision too, the step's one host sync.
        global_sumsq = float(self._sum_over_norm_groups(self._sumsq()).item())
        found_inf = not math.isfinite(global_sumsq)
        norm = float("inf") if found_inf else math.sqrt(global_sumsq)
        self.scaler.update(found_inf)
        self._report_verdict(not found_inf)
        if found_inf:
            self._drop_grads()
            return False, float("inf")
        coef = clip_coefficient(self.config.grad_clip, norm)
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        self._update(norm)
        self._drop_grads()
        return True, norm

    def device_decided_step(self) -> "StepVerdict":
        """The same step with the skip and the clip decided on the device (`_device_decided_step`): for an
        optimizer whose every update takes a device flag (`_update_on_device`: fused AdamW's `found_inf`)."""
        grads = self._unscaled_grads()
        return self._device_decided_step(grads, self._sum_over_norm_groups(self._sumsq()))

    def _device_decided_step(self, grads: list[torch.Tensor], sumsq: torch.Tensor) -> tuple[bool, float]:
        """The same step with the skip and the clip decided on the device: the clip coefficient is a tensor
        (computed in float64 like `clip_coefficient`, so the clipped gradients are the same bits), the
        overflow a 0/1 tensor that AdamW's fused kernel reads (`found_inf`: a skipped step changes no
        parameter, moment or step counter), and the one host read of the squared norm comes after every
        launch of the update and waits for the norm alone (utils.device.HostCopy), so the device never idles while
        the host decides or sets up the next step."""
        s = sumsq.detach().reshape(()).to(torch.float64)
        # queued now, read after the update's launches: the host then waits for the norm only, while the
        # device still has the update (clip, AdamW, write-back) to run. `s.item()` there waited for all of
        # it, so every step began with an idle device while the host set up the next one.
        s_host = HostCopy(s)
        found_inf = (s * 0).ne(0).to(torch.float32)  # 1.0 iff inf/nan (inf * 0 is nan): isfinite is 4 ops
        if self.config.grad_clip > 0 and grads:
            norm = s.sqrt()
            # tensor / tensor: `float / tensor` would multiply by a reciprocal (other bits than min(1, c/n))
            coef = (self._clip_numerator(norm) / (norm + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(torch.float32))  # a factor of 1.0 leaves every bit
        self._update_on_device(found_inf)
        result = self._device_verdict(s_host)
        self._drop_grads()
        return result

    def _device_verdict(self, s_host: HostCopy, then: Optional[Callable[[bool], None]] = None) -> StepVerdict:
        """The step's verdict from the squared norm (copied to the host behind its own computation), the update
        already launched and decided on the device; when read, the scaler, the comm hook and `then` learn it.
        Read now when the next step needs it before its optimizer step (`_verdict_needed_now`: fp16's loss scale
        is applied in the next forward, PowerSGD's error feedback in the next backward); else left unread for
        the caller (the trainer reads it a step later) and read at the latest by the next `settle_steps`."""
        def settle(stepped: bool) -> None:
            self.scaler.update(not stepped)
            self._report_verdict(stepped)
            if then is not None:
                then(stepped)
        verdict = StepVerdict(s_host, settle)
        if self._verdict_needed_now():
            verdict.get()
        else:
            self._unread_verdicts.append(verdict)
        return verdict

    def _verdict_needed_now(self) -> bool:
        """Whether something on the host uses a step's verdict before the next step's optimizer step."""
        return isinstance(self.scaler, DynamicGradScaler)

    def settle_steps(self) -> None:
        """Read (and settle) every step verdict not read yet, in step order: the start of each step (its step
        count then knows about a skip), state_dict and load_state_dict. A verdict a step old waits for
        nothing: the device computed that norm before the previous update."""
        unread, self._unread_verdicts = self._unread_verdicts, []
        for verdict in unread:
            verdict.get()

    def _clip_numerator(self, like: torch.Tensor) -> torch.Tensor:
        """--grad_clip as a 0-d tensor beside the norm, filled once on the device and kept (a `new_tensor`
        per step copied it from the host: a second CUDA sync per step, measured on an H200 by
        tests/parallel/test_host_syncs.py, then named test_cuda_step_syncs_once)."""
        key = (like.device, like.dtype, float(self.config.grad_clip))
        cached = self._clip_numerator_cache
        if cached is None or cached[0] != key:
            cached = (key, torch.full((), key[2], dtype=like.dtype, device=like.device))
            self._clip_numerator_cache = cached
        return cached[1]

    def _update_on_device(self, found_inf: torch.Tensor) -> None:
        """`_update`, skipped inside the kernels where `found_inf` is 1."""
        raise NotImplementedError

    def _sum_over_norm_groups(self, sumsq: torch.Tensor) -> torch.Tensor:
        """The optimizer's own squared norm summed over each norm group (on the device: no host read)."""
        if not self.norm_groups:
            return sumsq
        total = sumsq.detach().to(dtype=self.norm_sum_dtype).reshape(1).clone()
        for group in self.norm_groups:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    # ------------------------------------------------------------------ hooks
    def _sync_grads(self) -> None:
        """Finish the gradient reduction and make the gradients `_grads()` returns ready."""
        raise NotImplementedError

    def _grads(self) -> list[torch.Tensor]:
        """The local gradient tensors the step reads: unscaled and clipped in place."""
        raise NotImplementedError

    def _sumsq(self) -> torch.Tensor:
        """The squared gradient norm over this optimizer's own ranks (not yet over norm_groups), on the device."""
        raise NotImplementedError

    def _report_verdict(self, stepped: bool) -> None:
        """Told whether this step's gradients are applied (the same verdict on every rank)."""

    def _update(self, norm: float) -> None:
        """The AdamW step(s) on the clipped gradients, then the masters written back to the model."""
        raise NotImplementedError

    def _drop_grads(self) -> None:
        """Release the step's gradients (after a step or a skip)."""
        raise NotImplementedError

    def _adamws(self) -> Iterable[torch.optim.AdamW]:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared API
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if isinstance(self.scaler, DynamicGradScaler) else loss

    @property
    def loss_scale(self) -> float:
        return float(self.scaler.scale)

    def set_lr(self, lr: float) -> None:
        self.lr = float(lr)
        if self.muon is not None:  # Muon's own lr follows the schedule by the same factor
            self.muon.lr_scale = self.lr / self.config.lr if self.config.lr else 1.0
        for opt in self._adamws():
            for g in opt.param_groups:
                g["lr"] = self.lr

    def finish_param_sync(self) -> None:
        """Wait for any in-flight parameter all-gather (a no-op unless an optimizer gathers)."""

    def state_dict(self) -> dict:
        raise NotImplementedError

    def check_state_dict(self, state) -> None:
        """Raise what load_state_dict(state) would refuse in this process (ValueError, KeyError, ...) without a
        collective and without changing the optimizer: a checkpoint's loader asks every rank first and gathers
        the verdicts, so that no rank enters the load's collectives while another has already failed."""
        raise NotImplementedError

    def _moment_bytes(self) -> int:
        return moment_bytes(self._adamws())

    def scaling_state(self) -> dict:
        return {"lr": self.lr, "scaler": self.scaler.state_dict(),
                "prev_grad_norm": -1.0 if self.prev_grad_norm is None else float(self.prev_grad_norm)}

    @staticmethod
    def check_scaling_state(sd: dict) -> None:
        """What load_scaling_state(sd) needs: the learning rate and the last gradient norm (numbers), the loss
        scaler's state (a dict); KeyError / ValueError naming the one that is not there or not one."""
        for key, kind in (("lr", "a number"), ("prev_grad_norm", "a number"), ("scaler", "a dict")):
            if key not in sd:
                raise KeyError(f"optimizer state has no {key!r}")
            v = sd[key]
            ok = isinstance(v, dict) if key == "scaler" else isinstance(v, (int, float)) and not isinstance(v, bool)
            if not ok:
                raise ValueError(f"optimizer state: {key}={v!r} is not {kind}")

    def load_scaling_state(self, sd: dict) -> None:
        self.scaler.load_state_dict(sd["scaler"])
        self.set_lr(float(sd["lr"]))
        pg = float(sd["prev_grad_norm"])
        self.prev_grad_norm = None if pg < 0 else pg
