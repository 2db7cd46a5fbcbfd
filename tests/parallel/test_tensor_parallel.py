"""Tensor (and sequence) parallelism, HSDP and the one device mesh (parallel/mesh.py, parallel/transforms/tensor_parallel.py,
model/vocab_parallel_loss.py) on CPU + gloo, through the trainer's engine (`build_engine` with the flags).

Two spawns do the distributed work and write what they measured to JSON; the tests assert on it:
  world 2: tp=2 (plain, tied embeddings, activation checkpointing, sequence parallel with and without
           tied embeddings, sequence parallel with every block compiled, LoRA adapters on every
           projection, a Qwen3-shaped model with and without sequence parallelism: heads sized on their own
           and q / k norms), the vocabulary-parallel loss against the full-vocabulary one (every reduction,
           values and gradients), a DCP save at tp=2, and its resume at tp=1 x dp=2;
  world 4: tp=2 x fsdp=2 (saved, resumed at the same layout), the same with sequence parallelism and
           activation checkpointing, the same with sequence parallelism and LoRA, HSDP 2 x 2, pp=2 x tp=2
           with sequence parallelism (the stages exchange sequence-split hidden states), pp=2 x HSDP
           replicate 2, pp=2 x tp=2
           (saved, resumed at the same layout and at pp=2 x dp=2), and the tp=2 checkpoint resumed at
           tp=1 x dp=4 and at tp=2 x dp=2.
Every run trains the same model on the same global batch as a one-process reference (torch AdamW +
clip_grad_norm_). The tolerance is the reference's own fp32 rounding: the same reference run in fp64
gives |fp32 - fp64|, and a parallel run may differ from the fp32 reference by 10x that.
"""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist

from model import ModelConfig, Transformer
from tests.dist_helpers import computed_once, one_process_step, spawn
# the same global batches as the FSDP tests: GAS micro-batches of GLOBAL_B x SEQ, ~25 % of labels ignored
from tests.parallel.test_fsdp import GAS, GLOBAL_B, VOCAB, _global_batches, _units

STEPS = 3
OPT = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=0.3)


# Gemma 3's block on the Qwen3 shape: the sublayers' output norms (replicated, under sequence parallelism each rank's
# positions' part of their gradients), GeGLU, scaled embeddings and scores, a sliding first layer at its own RoPE base
GEMMA3 = dict(sandwich_norms=True, scale_embeddings=True, mlp_act="gelu_tanh", query_scale=6.0, sliding_window=5,
              sliding_layers=[0], rope_local_theta=100.0)
# Gemma 2's: that block without q / k norms or a local RoPE base, its attention scores and logits soft-capped (caps
# small enough to bind: each rank caps its heads' scores and its shard of the vocabulary's logits)
GEMMA2 = dict(sandwich_norms=True, scale_embeddings=True, mlp_act="gelu_tanh", query_scale=6.0, sliding_window=5,
              sliding_layers=[0], attn_softcap=1.0, final_softcap=2.0)


# DeepSeek's multi-head latent attention (model/mla.py): a query latent, the heads' projections split, the latents
# whole on every rank (their gradients whole too: the shared RoPE key's summed over the ranks)
MLA = dict(kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6)
# gpt-oss (model/hf_gpt_oss.py): attention sinks (each tensor rank its heads'), q/k/v/o biases, a sliding first layer,
# MoE blocks with a router bias, expert biases and the clamped SwiGLU (whole on every tensor rank)
GPT_OSS = dict(attn_sinks=True, qkv_bias=True, o_bias=True, sliding_window=5, sliding_layers=[0], moe_num_experts=4,
               moe_top_k=2, moe_hidden_dim=8, moe_router_bias=True, moe_expert_biases=True, moe_act="gpt_oss")


