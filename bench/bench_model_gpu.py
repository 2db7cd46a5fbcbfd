"""GPU benchmark: our model (Triton kernels and references, eager and torch.compile) against
transformers.LlamaForCausalLM (SDPA, eager and compiled) and HF + Liger-Kernel when it is installed,
in the two precision setups that matter:

- `trainer` = "bf16 params + fp32 master (trainer)": what `train_my_ddp.py --dtype=bf16` runs. The model's
  parameters are bf16 (no autocast), wrapped by `parallel.build.build_engine` with the trainer's own
  TrainConfig defaults: our DDP (world size 1, contiguous fp32 gradient buffer) + MixedPrecisionOptimizer
  (fp32 master copies, global-norm clipping at 1.0; on CUDA the one-launch Triton AdamW of
  optimizer/one_launch_step.py, elsewhere torch's fused AdamW), the token-summed loss divided by the target
  count as the trainer does, and `--compile` as the trainer compiles (`torch.compile` of the wrapped model).
  HF models run inside the same engine, so their "trainer" rows (`hf:trainer`) are HF with bf16 weights and
  the same optimizer as ours: HF at its fastest precision, not how its Trainer runs it.
- `autocast` = "autocast (fp32 params)": fp32 parameters, bf16 autocast, torch fused AdamW on the fp32
  parameters, the gradients clipped to global norm 1.0 before each step (`clip_grad_norm_`, foreach). This is
  what Hugging Face's Trainer does with `--bf16` (autocast over fp32 weights, `max_grad_norm=1.0` by default),
  so the HF autocast rows are the fair "HF as its users run it" baseline; every peer row clips as its trainer
  does by default.

Every model gets the same config, the same weights and the same batch; a step is forward + backward +
optimizer step. Each (config, model, precision, mode) runs in its own subprocess, so a compile failure or
an out-of-memory is a row that says so, and peak memory is that of one model alone. A row's time is the
median step of --steps timed steps run back to back with no device sync until the last, each timed on the
device by CUDA events at the steps' ends (the trainer's way: the host queues ahead while the device runs),
after the first step (timed alone: the compile, or eagerly the Triton JIT / cuBLAS start-up) and --warmup
untimed steps; the first-step time minus one steady step is reported apart as "compile s" (eager rows:
first-call overhead). --window N times windows of N steps by the host clock with a device sync at each
window's end instead (--window 1: a sync after every step; windows make the bench slower than the trainer, whose
host never waits for the device between steps). Ratios are printed, never asserted.

    python bench/bench_model_gpu.py                                 # 124m and 1b, all rows (eager first)
    python bench/bench_model_gpu.py --configs 124m --modes eager --precisions trainer
    python bench/bench_model_gpu.py --configs 124m --rows ours:trainer:compile,hf:autocast:compile
    python bench/bench_model_gpu.py --configs 124m --budget-s 400 --json-out rows.json   # stop starting rows at 400 s
    python bench/bench_model_gpu.py --profile 124m --json-out prof.json   # torch.profiler: one eager trainer step
    python bench/bench_model_gpu.py --device cpu --configs tiny --steps 2 --warmup 1   # smoke test without a GPU

Models: ours (kernel_backend=auto: Triton kernels on CUDA), ours-ref (every fused_* switch off: the
plain-PyTorch references, = --fused_kernels=false), ours-triton (kernel_backend=triton: our Triton kernels
under torch.compile too, where auto lets Inductor fuse the references), hf (LlamaForCausalLM, attn_implementation="sdpa"),
hf-liger (the same with Liger-Kernel's RMSNorm/RoPE/SwiGLU/fused linear-CE patched in; a row saying
"not installed" when liger-kernel is absent), ours-fp8 / ours-fp8r (ours with --float8=tensorwise / rowwise: the
blocks' matmuls in FP8 through torchao; on CPU torchao's emulation, so only their GPU rows say anything about speed;
reported apart from bf16, in tokens/s: MFU is not defined for them), ours-torchadam
(ours with torch's fused AdamW instead of the one-launch kernel, OptimizerConfig.one_launch="off": the A/B of that
kernel; trainer precision only), ours-concat (ours with the other compiled choice of kernel_backend=auto:
q/k/v and gate/up as one matmul each and the chunked Triton linear+CE; the A/B of that choice),
ours-gradbuf (ours with the gradients copied into DDP's fp32 buffers, OptimizerConfig.grads_on_params=False, where
one process with one micro-batch a step reads them from the parameters: the A/B of that; trainer precision only),
ours-tce (compiled, the loss as the Triton linear+CE op in one chunk instead of Inductor's full-logits fusion: the
op computes the loss and both gradients in the forward, one pass over the logits after their matmul, where
Inductor's two kernels took 1.35 ms per 124M step on an H200; the A/B of that), ours-tce4k (ours-tce with the
op's softmax kernel in 4096-element tiles with 8 warps instead of 16384 with 16: compiled for sm_90 the default
tile takes 64 registers a thread, two rows an SM, the 4096 tile 32, eight; the end-to-end A/B of
bench/bench_kernels_gpu.py's triton-4k), ours-sync (ours with each step's
optimizer verdict read inside the step, the host waiting for the gradient norm every step;
ours leaves it unread, as the trainer reads it a step later: the A/B of that; trainer precision only), ours-bf16m
(ours with --optimizer_state_dtype=bf16: AdamW's moments in bf16 with stochastic rounding, 8 bytes a parameter less
for the one-launch AdamW to stream; a numerics choice, reported apart from bf16 like FP8, beside ours; trainer
precision only), ours-overlap (ours with --overlap_optim_step: each bucket's AdamW step as soon as its
gradients are ready, clipped with the previous step's norm; torch's AdamW per bucket, the host reading each step's
norm: the A/B of taking the optimizer off the end of the step; trainer precision only), ours-nofa4 (ours with
FlashAttention-4 off, ModelConfig.fa4="false": the A/B of FA4; = ours where FA4 cannot run, and then skipped).
Rows run in priority order, all eager rows of a config
before its compile rows, so a --budget-s that runs out drops the least informative rows ("not run").
MFU uses model/flops.py's formula against the dense bf16 peak of the GPU (model/flops.py's table; H100
SXM 989 TFLOP/s; --peak-tflops overrides) and against the bf16 matmul peak measured in the same run, with the
attention FLOPs counted whole (PaLM / nanoGPT; what the project's MFU goals use) and, in a column beside it,
counted at half (what a causal kernel computes). FP8 rows print no MFU.

Loss curves: every row keeps its timed steps' losses (read after the last step: no sync between steps);
`--curve-steps N --curve-models ours,ours-fp8,ours-fp8r` gives those models N timed steps, and the tables then
compare each FP8 row's curve with the bf16 `ours` row of the same config and mode (the same batch every step:
the loss falls as the model fits it, so a recipe that diverges or stalls shows).

Peer: titan (torchtitan 0.2.2's Llama 3 on our weights with its trainer's own recipe, precision `titan`: on one GPU
no FSDP, bf16 autocast over fp32 parameters, per-block and loss compile in mode compile, causal SDPA, full-logit
cross-entropy, fused AdamW, clipping; bench/titan_peer.py says exactly what runs, what differs and why not 0.3.0; the
row says "torchtitan not installed" without requirements-peers.txt).

Settings (the same in every row, printed at start): TF32 for fp32 matmuls and cuDNN on CUDA
(`torch.set_float32_matmul_precision("high")`, `torch.backends.cudnn.allow_tf32`: it touches only fp32
matmuls, e.g. the autocast rows' fp32 ops and the loss's fp32 weight-gradient accumulation). And
TRITON_DEFAULT_FP_FUSION=1 unless set: Triton 3.9 warns when it is unset and its default (mul+add fused
into FMA in kernels that do not choose; ours do not) flips to off in Triton 3.10, so the value is pinned
to what the trainer runs under Triton 3.9 and what scripts/check_triton_cuda.py compiles. Inductor's
kernels pass their own choice and are unaffected.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

T_SCRIPT = time.perf_counter()  # a row's own process: from here to its row's print is its in_process_s

# before anything imports triton (the row subprocesses inherit it); see the docstring
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CONFIGS = {
    "124m": dict(model=dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, max_seq_len=1024), batch=16, seq=1024),
    "1b": dict(model=dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, max_seq_len=2048),
               batch=4, seq=2048),
    "tiny": dict(model=dict(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64),
                 batch=2, seq=64),
}
MODELS = ("ours", "ours-ref", "ours-triton", "hf", "hf-liger", "ours-fp8", "ours-fp8r", "ours-torchadam",
          "ours-concat", "ours-gradbuf", "ours-tce", "ours-tce4k", "ours-sync", "ours-bf16m", "ours-overlap",
          "ours-nofa4", "titan")
FP8_MODELS = {"ours-fp8": "tensorwise", "ours-fp8r": "rowwise"}  # --float8 recipe of each FP8 row
MAX_GRAD_NORM = 1.0  # the trainer's --grad_clip and HF Trainer's max_grad_norm default
PRECISIONS = {"trainer": "bf16 params + fp32 master (trainer)", "autocast": "autocast (fp32 params)",
              "titan": "torchtitan's recipe (bf16 autocast, fp32 params)"}  # model titan only
MODES = ("eager", "compile", "compile-cg", "compile-mat", "compile-cdt")
DEFAULT_MODES = ("eager", "compile")
# compile-cg: torch.compile(mode="reduce-overhead") = the trainer's --compile_mode=reduce-overhead (the forward
# and backward replayed as CUDA graphs; the optimizer step outside them)
# compile-mat: mode="max-autotune-no-cudagraphs" = --compile_mode=max-autotune-no-cudagraphs (Inductor benchmarks its
# Triton matmul templates against cuBLAS per shape and can fuse neighbouring pointwise ops into a template's epilogue;
# minutes of compile, so only on request: --rows ours:trainer:compile-mat with a longer --timeout)
# compile-cdt: compile with Inductor's coordinate-descent tuning = the trainer's --compile_tuning=true (each generated
# Triton kernel's block sizes and warps timed around the heuristic's pick while compiling; the matmuls stay cuBLAS)
COMPILE_KW = {"eager": None, "compile": {}, "compile-cg": {"mode": "reduce-overhead"},
              "compile-mat": {"mode": "max-autotune-no-cudagraphs"},
              "compile-cdt": {"options": {"coordinate_descent_tuning": True}}}
# modes whose compile times kernels on the GPU (max-autotune's matmul templates, coordinate-descent tuning) and keeps
# the winners in Inductor's caches: never prewarmed, since the prewarm runs beside the GPU tests and would pick
# them on a shared GPU
TIMED_AT_COMPILE = ("compile-mat", "compile-cdt")
# (model, precision) in the order rows run within a mode: the trainer's own setup and HF's default first
PRIORITY = (("ours", "trainer"), ("hf", "autocast"), ("ours", "autocast"), ("ours-ref", "trainer"),
            ("hf", "trainer"), ("hf-liger", "autocast"), ("ours-ref", "autocast"), ("hf-liger", "trainer"),
            ("titan", "titan"), ("ours-fp8", "trainer"))
LR = 1e-4


def fast_fp32_matmuls(device) -> None:
    """TF32 for fp32 matmuls and convolutions on CUDA (legacy API only: mixing it with the new
    `fp32_precision` attributes makes torch.get_float32_matmul_precision raise)."""
    import torch
    if torch.device(device).type == "cuda":
        torch.set_float32_matmul_precision("high")
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def _build(model_name: str, mcfg: dict, device):
    """The model of `model_name` with the weights of our Transformer built from seed 0, built on `device`."""
    import torch
    from model import ModelConfig, Transformer
    from model.hf_interop import hf_config_dict, to_hf_state_dict
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: a 1B model's CPU init takes tens of seconds
        # FA4, once activated, runs every SDPA flash call of the process (model/fa4.py): HF rows never activate it
        cfg = ModelConfig(**mcfg, fa4="auto" if model_name.startswith("ours") and model_name != "ours-nofa4" else "false")
        ours = Transformer(cfg)
        if model_name == "titan" or (model_name.startswith("ours") and model_name not in ("ours-triton", "ours-ref")):
            return ours  # our model as it is: make_step sets the row's variant (titan: bench/titan_peer.py)
        if model_name == "ours-triton":  # our Triton kernels also under torch.compile (auto: references there)
            return Transformer(ModelConfig(**mcfg, kernel_backend="triton"))
        if model_name == "ours-ref":
            ref = Transformer(ModelConfig(**mcfg, fused_rmsnorm=False, fused_rope=False, fused_swiglu=False,
                                          fused_qkv=False, fused_cross_entropy=False))
            ref.load_state_dict(ours.state_dict())
            return ref
        from transformers import LlamaConfig, LlamaForCausalLM
        hf_cfg = hf_config_dict(ours.cfg)
        for k in ("dtype", "torch_dtype", "architectures"):
            hf_cfg.pop(k, None)
        if model_name == "hf-liger":
            from liger_kernel.transformers import apply_liger_kernel_to_llama  # ImportError: "not installed"
            apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                        fused_linear_cross_entropy=True)
        hf = LlamaForCausalLM(LlamaConfig(**hf_cfg, attn_implementation="sdpa"))
        hf.load_state_dict(to_hf_state_dict(ours), strict=True)
        del ours
        return hf


def _autocast_step(model, model_name: str, mode: str, x, y, device):
    """step() of an autocast row (HF Trainer's --bf16): fp32 parameters, bf16 autocast, torch's fused AdamW, the
    gradients clipped to MAX_GRAD_NORM; FP8 rows converted and compiled rows compiled first."""
    import torch
    from optimizer import OptimizerConfig
    from optimizer.adamw import build_adamw
    from parallel.transforms.compile import compile_in_place
    from utils.device import autocast_context
    ours = model_name.startswith("ours")
    if model_name in FP8_MODELS:  # the trainer's transform, before compile (parallel/transforms/float8.py)
        from types import SimpleNamespace

        from parallel.transforms import float8
        float8.apply(model, None, SimpleNamespace(float8=FP8_MODELS[model_name]), device=torch.device(device))
    if COMPILE_KW[mode] is not None:
        if ours:
            compile_in_place(model, **COMPILE_KW[mode])
        else:
            model.compile(**COMPILE_KW[mode])
    params = list(model.parameters())
    opt = build_adamw(params, [], OptimizerConfig(lr=LR, weight_decay=0.0, fused=True), torch.device(device).type)

    def step() -> torch.Tensor:
        if mode == "compile-cg":
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        with autocast_context(device, torch.bfloat16):
            loss = model(x, labels=y) if ours else model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM, foreach=True)  # HF Trainer's default clip
        opt.step()
        return loss.detach().clone()  # compile-cg: the graph's output is overwritten by the next replay
    return step


def make_step(config: str, model_name: str, mode: str, precision: str, device):
    """(step() -> loss tensor, model) for one row: the model built, wrapped and compiled as the row says."""
    import torch
    spec = CONFIGS[config]
    B, T = spec["batch"], spec["seq"]
    model = _build(model_name, spec["model"], device)
    model.train()
    ours = model_name.startswith("ours")
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["model"]["vocab_size"], (B, T), generator=g).to(device)
    y = torch.cat((x[:, 1:], torch.full((B, 1), -100, device=device)), dim=1)  # = HF's own shift
    if "titan" in (model_name, precision):  # torchtitan's model and trainer recipe, nothing of ours but the weights
        if (model_name, precision) != ("titan", "titan"):
            raise ValueError(f"model titan runs only at precision titan (its own recipe), got {model_name}:{precision}")
        from bench import titan_peer
        why = titan_peer.titan_unavailable()
        if why:
            raise RuntimeError(why)
        step, titan = titan_peer.make_titan_step(model, x, y, mode, device, LR)
        del model
        return step, titan
    if precision == "autocast":
        return _autocast_step(model, model_name, mode, x, y, device), model

    # precision == "trainer": the objects train_my_ddp.py builds for --dtype=bf16 (parallel/build.py)
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    model.to(dtype=torch.bfloat16)
    cfg = TrainConfig(dtype="bf16", device=torch.device(device).type, compile=mode != "eager",
                      compile_mode=COMPILE_KW[mode].get("mode", "default") if COMPILE_KW[mode] else "default",
                      compile_tuning=mode == "compile-cdt",
                      learning_rate=LR, batch_size=B, max_seq_len=T,
                      float8=FP8_MODELS.get(model_name, "off"), grad_clip=MAX_GRAD_NORM,
                      overlap_optim_step=model_name == "ours-overlap",
                      optimizer_state_dtype="bf16" if model_name == "ours-bf16m" else "fp32")
    if model_name == "ours-concat":  # the other compiled choice (model/kernels.py AUTO_UNDER_COMPILE)
        from model import kernels
        kernels.AUTO_UNDER_COMPILE.update(cross_entropy="triton", concat_linear="torch")
    # the optimizer's A/B rows: its step path given explicitly (OptimizerConfig's fields that no trainer flag sets)
    optimizer_fields = {"ours-torchadam": dict(one_launch="off"),  # torch's fused AdamW, not the one-launch kernel
                        # the gradients copied into DDP's fp32 buffers, not read from the parameters
                        "ours-gradbuf": dict(grads_on_params=False)}.get(model_name)
    if optimizer_fields:
        import dataclasses

        from parallel import build
        flags_to_config = build.optimizer_config  # (this row's process only: each row runs in its own)
        build.optimizer_config = lambda flags: dataclasses.replace(flags_to_config(flags), **optimizer_fields)
    if model_name in ("ours-tce", "ours-tce4k"):  # compiled: the Triton linear+CE op in ONE chunk (<= 4 GiB fp32)
        from model import kernels, triton_loss
        kernels.AUTO_UNDER_COMPILE.update(cross_entropy="triton")
        triton_loss.LOSS_CHUNK_BUDGET_BYTES = kernels.REFERENCE_LOSS_MAX_LOGITS_BYTES
        if model_name == "ours-tce4k":  # its softmax kernel with 4096-element tiles (8 warps), not 16384 (16)
            triton_loss.MAX_BLOCK_V = 4096
    engine = build_engine(model, cfg, device=torch.device(device))
    engine.optimizer.set_lr(LR)
    units = float((y != -100).sum())
    batch = {"input_ids": x, "labels": y}

    def loss_fn(m, b):  # trainer.task.micro_batch_loss: the sum of the token losses
        if ours:
            return m(b["input_ids"], labels=b["labels"], reduction="sum"), {}
        return m(input_ids=b["input_ids"], labels=b["input_ids"]).loss * units, {}  # HF: mean over the same tokens

    read_now = model_name == "ours-sync"

    def step() -> torch.Tensor:
        engine.optimizer.zero_grad()
        sums = engine.forward_backward([batch], loss_fn, units)
        verdict = engine.optimizer.step()  # (read a step later by the trainer: the next step() reads it here)
        if read_now:
            tuple(verdict)  # the host waits for this step's gradient norm
        return sums[0] / units
    return step, engine.module


def _dynamo_counts() -> dict:
    try:
        from torch._dynamo.utils import counters
        return {"graphs": int(counters["stats"].get("unique_graphs", 0)),
                "graph_breaks": int(sum(counters["graph_break"].values())),
                # graphs Inductor did not replay as CUDA graphs (compile-cg; the reasons are logged)
                "cudagraph_skips": int(counters["inductor"].get("cudagraph_skips", 0))}
    except Exception:  # noqa: BLE001 - a private API: its absence must not fail a row
        return {}


def _windows(steps: int, window: int) -> list[int]:
    """The timed steps as back-to-back windows of `window` steps (the last one shorter)."""
    window = max(1, window)
    return [min(window, steps - i) for i in range(0, steps, window)]


def run_one(config: str, model_name: str, mode: str, precision: str, device_name: str, steps: int,
            warmup: int, window: int = 0) -> dict:
    """One row in this process: median step time, tokens/s, compile (first-step) seconds, peak memory.
    window 0 (default): the timed steps run back to back with no device sync until the last, as the trainer
    runs them, and on a GPU each step's time is the device time between the CUDA events recorded at its end
    and the previous step's (the trainer's StepTimer: the host queues ahead, the device's idle time, if any,
    counts); on the CPU their mean. window N: windows of N steps with a device sync at each window's end,
    timed by the host clock (window 1 = a sync after every step: each step then starts on an idle device)."""
    import torch
    from model import ModelConfig
    from model.flops import flops_per_token
    from utils.device import synchronize
    device = torch.device(device_name)
    fast_fp32_matmuls(device)
    if mode == "compile-cg":  # print why Inductor declines to replay a graph as a CUDA graph, if it does
        torch._logging.set_logs(perf_hints=True)
    spec = CONFIGS[config]
    B, T = spec["batch"], spec["seq"]
    t_build = time.perf_counter()
    step, _ = make_step(config, model_name, mode, precision, device)
    synchronize(device)
    build_s = time.perf_counter() - t_build
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    first = float(step())
    synchronize(device)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    synchronize(device)
    warm_s = time.perf_counter() - t0
    times = []  # seconds per step: one value per step (window 0 on a GPU), else one per window
    losses = []  # each timed step's loss tensor, read after the last step (reading one is a sync)
    if window <= 0 and device.type == "cuda":  # no sync until the end; each step's device time, as the trainer's
        ends = [torch.cuda.Event(enable_timing=True)]  # StepTimer takes it (utils/device.py); the first step's
        ends[0].record()                                 # interval starts on the idle device after the warm-up
        for _ in range(steps):
            losses.append(step())
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
        synchronize(device)
        times = [a.elapsed_time(b) / 1e3 for a, b in zip(ends, ends[1:])]
    else:
        for k in _windows(steps, window if window > 0 else steps):
            t0 = time.perf_counter()
            for _ in range(k):
                losses.append(step())
            synchronize(device)
            times.append((time.perf_counter() - t0) / k)
    losses = [round(float(v), 4) for v in losses]
    last = losses[-1] if losses else first
    med = statistics.median(times) if times else first_s
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    row = dict(config=config, model=model_name, mode=mode, precision=precision,
               tokens_per_s=round(B * T / med), step_ms=round(med * 1e3, 2),
               step_ms_min=round(min(times) * 1e3, 2) if times else None,
               compile_s=round(max(0.0, first_s - med), 2), first_step_s=round(first_s, 2),
               warmup_s=round(warm_s, 2), build_s=round(build_s, 2), first_loss=round(first, 4),
               last_loss=round(last, 4), peak_mem_gib=round(peak_mem / 2**30, 2),
               flops_per_token=flops_per_token(ModelConfig(**spec["model"]), T),
               flops_per_token_causal_half=flops_per_token(ModelConfig(**spec["model"]), T, causal_half=True),
               fp8=model_name in FP8_MODELS, losses=losses, steps=steps, warmup=warmup, window=window)
    if mode != "eager":
        row.update(_dynamo_counts())
    return row


# ------------------------------------------------------------------------------------------ profile
def _our_triton_kernel_names() -> set[str]:
    import re
    names = set()
    for f in ("triton_norm.py", "triton_rope.py", "triton_swiglu.py", "triton_loss.py"):
        try:
            with open(os.path.join(ROOT, "model", f), encoding="utf-8") as fh:
                names |= set(re.findall(r"@triton\.jit[^\n]*\n\s*def (\w+)", fh.read()))
        except OSError:
            pass
    return names


def _category(name: str, ours: set[str]) -> str:
    n = name.lower()
    if any(k == name or name.startswith(k) for k in ours):
        return "our Triton kernels"
    # attention before matmuls: PyTorch's memory-efficient attention kernels are CUTLASS kernels (fmha_cutlass*);
    # "cudnn": cuDNN runs only SDPA here (no convolutions), its backward's helper kernels included
    # (cudnn::fusion::compute_dot_do_o_specialized, convert_dq_to_16bits: 0.62 ms of a 124M step on an H200)
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "efficient_attention", "attn", "cudnn")):
        return "attention (SDPA)"
    if any(k in n for k in ("gemm", "cutlass", "sm90_xmma", "sm80_xmma", "cublas", "matmul", "wgmma", "nvjet",
                            "aten::mm", "aten::addmm", "aten::bmm")):
        return "matmul (cuBLAS / CUTLASS)"
    if any(k in n for k in ("flash", "fmha", "attention", "sdpa", "efficient_attention")):
        return "attention (SDPA)"
    if "adam" in n or "multi_tensor_apply" in n or "foreach" in n:
        return "optimizer, foreach (AdamW, clip norms)"
    if "triton" in n:
        return "other Triton (Inductor)"
    if any(k in n for k in ("copy", "memcpy", "memset", "catarray", "fill")):
        return "copies / fills"
    return "other"


def timeline_gaps(kernels: list[tuple[float, float, str]], top: int = 6, min_gap_us: float = 20.0) -> dict:
    """Where the device waited: `kernels` are (start_us, end_us, name) of every device kernel in a profiled
    window. Returns its span (first start to last end), the busy time (the union of the kernels), the idle
    time (span - busy), how many idle gaps last >= `min_gap_us` and what they add up to, and the `top`
    longest gaps with the kernels that end before and start after each (e.g. the optimizer's last kernel and
    the next step's first: a step boundary the host was late for)."""
    if not kernels:
        return dict(span_ms=0.0, busy_ms=0.0, idle_ms=0.0, gaps=0, gaps_ms=0.0, longest=[])
    ks = sorted(kernels)
    busy, gaps = 0.0, []
    run_start, run_end, last_name = ks[0][0], ks[0][1], ks[0][2]
    for start, end, name in ks[1:]:
        if start > run_end:
            gaps.append((start - run_end, last_name, name))
            busy += run_end - run_start
            run_start, run_end, last_name = start, end, name
        elif end >= run_end:
            run_end, last_name = end, name
    busy += run_end - run_start
    span = run_end - ks[0][0]
    big = sorted((g for g in gaps if g[0] >= min_gap_us), key=lambda g: -g[0])
    return dict(span_ms=round(span / 1e3, 3), busy_ms=round(busy / 1e3, 3), idle_ms=round((span - busy) / 1e3, 3),
                gaps=len(big), gaps_ms=round(sum(g[0] for g in big) / 1e3, 3),
                longest=[dict(gap_us=round(g, 1), before=b[:80], after=a[:80]) for g, b, a in big[:top]])


def profile_step(config: str, device_name: str, precision: str = "trainer", warmup: int = 3,
                 row_limit: int = 15, mode: str = "eager", steps: int = 2) -> dict:
    """torch.profiler over `steps` back-to-back steps of `ours` (eager, or compiled as the trainer compiles;
    one device sync after the last) after `warmup` steps (compiling, Triton JIT and cuBLAS set-up excluded):
    the top `row_limit` kernels by self device time per step (ops by self CPU time on a CPU), and on a GPU
    the timeline's idle gaps (`timeline_gaps`: where the device waited for the host, step boundaries
    included). Profiler annotations (user ranges, Inductor's graph markers, which span kernels on the GPU
    timeline) are not kernels and are left out of the times."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from utils.device import synchronize
    device = torch.device(device_name)
    fast_fp32_matmuls(device)
    step, _ = make_step(config, "ours", mode, precision, device)
    for _ in range(warmup):
        step()
    synchronize(device)
    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    wall = (time.perf_counter() - t0) / steps
    avg = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    sort_by = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in avg if getattr(e, key, 0) > 0 and not getattr(e, "is_user_annotation", False)]
    if cuda:  # the kernels themselves: an op's self CUDA time repeats its kernels' (counted twice otherwise)
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        events = kernels or events
    per_step = lambda e: getattr(e, key) / steps  # noqa: E731 - us per step
    total = sum(per_step(e) for e in events) or 1.0
    events.sort(key=per_step, reverse=True)
    ours = _our_triton_kernel_names()
    top = [dict(name=e.key, self_ms=round(per_step(e) / 1e3, 3), pct=round(100 * per_step(e) / total, 1),
                calls=round(e.count / steps, 1), category=_category(e.key, ours)) for e in events[:row_limit]]
    cats: dict[str, float] = {}
    for e in events:
        c = _category(e.key, ours)
        cats[c] = cats.get(c, 0.0) + per_step(e)
    cat_total = sum(cats.values()) or 1.0
    members: dict[str, list] = {}  # each kind's largest kernels (the 124M "other" was 1.24 ms, 4%, unnamed)
    for e in events:  # (sorted by time)
        c = _category(e.key, ours)
        if len(members.setdefault(c, [])) < 5:
            members[c].append(dict(name=e.key[:90], self_ms=round(per_step(e) / 1e3, 3),
                                   calls=round(e.count / steps, 1)))
    timeline = None
    if cuda:
        timeline = timeline_gaps([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                                  if e.device_type == torch.autograd.DeviceType.CUDA
                                  and not getattr(e, "is_user_annotation", False)])
    return dict(config=config, precision=precision, mode=mode, device=str(device),
                time_kind="CUDA" if cuda else "CPU", steps=steps, timeline=timeline,
                what="kernels" if cuda else "ops",
                step_wall_ms=round(wall * 1e3, 2), total_self_ms=round(total / 1e3, 3), top=top,
                categories=[dict(category=c, ms=round(v / 1e3, 3), pct=round(100 * v / cat_total, 1),
                                 largest=members.get(c, []))
                            for c, v in sorted(cats.items(), key=lambda kv: -kv[1])],
                table=avg.table(sort_by=sort_by, row_limit=row_limit, max_name_column_width=60))  # all steps


# ------------------------------------------------------------------------------------------ parent
def run_capture(cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, str, bool]:
    """(returncode, stdout, stderr, timed_out); the child runs in its own session, killed on timeout (or when
    this process stops early) with every process below it (utils/proc_tree.py kill_tree: Inductor's compile
    workers included)."""
    from utils.proc_tree import kill_tree
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=max(1.0, timeout))
        return p.returncode, out, err, False
    except subprocess.TimeoutExpired:
        kill_tree(p.pid)
        out, err = p.communicate()
        return -9, out or "", err or "", True
    finally:  # this process stopped early (SIGTERM, Ctrl-C): the row, in its own session, must not run on
        if p.poll() is None:
            kill_tree(p.pid)


def planned_rows(args) -> list[tuple[str, str, str, str]]:
    """(config, model, precision, mode) in the order they run: per config, eager rows then compile rows,
    each in PRIORITY order; --rows (model:precision:mode,...) replaces the matrix. When every --rows entry names
    its config (config:model:precision:mode) they run in the order listed (the GPU report's A/B rows, most
    wanted first: config by config would run a 1B row it wants early only after every 124M row)."""
    rows = []
    if args.rows and all(r.count(":") == 3 for r in args.rows):  # every row config-prefixed: the order listed
        return [tuple(r.split(":")) for r in args.rows if r.split(":")[0] in args.configs]
    for config in args.configs:
        if args.rows:
            for r in args.rows:  # model:precision:mode, or config:model:precision:mode (that config only)
                parts = r.split(":")
                if len(parts) == 4 and parts.pop(0) != config:
                    continue
                m, prec, mode = parts
                rows.append((config, m, prec, mode))
            continue
        for mode in MODES:
            if mode not in args.modes:
                continue
            for m, prec in PRIORITY:
                if m in args.models and prec in args.precisions:
                    rows.append((config, m, prec, mode))
    return rows


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing (find_spec imports it) or broken
        return False


# the rows that need an optional package, and the line a row says without it
EXTRAS = {"hf-liger": ("liger_kernel", "liger-kernel not installed"),
          "ours-nofa4": ("flash_attn.cute", "flash-attn-4 not installed: ours runs without it already"),
          "titan": ("torchtitan", "torchtitan not installed (pip install --no-deps -r requirements-peers.txt)")}


def missing_extra(model_name: str) -> str:
    """Why the row of `model_name` cannot run here ("" when it can): its optional package is not installed."""
    module, why = EXTRAS.get(model_name, ("", ""))
    return why if module and not _importable(module) else ""


def child_rows(args) -> list[dict]:
    rows = []
    t_start = time.perf_counter()
    plan = planned_rows(args)
    for i, (config, model_name, precision, mode) in enumerate(plan):
        key = dict(config=config, model=model_name, mode=mode, precision=precision)
        left = args.budget_s - (time.perf_counter() - t_start) if args.budget_s else None
        missing = missing_extra(model_name)
        if left is not None and left < 5:
            row = dict(key, skipped=f"not run: the {args.budget_s:.0f} s budget was spent")
        elif missing:
            row = dict(key, skipped=missing)
        else:
            steps = args.curve_steps if args.curve_steps and model_name in args.curve_models else args.steps
            cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{config},{model_name},{mode},{precision}",
                   "--device", args.device, "--steps", str(steps), "--warmup", str(args.warmup),
                   "--window", str(args.window)]
            timeout = min(args.timeout, left) if left is not None else args.timeout
            t0 = time.perf_counter()
            rc, out, err, timed_out = run_capture(cmd, timeout)
            lines = [ln for ln in out.splitlines() if ln.startswith("{")]
            if rc == 0 and lines:
                row = json.loads(lines[-1])
            else:
                tail = [ln for ln in err.strip().splitlines() if ln.strip()][-8:] or ["(no output)"]
                last = tail[-1]
                if timed_out:
                    last = f"timed out after {timeout:.0f} s"
                elif "out of memory" in err.lower():
                    last = "out of memory: " + last
                row = dict(key, error=last[:200], error_tail=tail, returncode=rc)
            row["wall_s"] = round(time.perf_counter() - t0, 1)
        row["precision_label"] = PRECISIONS.get(precision, precision)
        rows.append(row)
        print(f"[bench {i + 1}/{len(plan)}] " + json.dumps(row), flush=True)
        if args.json_out:
            _write_json(args.json_out, dict(meta=args.meta, rows=rows, done=False))
    return rows


def prewarm_plan(args) -> list[tuple[str, str, str, str]]:
    """The prewarm's rows: the plan's compiled ones (those TIMED_AT_COMPILE left out), config-prefixed --rows
    first in the order listed."""
    plan = [r for r in planned_rows(args) if r[3] != "eager" and r[3] not in TIMED_AT_COMPILE]
    listed = {tuple(r.split(":")): i for i, r in reversed(list(enumerate(args.rows or []))) if r.count(":") == 3}
    plan.sort(key=lambda row: listed.get(row, len(listed)))  # stable: the rows not listed keep the plan's order
    return plan


def prewarm_rows(args) -> list[dict]:
    """The plan's compile rows, `args.parallel` at a time, one (compiling) step each and no timing: Inductor's
    FX-graph, AOTAutograd and Triton caches (on disk, shared by every process of this machine) then hold
    what the timed rows and the trainer's compiled runs compile, so each of those starts in seconds. Rows
    run in plan order (smaller configs first), or with config-prefixed --rows in the order listed (the GPU
    report lists first what is needed first and compiles longest); an error (an out-of-memory beside other
    rows) only means that row compiles cold later."""
    from utils.proc_tree import kill_tree, process_table
    plan = prewarm_plan(args)
    t_start = T_SCRIPT  # the budget counts from the process's start: its caller's timeout does too
    running: list = []
    done: list[dict] = []

    def reap(block: bool) -> None:
        for item in list(running):
            proc, key, t0 = item
            if block or proc.poll() is not None:
                try:
                    out, err = proc.communicate(timeout=max(1.0, args.budget_s - (time.perf_counter() - t_start))
                                                if args.budget_s else None)
                except subprocess.TimeoutExpired:
                    kill_tree(proc.pid)
                    out, err = proc.communicate()
                row = dict(key, wall_s=round(time.perf_counter() - t0, 1), ok=proc.returncode == 0)
                if proc.returncode != 0:
                    row["error"] = ([ln for ln in (err or "").splitlines() if ln.strip()][-1:] or ["?"])[0][:200]
                done.append(row)
                print("[prewarm] " + json.dumps(row), flush=True)
                running.remove(item)

    try:
        for config, model_name, precision, mode in plan:
            if missing_extra(model_name):
                continue
            while len(running) >= max(1, args.parallel):
                reap(block=False)
                time.sleep(0.5)
            if args.budget_s and time.perf_counter() - t_start > args.budget_s:
                break
            cmd = [sys.executable, os.path.abspath(__file__), "--one", f"{config},{model_name},{mode},{precision}",
                   "--device", args.device, "--steps", "0", "--warmup", "0"]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                                    start_new_session=True)
            running.append((proc, dict(config=config, model=model_name, precision=precision, mode=mode),
                            time.perf_counter()))
        while running:
            reap(block=True)
    finally:  # stopped early (SIGTERM, Ctrl-C): each row runs in a session of its own and would run on
        for proc, _, _ in running:
            if proc.poll() is None:
                kill_tree(proc.pid)
        # and a row the signal came upon between its Popen and `running.append` (the handler runs at the next
        # bytecode): every child of this process is a row
        for pid, info in process_table().items():
            if info.ppid == os.getpid() and info.state != "Z":
                kill_tree(pid)
    return done


def _write_json(path: str, obj: dict) -> None:
    from utils.publish import atomic_write_text
    atomic_write_text(path, json.dumps(obj, indent=1))


# our bf16 rows a user gets from a flag (the goals take the best of them); FP8 and bf16 moments are reported apart
BF16_OURS = ("ours", "ours-nofa4")


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def markdown_tables(rows: list[dict], peak_table: float, peak_measured: float) -> str:
    """The rows table and the ratios the issue's goals are stated in, as markdown."""
    out = ["| config | model | precision | mode | tokens/s | step ms | MFU (table peak) | MFU (measured peak) | "
           "MFU, causal half (table peak) | compile s (eager: first call) | peak GiB | first loss |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        head = f"| {r['config']} | {r['model']} | {PRECISIONS.get(r['precision'], r['precision'])} | {r['mode']} |"
        if "tokens_per_s" not in r:
            why = r.get("skipped") or f"failed: {r.get('error', '?')}"
            out.append(f"{head} {why} | | | | | | | |")
            continue
        f = r["flops_per_token"] * r["tokens_per_s"]
        f_half = r.get("flops_per_token_causal_half", 0) * r["tokens_per_s"]
        if r.get("fp8") or r.get("model") in FP8_MODELS:  # FP8 matmuls: no bf16 peak to divide by
            mfu_t = mfu_m = mfu_h = "FP8: -"
        else:
            mfu_t, mfu_h = f"{f / peak_table:.1%}", (f"{f_half / peak_table:.1%}" if f_half else "-")
            mfu_m = f"{f / peak_measured:.1%}" if peak_measured else "-"
        graphs = f" ({r['graphs']} graph(s), {r['graph_breaks']} break(s))" if "graphs" in r else ""
        if r.get("mode") == "compile-cg" and "cudagraph_skips" in r:
            graphs = graphs[:-1] + f", {r['cudagraph_skips']} not replayed as CUDA graphs)"
        out.append(f"{head} {r['tokens_per_s']:,} | {r['step_ms']} | {mfu_t} | {mfu_m} | {mfu_h} | "
                   f"{r['compile_s']}{graphs} | {r['peak_mem_gib']} | {r['first_loss']} |")
    tps = {(r["config"], r["model"], r["precision"], r["mode"]): r.get("tokens_per_s", 0) for r in rows}
    mem = {(r["config"], r["model"], r["precision"], r["mode"]): r.get("peak_mem_gib", 0) for r in rows}
    ratios = []
    for c in dict.fromkeys(r["config"] for r in rows):
        get = lambda m, p, md: tps.get((c, m, p, md), 0)  # noqa: E731
        # the goals' ratio: our best bf16 row (any precision and mode) over the best peer row; FP8 apart
        best = lambda models: max((get(m, p, md) for m in models for p in PRECISIONS for md in MODES),  # noqa: E731
                                  default=0)
        compiled = lambda models: max((get(m, p, md) for m in models for p in PRECISIONS  # noqa: E731
                                       for md in MODES if md != "eager"), default=0)
        ours_bf16 = best(BF16_OURS)
        ratios.append(f"| {c} | GOAL (>= 1.15x): best ours (bf16) / torchtitan | {_ratio(ours_bf16, best(('titan',)))} |")
        ratios.append(f"| {c} | GOAL (>= 1.5x at 124m): best ours (bf16) / best HF compiled (HF, HF+Liger) | "
                      f"{_ratio(ours_bf16, compiled(('hf', 'hf-liger')))} |")
        ratios.append(f"| {c} | GOAL (>= 1.25x at 1b): best ours with FP8 (either recipe) / best ours bf16 | "
                      f"{_ratio(best(tuple(FP8_MODELS)), ours_bf16)} |")
        ratios.append(f"| {c} | FP8 rowwise / FP8 tensorwise (best rows) | "
                      f"{_ratio(best(('ours-fp8r',)), best(('ours-fp8',)))} |")
        ratios.append(f"| {c} | ours / ours-nofa4 (FlashAttention-4's gain where --fa4=auto picks it; best "
                      f"rows) | {_ratio(best(('ours',)), best(('ours-nofa4',)))} |")
        ratios.append(f"| {c} | best ours (bf16) / best of HF and HF+Liger, any mode | "
                      f"{_ratio(ours_bf16, best(('hf', 'hf-liger')))} |")
        ratios.append(f"| {c} | ours / ours with torch's fused AdamW (the one-launch AdamW's gain; best rows) | "
                      f"{_ratio(best(('ours',)), best(('ours-torchadam',)))} |")
        ratios.append(f"| {c} | ours / ours-concat (separate projections + full-logits loss when compiled; best rows) | "
                      f"{_ratio(best(('ours',)), best(('ours-concat',)))} |")
        ratios.append(f"| {c} | ours / ours-tce (full-logits loss fused by Inductor vs the Triton linear+CE op in "
                      f"one chunk; best rows) | {_ratio(best(('ours',)), best(('ours-tce',)))} |")
        ratios.append(f"| {c} | ours / ours-tce4k (as ours-tce, the op's softmax kernel in 4096-element tiles, "
                      f"8 warps; best rows) | {_ratio(best(('ours',)), best(('ours-tce4k',)))} |")
        ratios.append(f"| {c} | ours / ours-gradbuf (gradients read from the parameters, not copied into fp32 "
                      f"buffers; best rows) | {_ratio(best(('ours',)), best(('ours-gradbuf',)))} |")
        ratios.append(f"| {c} | ours-overlap / ours (each bucket stepped when its gradients are ready, clipped with "
                      f"the previous norm; best rows) | {_ratio(best(('ours-overlap',)), best(('ours',)))} |")
        ratios.append(f"| {c} | ours / ours-sync (the step's gradient norm read a step later vs inside the step; "
                      f"best rows) | {_ratio(best(('ours',)), best(('ours-sync',)))} |")
        ratios.append(f"| {c} | GOAL, bf16 moments apart: best ours-bf16m / best of HF and HF+Liger | "
                      f"{_ratio(best(('ours-bf16m',)), best(('hf', 'hf-liger')))} |")
        ratios.append(f"| {c} | ours-bf16m / ours (AdamW's moments in bf16 vs fp32; best rows) | "
                      f"{_ratio(best(('ours-bf16m',)), best(('ours',)))} |")
        ratios.append(f"| {c} | ours compile-cdt / ours compile (Inductor's coordinate-descent tuning; trainer) | "
                      f"{_ratio(get('ours', 'trainer', 'compile-cdt'), get('ours', 'trainer', 'compile'))} |")
        ratios.append(f"| {c} | ours compile-cg / ours compile (CUDA graphs: --compile_mode=reduce-overhead; "
                      f"trainer) | {_ratio(get('ours', 'trainer', 'compile-cg'), get('ours', 'trainer', 'compile'))} |")
        for md in MODES:
            ratios.append(f"| {c} | ours trainer / HF autocast = HF Trainer's bf16 ({md}) | "
                       f"{_ratio(get('ours', 'trainer', md), get('hf', 'autocast', md))} |")
        for p in PRECISIONS:
            best_ours = max(get("ours", p, md) for md in MODES)
            best_peer = max(get(m, p, md) for m in ("hf", "hf-liger") for md in MODES)
            ratios.append(f"| {c} | best ours / best of HF and HF+Liger ({p}) | {_ratio(best_ours, best_peer)} |")
            for md in MODES:
                ratios.append(f"| {c} | ours / HF ({p}, {md}) | {_ratio(get('ours', p, md), get('hf', p, md))} |")
                ratios.append(f"| {c} | ours kernels / ours references ({p}, {md}) | "
                           f"{_ratio(get('ours', p, md), get('ours-ref', p, md))} |")
            ratios.append(f"| {c} | ours eager / HF+Liger eager ({p}) | "
                       f"{_ratio(get('ours', p, 'eager'), get('hf-liger', p, 'eager'))} |")
            for md in MODES:
                ratios.append(f"| {c} | peak memory ours / HF ({p}, {md}) | "
                           f"{_ratio(mem.get((c, 'ours', p, md), 0), mem.get((c, 'hf', p, md), 0))} |")
        for md in MODES:
            ratios.append(f"| {c} | ours trainer / ours autocast ({md}) | "
                          f"{_ratio(get('ours', 'trainer', md), get('ours', 'autocast', md))} |")
    ratios = [r for r in ratios if not r.endswith("| - |")]  # only the ratios both of whose rows ran
    out += [""] + (["| config | ratio (tokens/s unless memory) | value |", "| --- | --- | --- |"] + ratios
                   if ratios else ["(no ratio: none of the row pairs it compares ran)"])
    curves = loss_curves(rows)
    if curves:
        out += ["", curves]
    return "\n".join(out)


CURVE_MIN_STEPS = 20  # rows with fewer timed steps are not compared as curves


def curve_summary(curve: list[float], ref: list[float]) -> dict:
    """How `curve` (an FP8 row's timed losses) follows `ref` (bf16's, the same batch and steps): the largest
    relative gap over the common steps, the gap at the last common step, and whether every loss is finite."""
    n = min(len(curve), len(ref))
    gaps = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve[:n], ref[:n])]
    finite = all(v == v and abs(v) != float("inf") for v in curve)
    return dict(steps=n, max_rel_gap=max(gaps) if gaps else float("nan"),
                last_rel_gap=gaps[-1] if gaps else float("nan"), finite=finite,
                first=curve[0] if curve else None, last=curve[n - 1] if n else None,
                ref_first=ref[0] if ref else None, ref_last=ref[n - 1] if n else None)


