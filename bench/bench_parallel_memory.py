"""Benchmark: per-rank memory (parameters, gradients, optimizer state) and step time of every engine
(our DDP, ZeRO-1, ZeRO-2, FSDP2, FSDP2 + CPU offload, pipeline pp=2) on CPU gloo processes, each row
beside its bytes-per-parameter formula, step times as ratios to our DDP.

    .venv/bin/python bench/bench_parallel_memory.py --small   # 35.2M params (dim 384, 6 layers, vocab 32000)
    .venv/bin/python bench/bench_parallel_memory.py           # 271.1M params (dim 1024, 16 layers, vocab 32000)
    .venv/bin/python bench/bench_parallel_memory.py --activations   # only the activation pass (~1 min, below)

Run time is dominated by CPU contention: --small took 271 s on the shared 2-core box at load ~3
(8 min at load 8-10), the default 668 s at load 2-8; the default model needs ~13 GiB of RAM at world 2.
Each engine of the memory pass runs in its own spawn (glibc does not hand a dropped engine's heap back
to the OS at once; the uncollectable hook cycle that used to keep dropped ddp/ZeRO engines alive is
fixed, tests/optimizer/test_optimizer.py::test_dropped_engine_is_freed); at world 4 the default model's ddp row is skipped by the RAM estimate.

Memory: bytes are MEASURED by walking the tensors each engine holds (model parameters, local shards
of FSDP's DTensors, DDP's flat buffers, main_grad / FSDP's sharded .grad / ZeRO-2's gradient shards /
the optimizer's fp32 grad copies, AdamW's exp_avg / exp_avg_sq / step, fp32 master copies), every
storage counted once (deduplicated by its data pointer; a storage counts in the first of params,
grads, optimizer that holds it; padding of flat buffers included, freed storages count 0).
Gradients are taken after the gradient sync and before optimizer.step() (the point where params,
grads and optimizer state all exist; ZeRO-2 has already dropped the unowned part), optimizer state
right after the step. Transient memory (activations, FSDP's all-gathered compute copies, ZeRO-2's
full bucket during backward, communication buffers) is not counted.

Precision of the memory table (--mem-precision bf16, default): bf16 model parameters with fp32
gradients (DDPConfig.grad_reduce_in_fp32) and fp32 masters + Adam moments for ddp / ZeRO / pp (the
"bf16 params, fp32 grads" row of Megatron's distributed-optimizer table); FSDP keeps fp32 sharded
parameters (they ARE the masters), bf16 compute copies (param_dtype) and fp32 gradient shards. The
memory step uses --mem-seq tokens only: bf16 matmuls are ~50x slower than fp32 on a CPU without
AVX512-BF16, and the bytes do not depend on the sequence length.

Step time (--time-worlds, --time-engines): a separate fp32 pass (fp32 parameters everywhere, FSDP
param_dtype fp32), batch 1 x --seq per dp rank (pp: 2 micro-batches of 1 x --seq per dp replica = the
same global batch). The timed engines are held in memory at once and stepped in rounds, each engine
once per round, the order rotated every round, so each engine/ddp ratio compares steps taken seconds
apart on this shared box; printed: median step time, median / min / max over rounds of engine/ddp (a
step's time is the slowest rank's; one warm-up step each, which is also the fp32 memory walk: second
memory table, fp32 formulas). Default model: only ddp and fsdp are timed (all six at once would not fit in RAM).

Activations (--activations, nothing else runs): the bytes autograd saves for backward during one forward,
per token per transformer block, per rank, for tp1 / tp2 / tp2+sp at world 2 and also tp4 / tp4+sp at
world 4 (--act-worlds), and context parallel cp2 (world 2 and 4) / cp4 (world 4) under our DDP, each engine built by parallel.build.build_engine (FSDP2 + DTensor tensor
parallelism, fp32). A saved_tensors_hooks sums every saved tensor's storage once (a DTensor counts its
local shard), attributed by forward hooks to the block running when it was first saved; the forward runs
at B and 2B sequences and the difference is the per-token part (weights saved by the matmuls cancel).
Each row is printed beside act_formula (what our block saves, term by term, in h, hk, H, f, t) and
beside Korthikanti et al. 2022's formula. Model: dim 256, 3 layers, 8 heads over 4 kv heads, vocab
4096, B 2, S 256 (--act-dim/--act-layers/--act-seq/--act-batch); --verbose lists every saved tensor.

Nothing is asserted. CPU offload on a CPU-only run: the compute device IS the host, so "device" vs
"host" is decided by the placement policy (every FSDPParam reports offload_to_cpu), not by
tensor.device: with offload, sharded params, grads and optimizer state count as host/offloaded.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import ModelConfig, Transformer  # noqa: E402
from optimizer import OptimizerConfig, build_optimizer  # noqa: E402
from parallel import DDPConfig, DistributedDataParallel  # noqa: E402

ENGINES = ["ddp", "zero1", "zero2", "fsdp", "fsdp_offload", "pp2", "tp2", "hsdp2"]
BUCKET = 40_000_000


def model_config(a) -> ModelConfig:
    moe = dict(moe_num_experts=a.moe_experts, moe_top_k=a.moe_top_k) if a.moe_experts else {}  # MoE: every expert
    if a.small:
        return ModelConfig(vocab_size=32000, dim=384, n_layers=6, n_heads=6, max_seq_len=max(a.seq, a.mem_seq), **moe)
    return ModelConfig(vocab_size=32000, dim=a.dim, n_layers=a.layers, n_heads=a.dim // 64,
                       max_seq_len=max(a.seq, a.mem_seq), **moe)


def build_model(a, dtype: torch.dtype) -> Transformer:
    torch.manual_seed(0)
    m = Transformer(model_config(a))
    return m.to(dtype) if dtype != torch.float32 else m


# ---------------------------------------------------------------------------- formulas (B / param of the whole model)

def formula(engine: str, prec: str, d: int, stage_frac: float = 1.0) -> tuple[str, float]:
    """(text, bytes per parameter of the WHOLE model on one rank). d = data-parallel size."""
    # tp2: FSDP2 over d = world/2 data-parallel ranks x 2 tensor ranks: every matrix is split over all
    # d x 2 ranks (the norms, ~0.01% of N, only over d); hsdp2: FSDP2 sharded over d/2 ranks, 2 replicas
    if prec == "bf16":
        table = {"ddp": ("18 = 2+4+12", 18.0), "zero1": ("6+12/d (Megatron)", 6 + 12 / d),
                 "zero2": ("2+16/d", 2 + 16 / d), "fsdp": ("16/d", 16 / d), "fsdp_offload": ("16/d host", 16 / d),
                 "pp2": ("18 x N_stage/N", 18.0 * stage_frac), "tp2": ("16/(2d)", 16 / (2 * d)),
                 "hsdp2": ("16/(d/2)", 32 / d)}
    else:
        table = {"ddp": ("16 = 4+4+8", 16.0), "zero1": ("8+8/d", 8 + 8 / d), "zero2": ("4+12/d", 4 + 12 / d),
                 "fsdp": ("16/d", 16 / d), "fsdp_offload": ("16/d host", 16 / d),
                 "pp2": ("16 x N_stage/N", 16.0 * stage_frac), "tp2": ("16/(2d)", 16 / (2 * d)),
                 "hsdp2": ("16/(d/2)", 32 / d)}
    return table[engine]


# ---------------------------------------------------------------------------- tensor walking

def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


class Ledger:
    """Storages by category, each storage counted once (first category wins)."""

    def __init__(self):
        self.seen: dict[int, str] = {}
        self.bytes = {"params": 0, "grads": 0, "optimizer": 0}
        self.keep: list = []  # hold storages until the ledger is done, so a freed pointer is never reused

    def add(self, cat: str, t) -> None:
        if t is None or not torch.is_tensor(t):
            return
        st = _local(t).untyped_storage()
        ptr = st.data_ptr()
        if st.nbytes() == 0 or ptr in self.seen:
            return
        self.seen[ptr] = cat
        self.bytes[cat] += st.nbytes()
        self.keep.append(st)


def grad_tensors(kind: str, eng) -> list:
    out = []
    if kind == "fsdp":
        for p in eng["module"].parameters():
            out.append(p.grad)
        return out
    ddp, opt = eng["ddp"], eng["opt"]
    for p in ddp.module.parameters():
        out.append(getattr(p, "main_grad", None))
    for pc in opt.pieces:
        out += [pc.grad_store, pc.main.grad]
    out += list(getattr(opt, "_grad_shards", {}).values())
    return out


def param_tensors(eng) -> list:
    return list(eng["module"].parameters())


def optim_tensors(kind: str, eng) -> list:
    opt = eng["opt"]
    adamws = [opt.adamw] if kind == "fsdp" else list(opt.optimizers.values())
    out = []
    for aw in adamws:
        for g in aw.param_groups:
            out += list(g["params"])  # fp32 masters (deduplicated against the params when they ARE the params)
        for st in aw.state.values():
            out += [v for v in st.values() if torch.is_tensor(v)]
    return out


# ---------------------------------------------------------------------------- engines

def build_engine(name: str, a, prec: str, world: int) -> dict:
    dtype = torch.bfloat16 if prec == "bf16" else torch.float32
    ocfg = dict(lr=1e-4, precision=prec, fused=False)
    if name in ("ddp", "zero1", "zero2"):
        zero = name != "ddp"
        m = build_model(a, dtype)
        ddp = DistributedDataParallel(m, DDPConfig(bucket_size=BUCKET, grad_reduce_in_fp32=prec == "bf16",
                                                   use_distributed_optimizer=zero))
        ddp.broadcast_params()
        opt = build_optimizer(ddp, OptimizerConfig(use_distributed_optimizer=zero, zero_stage=2 if name == "zero2" else 1,
                                                   **ocfg))
        return {"kind": "ddp", "ddp": ddp, "opt": opt, "module": m, "fwd": lambda ids: ddp(ids, labels=ids),
                "dp": world, "stage": None, "host": False}
    if name in ("fsdp", "fsdp_offload", "tp2", "hsdp2"):
        from parallel.fsdp import build_fsdp_engine
        from parallel.mesh import MeshLayout, build_device_mesh
        m = build_model(a, torch.float32)  # FSDP: fp32 shards are the masters; dtype only for compute
        mesh = build_device_mesh(MeshLayout.from_sizes(world, tp=2 if name == "tp2" else 1,
                                                       dp_replicate=2 if name == "hsdp2" else 1), "cpu")
        wrapped, opt = build_fsdp_engine(m, OptimizerConfig(**ocfg), mesh_or_group=mesh, param_dtype=dtype,
                                         reshard_after_forward=True, cpu_offload=name == "fsdp_offload")
        mod = wrapped
        # placement by policy: every FSDPParam of every unit must report offload_to_cpu
        flags = [fp.offload_to_cpu for sub in mod.modules() if hasattr(sub, "_get_fsdp_state")
                 for g in sub._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params]
        host = bool(flags) and all(flags)
        return {"kind": "fsdp", "wrapped": wrapped, "opt": opt, "module": mod,
                "fwd": lambda ids: wrapped(ids, labels=ids), "dp": world // 2 if name == "tp2" else world,
                "stage": None, "host": host}
    if name == "pp2":
        from parallel.config import ParallelConfig
        from parallel.build import build_parallel_engine
        m = build_model(a, dtype)
        n_total = sum(p.numel() for p in m.parameters())
        pc = ParallelConfig(pipeline_parallel_size=2, pipeline_schedule="gpipe", gradient_accumulation_steps=2,
                            bucket_size=BUCKET, grad_reduce_in_fp32=prec == "bf16")
        eng = build_parallel_engine(m, pc, OptimizerConfig(**ocfg), device=torch.device("cpu"))
        del m
        n_stage = sum(p.numel() for p in eng.module.parameters())
        return {"kind": "ddp", "ddp": eng.model, "opt": eng.optimizer, "module": eng.module, "pp": eng,
                "dp": eng.dp_size, "stage": eng.stage_index, "stage_frac": n_stage / n_total, "host": False}
    raise ValueError(name)


def fwd_bwd(eng: dict, ids: torch.Tensor) -> None:
    eng["opt"].zero_grad()
    if "pp" in eng:
        def token_loss(model, batch):  # the task's loss (trainer/task.py): the sum of the token losses
            return model(batch["input_ids"], labels=batch["labels"], reduction="sum"), {}
        eng["pp"].forward_backward([{"input_ids": ids, "labels": ids}] * 2, token_loss, float(2 * ids.numel()))
    else:
        eng["opt"].scale_loss(eng["fwd"](ids)).backward()


def measured_step(eng: dict, ids: torch.Tensor) -> dict:
    """One full step; bytes of grads after the grad sync (before the optimizer), params and optimizer
    state after it."""
    fwd_bwd(eng, ids)
    if eng["kind"] == "ddp":
        eng["ddp"].finish_grad_sync()  # what step() does first; a second call reduces nothing
    led = Ledger()
    grads = grad_tensors(eng["kind"], eng)
    for t in param_tensors(eng):  # params first: a grad view of a param storage never counts twice
        led.add("params", t)
    for t in grads:
        led.add("grads", t)
    del grads
    eng["opt"].step()
    for t in param_tensors(eng):
        led.add("params", t)
    for t in optim_tensors(eng["kind"], eng):
        led.add("optimizer", t)
    out = dict(led.bytes)
    led.keep.clear()
    return out


def timed_steps(eng: dict, ids: torch.Tensor, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        dist.barrier()
        t = time.perf_counter()
        fwd_bwd(eng, ids)
        eng["opt"].step()
        times.append(time.perf_counter() - t)
    return times


def rss_gb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def release() -> None:
    """Free what a dropped engine held: reference cycles (engine <-> optimizer), then glibc's heap."""
    gc.collect()
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _write_all_ranks(res: dict, world: int, rank: int, path: str) -> None:
    """Every rank's results, gathered to rank 0 and written to `path` as one JSON list; ends the group."""
    everyone = [None] * world
    dist.all_gather_object(everyone, res)
    if rank == 0:
        with open(path, "w") as f:
            json.dump(everyone, f)
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, a, plan: dict, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    res: dict = {"mem": {}, "time": {}, "fp32_mem": {}}
    for name in plan["mem"]:
        ids = torch.randint(0, 32000, (1, a.mem_seq), generator=g)
        eng = build_engine(name, a, a.mem_precision, world)
        b = measured_step(eng, ids)
        res["mem"][name] = {**b, "host": eng["host"], "dp": eng["dp"], "stage": eng["stage"],
                            "stage_frac": eng.get("stage_frac", 1.0)}
        peak = rss_gb()
        del eng
        release()
        if a.verbose:
            print(f"[rank {rank}] {name}: RSS {peak:.2f} GiB after its step, {rss_gb():.2f} after release", flush=True)
        dist.barrier()
    if plan["time"]:
        # all timed engines are held at once and stepped in rounds (order rotated every round), so a
        # ratio compares steps taken seconds apart: the box is shared and its load drifts
        ids = torch.randint(0, 32000, (1, a.seq), generator=g)
        engs = {}
        for name in plan["time"]:
            engs[name] = build_engine(name, a, "fp32", world)
            b = measured_step(engs[name], ids)  # also the warm-up step
            res["fp32_mem"][name] = {**b, "host": engs[name]["host"], "dp": engs[name]["dp"],
                                     "stage": engs[name]["stage"], "stage_frac": engs[name].get("stage_frac", 1.0)}
        names = list(engs)
        res["time"] = {k: [] for k in names}
        for r in range(a.steps):
            for k in names[r % len(names):] + names[:r % len(names)]:
                res["time"][k] += timed_steps(engs[k], ids, 1)
        if a.verbose:
            print(f"[rank {rank}] timing pass: RSS {rss_gb():.2f} GiB", flush=True)
        del engs
        release()
    _write_all_ranks(res, world, rank, path)


