"""torchtitan as a peer row of bench/bench_model_gpu.py: its Llama3 model at our shapes, on our weights, run with
the recipe its trainer (torchtitan 0.3.0, `torchtitan/trainer.py`) applies on one GPU.

Owns: building torchtitan's `Llama3Model` at one of our ModelConfigs (every shape equal, the parameter count equal),
loading our seed-0 Transformer's weights into it, and one training step as its trainer runs it. Must never be
imported by the library (bench only) and never import torchtitan at module import: a machine without torchtitan
still runs every other row (`titan_unavailable()` says why the row cannot run).

Why not its `Trainer` itself: `torchtitan.trainer` imports its dataloader (torchdata, datasets<4.8: we pin 5.2.0),
tokenizer and checkpointer, which `requirements-peers.txt` leaves out (installed with --no-deps). The row is its
model module with the trainer's own functions, called in the trainer's order (`Trainer.__init__`, `train_step`,
`_forward_backward_body`, `post_dataloading_process`):

- model: `Llama3Model.Config` built like its registry's flavours (`model_registry` / `_debugmodel`): fused `wqkv`,
  `ComplexRoPE` (no scaling, our rope_theta, the cache sized to the sequence as `update_from_config` sizes it),
  RMSNorm eps = ours, SwiGLU hidden dim = ours (its `compute_ffn_hidden_dim` takes the final width), untied
  embeddings; attention = its language-model default, FlexAttention (`attn_backend="flex"`: its SDPA backend is
  refused for language models in 0.3.0) with the block-causal mask the trainer builds every step from the batch's
  positions (`Decoder.get_attention_masks`; one document per row here, so the mask is causal).
  Weights: our `to_hf_state_dict`, then its own `Llama3StateDictAdapter.from_hf` (which undoes HF's q/k
  permutation for its complex RoPE), then `load_state_dict` (its fused-qkv load hook merges wq/wk/wv).
- parallelism and precision: `parallelize_llama` with a one-rank `ParallelDims` (its default `spmd_types` backend),
  which always applies FSDP2 (`apply_fsdp_to_decoder`, size-1 mesh) for its MixedPrecisionPolicy: fp32 parameters,
  bf16 compute copies, fp32 gradient reduction (`TrainingConfig` defaults). A process group of one rank is started
  for it (nccl on CUDA, gloo on the CPU).
- compile (mode compile): its `CompileConfig(enable=True)` with the default components `["model", "loss"]`: each
  TransformerBlock compiled alone (`apply_compile`, fullgraph) and the loss function compiled; eager mode leaves
  FlexAttention compiled anyway (it always runs `torch.compile(flex_attention)`, with max-autotune and coordinate
  descent on a GPU).
- loss: `ChunkedLossWrapper` (8 chunks) over `CrossEntropyLoss`, as every Llama3 recipe of its registry: the model
  stops before `lm_head`, the loss runs lm_head + CE chunk by chunk with a backward per chunk; the sum over tokens
  divided by the global count of target tokens.
- optimizer: `default_adamw` (torch AdamW, implementation "fused", betas (0.9, 0.95), eps 1e-8, weight decay 0.1) at
  the bench's learning rate; `clip_grad_norm_` at its `max_norm` default 1.0 (foreach) before the step.
- CUDA graphs: its trainer captures forward+backward in a CUDA graph by default (`wrap_with_cuda_graph`, not
  `--training.disable_cuda_graphs`); the row does too (on the CPU its wrapper runs eagerly, as the trainer's does).

What differs from its trainer: no dataloader, tokenizer, checkpointer, metrics or logging (the bench's fixed batch,
as every row); its learning-rate scheduler (a LambdaLR warm-up) is not stepped (the bench's constant rate);
activation checkpointing off (its Llama3 recipes use selective AC; no other row recomputes, and AC trades speed
for memory); its seeded `set_determinism` and garbage-collection control not applied (no row does either).
"""
from __future__ import annotations

import os
import tempfile


def titan_unavailable() -> str | None:
    """None when torchtitan's modules the row needs import; else one line saying why not."""
    try:
        import torchtitan.components.loss  # noqa: F401
        import torchtitan.components.optimizer  # noqa: F401
        import torchtitan.distributed.cudagraph  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure makes the row say so, not fail the bench
        return f"torchtitan not installed ({type(e).__name__}: {e}); pip install --no-deps -r requirements-peers.txt"
    return None


def attention_for(device) -> str:
    """Its language-model attention, FlexAttention, where it trains; its causal SDPA module on the CPU, where
    FlexAttention has no backward (torch raises) and one causal document per row computes the same attention."""
    import torch
    return "flex" if torch.device(device).type == "cuda" else "sdpa"


