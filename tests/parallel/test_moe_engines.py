"""An MoE model (shared expert, first block dense, balancing loss, z-loss and the bias update on) under our DDP,
ZeRO-1 and FSDP2 at 2 gloo ranks, under 2 pipeline stages (alone and x 2 replicas, 4 ranks) and under context
parallelism 2 follows one process: each step's loss and gradient norm, the parameters after 3 steps (within 10x
the one-process reference's own fp32 rounding, against its fp64 run), the selection biases exactly (they move by
whole steps of the rate, from integer loads), and the metrics row's loads (exactly) and balancing loss.

Every forward sees the same 2 rows in every layout (the global batch is 4 micro-batches of 2 rows: one process
takes all 4, each of 2 ranks 2), so the per-micro-batch balancing loss is the same function everywhere; context
parallelism splits each row's tokens over its ranks and computes the whole sequence's balancing loss; so does tensor
parallelism (each tensor rank runs the MoE layer on its share of the tokens); and the sequence-wise balancing loss
(--moe_aux_loss_type=sequence) under tp and tp x cp equals one process's."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model import ModelConfig, Transformer
from model.moe import moe_layers, take_aux_losses, update_expert_bias
from tests.dist_helpers import computed_once, spawn, traced_with_aot_eager

VOCAB, SEQ, CHUNKS, ROWS, STEPS = 64, 8, 4, 2, 3
OPT = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=0.3)
MOE = dict(moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01, moe_bias_update_rate=0.02)


# gpt-oss's block (model/hf_gpt_oss.py): attention sinks, q/k/v/o biases, a router bias, expert biases (cut by expert
# under expert parallelism), its clamped SwiGLU; no shared expert
GPT_OSS = dict(attn_sinks=True, qkv_bias=True, o_bias=True, moe_router_bias=True, moe_expert_biases=True,
               moe_act="gpt_oss", moe_shared_experts=0)


def new_model(starve: bool = False, n_layers: int = 3, gpt_oss: bool = False, lora: int = 0) -> Transformer:
    """The tiny MoE model (first layer dense, 4 experts, top 2, one shared); with `starve` every token of the first
    MoE layer goes to experts 0 and 1 (rank 0's at ep=2: tests/parallel/test_expert_parallel.py). 4 layers for
    pipeline stages (2 + 2). `gpt_oss`: gpt-oss's block (GPT_OSS), its biases drawn away from zero. `lora`: adapters of
    that rank on q_proj and the routed experts (model/lora_experts.py), B drawn away from zero, the rest frozen (rank
    4 runs the CPU's grouped matmul, the update on its outputs; rank 2 the weight-space update on the fused loop)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**dict(vocab_size=VOCAB, dim=16, n_layers=n_layers, n_heads=2, hidden_dim=32,
                                              max_seq_len=16, moe_num_experts=4, moe_top_k=2, moe_shared_experts=1,
                                              moe_hidden_dim=8, moe_first_dense_layers=1),
                                       **(GPT_OSS if gpt_oss else {})}))
    if gpt_oss:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(("sinks", "bias")):
                    p.normal_(0.0, 0.3)
    if starve:
        moe_layers(model)[0].expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    if lora:
        from model.lora import apply_lora
        apply_lora(model, r=lora, alpha=16.0 if lora == 4 else 64.0, target_modules="q_proj,experts")
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.5)
    return model


def batches(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(CHUNKS):
        x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        y[torch.rand(ROWS, SEQ, generator=g) < 0.25] = -100
        out.append((x, y))
    return out


def _units(b) -> int:
    return int((b["labels"] != -100).sum())


def moe_loss(cfg, engine):
    """(MoETraining of the engine's model, set as its side loss (the balancing terms), the summed-loss function of
    its forward_backward)."""
    from trainer.moe import MoETraining
    training = MoETraining.of(cfg, engine.module, _units)
    engine.side_loss = training
    return training, lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {})


