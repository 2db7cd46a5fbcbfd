"""--optimizer=muon on one process: which parameters are Muon's, the step equals torch.optim.Muon (matrices)
+ torch.optim.AdamW (the rest) on a plain copy of the model, and the state round-trips exactly."""
from __future__ import annotations

import copy

import pytest
import torch

from model.config import ModelConfig
from model.llama import Transformer
from optimizer import OptimizerConfig, build_optimizer
from optimizer.muon import is_muon_param
from parallel import DDPConfig, DistributedDataParallel

STEPS = 5
VOCAB = 64


def tiny_model(dtype=torch.float64, moe: bool = False) -> Transformer:
    """2 blocks; with `moe` the second is an MoE block (4 experts of width 16, top 2, one shared expert)."""
    torch.manual_seed(0)
    extra = dict(moe_num_experts=4, moe_top_k=2, moe_hidden_dim=16, moe_shared_experts=1,
                 moe_first_dense_layers=1) if moe else {}
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=64,
                      max_seq_len=16, **extra)
    return Transformer(cfg).to(dtype)


def batches(n: int = STEPS, b: int = 4, t: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (b, t), generator=g), torch.randint(0, VOCAB, (b, t), generator=g))
            for _ in range(n)]


def muon_config(**kw) -> OptimizerConfig:
    base = dict(optimizer="muon", lr=3e-3, muon_lr=2e-2, weight_decay=0.1, muon_weight_decay=0.05,
                grad_clip=0.5, muon_adjust_lr="match_rms_adamw")
    return OptimizerConfig(**(base | kw))


def reference_run(model: Transformer, cfg: OptimizerConfig, data, kind: str = "muon") -> dict:
    """torch.optim.Muon on the Muon matrices and torch.optim.AdamW on the rest (kind="adamw": AdamW on
    everything), stepping the plain model's own parameters in their dtype; clipped by clip_grad_norm_. A stacked
    expert weight (3-D) is stepped as Mixtral's separate matrices (each expert's gate [I, D] and up [I, D], down
    [D, I]), each a 2-D tensor of its own for torch.optim.Muon: their gradients cut from the stack's, their results
    written back into it."""
    def matrices_of(name: str, shape) -> tuple:
        e, r, c = shape
        return (2 * e, r // 2, c) if name.endswith("experts.gate_up_proj") else (e, r, c)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = [p for n, p in named if kind == "muon" and is_muon_param(n, p.shape)]
    rest = [(n, p) for n, p in named if not any(p is q for q in muon)]
    stacks = [(p, matrices_of(n, p.shape)) for n, p in named if any(p is q for q in muon) and p.ndim == 3]
    cut = {id(p): [m.clone().requires_grad_() for m in p.detach().reshape(shape)] for p, shape in stacks}
    muon = [p for p in muon if p.ndim == 2] + [m for ms in cut.values() for m in ms]
    adamw = torch.optim.AdamW([{"params": [p for _, p in rest if p.ndim >= 2], "weight_decay": cfg.weight_decay},
                               {"params": [p for _, p in rest if p.ndim < 2], "weight_decay": 0.0}],
                              lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
    opts = [adamw]
    if muon:
        opts.append(torch.optim.Muon(muon, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay,
                                     momentum=cfg.muon_momentum, nesterov=cfg.muon_nesterov,
                                     adjust_lr_fn=cfg.muon_adjust_lr))
    for x, y in data:
        for o in opts:
            o.zero_grad(set_to_none=True)
        model(x, labels=y).backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in named], cfg.grad_clip)
        for p, shape in stacks:
            for m, g in zip(cut[id(p)], p.grad.reshape(shape)):
                m.grad = g.clone()
        for o in opts:
            o.step()
        with torch.no_grad():
            for p, _ in stacks:
                p.copy_(torch.stack(cut[id(p)]).view(p.shape))
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}