def titan_config(cfg, seq_len: int, attention: str = "flex"):
    """torchtitan's Llama3Model.Config with every shape of our ModelConfig `cfg` (built as its registry builds
    its flavours, with our widths instead of its formula); attention "flex" (its default) or "sdpa"."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock
    if cfg.tie_embeddings or cfg.rope_scaling or cfg.moe_num_experts:
        raise ValueError("titan_peer: tied embeddings, RoPE scaling and MoE are not mapped")
    no_init: dict = {}  # weights come from ours
    inner = ScaledDotProductAttention.Config() if attention == "sdpa" else get_attention_config(attention)
    dim, hd = cfg.dim, cfg.dim // cfg.n_heads
    rope = ComplexRoPE.Config(dim=hd, max_seq_len=seq_len, theta=float(cfg.rope_theta), scaling="none")
    layers = [Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=dim, eps=cfg.norm_eps),
        ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=cfg.norm_eps),
        attention=make_gqa_config(dim=dim, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, wqkv_param_init=no_init,
                                  wo_param_init=no_init, inner_attention=inner,
                                  fuse_qkv=True, rope=rope),
        feed_forward=make_ffn_config(dim=dim, hidden_dim=cfg.hidden_dim, w1_param_init=no_init,
                                     w2w3_param_init=no_init))
        for _ in range(cfg.n_layers)]
    return Llama3Model.Config(
        dim=dim, vocab_size=cfg.vocab_size,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, eps=cfg.norm_eps),
        lm_head=Linear.Config(in_features=dim, out_features=cfg.vocab_size),
        layers=layers)


def build_titan(ours, seq_len: int, device, attention: str = "flex"):
    """torchtitan's Llama3Model with the weights of our Transformer `ours`, fp32, on `device`, not parallelized."""
    import torch
    from model.hf_interop import to_hf_state_dict
    from torchtitan.models.llama3 import Llama3StateDictAdapter
    mcfg = titan_config(ours.cfg, seq_len, attention)
    with torch.device(device):
        model = mcfg.build()
    sd = Llama3StateDictAdapter(mcfg, None).from_hf({k: v.detach().clone() for k, v in to_hf_state_dict(ours).items()})
    model.load_state_dict(sd, strict=True)
    return model


def positions_for(x):
    """The positions its dataloader emits for a batch of one document per row: 0..T-1 on every row."""
    import torch
    return torch.arange(x.shape[1], device=x.device).expand_as(x).contiguous()


def start_one_rank_group(device) -> bool:
    """A process group of one rank for its FSDP2 (nccl on CUDA, gloo elsewhere); True when this call started it."""
    import torch
    import torch.distributed as dist
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("titan_peer: a process group of more than one rank is already running")
        return False
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="titan_pg_"), "store"), 1)
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)  # its Trainer sets the device before the process group
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1,
                            device_id=device if device.type == "cuda" else None)
    return True


def make_titan_step(ours, x, y, mode: str, device, lr: float):
    """(step() -> loss tensor, model) for the titan row: its model on our weights, its trainer's recipe (see the
    module docstring). `ours` is our fp32 Transformer (freed by the caller after this returns); x, y the batch
    (y[t] = x[t+1], -100 ignored)."""
    import torch
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import parallel_dims as parallel_dims_module
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.cudagraph import wrap_with_cuda_graph
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models.llama3 import parallelize_llama
    if mode not in ("eager", "compile"):
        raise ValueError(f"titan row: mode {mode!r} is not its recipe (eager or compile)")
    attention = attention_for(device)
    model = build_titan(ours, x.shape[1], device, attention)
    start_one_rank_group(device)
    torch.autograd.set_multithreading_enabled(False)  # its init_distributed does (spmd_types + AC)
    parallelism, training = ParallelismConfig(), TrainingConfig(local_batch_size=x.shape[0], seq_len=x.shape[1])
    compile_config = CompileConfig(enable=mode == "compile")
    # its meshes are built on the accelerator it found at import ("cuda" when none): the row's device type here
    parallel_dims_module.device_type = torch.device(device).type
    parallel_dims = ParallelDims.from_config(parallelism, 1)
    parallel_dims.build_mesh()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    model = parallelize_llama(model, parallel_dims=parallel_dims, training=training, parallelism=parallelism,
                              compile_config=compile_config, ac_config=None,
                              dump_folder=tempfile.mkdtemp(prefix="titan_dump_"))
    model.train()
    loss_fn = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=ours.cfg.vocab_size)
                                        ).build(compile_config=compile_config)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = default_adamw(lr=lr).build(model_parts=[model])
    train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    positions = positions_for(x)

    def fwd_bwd(inputs, labels, gvt, extra_kwargs):  # Trainer._forward_backward_body
        with train_context():
            pred = model(inputs, **extra_kwargs)
            loss, _ = loss_fn(pred, labels, gvt, positions=extra_kwargs["positions"])
            del pred
            loss.backward()
        return loss

    fwd_bwd_fn = wrap_with_cuda_graph(fwd_bwd) if torch.device(device).type == "cuda" else fwd_bwd
    params = [p for p in model.parameters()]

    def step() -> torch.Tensor:  # Trainer.train_step, one micro-batch
        optimizers.zero_grad(set_to_none=False)  # its trainer: set_to_none only with CUDA graphs disabled
        global_valid_tokens = (y != -100).sum()
        extra = {"positions": positions}  # its post_dataloading_process: a mask for the masked backends
        if attention == "flex":
            extra["attention_masks"] = model.get_attention_masks(positions=positions)
        inputs, labels, extra = annotate_input_spmd_types(parallel_dims, x, y, extra)
        loss = fwd_bwd_fn(inputs, labels, global_valid_tokens, extra)
        dist_utils.clip_grad_norm_(params, training.max_norm, foreach=True)
        optimizers.step()
        return loss.detach().clone()  # graph-owned under CUDA graphs: the next replay overwrites it
    return step, model
