"""Tensor parallelism (Megatron-LM's layout) on torch's own DTensor: `apply_tensor_parallel(model, tp_mesh)`.

Per block: q/k/v and gate/up are column-parallel (each rank computes n_heads/tp query heads,
n_kv_heads/tp key/value heads - contiguous, so GQA's grouping stays on the rank - and hidden_dim/tp of
the MLP), o and down are row-parallel (partial sums all-reduced over the tensor group). RoPE, attention
and SwiGLU run on the local heads / columns with the usual kernels (model/kernels.py: the fused CPU
and Triton RMSNorm, RoPE and SwiGLU see plain local tensors). The embedding is vocabulary-parallel
(rows of the table per rank, torch's masked lookup + all-reduce), the LM head is sharded on the
vocabulary, and its loss (model/vocab_parallel_loss.py) all-reduces the softmax's max and sum over
the tensor group instead of gathering logits; without labels (evaluation of logits, generation) the
logits are all-gathered. The norms and the residual stream are replicated on the tensor ranks. Multi-token
prediction's depths (model/mtp.py) are split the same way: their blocks as blocks, their projection and norms
replicated (partial gradients under sequence parallelism), their final norm's output gathered like the model's.

Built on `torch.distributed.tensor.parallel.parallelize_module` (ColwiseParallel / RowwiseParallel):
the collectives are torch's (NCCL on CUDA, gloo on CPU). FSDP2 then shards the result over the
data-parallel mesh (parallel/fsdp.py), which gives 2-D parameters (dp x tp) that DCP checkpoints
reshard to any other layout.

Owns: the plan, and what a model must satisfy to be split (`tensor_parallel_problems`).
Must never: change parameter names (checkpoints, HF export and LoRA names stay the model's).
"""
from __future__ import annotations

from typing import Any

from torch import nn

from model.llama import blocks_of
from model.lora import LoRALinear


def tensor_parallel_problems(model_cfg: Any, tp: int, sequence_parallel: bool = False) -> list[str]:
    """What stops `model_cfg` from being split over `tp` ranks (none when tp == 1).

    Dropout: the ranks of a tensor group start from the same seed and draw the same number of random
    numbers, so the residual dropout on the replicated hidden state draws the same mask on every rank
    (as it must; attention dropout on each rank's heads draws the same pattern per head slot). Under
    sequence parallelism each rank's residual dropout covers other positions, where one shared stream
    would repeat one mask along the sequence: refused."""
    if tp <= 1:
        return []
    out = []
    if model_cfg.n_heads % tp:
        out.append(f"n_heads={model_cfg.n_heads} is not divisible by tensor_parallel_size={tp}")
    n_kv = model_cfg.n_kv_heads or model_cfg.n_heads
    if n_kv % tp:
        out.append(f"n_kv_heads={n_kv} is not divisible by tensor_parallel_size={tp} (each rank needs whole "
                   "key/value heads for its query heads)")
    hidden = model_cfg.hidden_dim
    if hidden is not None and hidden % tp:
        out.append(f"the MLP's hidden_dim={hidden} is not divisible by tensor_parallel_size={tp}")
    if getattr(model_cfg, "qk_norm_full", False):
        out.append("the q / k norms run over all the heads' width (OLMo 2's qk_norm_full): each tensor rank holds some "
                   "heads only")
    if sequence_parallel and (model_cfg.attn_dropout > 0 or model_cfg.resid_dropout > 0):
        out.append("dropout > 0 is not supported with sequence parallelism yet (each rank's positions would need "
                   "their own random stream); set --dropout=0 or --sequence_parallel=false")
    return out