def _cfg(tied: bool = False, ckpt: bool | str = False, dropout: float = 0.0, family: str = "llama") -> ModelConfig:
    # 4 query heads over 2 key/value heads (GQA), so each tensor rank holds 2 query heads and 1 kv head; qwen3: the
    # heads 8 wide at dim 16 and q / k norms (one weight over the heads, whose gradient each tensor rank has a part of)
    # ckpt: True (each block recomputed) or a model/checkpointing.py policy ("op": selective per op)
    qwen = family in ("qwen3", "gemma3")
    return ModelConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=4, n_kv_heads=4 if family == "mla" else 2,
                       multiple_of=16, max_seq_len=16, tie_embeddings=tied, gradient_checkpointing=bool(ckpt),
                       checkpoint_policy=ckpt if isinstance(ckpt, str) else "full", attn_dropout=dropout,
                       resid_dropout=dropout, qk_norm=qwen, attn_head_dim=8 if qwen or family == "gemma2" else None,
                       **{"gemma3": GEMMA3, "gemma2": GEMMA2, "mla": MLA, "gpt_oss": GPT_OSS}.get(family, {}))


def _new_model(tied: bool = False, ckpt: bool | str = False, dropout: float = 0.0, lora: bool = False,
               family: str = "llama") -> Transformer:
    torch.manual_seed(0)
    model = Transformer(_cfg(tied, ckpt, dropout, family))
    if lora:  # rank-2 adapters on every projection (A drawn from the same seed on every rank), the rest frozen
        from model.lora import apply_lora
        apply_lora(model, r=2, alpha=4.0, target_modules="all")
    return model


# ------------------------------------------------------------------------------ reference (1 process)

def _reference(steps: int, dtype: torch.dtype, tied: bool = False,
               lora: bool = False, family: str = "llama") -> tuple[dict, list[float], list[float]]:
    """(parameters, losses, gradient norms before clipping) of `steps` one-process steps."""
    model = _new_model(tied, lora=lora, family=family).to(dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPT["weight_decay"]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=OPT["learning_rate"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"],
                            foreach=False)
    losses, norms = [], []
    for step in range(1, steps + 1):
        batches = _global_batches(step)
        loss, norm = one_process_step(model, opt, params, batches, _units(batches), OPT["grad_clip"])
        losses.append(loss)
        norms.append(norm)
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}, losses, norms


# ------------------------------------------------------------------------------ in the workers

def _engine(tp: int = 1, rep: int = 1, tied: bool = False, ckpt: bool | str = False, sp: bool = False,
            dtype: str = "fp32", pp: int = 1, dropout: float = 0.0, lora: bool = False, compile: bool = False,
            cp: int = 1, parallel: str = "fsdp", zero: bool = False, family: str = "llama"):
    from parallel.build import build_engine
    from trainer.config import TrainConfig
    cfg = dataclasses.replace(TrainConfig(), parallel=parallel, dtype=dtype, device="cpu",
                              tensor_parallel_size=tp, dp_replicate_size=rep, sequence_parallel=sp,
                              pipeline_parallel_size=pp, gradient_accumulation_steps=GAS, compile=compile,
                              context_parallel_size=cp, use_distributed_optimizer=zero, **OPT)
    return build_engine(_new_model(tied, ckpt, dropout, lora, family), cfg, device=torch.device("cpu"))


def _prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(4))


def _loss_fn(model, batch):
    return model(batch["input_ids"], labels=batch["labels"], reduction="sum"), {}


def _step(engine, step: int) -> tuple[float, float]:
    """One optimizer step on this rank's slice of the global batch: (global mean loss, grad norm)."""
    batches = _global_batches(step)
    units = _units(batches)
    n = GLOBAL_B // engine.dp_size
    rows = slice(engine.dp_rank * n, (engine.dp_rank + 1) * n)
    local = [{"input_ids": x[rows], "labels": y[rows]} for x, y in batches]
    engine.optimizer.zero_grad()
    sums = engine.forward_backward(local, _loss_fn, units)
    total = engine.sum_over_data(sums, torch.device("cpu"))
    stepped, norm = engine.optimizer.step()
    assert stepped
    return float(total[0]) / units, float(norm)