def our_run(model: Transformer, cfg: OptimizerConfig, data, ddp_cfg: DDPConfig = None) -> tuple:
    ddp = DistributedDataParallel(model, ddp_cfg or DDPConfig())
    opt = build_optimizer(ddp, cfg)
    for x, y in data:
        opt.zero_grad()
        ddp(x, labels=y).backward()
        assert opt.step()[0]
    return {n: p.detach().double().clone() for n, p in model.named_parameters()}, ddp, opt


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_muon_parameters_are_the_hidden_matrices():
    from model.lora import apply_lora
    m = tiny_model()
    names = {n for n, p in m.named_parameters() if is_muon_param(n, p.shape)}
    assert names == {f"layers.{i}.{s}.weight" for i in range(2) for s in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}, names
    apply_lora(m, r=4, alpha=8, target_modules=("q_proj", "v_proj"))
    lora = {n for n, p in m.named_parameters() if p.requires_grad and is_muon_param(n, p.shape)}
    assert "layers.0.self_attn.q_proj.lora_A.weight" in lora and "layers.1.self_attn.v_proj.lora_B.weight" in lora
    assert not is_muon_param("module.embed_tokens.weight", (64, 32)) and not is_muon_param("lm_head.weight", (64, 32))


def bf16_step_bound(cfg: OptimizerConfig, name: str, shape) -> float:
    """What one bf16 rounding of the Newton-Schulz output can move a weight in one Muon step: 2 bf16 spacings
    (2^-7 each, relative) of its largest entry, which for these small matrices is below 2, times the matrix's
    adjusted learning rate."""
    from optimizer.muon import adjusted_lr, matrices_of
    return 2 * 2.0 ** -7 * 2.0 * adjusted_lr(cfg.muon_lr, matrices_of(name, shape)[1:], cfg.muon_adjust_lr)


def test_moe_experts_are_muons_stacks_of_matrices():
    """The stacked expert weights are Muon's: gate_up_proj [E, 2I, D] as 2E matrices [I, D] (each expert's gate and
    up apart), down_proj as E; the router and the shared expert are plain matrices. The stack is orthogonalised by
    batched matmuls (one launch per op for all of a layer's experts), torch.optim.Muon's matrices one by one by 2-D
    ones, which may round a bf16 product differently: from the same start, one step equals torch.optim.Muon
    stepping each matrix as a tensor of its own (+ AdamW on the rest) bit for bit on every other weight and within
    a bf16 rounding of the orthogonalised update on the experts; AdamW on the experts lands far outside that."""
    from optimizer.muon import matrices_of, orthogonalise, zeropower_via_newtonschulz
    m = tiny_model(torch.float32, moe=True)
    names = {n for n, p in m.named_parameters() if is_muon_param(n, p.shape)}
    assert {"layers.1.mlp.experts.gate_up_proj", "layers.1.mlp.experts.down_proj", "layers.1.mlp.router.weight",
            "layers.1.mlp.shared_experts.up_proj.weight", "layers.0.mlp.gate_proj.weight"} <= names
    assert matrices_of("layers.1.mlp.experts.gate_up_proj", (4, 32, 32)) == (8, 16, 32)
    assert matrices_of("layers.1.mlp.experts.down_proj", (4, 32, 16)) == (4, 32, 16)
    g = torch.randn(4, 32, 32, generator=torch.Generator().manual_seed(0))
    one_by_one = torch.stack([zeropower_via_newtonschulz(x) for x in g.view(8, 16, 32)]).view(4, 32, 32)
    torch.testing.assert_close(orthogonalise(g, "x.experts.gate_up_proj", (4, 32, 32)).float(), one_by_one.float(),
                               atol=2 * 2.0 ** -7 * float(one_by_one.abs().max()), rtol=0)
    cfg, data = muon_config(grad_clip=0.0), batches(1)
    ref = reference_run(tiny_model(torch.float32, moe=True), cfg, data)
    ours, _, opt = our_run(tiny_model(torch.float32, moe=True), cfg, data)
    assert {mm.name for mm in opt.muon.matrices} == names
    stacks = {n: tuple(p.shape) for n, p in m.named_parameters() if p.ndim == 3}
    for n in ref:
        bound = bf16_step_bound(cfg, n, stacks[n]) if n in stacks else 0.0
        assert float((ours[n] - ref[n]).abs().max()) <= bound, (n, float((ours[n] - ref[n]).abs().max()), bound)
    adamw = reference_run(tiny_model(torch.float32, moe=True), cfg, data, kind="adamw")
    assert all(float((adamw[n] - ref[n]).abs().max()) > 10 * bf16_step_bound(cfg, n, s) for n, s in stacks.items())


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_one_process_fp32_equals_torch_muon_and_adamw_bit_for_bit(adjust):
    """fp32 model (the masters are the parameters), clipping off: the same gradients reach the same ops in
    the same order, so 5 steps equal torch's optimizers bit for bit (tighter than any rounding rule)."""
    cfg, data = muon_config(muon_adjust_lr=adjust, grad_clip=0.0), batches()
    ref32 = reference_run(tiny_model(torch.float32), cfg, data)
    ours, _, opt = our_run(tiny_model(torch.float32), cfg, data)
    assert max_diff(ours, ref32) == 0.0
    assert opt.muon is not None and len(opt.muon.matrices) == 14
    # the test can fail: AdamW on the matrices lands elsewhere
    assert max_diff(reference_run(tiny_model(torch.float32), cfg, data, kind="adamw"), ref32) > 1e-3