# ---------------------------------------------------------------------------- activation pass (--activations)
# Bytes autograd saves for backward in one forward, per token per transformer block, for tensor
# parallelism with and without sequence parallelism, beside the formula of OUR block (see act_formula).

ACT_LAYOUTS = {2: [("tp1", 1, False), ("tp2", 2, False), ("tp2+sp", 2, True)],
               4: [("tp1", 1, False), ("tp2", 2, False), ("tp2+sp", 2, True), ("tp4", 4, False), ("tp4+sp", 4, True)]}
# context parallel (our DDP, model/ring_attention.py): each rank holds S / C tokens of every sequence; the
# bytes are divided by all B x S tokens of the batch, so per token per rank they should be 1 / C of tp1's
CP_LAYOUTS = {2: [("cp2", 2)], 4: [("cp2", 2), ("cp4", 4)]}


def act_model_config(a) -> ModelConfig:
    # GQA (8 query heads over 4 key/value heads) so that k/v terms differ from q's; hidden_dim 768 (multiple_of 256)
    return ModelConfig(vocab_size=4096, dim=a.act_dim, n_layers=a.act_layers, n_heads=8, n_kv_heads=4,
                       max_seq_len=a.act_seq)


def act_formula(cfg: ModelConfig, t: int, sp: bool) -> tuple[float, dict]:
    """Bytes per token per block that our block saves for backward, fp32, no dropout, SDPA (CPU flash kernel:
    no [B, heads, S, S] matrix, a logsumexp per head). h = dim, hk = n_kv_heads * head_dim, H = n_heads,
    f = hidden_dim, t = tensor-parallel size. Returns (total, {term: bytes}).
      norms      RMSNorm (_RMSNormFn) x 2: input x [h] and 1/rms [1]          -> replicated; / t with sp
      gathered   input of q/k/v and of gate/up (the normed x) [h] x 2         -> never / t: without sp the
                 input is replicated, with sp torch's PrepareModuleInput all-gathers it and the matmul
                 saves the gathered copy (Megatron saves the shard and all-gathers again in backward)
      attention  q after RoPE [h], k after RoPE [hk], v [hk], SDPA output [h] (= o_proj's input, same
                 storage), logsumexp [H]                                      -> / t (local heads)
      mlp        gate [f], up [f] (_SwiGLUFn), silu(gate)*up [f] (down_proj's input) -> / t
      (the fused q/k/v matmul at t = 1 adds nothing: v is copied out of its one output, so the pre-RoPE
                 q and k are not kept behind a view of it; model/llama.py Attention._qkv)
    Korthikanti et al. 2022 (fp16, bytes): sbh(34 + 5as/h), TP sbh(10 + 24/t + 5as/(ht)), TP+SP sbh/t(34 + 5as/h)."""
    h, H, f = cfg.dim, cfg.n_heads, cfg.hidden_dim
    hk = cfg.n_kv_heads * cfg.head_dim
    terms = {"norms": 4 * 2 * (h + 1) / (t if sp else 1), "gathered": 4 * 2 * h,
             "attention": 4 * (2 * h + 2 * hk + H) / t, "mlp": 4 * 3 * f / t}
    return sum(terms.values()), terms


