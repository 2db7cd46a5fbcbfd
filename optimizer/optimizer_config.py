"""Optimizer configuration (plain values, filled by utils/configurator.py / the trainer)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1  # applied only to parameters with ndim >= 2
    grad_clip: float = 1.0  # max global L2 norm; 0 disables clipping
    # Compute precision of the run: "fp16" turns on dynamic loss scaling. fp32 master params are
    # kept automatically for every parameter whose dtype is not fp32; the model dtype itself is
    # the caller's choice and is never changed here (trap 10).
    precision: str = "fp32"
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_growth_interval: int = 1000  # overflow-free steps before the scale doubles
    hysteresis: int = 2  # consecutive overflows before the scale halves
    fused: bool = False  # torch fused AdamW where the device supports it, else foreach
    use_distributed_optimizer: bool = False  # ZeRO: shard main params + Adam state across ranks
    zero_stage: int = 1  # 1: shard optimizer state; 2: also free non-owned gradient memory
    overlap_param_gather: bool = False  # ZeRO: all-gather params async, wait in forward pre-hooks
    overlap_optim_step: bool = False  # step each bucket as soon as its grads arrived (see docs)
    # "adamw" | "muon": Muon on the hidden 2-D matrices, AdamW (the fields above) on the rest (optimizer/muon.py)
    optimizer: str = "adamw"
    muon_lr: float = 0.0  # 0: the same as lr (the Moonlight convention lets AdamW's lr carry over)
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_weight_decay: float = 0.1  # decoupled: p <- p (1 - lr wd), as torch.optim.Muon
    muon_adjust_lr: str = "match_rms_adamw"  # | "original" (optimizer/muon.py says why)
    muon_experts: bool = True  # Muon on an MoE block's stacked experts (False: AdamW on them)
    # AdamW's moments (exp_avg, exp_avg_sq): "fp32", or "bf16" (stochastic rounding; the one-launch AdamW only:
    # optimizer/flat_adamw.py says why and how)
    state_dtype: str = "fp32"
    # Not trainer flags: where the one-launch AdamW (optimizer/one_launch_step.py) steps a run of our DDP. "auto": on
    # CUDA with Triton; "on": anywhere it can (a CPU runs the kernel's torch reference: tests; a command's run gets
    # it from MYLLM_FLAT_ADAMW, read by build_optimizer: the kill trials); "off": never (bench/bench_model_gpu.py's
    # ours-torchadam row, the A/B of the kernel)
    one_launch: str = "auto"
    # one process, one micro-batch a step: the one-launch AdamW reads the gradients from the parameters; False keeps
    # them in DDP's buffers (bench/bench_model_gpu.py's ours-gradbuf row, the A/B of that)
    grads_on_params: bool = True

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be fp32, bf16 or fp16, got {self.precision!r}")
        if self.zero_stage not in (1, 2):
            raise ValueError(f"zero_stage must be 1 or 2, got {self.zero_stage}")
        if self.zero_stage == 2 and not self.use_distributed_optimizer:
            raise ValueError("zero_stage=2 needs use_distributed_optimizer=True")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather needs use_distributed_optimizer=True")
        if self.overlap_optim_step and self.precision == "fp16":
            raise ValueError("overlap_optim_step is not supported with fp16: the overflow check "
                             "must see every bucket before any is stepped")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be adamw or muon, got {self.optimizer!r}")
        if self.muon_adjust_lr not in ("match_rms_adamw", "original"):
            raise ValueError(f"muon_adjust_lr must be match_rms_adamw or original, got {self.muon_adjust_lr!r}")
        if self.optimizer == "muon" and self.overlap_optim_step:
            raise ValueError("overlap_optim_step is not supported with optimizer=muon: a sharded matrix's "
                             "orthogonalisation needs every bucket's update at once")
        if self.state_dtype not in ("fp32", "bf16"):
            raise ValueError(f"state_dtype must be fp32 or bf16, got {self.state_dtype!r}")
        if self.state_dtype == "bf16":
            unsupported = bf16_state_conflicts(self.optimizer, self.precision, self.zero_stage,
                                               self.overlap_optim_step)
            if unsupported:
                raise ValueError(f"state_dtype=bf16 (the one-launch AdamW's bf16 moments) cannot be combined with "
                                 f"{', '.join(f'{k}={v}' for k, v in unsupported)}")
        if self.one_launch not in ("auto", "on", "off"):
            raise ValueError(f"one_launch must be auto, on or off, got {self.one_launch!r}")
        if self.grad_clip < 0:
            raise ValueError("grad_clip must be >= 0")
        self.betas = (float(self.betas[0]), float(self.betas[1]))


def bf16_state_conflicts(optimizer: str, precision: str, zero_stage: int,
                         overlap_optim_step: bool) -> list[tuple[str, object]]:
    """The settings that AdamW's bf16 moments (state_dtype="bf16") cannot be combined with, as (field, value)
    pairs, empty when none: the moments live in the one-launch AdamW (optimizer/flat_adamw.py), which steps
    neither Muon, nor fp16 (its loss scale), nor ZeRO-2, nor a per-bucket overlapped step. OptimizerConfig
    refuses them; the trainer's torch-free pre-check names them as flags (trainer/config.py)."""
    return [(k, v) for k, v, on in (
        ("optimizer", optimizer, optimizer == "muon"), ("precision", precision, precision == "fp16"),
        ("zero_stage", zero_stage, zero_stage == 2), ("overlap_optim_step", overlap_optim_step, overlap_optim_step))
        if on]