def test_one_process_clipped_within_the_references_rounding():
    """Clipping on (and active): our clip coefficient is computed in another order than clip_grad_norm_'s, so
    the bits may differ; the bound is the reference's own rounding, the largest difference between torch's
    optimizers run in fp32 and in fp64 from the same start (the Newton-Schulz runs in bf16 in both, so a
    last-bit input difference may flip a bf16 rounding: the reference's noise)."""
    cfg, data = muon_config(grad_clip=0.05), batches()
    ref64 = reference_run(tiny_model(torch.float64), cfg, data)
    ref32 = reference_run(tiny_model(torch.float32), cfg, data)
    ours, ddp, opt = our_run(tiny_model(torch.float32), cfg, data)
    tol = max_diff(ref32, ref64)
    assert max_diff(ours, ref32) <= tol, (max_diff(ours, ref32), tol)
    unclipped, _, _ = our_run(tiny_model(torch.float32), muon_config(grad_clip=0.0), data)
    assert max_diff(unclipped, ref32) > tol  # the clip was active: without it the run lands elsewhere


def test_one_process_bf16_params_within_the_references_rounding():
    """bf16 parameters with fp32 masters and momentum: closer to the fp32 reference than the reference itself
    run on bf16 parameters (its own rounding at that precision)."""
    cfg, data = muon_config(precision="bf16"), batches()
    ref32 = reference_run(tiny_model(torch.float32), cfg, data)
    ref16 = reference_run(tiny_model(torch.bfloat16), cfg, data)
    ours, _, opt = our_run(tiny_model(torch.bfloat16), cfg, data, DDPConfig(grad_reduce_in_fp32=True))
    assert all(pc.main.dtype == torch.float32 for pc in opt.pieces)
    assert all(m.momentum.dtype == torch.float32 for m in opt.muon.matrices)
    assert max_diff(ours, ref32) <= max_diff(ref16, ref32), (max_diff(ours, ref32), max_diff(ref16, ref32))


def test_schedule_scales_muon_lr_and_overflow_skips():
    cfg, data = muon_config(precision="fp16", initial_loss_scale=2.0 ** 10, hysteresis=1), batches(2)
    m = tiny_model(torch.float16)
    ddp = DistributedDataParallel(m, DDPConfig(grad_reduce_in_fp32=True))
    opt = build_optimizer(ddp, cfg)
    opt.set_lr(cfg.lr / 2)
    assert opt.muon.current_lr() == pytest.approx(cfg.muon_lr / 2)
    x, y = data[0]
    opt.zero_grad()
    (ddp(x, labels=y) * float("inf")).backward()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    stepped, _ = opt.step()
    assert not stepped and opt.muon.steps == 0
    assert all(torch.equal(before[n], p) for n, p in m.named_parameters())
    assert all(not mm.momentum.any() for mm in opt.muon.matrices)  # a skipped step leaves the momentum


