"""torchtitan as a peer row of bench/bench_model_gpu.py: its Llama 3 model at our shapes, on our weights, run with
the recipe its trainer (torchtitan 0.2.2, `torchtitan/train.py`) applies on one GPU.

Why 0.2.2 and not 0.3.0: the GPU machines run torch 2.11, and torchtitan 0.3.0 does not import there (its FSDP module
imports `torch.distributed.fsdp.DataParallelMeshDims`, which torch 2.11 lacks); 0.2.2 is the newest release that
does, and it runs on this repository's CPU torch (2.13) too, so the tests here check the code the GPU runs.

Owns: building torchtitan's `Transformer` at one of our ModelConfigs (every shape equal, the parameter count equal),
loading our seed-0 Transformer's weights into it, and one training step as its trainer runs it. Must never be
imported by the library (bench only) and never import torchtitan at module import: a machine without torchtitan
still runs every other row (`titan_unavailable()` says why the row cannot run).

Why not its `Trainer` itself: it builds its tokenizer, HF dataloader and checkpointer from a job's files, which the
bench has none of. The row is its model module with the trainer's own functions, called in the trainer's order
(`Trainer.__init__`, `train_step`, `forward_backward_step`) with its `JobConfig` defaults:

- model: `TransformerModelArgs` as its `llama3_args` flavours build it, with our widths: separate wq/wk/wv, complex
  RoPE at our rope_theta with its Llama 3.1 scaling switched off (scaling_factor 1: every frequency unchanged),
  RMSNorm eps = ours, SwiGLU hidden dim = ours (its multiple_of rounding set to land on our width), untied
  embeddings, `max_seq_len` = the batch's sequence (`update_from_config`); attention = its Llama 3 default, SDPA
  with `is_causal` (its `sdpa` attn_type; one document per row). Weights: our `to_hf_state_dict`, then its own
  `Llama3StateDictAdapter.from_hf` (which undoes HF's q/k permutation for its complex RoPE), then `load_state_dict`.
- parallelism and precision: `parallelize_llama` with a one-rank `ParallelDims` (its defaults: dp_shard -1 -> 1),
  which on one GPU applies no FSDP; its trainer then trains the fp32 parameters under `torch.autocast` in bf16
  (`maybe_enable_amp`: mixed_precision_param bfloat16, training dtype float32). No process group is needed.
- compile (mode compile): its `compile.enable` with the default components ["model", "loss"]: each TransformerBlock
  compiled alone (`apply_compile`, fullgraph) and the loss function compiled (`build_cross_entropy_loss`).
- loss: its `cross_entropy_loss` (full logits, fp32, sum over tokens) divided by the count of target tokens.
- optimizer: `build_optimizers` with its default optimizer config (torch AdamW, implementation "fused", betas
  (0.9, 0.95), eps 1e-8, weight decay 0.1) at the bench's learning rate; `clip_grad_norm_` at its `max_norm`
  default 1.0 (foreach) before the step.

What differs from its trainer: no dataloader, tokenizer, checkpointer, metrics or logging (the bench's fixed batch,
as every row); its learning-rate scheduler (a LambdaLR warm-up) is not stepped (the bench's constant rate);
activation checkpointing off (its default is selective AC; no other row recomputes, and AC trades speed for memory);
its seeded `set_determinism` and garbage-collection control not applied (no row does either).

Its `torchtitan.models.llama3` package imports its Hugging Face dataset loader at import (`from datasets import
Dataset, load_dataset`). Where `datasets` is not installed (the GPU image), `titan_unavailable` puts a stand-in
module in its place whose functions raise if called: the row never loads a data set.
"""
from __future__ import annotations

import sys
import types


def _datasets_stand_in() -> None:
    """A `datasets` module with the names torchtitan 0.2's dataset loader imports, each raising if called; only
    where the real package is not installed (the row loads no data set)."""
    try:
        import datasets  # noqa: F401  (torchtitan imports it anyway)
        return
    except ImportError:
        pass

    def unavailable(*_a, **_k):
        raise RuntimeError("bench/titan_peer.py: `datasets` is not installed; the torchtitan row loads no data set")

    mod = types.ModuleType("datasets")
    mod.__doc__ = "stand-in (bench/titan_peer.py): the real `datasets` is not installed"
    mod.Dataset = type("Dataset", (), {"__init__": unavailable})
    mod.load_dataset = unavailable
    dist = types.ModuleType("datasets.distributed")
    dist.split_dataset_by_node = unavailable
    mod.distributed = dist
    sys.modules["datasets"], sys.modules["datasets.distributed"] = mod, dist