def _full_params(engine) -> dict[str, list]:
    """The whole model's parameters, gathered (collective): a pipeline rank holds only its stage's."""
    from torch.distributed.tensor import DTensor
    out = {}
    for n, p in engine.module.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[n] = t.detach().double().reshape(-1).tolist()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, out)
    return {k: v for part in every for k, v in part.items()}


def _manager(engine, root: str):
    from checkpoint.manager import CheckpointManager
    return CheckpointManager(engine, root, rank=dist.get_rank(), world_size=dist.get_world_size(), keep_last=5,
                             barrier=dist.barrier, log=lambda m: None)


def _save(engine, root: str, step: int) -> str:
    return _manager(engine, root).save(step, model_config={}, trainer_state={}, run_config={})


def _load(engine, ckpt_dir: str, saved_world: int) -> None:
    _manager(engine, os.path.dirname(os.path.dirname(ckpt_dir))).load(ckpt_dir, saved_world)


def _train(out: dict, name: str, steps: int, **kw):
    engine = _engine(**kw)
    rec = {"losses": [], "norms": [], "dp": [engine.dp_rank, engine.dp_size]}
    for step in range(1, steps + 1):
        loss, norm = _step(engine, step)
        rec["losses"].append(loss)
        rec["norms"].append(norm)
    rec["params"] = _full_params(engine)
    out[name] = rec
    return engine


def _ce_fp64(h, w, y, reduction: str):
    """Full logits and F.cross_entropy, all in fp64 (model/loss.py's reference computes its logits in fp32)."""
    per_token = torch.nn.functional.cross_entropy((h @ w.t()).reshape(-1, VOCAB), y.reshape(-1),
                                                  ignore_index=-100, reduction="none").reshape(y.shape)
    if reduction == "none":
        return per_token
    return per_token.sum() / ((y != -100).sum() if reduction == "mean" else 1)