def act_rest_formula(cfg: ModelConfig, t: int, sp: bool) -> float:
    """Bytes per token saved outside the blocks: the input ids (int64, the embedding's lookup), the final
    RMSNorm's input and 1/rms (/ t with sp), and the loss: t = 1, the chunked linear+CE computes d hidden
    in forward and saves it [h]; t > 1, the vocabulary-parallel loss saves the gathered normed hidden [h],
    the labels (int64) and a logsumexp per token. (Block 0 also holds RoPE's cos/sin, 4 * head_dim.)"""
    h = cfg.dim
    return 8 + 4 * (h + 1) / (t if sp else 1) + 4 * h + (8 + 4 if t > 1 else 0)


def korthikanti(cfg: ModelConfig, t: int, sp: bool, s: int) -> float:
    """Korthikanti et al. 2022, bytes per token per layer (fp16, dropout, attention matrix kept; a = heads):
    34h + 5as, TP 10h + 24h/t + 5as/t, TP+SP (34h + 5as)/t."""
    h, a = cfg.dim, cfg.n_heads
    if t == 1 or sp:
        return (34 * h + 5 * a * s) / t
    return 10 * h + 24 * h / t + 5 * a * s / t


def _plain(t):
    """The tensor whose storage is held: a DTensor's local shard, an AsyncCollectiveTensor's buffer."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
    while True:
        if isinstance(t, DTensor):
            t = t._local_tensor
        elif isinstance(t, AsyncCollectiveTensor):
            t = t.elem
        else:
            return t


def saved_bytes_by_region(module, forward) -> tuple[dict, list, torch.Tensor]:
    """Run `forward()` with a saved_tensors_hooks that sums the bytes of every tensor autograd saves,
    each storage once (a saved view counts its whole storage, which it keeps alive; identified by its
    StorageImpl, not by its data pointer: FSDP2 frees a gathered weight's storage with resize_(0) after each
    block, and the next block's activations are then allocated at that address),
    attributed to the region running when it was first saved: "pre" (embedding), "L<i>" (block i),
    "post" (final norm, LM head, loss). Returns ({region: bytes}, [(region, shape, dtype, bytes)], output)."""
    from model.llama import blocks_of
    region = ["pre"]
    handles = []
    for i, blk in enumerate(blocks_of(module.layers)):
        handles.append(blk.register_forward_pre_hook(lambda m, args, i=i: region.__setitem__(0, f"L{i}")))
        handles.append(blk.register_forward_hook(lambda m, args, out: region.__setitem__(0, "post")))
    seen: dict = {}
    by_region: dict = {}
    log: list = []

    def pack(x):
        p = _plain(x)
        try:
            st = p.untyped_storage()
            key, nb = st._cdata, st.nbytes()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without a storage of its own
            st, key, nb = p, ("id", id(p)), p.numel() * p.element_size()
        if key not in seen:
            seen[key] = st  # held until the end, so that no other storage gets its StorageImpl address
            by_region[region[0]] = by_region.get(region[0], 0) + nb
            log.append((region[0], tuple(p.shape), str(p.dtype).replace("torch.", ""), nb))
        return x

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = forward()
    finally:
        for hd in handles:
            hd.remove()
    return by_region, log, out


def _act_worker(rank: int, world: int, port: int, a, path: str) -> None:
    import dataclasses

    from parallel.build import build_engine
    from trainer.config import TrainConfig
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    res = {}
    layouts = [(name, tp, sp, 1) for name, tp, sp in ACT_LAYOUTS[world]] + [(n, 1, False, c) for n, c in CP_LAYOUTS[world]]
    for name, tp, sp, cp in layouts:
        torch.manual_seed(0)
        model = Transformer(act_model_config(a))
        cfg = dataclasses.replace(TrainConfig(), parallel="fsdp" if cp == 1 else "ddp", device="cpu", dtype="fp32",
                                  tensor_parallel_size=tp, sequence_parallel=sp, max_seq_len=a.act_seq,
                                  batch_size=a.act_batch, context_parallel_size=cp)
        eng = build_engine(model, cfg, device=torch.device("cpu"))
        fwd = eng.forward_model
        fused = model.cfg.fused_qkv and all(blk.self_attn.fused_qkv for blk in eng.module.layers)
        runs = {}
        # B and 2B sequences: the difference is what grows with the tokens (activations); what does not
        # (weights saved by the matmuls: FSDP's gathered parameters, the loss's weight gradient computed
        # in forward) cancels and is reported apart
        for b in (a.act_batch, 2 * a.act_batch):
            # the same batch on every rank; labels a tensor of their own, as in training
            ids = torch.randint(0, 4096, (b, a.act_seq + 1), generator=torch.Generator().manual_seed(b))
            x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
            eng.optimizer.zero_grad()
            by_region, log, loss = saved_bytes_by_region(eng.module, lambda: fwd(x, labels=y))
            eng.optimizer.scale_loss(loss).backward()
            if cp > 1:  # our DDP: the gradient reduction completes before the buffers are zeroed
                eng.model.finish_grad_sync()
            runs[b] = (by_region, log)
        eng.optimizer.zero_grad()
        res[name] = {"tp": tp, "sp": sp, "fused_qkv": fused, "runs": {str(b): r for b, r in runs.items()}}
        eng = model = fwd = None
        release()
    _write_all_ranks(res, world, rank, path)


def run_activations(a) -> None:
    cfg = act_model_config(a)
    B, S, L = a.act_batch, a.act_seq, cfg.n_layers
    hk = cfg.n_kv_heads * cfg.head_dim
    print(f"\nactivation bytes saved for backward, one forward (fp32, no dropout, SDPA): dim h={cfg.dim}, {L} layers, "
          f"n_heads H={cfg.n_heads}, n_kv_heads {cfg.n_kv_heads} (hk={hk}), head_dim {cfg.head_dim}, hidden_dim "
          f"f={cfg.hidden_dim}, vocab {cfg.vocab_size}; measured at {B} and {2 * B} sequences of S={S} tokens, "
          f"per token = (bytes at {2 * B} - bytes at {B}) / ({B} x {S}); engine: parallel.build.build_engine "
          f"(FSDP2 + DTensor TP), gloo, 1 thread/rank")
    tp1_meas = tp1_form = tp1_k22 = 1.0
    for world in a.act_worlds:
        tw = time.time()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        path = os.path.join("/tmp", f"bench_parallel_memory_act_{os.getpid()}_{world}.json")
        mp.start_processes(_act_worker, args=(world, port, a, path), nprocs=world, start_method="spawn")
        with open(path) as f:
            ranks = json.load(f)
        os.remove(path)
        print(f"\n=== activations, world {world} ({time.time() - tw:.0f} s) ===")
        print(f"{'layout':8s} {'B/tok/layer':>11s} {'formula':>9s} {'meas/form':>9s} {'vs tp1':>7s} {'formula':>7s} "
              f"{'K22 fp16':>8s} {'K22':>6s} {'L0-L':>5s} {'rest B/tok':>10s} {'formula':>8s} {'ranks':>5s}")
        ss = []
        for name, tp, sp in ACT_LAYOUTS[world]:
            per_rank = []
            for r in range(world):
                m = ranks[r][name]
                lo, hi = m["runs"][str(B)][0], m["runs"][str(2 * B)][0]
                act = {k: hi.get(k, 0) - lo.get(k, 0) for k in set(lo) | set(hi)}
                blocks = [act.get(f"L{i}", 0) / (B * S) for i in range(L)]
                rest = (act.get("pre", 0) + act.get("post", 0)) / (B * S)
                per_rank.append((blocks, rest))
                ss += [(name, r, shape) for _, shape, _, _ in m["runs"][str(B)][1] if len(shape) == 4 and list(shape[-2:]) == [S, S]]
            blocks, rest = per_rank[0]
            layer = blocks[-1]  # block 0 also holds RoPE's cos/sin, shared by all blocks (first saved there)
            form, _ = act_formula(cfg, tp, sp)
            k22 = korthikanti(cfg, tp, sp, S)
            if name == "tp1":
                tp1_meas, tp1_form, tp1_k22 = layer, form, k22
            same = all(p == per_rank[0] for p in per_rank[1:])
            print(f"{name:8s} {layer:11.1f} {form:9.1f} {layer / form:9.4f} {layer / tp1_meas:7.3f} {form / tp1_form:7.3f} "
                  f"{k22:8.0f} {k22 / tp1_k22:6.3f} {blocks[0] - layer:5.0f} {rest:10.1f} "
                  f"{act_rest_formula(cfg, tp, sp):8.1f} {'same' if same else 'DIFF':>5s}")
        print(f"columns: measured bytes/token/layer on rank 0 (the last block) | our formula (act_formula) | measured / "
              f"formula | measured vs tp1 | formula vs tp1 | Korthikanti et al. 2022 for these shapes (fp16, dropout, "
              f"attention matrix, a={cfg.n_heads}, s={S}) and its ratio vs t=1 | block 0 minus the last block (RoPE "
              f"cos/sin: 4 x head_dim = {4 * cfg.head_dim}) | bytes/token outside the blocks, measured and "
              f"act_rest_formula | all ranks measured the same")
        print(f"SDPA on CPU saved a [.., S, S] tensor: {'yes ' + str(ss[:3]) if ss else 'no'} (it saves q, k, v, "
              f"its output and a logsumexp [B, heads, S]: the CPU flash kernel)")
        for name, cp in CP_LAYOUTS[world]:
            m = ranks[0][name]
            lo, hi = m["runs"][str(B)][0], m["runs"][str(2 * B)][0]
            act = {k: hi.get(k, 0) - lo.get(k, 0) for k in set(lo) | set(hi)}
            layer = act.get(f"L{L - 1}", 0) / (B * S)
            rest = (act.get("pre", 0) + act.get("post", 0)) / (B * S)
            same = all(ranks[r][name]["runs"][str(2 * B)][0].get(f"L{L - 1}") == hi.get(f"L{L - 1}")
                       for r in range(world))
            print(f"{name:8s} {layer:11.1f} {act_formula(cfg, 1, False)[0] / cp:9.1f} "
                  f"{layer / (act_formula(cfg, 1, False)[0] / cp):9.4f} {layer / tp1_meas:7.3f} {1 / cp:7.3f}   "
                  f"x C = {layer * cp:.1f} B/tok/layer, {layer * cp / tp1_meas:.4f} of tp1; rest {rest:.1f} "
                  f"({rest * cp:.1f} x C) {'same' if same else 'DIFF':>5s}")
        print(f"cp rows: context parallel C over our DDP (ring attention), bytes per token of the whole B x S batch "
              f"on rank 0 (each rank holds S / C of every sequence); formula = act_formula(t=1) / C")
        print("formula terms, bytes/token/layer (act_formula):")
        for name, tp, sp in ACT_LAYOUTS[world]:
            _, terms = act_formula(cfg, tp, sp)
            print(f"  {name:8s} " + ", ".join(f"{k} {v:.1f}" for k, v in terms.items()))
        if a.verbose:
            for name, _, _ in ACT_LAYOUTS[world]:
                print(f"\n[{name}] rank 0, saved tensors at {B} sequences (region, local shape, dtype, storage bytes):")
                for reg, shape, dt, nb in ranks[0][name]["runs"][str(B)][1]:
                    print(f"  {reg:5s} {str(shape):24s} {dt:8s} {nb:10d}")


# ---------------------------------------------------------------------------- driver + tables

def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fits_bytes(name: str, prec: str, world: int, n: int) -> float:
    """Rough box-wide estimate: formula bytes + one fp32 copy of the full model per rank (construction)."""
    dp = max(1, world // 2) if name in ("pp2", "tp2") else world
    per_rank = formula(name, prec, dp, 0.5)[1] * n + 4 * n
    return world * per_rank * 1.15


def fits(name: str, prec: str, world: int, n: int, budget: float) -> bool:
    return fits_bytes(name, prec, world, n) < budget


def print_mem_table(title: str, ranks: list, key: str, prec: str, n: int, world: int) -> None:
    print(f"\n{title}")
    print(f"{'engine':14s} {'rank':>4s} {'params MB':>10s} {'grads MB':>9s} {'optim MB':>9s} {'total bytes':>13s} {'where':>14s} "
          f"{'B/param':>8s} {'formula':>18s} {'B/param':>8s} {'ratio':>7s}")
    names = [e for e in ENGINES if e in ranks[0][key]]
    for name in names:
        rows = [(r, ranks[r][key][name]) for r in range(world)]
        if name == "pp2":  # one row per stage (dp rank 0 of each stage)
            stages: dict = {}
            for r, m in rows:
                stages.setdefault(m["stage"], (r, m))
            show = [stages[s] for s in sorted(stages)]
        else:  # the rank holding the most (ranks differ by padding only)
            show = [max(rows, key=lambda x: x[1]["params"] + x[1]["grads"] + x[1]["optimizer"])]
        for r, m in show:
            tot = m["params"] + m["grads"] + m["optimizer"]
            ftxt, fb = formula(name, prec, m["dp"], m["stage_frac"])
            where = "host/offloaded" if m["host"] else "device"
            label = name if m["stage"] is None else f"pp2 stage{m['stage']}"
            print(f"{label:14s} {r:4d} {m['params'] / 1e6:10.1f} {m['grads'] / 1e6:9.1f} {m['optimizer'] / 1e6:9.1f} "
                  f"{tot:13d} {where:>14s} {tot / n:8.3f} {ftxt:>18s} {fb:8.3f} {tot / n / fb:7.4f}")
            if m["host"]:
                print(f"{'':14s} {'':4s} {'':>10s} {'':>9s} {'':>9s} {0:13d} {'device':>14s} {0.0:8.3f} "
                      f"{'0 (persistent)':>18s}")


def spawn_world(world: int, a, plan: dict) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = os.path.join("/tmp", f"bench_parallel_memory_{os.getpid()}_{world}.json")
    mp.start_processes(_worker, args=(world, port, a, plan, path), nprocs=world, start_method="spawn")
    with open(path) as f:
        ranks = json.load(f)
    os.remove(path)
    return ranks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="~37M params (dim 384, 6 layers): under a minute")
    ap.add_argument("--moe-experts", type=int, default=0, help="an MoE model: routed experts per block (0 = dense)")
    ap.add_argument("--moe-top-k", type=int, default=2)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--time-worlds", type=int, nargs="*", default=None,
                    help="worlds with the fp32 timing pass (default: 2 and 4 with --small, 2 otherwise)")
    ap.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES, help="engines of the memory table")
    ap.add_argument("--time-engines", nargs="+", default=None, choices=ENGINES,
                    help="engines of the timing pass, held in memory at once (default: all with --small, "
                         "ddp fsdp otherwise)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence of the timed steps (64; --small 128)")
    ap.add_argument("--mem-seq", type=int, default=8, help="tokens of the memory step")
    ap.add_argument("--mem-precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--verbose", action="store_true", help="print each rank's RSS after each engine")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per engine after 1 warm-up")
    ap.add_argument("--activations", action="store_true",
                    help="run only the activation pass: bytes saved for backward per token per layer, tp1 / tp / tp+sp")
    ap.add_argument("--act-worlds", type=int, nargs="+", default=[2, 4], choices=sorted(ACT_LAYOUTS),
                    help="worlds of the activation pass (2: tp1 tp2 tp2+sp; 4: also tp4 tp4+sp)")
    ap.add_argument("--act-dim", type=int, default=256)
    ap.add_argument("--act-layers", type=int, default=3)
    ap.add_argument("--act-seq", type=int, default=256)
    ap.add_argument("--act-batch", type=int, default=2, help="B: measured at B and 2B sequences")
    a = ap.parse_args()
    if a.activations:
        t0 = time.time()
        run_activations(a)
        print(f"\ntotal {time.time() - t0:.0f} s")
        return
    if a.seq is None:
        a.seq = 128 if a.small else 64
    if a.time_engines is None:
        a.time_engines = list(ENGINES) if a.small else ["ddp", "fsdp"]
    if "ddp" not in a.time_engines:
        a.time_engines.insert(0, "ddp")
    a.time_engines = ["ddp"] + [e for e in a.time_engines if e != "ddp"]
    if a.time_worlds is None:
        a.time_worlds = [2, 4] if a.small else [2]
    n = sum(p.numel() for p in Transformer(model_config(a)).parameters())
    cfg = model_config(a)
    print(f"model: dim {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}, hidden {cfg.hidden_dim}: "
          f"N = {n / 1e6:.1f}M params; memory step {a.mem_precision}, {a.mem_seq} tokens/rank; "
          f"timing fp32, batch 1 x {a.seq} per dp rank, {a.steps} steps after 1 warm-up; gloo on CPU, 1 thread/rank")
    t0 = time.time()
    # a fixed mmap threshold: glibc's adaptive one grows after the first large free, after which the
    # model's 1-12 MB tensors land on the heap and a dropped engine's memory is never returned
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    for world in a.worlds:
        budget = 0.8 * mem_available()
        mem_plan = [e for e in a.engines if fits(e, a.mem_precision, world, n, budget)]
        time_plan = []
        if world in a.time_worlds:  # held at once: drop engines (not ddp, fsdp) until the sum fits
            time_plan = [e for e in a.time_engines]
            while len(time_plan) > 2 and sum(fits_bytes(e, "fp32", world, n) for e in time_plan) > budget:
                time_plan.pop()
        dropped = [e for e in a.time_engines if e not in time_plan] if world in a.time_worlds else []
        if dropped:
            print(f"\n[world {world}] not timed (all timed engines are held at once; RAM): {dropped}")
        skipped = sorted(set(a.engines) - set(mem_plan))
        if skipped:
            print(f"\n[world {world}] skipped (estimated RAM above 80% of MemAvailable "
                  f"{budget / 0.8 / 2**30:.1f} GiB): {skipped}")
        tw = time.time()
        # one spawn per engine of the memory pass (an engine dropped inside a process does not give all
        # its memory back, and the default model leaves no room for that), one for the timing pass
        ranks = [{"mem": {}, "time": {}, "fp32_mem": {}} for _ in range(world)]
        for plan in [{"mem": [e], "time": []} for e in mem_plan] + ([{"mem": [], "time": time_plan}] if time_plan else []):
            for r, part in enumerate(spawn_world(world, a, plan)):
                for k in ranks[r]:
                    ranks[r][k].update(part[k])
        print(f"\n=== world {world} ({time.time() - tw:.0f} s) ===")
        if mem_plan:
            print_mem_table(f"memory per rank, {a.mem_precision} params"
                            + (" + fp32 grads + fp32 masters/m/v (FSDP: fp32 sharded params, bf16 compute)"
                               if a.mem_precision == "bf16" else " (all fp32)")
                            + "; B/param = rank bytes / N (whole model)", ranks, "mem", a.mem_precision, n, world)
        if time_plan:
            print_mem_table("memory per rank, fp32 pass (the timed engines)", ranks, "fp32_mem", "fp32", n, world)
            times = {k: [max(ranks[r]["time"][k][i] for r in range(world)) for i in range(a.steps)]
                     for k in ranks[0]["time"]}
            print(f"\nstep time, fp32, world {world}: median of {a.steps} rounds (each engine once per round, "
                  f"order rotated; a step's time = the slowest rank's); vs ddp = median over rounds of engine / ddp")
            print(f"{'engine':14s} {'step s':>8s} {'vs ddp':>7s} {'min':>6s} {'max':>6s}")
            for k, v in times.items():
                rat = [x / y for x, y in zip(v, times["ddp"])]
                print(f"{k:14s} {statistics.median(v):8.3f} {statistics.median(rat):7.3f} {min(rat):6.3f} {max(rat):6.3f}")
    print(f"\ntotal {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