@pytest.mark.parametrize("zero", [False, True])
def test_state_round_trip_resumes_bit_exact_and_refuses_a_switch(zero):
    """4 steps == 2 steps, state_dict -> a fresh optimizer (load_state_dict) -> 2 steps, bit for bit."""
    cfg = muon_config(precision="bf16", use_distributed_optimizer=zero)
    ddp_cfg = DDPConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=zero)
    data = batches(4)
    full, _, _ = our_run(tiny_model(torch.bfloat16), cfg, data, ddp_cfg)
    _, ddp, opt = our_run(tiny_model(torch.bfloat16), cfg, data[:2], ddp_cfg)
    sd = copy.deepcopy(opt.state_dict())
    assert sd["optimizer"] == "muon"
    assert any("momentum" in e and e["momentum"].abs().sum() > 0 for e in sd["params"].values())
    model2 = tiny_model(torch.bfloat16)
    ddp2 = DistributedDataParallel(model2, ddp_cfg)
    opt2 = build_optimizer(ddp2, cfg)
    opt2.load_state_dict(sd)
    for x, y in data[2:]:
        opt2.zero_grad()
        ddp2(x, labels=y).backward()
        opt2.step()
    resumed = {n: p.detach().double() for n, p in model2.named_parameters()}
    assert all(torch.equal(full[n], resumed[n]) for n in full)
    adamw = build_optimizer(DistributedDataParallel(tiny_model(torch.bfloat16), ddp_cfg),
                            OptimizerConfig(precision="bf16", use_distributed_optimizer=zero))
    with pytest.raises(ValueError, match="switching optimizers on resume is refused"):
        adamw.load_state_dict(sd)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_muon_within_the_references_rounding():
    """Our Muon on the GPU against torch.optim.Muon + AdamW on the GPU: 5 steps, clipping off, within 4x the
    reference's own fp32-vs-fp64 distance (cuBLAS may order the Newton-Schulz products' sums differently)."""
    cfg = muon_config(grad_clip=0.0)
    data = [(x.cuda(), y.cuda()) for x, y in batches()]
    ref32 = reference_run(tiny_model(torch.float32).cuda(), cfg, data)
    ref64 = reference_run(tiny_model(torch.float64).cuda(), cfg, data)
    ours, _, opt = our_run(tiny_model(torch.float32).cuda(), cfg, data)
    assert opt.muon is not None and len(opt.muon.matrices) == 14
    assert max_diff(ours, ref32) <= 4 * max_diff(ref32, ref64) + 1e-7


@pytest.mark.parametrize("flags, named", [
    ({"muon_momentum": 1.5}, "--muon_momentum=1.5: must be in [0, 1)"),
    ({"muon_momentum": -0.5}, "--muon_momentum=-0.5: must be in [0, 1)"),
    ({"muon_momentum": 1.0}, "--muon_momentum=1.0: must be in [0, 1)"),
    ({"muon_lr": -1.0}, "--muon_lr=-1.0: must be a finite number >= 0 (0 = --learning_rate)"),
    ({"muon_lr": float("nan")}, "--muon_lr=nan"),
    ({"muon_weight_decay": -1.0}, "--muon_weight_decay=-1.0: must be a finite number >= 0"),
])
def test_muons_bad_numbers_are_one_exit_2_error_as_adamws_are(flags, named):
    from trainer.config import TrainConfig, TrainingError
    from trainer.validation import validate_config
    cfg = TrainConfig(data_dir="d", tokenizer_dir="t", optimizer="muon", **flags)
    with pytest.raises(TrainingError) as e:
        validate_config(cfg, torch_free=True)
    assert e.value.code == 2 and named in str(e.value), str(e.value)
    validate_config(TrainConfig(data_dir="d", tokenizer_dir="t", optimizer="muon", muon_momentum=0.0, muon_lr=0.0,
                                muon_weight_decay=0.0), torch_free=True)  # the edges that are allowed