def _vocab_parallel_loss_check(out: dict) -> None:
    """The vocabulary-parallel loss on shards vs the full-vocabulary reference on the whole weight."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from model.vocab_parallel_loss import vocab_parallel_lm_head_loss
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 7, 16, generator=g, dtype=torch.float64)
    w = torch.randn(VOCAB, 16, generator=g, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (3, 7), generator=g)
    y[0, :3] = -100
    up = torch.randn(3, 7, generator=g, dtype=torch.float64)
    res = {}
    for reduction in ("mean", "sum", "none"):
        h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
        ref = _ce_fp64(h1, w1, y, reduction)
        (ref * up if reduction == "none" else ref).sum().backward()
        h2 = h.clone().requires_grad_()
        w2 = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_()  # each rank: its rows
        got = vocab_parallel_lm_head_loss(h2, w2, y, reduction, chunk_size=5)  # chunks cut across rows
        (got * up if reduction == "none" else got).sum().backward()
        res[reduction] = {"loss": float((got - ref).detach().abs().max()),
                          "d_hidden": float((h2.grad - h1.grad).abs().max()),
                          "d_weight": float((w2.grad.full_tensor() - w1.grad).abs().max())}
    out["vocab_parallel_loss"] = res


def _world2(rank: int, world: int, out_path: str, root: str) -> None:
    out: dict = {}
    _vocab_parallel_loss_check(out)
    engine = _train(out, "tp2", STEPS, tp=2)
    out["tp2"]["layout"] = [engine.mesh[n].size() for n in ("pp", "dp_replicate", "dp_shard", "tp")]
    out["tp2"]["embed_local_rows"] = engine.module.embed_tokens.weight.to_local().shape[0]
    path = _save(engine, os.path.join(root, "tp2"), STEPS)
    del engine
    _train(out, "tp2_tied", STEPS, tp=2, tied=True)
    _train(out, "tp2_ckpt", STEPS, tp=2, ckpt=True)
    _train(out, "tp2_sp", STEPS, tp=2, sp=True)
    _train(out, "tp2_sp_tied", STEPS, tp=2, sp=True, tied=True)
    _train(out, "tp2_sp_compile", STEPS, tp=2, sp=True, compile=True)  # each block torch.compile-d (inductor)
    _train(out, "tp2_qwen3", STEPS, tp=2, family="qwen3")
    _train(out, "tp2_sp_gemma3", STEPS, tp=2, sp=True, family="gemma3")  # (Qwen3's q / k norms as well)
    _train(out, "tp2_sp_gemma2", STEPS, tp=2, sp=True, family="gemma2")  # (soft-capped scores and logits)
    from model.generate import generate
    engine = _engine(tp=2, family="mla")  # the latent cache under tp: each rank absorbs its heads' kv_b_proj rows
    out["tp2_mla_greedy"] = generate(engine.module, _prompt(), 6, temperature=0.0).tolist()
    del engine
    _train(out, "tp2_mla", STEPS, tp=2, family="mla")
    _train(out, "tp2_sp_mla", STEPS, tp=2, sp=True, family="mla")
    _train(out, "tp2_sp_gpt_oss", STEPS, tp=2, sp=True, family="gpt_oss")
    engine = _train(out, "tp2_lora", STEPS, tp=2, lora=True)
    # the tensor dim's placement of each projection's tensors: S(0), S(1) or R
    out["tp2_lora"]["placements"] = {n: str(p.placements[-1]) for n, p in engine.module.named_parameters()
                                     if "layers.0." in n and "_proj" in n}
    del engine
    engine = _train(out, "tp2_dropout", STEPS, tp=2, dropout=0.2)
    # the norms are replicated on the tensor ranks: equal on both only if both drew the same masks
    norms = {n: p.to_local().tolist() for n, p in engine.module.named_parameters() if "norm" in n}
    every = [None] * world
    dist.all_gather_object(every, norms)
    out["tp2_dropout"]["norms_equal_across_tp"] = every[0] == every[1]
    del engine
    for dtype in ("bf16", "fp16"):  # each against plain FSDP at the same precision (tp=1 x dp=2)
        _train(out, f"tp2_sp_{dtype}", STEPS, tp=2, sp=True, dtype=dtype)
        _train(out, f"fsdp2_{dtype}", STEPS, tp=1, dtype=dtype)
    resumed = _engine(tp=1)
    _load(resumed, path, 2)
    out["tp2_to_dp2"] = {"dp": [resumed.dp_rank, resumed.dp_size], "loss": _step(resumed, STEPS + 1)[0],
                         "params": _full_params(resumed)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def _world4(rank: int, world: int, out_path: str, root: str, tp2_ckpt: str) -> None:
    out: dict = {}
    engine = _train(out, "tp2_fsdp2", STEPS, tp=2)
    path = _save(engine, os.path.join(root, "tp2_fsdp2"), STEPS)
    out["tp2_fsdp2"]["next_loss"] = _step(engine, STEPS + 1)[0]
    out["tp2_fsdp2"]["next_params"] = _full_params(engine)
    del engine
    same = _engine(tp=2)
    _load(same, path, 4)
    out["tp2_fsdp2_resumed"] = {"loss": _step(same, STEPS + 1)[0], "params": _full_params(same)}
    del same
    _train(out, "hsdp", STEPS, rep=2)
    # selective per op: sequence parallelism's reduce-scatters kept, its all-gathers run again in the backward
    _train(out, "tp2_sp_fsdp2", STEPS, tp=2, sp=True, ckpt="op")
    _train(out, "tp2_sp_fsdp2_lora", STEPS, tp=2, sp=True, lora=True)
    for name, tp in (("tp2_to_dp4", 1), ("tp2_to_tp2_dp2", 2)):
        e = _engine(tp=tp)
        _load(e, tp2_ckpt, 2)
        out[name] = {"dp": [e.dp_rank, e.dp_size], "loss": _step(e, STEPS + 1)[0], "params": _full_params(e)}
    # 3-D: pipeline stages x tensor parallel (FSDP per stage over dp = 1), saved and resumed at the same
    # layout and at pp=2 x dp=2 (the stage files hold whole tensors: any tp / dp split loads them)
    _train(out, "pp2_tp2_sp", STEPS, pp=2, tp=2, sp=True)  # the stages exchange sequence-split hidden states
    _train(out, "pp2_hsdp", STEPS, pp=2, rep=2)  # 2 replicas of each stage (HSDP's replicate dimension)
    engine = _train(out, "pp2_tp2", STEPS, pp=2, tp=2)
    path = _save(engine, os.path.join(root, "pp2_tp2"), STEPS)
    out["pp2_tp2"]["next_loss"] = _step(engine, STEPS + 1)[0]
    out["pp2_tp2"]["next_params"] = _full_params(engine)
    del engine
    for name, tp in (("pp2_tp2_resumed", 2), ("pp2_tp2_to_pp2_dp2", 1)):
        e = _engine(pp=2, tp=tp)
        _load(e, path, 4)
        out[name] = {"loss": _step(e, STEPS + 1)[0], "params": _full_params(e)}
    # pipeline stages x context parallel: each cp rank's stages pass its chunks of the hidden states; FSDP2
    # stages shard over dp_shard x cp, our DDP's reduce over it (saved and resumed at the same layout: one
    # writer per stage of the cp ranks that hold the same state)
    _train(out, "pp2_cp2", STEPS, pp=2, cp=2, ckpt=True)
    for name, zero in (("pp2_cp2_ddp", False), ("pp2_cp2_zero1", True)):  # ZeRO: shards over dp x cp
        engine = _train(out, name, STEPS, pp=2, cp=2, parallel="ddp", zero=zero)
        path = _save(engine, os.path.join(root, name), STEPS)
        out[name]["next_loss"] = _step(engine, STEPS + 1)[0]
        out[name]["next_params"] = _full_params(engine)
        del engine
        e = _engine(pp=2, cp=2, parallel="ddp", zero=zero)
        _load(e, path, 4)
        out[f"{name}_resumed"] = {"loss": _step(e, STEPS + 1)[0], "params": _full_params(e)}
    e = _engine(pp=2, cp=1, parallel="ddp")  # the ZeRO x cp checkpoint at pp=2 x dp=2 without ZeRO
    _load(e, path, 4)
    out["pp2_cp2_zero1_to_pp2_dp2"] = {"loss": _step(e, STEPS + 1)[0], "params": _full_params(e)}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return computed_once(tmp_path_factory, "tensor_parallel", _results)


def _results(d) -> dict:
    spawn(_world2, 2, str(d / "w2.json"), str(d))
    with open(d / "w2.json") as f:
        out = json.load(f)
    from utils.checkpoint_layout import step_dir_name
    tp2_ckpt = os.path.join(str(d), "tp2", "checkpoints", step_dir_name(STEPS))
    assert os.path.isdir(tp2_ckpt), os.listdir(os.path.join(str(d), "tp2", "checkpoints"))
    spawn(_world4, 4, str(d / "w4.json"), str(d), tp2_ckpt)
    with open(d / "w4.json") as f:
        out.update(json.load(f))
    out["tp2_ckpt_dir"] = tp2_ckpt
    return out


@pytest.fixture(scope="module")
def reference() -> dict:
    """fp32 and fp64 references for STEPS and STEPS + 1 steps, and the tolerance between them."""
    out = {}
    for tied, lora, family in ((False, False, "llama"), (True, False, "llama"), (False, True, "llama"),
                               (False, False, "qwen3"), (False, False, "gemma3"), (False, False, "gemma2"),
                               (False, False, "mla"),
                               (False, False, "gpt_oss")):
        for steps in (STEPS, STEPS + 1) if not (lora or family != "llama") else (STEPS,):
            p32, l32, n32 = _reference(steps, torch.float32, tied, lora, family)
            p64, l64, n64 = _reference(steps, torch.float64, tied, lora, family)
            noise = max(float((p32[n] - p64[n]).abs().max()) for n in p32)
            # the loss: a mean of ~100 fp32 token losses, whose own rounding is ~1e-6 relative at worst
            out[("lora", steps) if lora else (family, steps) if family != "llama" else (tied, steps)] = {
                "params": p32, "losses": l32, "tol": 10 * noise + 1e-7, "norms": n32,
                "loss_tol": 10 * max(abs(a - b) for a, b in zip(l32, l64)) + 1e-6 * max(l32),
                "norm_tol": 10 * max(abs(a - b) for a, b in zip(n32, n64)) + 1e-6 * max(n32)}
    return out


def _max_param_diff(got: dict, ref: dict) -> float:
    assert set(got) == set(ref)
    return max(float((torch.tensor(got[n], dtype=torch.float64) - ref[n].reshape(-1)).abs().max()) for n in ref)


# ------------------------------------------------------------------------------ tests

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_parallel_loss_matches_full_vocabulary(results, reduction):
    # fp64 on both sides: any difference beyond rounding is a wrong max / sum / target / gradient
    diffs = results["vocab_parallel_loss"][reduction]
    assert diffs["loss"] < 1e-10 and diffs["d_hidden"] < 1e-10 and diffs["d_weight"] < 1e-10, diffs


@pytest.mark.parametrize("name,tied", [("tp2", False), ("tp2_tied", True), ("tp2_ckpt", False),
                                       ("tp2_sp", False), ("tp2_sp_tied", True), ("tp2_fsdp2", False),
                                       ("tp2_sp_fsdp2", False), ("hsdp", False), ("pp2_tp2", False),
                                       ("pp2_tp2_sp", False), ("pp2_hsdp", False), ("pp2_cp2", False),
                                       ("pp2_cp2_ddp", False), ("pp2_cp2_zero1", False),
                                       ("tp2_lora", "lora"), ("tp2_sp_fsdp2_lora", "lora"),
                                       ("tp2_sp_compile", False), ("tp2_qwen3", "qwen3"),
                                       ("tp2_sp_gemma3", "gemma3"), ("tp2_sp_gemma2", "gemma2"), ("tp2_mla", "mla"),
                                       ("tp2_sp_mla", "mla"),
                                       ("tp2_sp_gpt_oss", "gpt_oss")])
def test_parallel_layouts_match_one_process(results, reference, name, tied):
    ref = reference[(tied, STEPS)]
    rec = results[name]
    assert max(abs(a - b) for a, b in zip(rec["losses"], ref["losses"])) <= ref["loss_tol"], (rec["losses"], ref["losses"])
    # the gradient's scale too (AdamW and clipping would hide a factor on every gradient)
    assert max(abs(a - b) for a, b in zip(rec["norms"], ref["norms"])) <= ref["norm_tol"], (rec["norms"], ref["norms"])
    assert _max_param_diff(rec["params"], ref["params"]) <= ref["tol"], name


def test_latent_attention_generates_one_process_tokens_under_tp(results):
    """Greedy generation over multi-head latent attention's latent cache at tp 2 (each rank's heads, the logits
    gathered) gives the one-process model's tokens."""
    from model.generate import generate
    one = generate(_new_model(family="mla").eval(), _prompt(), 6, temperature=0.0)
    assert results["tp2_mla_greedy"] == one.tolist()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_low_precision_tp_is_as_close_to_fp32_as_plain_fsdp(results, reference, dtype):
    """bf16 (and fp16 with dynamic loss scaling): tp=2 + sp computes in low precision as FSDP does (fp32
    masters, low-precision compute copies); its distance from the fp32 reference may be at most 4x plain
    FSDP's at the same precision (tp=1 x dp=2, the same global batch)."""
    ref = reference[(False, STEPS)]
    plain = _max_param_diff(results[f"fsdp2_{dtype}"]["params"], ref["params"])
    got = _max_param_diff(results[f"tp2_sp_{dtype}"]["params"], ref["params"])
    assert 0 < plain and got <= 4 * plain, (got, plain)
    assert all(n == n and n < float("inf") for n in results[f"tp2_sp_{dtype}"]["norms"])