def loss_curves(rows: list[dict]) -> str:
    """Each FP8 row's loss curve against the bf16 `ours` row of its config, precision and mode, as markdown
    ("" when no pair has CURVE_MIN_STEPS timed steps)."""
    by_key = {(r["config"], r["model"], r["precision"], r["mode"]): r for r in rows if r.get("losses")}
    lines = []
    for (c, m, p, md), r in by_key.items():
        ref = by_key.get((c, "ours", p, md))
        if m not in FP8_MODELS or ref is None or min(len(r["losses"]), len(ref["losses"])) < CURVE_MIN_STEPS:
            continue
        s = curve_summary(r["losses"], ref["losses"])
        lines.append(f"| {c} | {m} ({FP8_MODELS[m]}) | {md} | {s['steps']} | {s['ref_first']} -> {s['ref_last']} | "
                     f"{s['first']} -> {s['last']} | {s['max_rel_gap']:.2%} | {s['last_rel_gap']:.2%} | "
                     f"{'yes' if s['finite'] else 'NO'} |")
    if not lines:
        return ""
    return "\n".join(["| config | FP8 row | mode | timed steps | bf16 loss first -> last | FP8 loss first -> last | "
                      "largest gap to bf16 | gap at the last step | all finite |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"] + lines)


def resolve_peak(device: str, override_tflops) -> tuple[float, str]:
    """(dense bf16 peak FLOP/s, where it came from): --peak-tflops, model/flops.py's table, else 989 (H100 SXM)."""
    import torch
    if override_tflops:
        return override_tflops * 1e12, "--peak-tflops"
    if torch.device(device).type == "cuda":
        from model.flops import table_peak_flops
        name = torch.cuda.get_device_name(torch.device(device))
        peak = table_peak_flops(name, torch.bfloat16)
        if peak:
            return peak, f"table: {name}"
    return 989e12, "H100 SXM dense bf16 (not this device's)"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="124m,1b", help="comma list of: " + ",".join(CONFIGS))
    p.add_argument("--models", default=",".join(MODELS), help="comma list of: " + ",".join(MODELS))
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma list of " + ",".join(MODES))
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of: " + ",".join(PRECISIONS))
    p.add_argument("--rows", default="", help="model:precision:mode,... run exactly these rows (per config); "
                   "config:model:precision:mode,... (every row with its config): these rows in this order")
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--window", type=int, default=0, help="0: no device sync until the last timed step, each "
                   "step timed by CUDA events (the trainer's way); N: timed steps per device sync, by the host clock "
                   "(1: a sync after every step)")
    p.add_argument("--curve-steps", type=int, default=0, help="timed steps of the --curve-models rows (0: --steps), "
                   "whose losses the tables compare as curves")
    p.add_argument("--curve-models", default="ours,ours-fp8,ours-fp8r", help="comma list: the rows --curve-steps applies to")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense bf16 peak of the GPU (default: model/flops.py's table for this GPU, else 989)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per row subprocess")
    p.add_argument("--budget-s", type=float, default=0, help="start no row after this many seconds (0 = no limit); "
                   "the rows left are reported as not run")
    p.add_argument("--json-out", default="", help="write {meta, rows, tables} here (rewritten after every row)")
    p.add_argument("--profile", default="", help="CONFIG: profile one eager trainer-precision step of ours instead")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument("--profile-mode", default="compile", choices=MODES, help="profile the eager or the compiled step")
    p.add_argument("--prewarm", action="store_true",
                   help="run only the compile rows of the plan, one step each, --parallel at a time, to fill "
                        "Inductor's caches (no timing: later rows and trainer runs compile from the cache)")
    p.add_argument("--parallel", type=int, default=1, help="--prewarm: rows at once")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: config,model,mode,precision
    args = p.parse_args(argv)
    # a SIGTERM ends this process through its `finally`s (the row processes it started are killed there)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.one:  # a row's process: where its wall time goes (the rest of the parent's wall_s: start and exit)
        config, model_name, mode, precision = args.one.split(",")
        row = run_one(config, model_name, mode, precision, args.device, args.steps, args.warmup, args.window)
        row["in_process_s"] = round(time.perf_counter() - T_SCRIPT, 2)
        print(json.dumps(row), flush=True)
        return
    if args.profile:
        res = profile_step(args.profile, args.device, row_limit=args.profile_rows, mode=args.profile_mode)
        print(res["table"], flush=True)
        print(json.dumps({k: v for k, v in res.items() if k != "table"}), flush=True)
        if args.json_out:
            _write_json(args.json_out, res)
        return
    args.configs, args.models, args.modes, args.precisions = (
        [s for s in v.split(",") if s] for v in (args.configs, args.models, args.modes, args.precisions))
    args.rows = [r for r in args.rows.split(",") if r]
    args.curve_models = [m for m in args.curve_models.split(",") if m]
    for c in args.configs:
        if c not in CONFIGS:
            p.error(f"unknown config {c!r}")
    if args.prewarm:  # no timing, no CUDA context here
        warmed = prewarm_rows(args)
        if args.json_out:
            _write_json(args.json_out, dict(prewarm=warmed, done=True))
        return
    import torch
    from model.flops import measure_peak_flops
    fast_fp32_matmuls(args.device)
    cuda = torch.device(args.device).type == "cuda"
    peak_measured = measure_peak_flops(args.device, torch.bfloat16, seconds=2.0 if cuda else 0.5)
    peak_table, peak_src = resolve_peak(args.device, args.peak_tflops)
    name = torch.cuda.get_device_name(torch.device(args.device)) if cuda else "cpu"
    args.meta = dict(torch=torch.__version__, device=name, peak_measured_flops=peak_measured,
                     peak_table_flops=peak_table, peak_table_source=peak_src,
                     steps=args.steps, warmup=args.warmup, window=args.window,
                     tf32=bool(cuda), triton_default_fp_fusion=os.environ.get("TRITON_DEFAULT_FP_FUSION"))
    print(f"torch {torch.__version__}, device {name}, measured bf16 matmul peak {peak_measured / 1e12:.3g} TFLOP/s, "
          f"table peak {peak_table / 1e12:.0f} TFLOP/s ({peak_src}); TF32 {'on' if cuda else 'n/a (CPU)'}, "
          f"TRITON_DEFAULT_FP_FUSION={os.environ.get('TRITON_DEFAULT_FP_FUSION')}", flush=True)
    rows = child_rows(args)
    tables = markdown_tables(rows, peak_table, peak_measured)
    print("\n" + tables, flush=True)
    if args.json_out:
        _write_json(args.json_out, dict(meta=args.meta, rows=rows, done=True, tables=tables))


if __name__ == "__main__":
    main()