def titan_unavailable() -> str | None:
    """None when torchtitan's modules the row needs import; else one line saying why not."""
    try:
        _datasets_stand_in()
        import torchtitan.components.loss  # noqa: F401
        import torchtitan.components.optimizer  # noqa: F401
        import torchtitan.distributed.utils  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure makes the row say so, not fail the bench
        return f"torchtitan not installed ({type(e).__name__}: {e}); pip install --no-deps -r requirements-peers.txt"
    return None


def titan_args(cfg, seq_len: int):
    """torchtitan's TransformerModelArgs with every shape of our ModelConfig `cfg`."""
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    if cfg.tie_embeddings or cfg.rope_scaling or cfg.moe_num_experts:
        raise ValueError("titan_peer: tied embeddings, RoPE scaling and MoE are not mapped")
    # its FeedForward: hidden = multiple_of * ceil(int(mult * int(2 * 4 * dim / 3)) / multiple_of); with multiple_of
    # = our width and the product in (0, our width], that is our width
    base = int(2 * 4 * cfg.dim / 3)
    mult = None if 0 < base <= cfg.hidden_dim else cfg.hidden_dim / base
    return TransformerModelArgs(
        dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        vocab_size=cfg.vocab_size, multiple_of=cfg.hidden_dim, ffn_dim_multiplier=mult, norm_eps=cfg.norm_eps,
        rope_theta=float(cfg.rope_theta), rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),
        max_seq_len=seq_len, attn_type="sdpa", attn_mask_type="causal")


def build_titan(ours, seq_len: int, device):
    """torchtitan's Transformer with the weights of our Transformer `ours`, fp32, on `device`, not parallelized."""
    import torch
    from model.hf_interop import to_hf_state_dict
    from torchtitan.models.llama3 import Llama3StateDictAdapter, Transformer
    args = titan_args(ours.cfg, seq_len)
    with torch.device(device):
        model = Transformer(args)
    width = model.layers["0"].feed_forward.w1.out_features
    if width != ours.cfg.hidden_dim:
        raise ValueError(f"titan_peer: its SwiGLU width {width} is not ours ({ours.cfg.hidden_dim})")
    sd = Llama3StateDictAdapter(args, None).from_hf({k: v.detach().clone() for k, v in to_hf_state_dict(ours).items()})
    model.load_state_dict(sd, strict=True)
    return model


def job_config(batch: int, seq_len: int, mode: str, lr: float):
    """Its JobConfig defaults with the row's batch, sequence, compile mode and learning rate; AC off."""
    from torchtitan.config import JobConfig
    job = JobConfig()
    job.training.local_batch_size, job.training.seq_len = batch, seq_len
    job.compile.enable = mode == "compile"
    job.activation_checkpoint.mode = "none"
    job.optimizer.lr = lr
    return job


def make_titan_step(ours, x, y, mode: str, device, lr: float):
    """(step() -> loss tensor, model) for the titan row: its model on our weights, its trainer's recipe (see the
    module docstring). `ours` is our fp32 Transformer (freed by the caller after this returns); x, y the batch
    (y[t] = x[t+1], -100 ignored)."""
    import torch
    from torchtitan.components.loss import IGNORE_INDEX, build_cross_entropy_loss
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.llama3 import parallelize_llama
    if mode not in ("eager", "compile"):
        raise ValueError(f"titan row: mode {mode!r} is not its recipe (eager or compile)")
    job = job_config(x.shape[0], x.shape[1], mode, lr)
    model = build_titan(ours, x.shape[1], device)
    p = job.parallelism
    parallel_dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                                 cp=p.context_parallel_degree, tp=p.tensor_parallel_degree,
                                 pp=p.pipeline_parallel_degree, ep=p.expert_parallel_degree,
                                 etp=p.expert_tensor_parallel_degree, world_size=1)
    model = parallelize_llama(model, parallel_dims, job)
    model.train()
    loss_fn = build_cross_entropy_loss(job)
    optimizers = build_optimizers([model], job.optimizer, parallel_dims)
    amp = dist_utils.maybe_enable_amp(parallel_dims, job.training.mixed_precision_param, torch.device(device).type)
    params = [q for q in model.parameters()]

    def step() -> torch.Tensor:  # Trainer.train_step with one micro-batch, forward_backward_step without PP
        optimizers.zero_grad()
        global_valid_tokens = (y != IGNORE_INDEX).sum().float()
        with amp:
            pred = model(x)
            loss = loss_fn(pred, y) / global_valid_tokens
        del pred
        loss.backward()
        dist_utils.clip_grad_norm_(params, job.training.max_norm, foreach=True)
        optimizers.step()
        return loss.detach()
    return step, model