def test_dropout_draws_the_same_masks_on_the_tensor_ranks(results):
    """With dropout the replicated norms stay identical on both tensor ranks (a rank drawing its own
    residual mask would train its copy on other activations), and dropout is active (other losses)."""
    rec = results["tp2_dropout"]
    assert rec["norms_equal_across_tp"]
    assert rec["losses"][0] != results["tp2"]["losses"][0]
    assert all(abs(a - b) < 0.5 for a, b in zip(rec["losses"], results["tp2"]["losses"]))


def test_mesh_layout_and_data_coordinates(results):
    # world 2, tp 2: one data-parallel rank (both tensor ranks read the whole global batch)
    assert results["tp2"]["layout"] == [1, 1, 1, 2]
    assert results["tp2"]["dp"] == [0, 1]
    assert results["tp2"]["embed_local_rows"] == VOCAB // 2  # the embedding is split on the vocabulary
    assert results["hsdp"]["dp"][1] == 4 and results["tp2_fsdp2"]["dp"][1] == 2
    assert results["tp2_to_dp2"]["dp"][1] == 2 and results["tp2_to_dp4"]["dp"][1] == 4


@pytest.mark.parametrize("run", ["tp2_fsdp2", "pp2_tp2", "pp2_cp2_ddp", "pp2_cp2_zero1"])
def test_resume_at_the_same_layout_is_bit_exact(results, run):
    a, b = results[run], results[f"{run}_resumed"]
    assert a["next_loss"] == b["loss"]
    assert a["next_params"] == b["params"]


