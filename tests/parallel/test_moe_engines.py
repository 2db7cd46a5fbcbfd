"""An MoE model (shared expert, first block dense, balancing loss, z-loss and the bias update on) under our DDP,
ZeRO-1 and FSDP2 at 2 gloo ranks follows one process: each step's loss and gradient norm, the parameters after 3
steps (within 10x the one-process reference's own fp32 rounding, against its fp64 run), and the selection biases
exactly (they move by whole steps of the rate, from integer loads).

Every forward sees the same 2 rows in every layout (the global batch is 4 micro-batches of 2 rows: one process
takes all 4, each of 2 ranks 2), so the per-micro-batch balancing loss is the same function everywhere."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model import ModelConfig, Transformer
from model.moe import moe_layers, take_aux_losses, update_expert_bias
from tests.dist_helpers import spawn

VOCAB, SEQ, CHUNKS, ROWS, STEPS = 64, 8, 4, 2, 3
OPT = dict(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=0.3)
MOE = dict(moe_aux_loss_coef=0.05, moe_z_loss_coef=0.01, moe_bias_update_rate=0.02)


def new_model(starve: bool = False) -> Transformer:
    """The tiny MoE model (first layer dense, 4 experts, top 2, one shared); with `starve` every token of the first
    MoE layer goes to experts 0 and 1 (rank 0's at ep=2: tests/parallel/test_expert_parallel.py)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=VOCAB, dim=16, n_layers=3, n_heads=2, hidden_dim=32, max_seq_len=16,
                                    moe_num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_hidden_dim=8,
                                    moe_first_dense_layers=1))
    if starve:
        moe_layers(model)[0].expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
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


def moe_loss(training):
    """The summed-loss function of the engines' forward_backward, with MoETraining's balancing terms."""
    return training.wrap_loss(lambda m, b: (m(b["input_ids"], labels=b["labels"], reduction="sum"), {}), _units)


def rank_batches(engine, step: int) -> tuple[list[dict], int]:
    """(this rank's micro-batches of batches(step): its dp_rank's contiguous share, the whole step's target units)."""
    chunks = batches(step)
    units = sum(int((y != -100).sum()) for _, y in chunks)
    per = CHUNKS // engine.dp_size
    return [{"input_ids": x, "labels": y} for x, y in chunks[engine.dp_rank * per:(engine.dp_rank + 1) * per]], units


def one_process_reference(dtype: torch.dtype, starve: bool = False) -> dict:
    """One process: torch AdamW + clip_grad_norm_, the balancing terms written out, the bias rule applied (with
    `starve` the bias update is off, so the starved experts stay starved); step 1's gradients are kept."""
    model = new_model(starve).to(dtype)
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": OPT["weight_decay"]},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=OPT["learning_rate"], betas=(OPT["beta1"], OPT["beta2"]), eps=OPT["eps"],
                            foreach=False)
    layers = moe_layers(model)
    rate = 0.0 if starve else MOE["moe_bias_update_rate"]
    rec = {"losses": [], "norms": []}
    for step in range(1, STEPS + 1):
        chunks = batches(step)
        units = sum(int((y != -100).sum()) for _, y in chunks)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in chunks:
            lm = model(x, labels=y, reduction="sum")
            aux = take_aux_losses(layers)
            extra = aux[:, 0].sum() * MOE["moe_aux_loss_coef"] + aux[:, 1].sum() * MOE["moe_z_loss_coef"]
            ((lm + extra * int((y != -100).sum())) / units).backward()
            total += float(lm.detach())
        if step == 1:
            rec["grads"] = {n: p.grad.detach().double().clone() for n, p in model.named_parameters()}
        rec["norms"].append(float(torch.nn.utils.clip_grad_norm_(params, OPT["grad_clip"])))
        opt.step()
        for layer in layers:
            update_expert_bias(layer.expert_bias, layer.take_counts(), rate)
        rec["losses"].append(total / units)
    rec["params"] = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    rec["bias"] = [layer.expert_bias.clone() for layer in layers]
    return rec


def _train(parallel: str, zero: bool = False) -> dict:
    from torch.distributed.tensor import DTensor

    from parallel.build import build_engine
    from trainer.config import TrainConfig
    from trainer.moe import MoETraining
    cfg = dataclasses.replace(TrainConfig(), parallel=parallel, dtype="fp32", device="cpu", bucket_size=500,
                              use_distributed_optimizer=zero, gradient_accumulation_steps=2, **OPT, **MOE)
    engine = build_engine(new_model(), cfg, device=torch.device("cpu"))
    moe = MoETraining.of(cfg, engine.module)
    loss_fn = moe_loss(moe)
    rec = {"losses": [], "norms": []}
    for step in range(1, STEPS + 1):
        mine, units = rank_batches(engine, step)
        engine.optimizer.zero_grad()
        sums = engine.forward_backward(mine, loss_fn, units)
        total = engine.sum_over_data(sums, torch.device("cpu"))
        stepped, norm = engine.optimizer.step()
        moe.after_step(engine, torch.device("cpu"))
        rec["losses"].append(float(total[0]) / units)
        rec["norms"].append(float(norm))
    rec["params"] = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().double().reshape(-1).tolist()
                     for n, p in engine.module.named_parameters()}
    rec["bias"] = [layer.expert_bias.tolist() for layer in moe.layers]
    return rec


def _world(rank: int, world: int, out_path: str) -> None:
    out = {"ddp": _train("ddp"), "zero1": _train("ddp", zero=True), "fsdp": _train("fsdp")}
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("moe") / "w2.json"
    spawn(_world, 2, str(path))
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def reference() -> dict:
    r32, r64 = one_process_reference(torch.float32), one_process_reference(torch.float64)
    noise = max(float((r32["params"][n] - r64["params"][n]).abs().max()) for n in r32["params"])
    r32["tol"] = 10 * noise + 1e-7
    r32["loss_tol"] = 10 * max(abs(a - b) for a, b in zip(r32["losses"], r64["losses"])) + 1e-6
    r32["norm_tol"] = 10 * max(abs(a - b) for a, b in zip(r32["norms"], r64["norms"])) + 1e-6
    return r32


@pytest.mark.parametrize("engine", ["ddp", "zero1", "fsdp"])
def test_two_ranks_follow_one_process(results, reference, engine):
    rec = results[engine]
    assert max(abs(a - b) for a, b in zip(rec["losses"], reference["losses"])) <= reference["loss_tol"]
    assert max(abs(a - b) for a, b in zip(rec["norms"], reference["norms"])) <= reference["norm_tol"]
    assert sorted(rec["params"]) == sorted(reference["params"])
    diff = max(float((torch.tensor(rec["params"][n], dtype=torch.float64) - reference["params"][n].reshape(-1))
                     .abs().max()) for n in reference["params"])
    assert diff <= reference["tol"], (diff, reference["tol"])
    for got, want in zip(rec["bias"], reference["bias"]):
        assert torch.equal(torch.tensor(got), want), (got, want)
    assert any(torch.count_nonzero(b) for b in reference["bias"])  # the rule moved them