def _sequence_length_check(tp: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        ids = args[0] if args else kwargs.get("input_ids")
        if ids is not None and ids.shape[1] % tp:
            raise ValueError(f"sequence parallelism splits every batch's {ids.shape[1]} positions over "
                             f"{tp} tensor-parallel ranks: the length must be a multiple of {tp} (pretraining: "
                             f"--max_seq_len; SFT: packed samples)")
    return hook


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, sequence_parallel: bool = False) -> list[str]:
    """Shard `model` (a full Transformer, plain parameters, identical on every rank of `tp_mesh`) over
    the 1-D `tp_mesh` in place. Parameters become DTensors (Shard(0) for column-parallel weights, the
    embedding and the LM head; Shard(1) for row-parallel weights); norms stay plain.

    sequence_parallel: the residual stream between the parallel regions is split on the sequence
    (each rank holds T/tp positions: the norms' activations and the residual adds cost 1/tp), entered
    by an all-gather before attention / MLP and left by a reduce-scatter after o / down (Megatron's
    sequence parallelism; the row-parallel all-reduce becomes that reduce-scatter). The final norm's
    output is all-gathered for the LM head. Every batch's length must be a multiple of tp.
    Returns the names of the parameters whose gradients are partial sums over the tensor ranks (the
    norms under sequence parallelism: each rank saw T/tp positions; Qwen3's q / k norms, each rank's heads; the MoE
    layers' router and experts, each rank having run its share of the tokens): the optimizer all-reduces those
    over the tensor group (FSDPOptimizer's `tp_partial`, read from the model's TP_PARTIAL_ATTR set here)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, parallelize_module)
    tp = tp_mesh.size()
    problems = tensor_parallel_problems(model.cfg, tp, sequence_parallel)
    if problems:
        raise ValueError("cannot split the model for tensor parallelism: " + "; ".join(problems))
    from model.moe import MoEFeedForward
    # a full model's ModuleList, or a pipeline stage's ModuleDict (Transformer.pruned); multi-token prediction's
    # depths (model/mtp.py) hold one block each, split like the others
    depths = list(getattr(getattr(model, "mtp", None), "depths", []))
    blocks = blocks_of(model.layers) + [d.block for d in depths]
    for block in blocks:
        wrapped = [n for n, m in block.named_modules()
                   if n.endswith("_proj") and type(m) not in (nn.Linear, LoRALinear)]
        if wrapped:
            raise ValueError(f"tensor parallelism splits nn.Linear projections (plain or LoRA); {wrapped[:3]} are "
                             "wrapped in something else")
    tied = model.cfg.tie_embeddings
    seq = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between regions
    colwise, rowwise = _styles()
    moe_params: list[str] = []  # the MoE layers' parameters: whole on every tensor rank, partial gradients
    for block_name, block in model.named_modules():
        if not any(block is b for b in blocks):
            continue
        moe = isinstance(block.mlp, MoEFeedForward)
        mla = bool(getattr(model.cfg, "kv_lora_rank", 0))
        plan = _mla_plan(block, tp_mesh, colwise, rowwise, seq) if mla else {
            "self_attn.q_proj": colwise(), "self_attn.k_proj": colwise(),
            "self_attn.v_proj": colwise(), "self_attn.o_proj": rowwise(output_layouts=seq),
        }
        if not moe:
            plan.update({"mlp.gate_proj": colwise(), "mlp.up_proj": colwise(),
                         "mlp.down_proj": rowwise(output_layouts=seq)})
        if sequence_parallel:
            # one all-gather of the normed input per region, kept a DTensor so that the q/k/v (gate/up)
            # input gradients add up as one partial sum, reduce-scattered once in backward
            # (multi-head latent attention: gathered to a plain tensor, `_mla_plan`)
            plan["self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None, None),
                                                   desired_input_layouts=(Replicate(), None, None, None, None),
                                                   use_local_output=mla)
            if not moe:
                plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, tp_mesh, plan)
        _finish_attention(block.self_attn, tp_mesh)
        if moe:  # each tensor rank routes and computes its share of the tokens (already its own under SP)
            from model import token_shares  # noqa: F401 (loaded before any compile traces the import in forward)
            block.mlp.sequence_group = tp_mesh.get_group()
            block.mlp.token_split_group = None if sequence_parallel else tp_mesh.get_group()
            moe_params += [f"{block_name}.mlp.{n}" for n, _ in block.mlp.named_parameters()]
        else:
            block.mlp.fused_qkv = False
    root = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),  # vocabulary-parallel lookup
        "lm_head": ColwiseParallel(output_layouts=Replicate()),  # logits gathered only when asked for
    }
    if sequence_parallel:  # the LM head (and its vocabulary-parallel loss) reads the whole sequence
        root["norm"] = PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
        for k in range(len(depths)):  # so do the depths' (their projection and norms work on the local positions,
            root[f"mtp.depths.{k}.norm"] = PrepareModuleOutput(output_layouts=Shard(1),  # which they slice out)
                                                               desired_output_layouts=Replicate())
            model.mtp.sequence_shard = (tp_mesh.get_local_rank(), tp)
    # a pipeline stage holds the embedding only on the first stage, norm + head only on the last
    root = {name: style for name, style in root.items() if name.startswith("mtp.") or
            getattr(model, name, None) is not None}
    if root:
        parallelize_module(model, tp_mesh, root)
    if tied:  # one weight, sharded the same way (on the vocabulary) for both uses
        model.lm_head.weight = model.embed_tokens.weight
    model.tensor_parallel_size = tp  # (a KV cache holds this rank's key/value heads: model/llama.py kv_heads_of)
    partial = list(moe_params)
    # Qwen3's q / k norms: one weight shared by the heads, each rank normalising its own heads' q and k
    partial += [n for n, _ in model.named_parameters() if n.endswith((".q_norm.weight", ".k_norm.weight"))]
    if sequence_parallel:
        if getattr(model, "embed_tokens", None) is not None:  # where the token ids come in
            model.register_forward_pre_hook(_sequence_length_check(tp), with_kwargs=True)
        else:  # a later pipeline stage: its hidden input is this rank's slice of the sequence (the previous stage's)
            model.hidden_input_seq_split = tp
        partial += [n for n, p in model.named_parameters() if ("norm" in n.rsplit(".", 2)[-2] and n not in partial
                                                                 and not n.endswith(MLA_WHOLE_NORMS))
                    or n.endswith(".eh_proj.weight")]  # (MTP's projection too: each rank saw its positions)
    if partial:
        from optimizer.fsdp_optimizer import TP_PARTIAL_ATTR
        # recorded on the model for the optimizer, which all-reduces these gradients over the tensor group
        setattr(model, TP_PARTIAL_ATTR, (tuple(partial), tp_mesh.get_group()))
    return partial


def _finish_attention(attn: nn.Module, tp_mesh: Any) -> None:
    """A block's attention after its plan: the fused q/k/v matmul off (it concatenates full weights: on shards each
    projection runs alone), and gpt-oss's attention sinks (one per query head, model/llama.py Attention), where the
    module has them, a DTensor Shard(0) on `tp_mesh`: each rank the sinks of its heads (split contiguously)."""
    attn.fused_qkv = False
    sinks = getattr(attn, "sinks", None)
    if sinks is None:
        return
    from torch.distributed.tensor import Shard, distribute_tensor
    attn.sinks = nn.Parameter(distribute_tensor(sinks.detach(), tp_mesh, [Shard(0)]), requires_grad=sinks.requires_grad)


# multi-head latent attention's latent norms: they see every position (its input is gathered), their gradients whole
MLA_WHOLE_NORMS = (".self_attn.q_a_layernorm.weight", ".self_attn.kv_a_layernorm.weight")


def _mla_plan(block: nn.Module, tp_mesh: Any, colwise, rowwise, seq) -> dict:
    """Multi-head latent attention's split (model/mla.py): the projections to the heads column-parallel (q_b_proj, or
    q_proj without a query latent, and kv_b_proj: each rank's heads), o_proj row-parallel; the latent projections and
    their norms whole on every rank, on the whole sequence (under sequence parallelism the block's input is gathered
    into a plain tensor). The latents' gradients come back whole (the column-parallel layers all-reduce their input
    gradient), and the RoPE'd key every head shares goes through `whole_gradient`, so every replicated weight's
    gradient is whole on each rank: no partial sum (torchtitan replicates them too, NoParallel)."""
    attn = block.self_attn
    attn.shared_key_grad = _whole_gradient(tp_mesh)
    q = "self_attn.q_b_proj" if getattr(attn, "q_lora_rank", None) else "self_attn.q_proj"
    return {q: colwise(), "self_attn.kv_b_proj": colwise(), "self_attn.o_proj": rowwise(output_layouts=seq)}


def _whole_gradient(tp_mesh: Any):
    """Identity forward; backward sums the gradient over the tensor ranks (Megatron's `f`): for a tensor each rank
    uses with its own heads only."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    def whole(t):
        return DTensor.from_local(t, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    return whole


def _styles():
    """torch's ColwiseParallel / RowwiseParallel, taught LoRA (model/lora.py's LoRALinear, an nn.Linear with
    two child linears): the adapter is split like its base so that the low-rank path needs no collective
    of its own. Column-parallel base W [out/T, in]: lora_B [out/T, r] is split on its rows too and
    lora_A [r, in] is replicated (every rank computes the same x A^T, r columns). Row-parallel base
    W [out, in/T]: lora_A [r, in/T] is split on its columns (each rank's x A^T is a partial sum, like
    x W^T) and lora_B [out, r] is replicated; the two partial sums are added before the one all-reduce
    (or reduce-scatter) of the base layer. Plain nn.Linear layers are split as torch does."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    def place(module: nn.Module, mesh, placements: dict) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            dist_param = nn.Parameter(distribute_tensor(param, mesh, [placements[pname]]),
                                      requires_grad=param.requires_grad)
            module.register_parameter(pname, dist_param)

    def adapter_fn(torch_fn, base: dict, a, b):
        # distribute_module calls this for the wrapped layer (name "") and then for each submodule by name
        def partition(self, name: str, module: nn.Module, mesh) -> None:
            if name == "" and not isinstance(module, LoRALinear):
                torch_fn(self, name, module, mesh)
            elif name == "":
                place(module, mesh, base)  # the frozen base weight only (recurse=False)
            elif name in ("lora_A", "lora_B"):
                place(module, mesh, {"weight": a if name == "lora_A" else b})
        return partition

    class LoRAColwise(ColwiseParallel):
        _partition_linear_fn = adapter_fn(ColwiseParallel._partition_linear_fn,
                                          {"weight": Shard(0), "bias": Shard(0)}, Replicate(), Shard(0))

    class LoRARowwise(RowwiseParallel):
        _partition_linear_fn = adapter_fn(RowwiseParallel._partition_linear_fn,
                                          {"weight": Shard(1), "bias": Replicate()}, Shard(1), Replicate())

    return LoRAColwise, LoRARowwise


def apply(model: nn.Module, mesh: Any, config: Any) -> list[str]:
    """The transform's entry (parallel/transforms/__init__.py ORDER): split `model` over the mesh's "tp"
    dimension when config.tensor_parallel_size > 1 (sequence parallel with config.sequence_parallel);
    the names of the parameters left whole (apply_tensor_parallel's return), [] when there is no tp."""
    if int(config.tensor_parallel_size) <= 1:
        return []
    return apply_tensor_parallel(model, mesh["tp"], sequence_parallel=bool(config.sequence_parallel))