def rank_batches(engine, step: int) -> tuple[list[dict], int]:
    """(this rank's micro-batches of batches(step): its dp_rank's contiguous share, the whole step's target units)."""
    chunks = batches(step)
    units = sum(int((y != -100).sum()) for _, y in chunks)
    per = CHUNKS // engine.dp_size
    return [{"input_ids": x, "labels": y} for x, y in chunks[engine.dp_rank * per:(engine.dp_rank + 1) * per]], units


def one_process_reference(dtype: torch.dtype, starve: bool = False, n_layers: int = 3,
                          per_sequence: bool = False, gpt_oss: bool = False, lora: int = 0) -> dict:
    """One process: torch AdamW + clip_grad_norm_, the balancing terms written out, the bias rule applied (with
    `starve` the bias update is off, so the starved experts stay starved); step 1's gradients are kept, and each
    step's tokens per expert and mean balancing loss (the metrics row's)."""
    model = new_model(starve, n_layers, gpt_oss, lora).to(dtype)
    for layer in moe_layers(model):  # --moe_aux_loss_type=sequence (tests/model/test_moe.py checks the function)
        layer.aux_per_sequence = per_sequence
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPT["weight_decay"]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=OPT["learning_rate"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"],
                            foreach=False)
    layers = moe_layers(model)
    rate = 0.0 if starve else MOE["moe_bias_update_rate"]
    rec = {"losses": [], "norms": [], "loads": [], "aux_loss": []}
    for step in range(1, STEPS + 1):
        chunks = batches(step)
        units = sum(int((y != -100).sum()) for _, y in chunks)
        opt.zero_grad(set_to_none=True)
        total, aux_sum = 0.0, 0.0
        for x, y in chunks:
            lm = model(x, labels=y, reduction="sum")
            aux = take_aux_losses(layers)
            extra = aux[:, 0].sum() * MOE["moe_aux_loss_coef"] + aux[:, 1].sum() * MOE["moe_z_loss_coef"]
            ((lm + extra * int((y != -100).sum())) / units).backward()
            total += float(lm.detach())
            aux_sum += float(aux[:, 0].detach().sum())
        rec["aux_loss"].append(aux_sum / (len(chunks) * len(layers)))
        if step == 1:
            rec["grads"] = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.requires_grad}
        rec["norms"].append(float(torch.nn.utils.clip_grad_norm_(params, OPT["grad_clip"])))
        opt.step()
        counts = [layer.take_counts() for layer in layers]
        rec["loads"].append([c.tolist() for c in counts])
        for layer, c in zip(layers, counts):
            update_expert_bias(layer.expert_bias, c, rate)
        rec["losses"].append(total / units)
    rec["params"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    rec["bias"] = [layer.expert_bias.clone() for layer in layers]
    return rec


def _train(parallel: str, zero: bool = False, **layout) -> dict:
    """3 steps of `parallel` (+ ZeRO-1 with `zero`; pipeline stages with pipeline_parallel_size in `layout`: the
    4-layer model, all 4 micro-batches of a replica in one schedule); what the reference records, every stage's
    parameters gathered, the metrics row's loads and balancing loss."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from parallel.build import build_engine
    from parallel.distributed_data_parallel import SHARD_OF_ATTR
    from trainer.config import TrainConfig
    pp = layout.get("pipeline_parallel_size", 1)
    cfg = dataclasses.replace(TrainConfig(), parallel=parallel, dtype="fp32", device="cpu", bucket_size=500,
                              use_distributed_optimizer=zero, **{"gradient_accumulation_steps": 2, **OPT, **MOE,
                                                                 **layout})
    engine = build_engine(new_model(n_layers=4 if pp > 1 else 3), cfg, device=torch.device("cpu"))
    moe, loss_fn = moe_loss(cfg, engine)
    rec = {"losses": [], "norms": [], "loads": [], "aux_loss": [],
           "on_ep": [(hasattr(w, "device_mesh") and "ep" in (w.device_mesh.mesh_dim_names or ()))
                     or getattr(w, SHARD_OF_ATTR, None) is not None  # our DDP's expert shards
                     for w in (layer.experts.down_proj for layer in moe.layers)]}
    for step in range(1, STEPS + 1):
        mine, units = rank_batches(engine, step)
        engine.optimizer.zero_grad()
        sums = engine.forward_backward(mine, loss_fn, units)
        total = engine.sum_over_data(sums, torch.device("cpu"))
        stepped, norm = engine.optimizer.step()
        row = moe.read(moe.after_step(engine, torch.device("cpu")))
        rec["losses"].append(float(total[0]) / units)
        rec["norms"].append(float(norm))
        rec["loads"].append(row["moe_tokens_per_expert"])
        rec["aux_loss"].append(row["moe_aux_loss"])
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().reshape(-1).tolist()
              for n, p in engine.module.named_parameters()}
    if pp > 1:  # the stage's state as its files hold it: our DDP's expert shards gathered (collective)
        whole = engine.state_dict()["model"]
        params = {n: whole[n].double().reshape(-1).tolist() for n in params}
    elif getattr(engine, "expert_state", None) is not None:  # our DDP's expert shards gathered (collective)
        whole = {**dict(engine.module.named_parameters()), **engine.expert_state.full_shards()}
        params = {n: whole[n].double().reshape(-1).tolist() for n in params}
    bias = {i: layer.expert_bias.tolist() for i, layer in zip(moe.layer_ids, moe.layers)}
    if pp > 1:  # every stage's, on every rank
        for part in (params, bias):
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, dict(part))
            for g in gathered:
                part.update(g)
    rec["params"], rec["bias"] = params, [bias[i] for i in sorted(bias)]
    return rec


PP = dict(pipeline_parallel_size=2, gradient_accumulation_steps=4)


def _compiled(parallel: str, **layout) -> dict:
    """_train with --compile (each block of a stage), traced with the aot_eager backend; the graphs it compiled."""
    rec, graphs = traced_with_aot_eager(_train, parallel, compile=True, **layout)
    return dict(rec, graphs=graphs)


def _world(rank: int, world: int, out_path: str) -> None:
    if world == 2:
        out = {"ddp": _train("ddp"), "zero1": _train("ddp", zero=True), "fsdp": _train("fsdp"),
               "pp_ddp": _train("ddp", **PP), "pp_fsdp_gpipe": _train("fsdp", **PP, pipeline_schedule="gpipe"),
               "cp2": _train("ddp", context_parallel_size=2), "cp2_fsdp": _train("fsdp", context_parallel_size=2),
               "tp2": _train("fsdp", tensor_parallel_size=2),
               "tp2_sp": _train("fsdp", tensor_parallel_size=2, sequence_parallel=True),
               "tp2_compiled": _compiled("fsdp", tensor_parallel_size=2),
               "seq_tp2": _train("fsdp", tensor_parallel_size=2, moe_aux_loss_type="sequence")}
    else:  # 2 stages x 2 replicas: each replica's schedule runs 2 micro-batches
        pp2 = dict(PP, gradient_accumulation_steps=2)
        out = {"pp_dp2_zero1": _train("ddp", zero=True, **pp2), "pp_dp2_fsdp": _train("fsdp", **pp2),
               "pp_ep2_fsdp": _train("fsdp", expert_parallel_size=2, **pp2),
               "pp_ep2_ddp": _train("ddp", expert_parallel_size=2, **pp2),
               "pp_ep2_zero1": _train("ddp", zero=True, expert_parallel_size=2, **pp2),
               "pp_ep2_compiled": _compiled("fsdp", expert_parallel_size=2, **pp2),
               "pp_tp2": _train("fsdp", tensor_parallel_size=2, **PP),
               "tp2_ep2": _train("fsdp", tensor_parallel_size=2, expert_parallel_size=2),
               "cp2_ep2": _train("fsdp", context_parallel_size=2, expert_parallel_size=2),
               "cp2_ep2_ddp": _train("ddp", context_parallel_size=2, expert_parallel_size=2),
               "cp2_ep2_zero1": _train("ddp", zero=True, context_parallel_size=2, expert_parallel_size=2),
               "cp2_tp2": _train("fsdp", tensor_parallel_size=2, context_parallel_size=2),
               "seq_cp2_tp2": _train("fsdp", tensor_parallel_size=2, context_parallel_size=2,
                                     moe_aux_loss_type="sequence")}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def _results(d) -> dict:
    out = {}
    for world in (2, 4):
        spawn(_world, world, str(d / f"w{world}.json"))
        out.update(json.loads((d / f"w{world}.json").read_text()))
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    return computed_once(tmp_path_factory, "moe_engines", _results)


def _reference(n_layers: int, per_sequence: bool = False) -> dict:
    r32, r64 = (one_process_reference(dtype, n_layers=n_layers, per_sequence=per_sequence)
                for dtype in (torch.float32, torch.float64))
    noise = max(float((r32["params"][n] - r64["params"][n]).abs().max()) for n in r32["params"])
    r32["tol"] = 10 * noise + 1e-7
    r32["loss_tol"] = 10 * max(abs(a - b) for a, b in zip(r32["losses"], r64["losses"])) + 1e-6
    r32["norm_tol"] = 10 * max(abs(a - b) for a, b in zip(r32["norms"], r64["norms"])) + 1e-6
    r32["aux_tol"] = 10 * max(abs(a - b) for a, b in zip(r32["aux_loss"], r64["aux_loss"])) + 1e-6
    return r32


@pytest.fixture(scope="module")
def reference() -> dict:
    return _reference(3)


@pytest.fixture(scope="module")
def reference4() -> dict:
    return _reference(4)


@pytest.fixture(scope="module")
def reference_seq() -> dict:
    return _reference(3, per_sequence=True)


@pytest.mark.parametrize("engine", ["ddp", "zero1", "fsdp", "pp_ddp", "pp_fsdp_gpipe", "pp_dp2_zero1",
                                    "pp_dp2_fsdp", "pp_ep2_fsdp", "pp_ep2_ddp", "pp_ep2_zero1", "pp_ep2_compiled",
                                    "cp2", "cp2_fsdp", "tp2", "tp2_sp", "tp2_compiled", "pp_tp2", "tp2_ep2", "cp2_ep2",
                                    "cp2_ep2_ddp", "cp2_ep2_zero1", "seq_tp2", "seq_cp2_tp2",
                                    "cp2_tp2"])
def test_two_ranks_follow_one_process(results, reference, reference4, reference_seq, engine):
    """Also pipeline stages (2, and 2 x 2 data-parallel replicas): the balancing losses of the first stage's
    layers join its backward (parallel/engine_pipeline.py JoinGradient); the loads and balancing loss of the
    metrics row are every stage's, summed over the replicas. And context parallelism (each of 2 ranks holds half
    of every sequence): the balancing loss is the whole sequence's (its loads summed over the cp group), each
    rank backpropagating its own tokens' part of it, and the loads logged are every cp rank's tokens."""
    rec = results[engine]
    reference = reference4 if engine.startswith("pp") else reference_seq if engine.startswith("seq") else reference
    if engine.endswith("compiled"):  # (each block compiled: FSDP2 stages x expert parallel 2; tensor parallel 2)
        assert rec["graphs"] >= 1
    # the experts of each of this rank's MoE layers laid out over the expert-parallel ranks, where asked
    assert rec["on_ep"] == ["ep2" in engine] * (1 if engine.startswith("pp") else 2)
    assert rec["loads"] == reference["loads"]  # integers: exactly
    assert max(abs(a - b) for a, b in zip(rec["aux_loss"], reference["aux_loss"])) <= reference["aux_tol"]
    assert max(abs(a - b) for a, b in zip(rec["losses"], reference["losses"])) <= reference["loss_tol"]
    assert max(abs(a - b) for a, b in zip(rec["norms"], reference["norms"])) <= reference["norm_tol"]
    assert sorted(rec["params"]) == sorted(reference["params"])
    diff = max(float((torch.tensor(rec["params"][n], dtype=torch.float64) - reference["params"][n].reshape(-1))
                     .abs().max()) for n in reference["params"])
    assert diff <= reference["tol"], (diff, reference["tol"])
    for got, want in zip(rec["bias"], reference["bias"]):
        assert torch.equal(torch.tensor(got), want), (got, want)
    assert any(torch.count_nonzero(b) for b in reference["bias"])  # the rule moved them