@pytest.mark.parametrize("name", ["tp2_to_dp2", "tp2_to_dp4", "tp2_to_tp2_dp2", "pp2_tp2_to_pp2_dp2",
                                  "pp2_cp2_zero1_to_pp2_dp2"])
def test_resume_across_layouts_continues_the_run(results, reference, name):
    """The tp=2 checkpoint of step 3, resumed at another tensor / data-parallel split, takes step 4 as
    the one-process reference does (weights and Adam moments resharded by DCP)."""
    ref = reference[(False, STEPS + 1)]
    assert abs(results[name]["loss"] - ref["losses"][-1]) <= ref["loss_tol"]
    assert _max_param_diff(results[name]["params"], ref["params"]) <= ref["tol"]


def test_tp_checkpoint_holds_the_full_model(results, reference):
    """tp=1 x dp=1 (export, sample, --init_from): the checkpoint's weights gathered in one process are
    the tp=2 run's weights, element for element."""
    from checkpoint.weights import checkpoint_model_state
    state = checkpoint_model_state(results["tp2_ckpt_dir"])
    got = {n: t.double().reshape(-1).tolist() for n, t in state.items()}
    assert got == results["tp2"]["params"]


def test_lora_adapters_are_split_like_their_base(results, reference):
    """Column-parallel q/k/v, gate/up: base and lora_B split on the output rows, lora_A whole; row-parallel
    o/down: base and lora_A split on the input columns, lora_B whole. The frozen base does not move."""
    got = results["tp2_lora"]["placements"]
    for proj in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"):
        p = f"layers.0.{proj}"
        assert (got[f"{p}.weight"], got[f"{p}.lora_A.weight"], got[f"{p}.lora_B.weight"]) == \
            ("S(0)", "R", "S(0)"), proj
    for proj in ("self_attn.o_proj", "mlp.down_proj"):
        p = f"layers.0.{proj}"
        assert (got[f"{p}.weight"], got[f"{p}.lora_A.weight"], got[f"{p}.lora_B.weight"]) == \
            ("S(1)", "S(1)", "R"), proj
    base = reference[(False, STEPS)]["params"]  # a full run moves every base weight; LoRA moves none
    start = {n: p.detach().double() for n, p in _new_model().named_parameters()}
    frozen = results["tp2_sp_fsdp2_lora"]["params"]
    assert all(torch.equal(torch.tensor(frozen[n], dtype=torch.float64), start[n].reshape(-1)) for n in start)
    assert any(not torch.equal(base[n], start[n]) for n in start)
