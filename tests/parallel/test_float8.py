"""--float8 (parallel/transforms/float8.py): the blocks' linear layers become torchao's FP8 training layers. On
CPU torchao emulates the FP8 matmul (the same casts and scales, the product in fp32), which is what is checked
here: bit for bit against torchao's own Float8Linear and conversion per recipe, against the FP8 products written
out within derived rounding bounds, which modules are converted with which config, and the trainer end to end.
The FP8 tensor cores themselves need a GPU (not run here)."""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from model import ModelConfig, Transformer
from utils.device import fp8_matmul_problem

torchao = pytest.importorskip("torchao.float8")
from parallel.transforms import float8  # noqa: E402


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=16))


def test_the_block_linears_and_only_they_are_converted_names_unchanged():
    model = _model()
    keys = list(model.state_dict())
    n = float8.apply(model, None, SimpleNamespace(float8="tensorwise", float8_layers="all"), device=torch.device("cpu"))
    assert n == 7 * 2  # q, k, v, o, gate, up, down in each of the 2 blocks
    converted = [name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    assert len(converted) == n and all(".layers." in f".{c}" for c in converted)
    assert type(model.lm_head) is nn.Linear  # the output layer stays in high precision
    assert list(model.state_dict()) == keys  # checkpoints and HF export see the same names
    assert float8.apply(_model(), None, SimpleNamespace(float8="off")) == 0


@pytest.mark.parametrize("recipe, shape, expect", [
    # 124M (768 x 12, hidden 2048): none. Tensorwise: torchao's filter kept gate/up (N 2048 > 1024), which lost on
    # an H200 (K 768 <= 1024); rowwise: N <= 2048 or K <= 1024
    ("tensorwise", dict(dim=768, n_heads=12, hidden_dim=2048), []),
    ("rowwise", dict(dim=768, n_heads=12, hidden_dim=2048), []),
    # 1B (2048 x 16, GQA 8, hidden 5632): tensorwise all but k/v (N 1024, K 2048); rowwise gate/up (N 5632)
    ("tensorwise", dict(dim=2048, n_heads=16, n_kv_heads=8, hidden_dim=5632),
     ["down_proj", "gate_proj", "o_proj", "q_proj", "up_proj"]),
    ("rowwise", dict(dim=2048, n_heads=16, n_kv_heads=8, hidden_dim=5632), ["gate_proj", "up_proj"]),
])
def test_auto_converts_only_the_layers_large_enough_to_gain(recipe, shape, expect, caplog):
    """--float8_layers=auto (the default): torchao's H100 size thresholds per recipe pick the layers; the
    choice is one log line. Built on the meta device (no memory), one block."""
    with torch.device("meta"):
        model = Transformer(ModelConfig(vocab_size=64, n_layers=1, max_seq_len=16, **shape))
    chosen = sorted(fqn.rsplit(".", 1)[-1] for fqn, m in model.named_modules()
                    if float8.converts(fqn, m, recipe, "auto"))
    assert chosen == expect
    assert len([f for f, m in model.named_modules() if float8.converts(f, m, recipe, "all")]) == 7
    assert float8.worth_fp8("tensorwise", 1024, 4096) is False and float8.worth_fp8("tensorwise", 1040, 4096)
    assert float8.worth_fp8("tensorwise", 2048, 768) is False and float8.worth_fp8("tensorwise", 2048, 1040)
    assert float8.worth_fp8("tensorwise", 4112, 768)  # wide enough: torchao's rule alone
    small = _model()
    with caplog.at_level("INFO", logger="parallel.transforms.float8"):
        assert float8.apply(small, None, SimpleNamespace(float8=recipe), device=torch.device("cpu")) == 0
    assert "0 of 14 block linears in FP8" in caplog.text and "--float8_layers=all" in caplog.text


# How FP8 computes a @ b, per recipe and per matmul of a linear layer y = x @ w.T (forward y; backward
# grad_input = go @ w and grad_weight = go.T @ x): the fp8 dtype of a and of b. Tensorwise: one scale per operand,
# e4m3 forward, the output gradient in e5m2. Rowwise: e4m3 throughout, a scaled per row and b per column (the
# rows and columns the product runs along), each scale rounded down to a power of 2.
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CAST_DTYPES = {"tensorwise": {"y": (E4M3, E4M3), "grad_input": (E5M2, E4M3), "grad_weight": (E5M2, E4M3)},
               "rowwise": {"y": (E4M3, E4M3), "grad_input": (E4M3, E4M3), "grad_weight": (E4M3, E4M3)}}
U32 = 2.0 ** -24  # fp32's unit roundoff
# Half the spacing of an fp8 format, relative (normal range: 3 mantissa bits -> 2^-4, 2 -> 2^-3) and absolute
# below the smallest normal (half the smallest subnormal, in the scaled units: e4m3 2^-9 / 2, e5m2 2^-16 / 2)
FP8_HALF_STEP = {E4M3: (2.0 ** -4, 2.0 ** -10), E5M2: (2.0 ** -3, 2.0 ** -17)}


def _cast(t: torch.Tensor, dtype: torch.dtype, dim, pow2: bool):
    """Dynamic scaling and the fp8 cast, written out: the scale maps the amax (over `dim`, or the whole tensor when
    None) to the format's largest value; (t * scale) rounded to fp8 (nearest, saturating). Returns the cast value
    back in fp64 (exact: fp8 / scale) and the scale."""
    fmax = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (fmax / amax.double().clamp(min=1e-12)).float()
    if pow2:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q.double() / scale.double(), scale.double()


def _fp8_matmul(a: torch.Tensor, b: torch.Tensor, dtypes, recipe: str):
    """a @ b as FP8 computes it. Returns (ref, acc, fp8):
    ref: the product of the fp8-cast operands in fp64 (its own rounding, (K + 2) 2^-53 relative, is in acc's slack);
    acc: how far an fp32 product of those operands can be from ref: torchao's emulation divides each fp8 value by
      its scale in fp32 (one rounding, relative U32) and multiplies in fp32 (K terms: gamma_K = K u / (1 - K u) of
      the sum of |terms|), so |y - ref| <= ((1 + u)^2 (1 + gamma_K) - 1) * (|a8| @ |b8|), plus fp64's own rounding;
    fp8: how far the fp32 product can be from the exact a @ b: each cast element is within h|v| + s/scale of v
      (h, s: FP8_HALF_STEP; plus 2u for the fp32 multiply by the scale and the saturation of the amax element), so
      |a8 b8 - a b| <= ea |b| + |a| eb + ea eb per term, plus acc."""
    rowwise = recipe == "rowwise"
    a8, sa = _cast(a, dtypes[0], -1 if rowwise else None, rowwise)
    b8, sb = _cast(b, dtypes[1], 0 if rowwise else None, rowwise)
    k = a.shape[-1]
    gamma = k * U32 / (1 - k * U32)
    acc = ((1 + U32) ** 2 * (1 + gamma) - 1 + 2 * k * 2.0 ** -53) * (a8.abs() @ b8.abs())
    (ha, la), (hb, lb) = FP8_HALF_STEP[dtypes[0]], FP8_HALF_STEP[dtypes[1]]
    ea = (ha + 2 * U32) * a.double().abs() + la / sa
    eb = (hb + 2 * U32) * b.double().abs() + lb / sb
    fp8 = ea @ b.double().abs() + a.double().abs() @ eb + ea @ eb + acc
    return a8 @ b8, acc, fp8


def _block_linear(in_features: int, out_features: int, seed: int = 1) -> nn.Module:
    """One linear at a block's path (layers.0.q_proj), the only thing in the module tree; weight rows spread
    over 2^-3..2^3 so that one scale per tensor and one per row round differently."""
    torch.manual_seed(seed)
    root = nn.Module()
    root.layers = nn.ModuleDict({"0": nn.ModuleDict({"q_proj": nn.Linear(in_features, out_features, bias=False)})})
    with torch.no_grad():
        root.layers["0"]["q_proj"].weight.mul_(torch.logspace(-3, 3, out_features, base=2).unsqueeze(1))
    return root


def _inputs(m: int, k: int, n: int, seed: int = 2):
    """x (m, k) and the output gradient (m, n), their rows' magnitudes spread over 2^-6..2^6 and 2^-4..2^4."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 6, m, base=2).unsqueeze(1)
    go = torch.randn(m, n, generator=g) * torch.logspace(-4, 4, m, base=2).unsqueeze(1)
    return x, go


def _converted(root: nn.Module, recipe: str) -> nn.Module:
    assert float8.apply(root, None, SimpleNamespace(float8=recipe, float8_layers="all"),
                        device=torch.device("cpu")) == 1
    return root.layers["0"]["q_proj"]


def _torchao_reference(linear: nn.Linear, recipe: str) -> nn.Module:
    """torchao's own FP8 training layer for this recipe, built directly from a copy of the linear (its emulation:
    the CPU has no FP8 matmul)."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    return Float8Linear.from_float(copy.deepcopy(linear), config=config)


def _forward_backward(layer: nn.Module, x: torch.Tensor, go: torch.Tensor):
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    y = layer(x)
    y.backward(go)
    return y.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_a_converted_layer_is_torchaos_float8_linear_for_the_recipe_bit_for_bit(recipe):
    """The converted layer against torchao's Float8Linear built from the same weights with the recipe's own config:
    the same casts and the same products, so the forward output and both gradients are equal bit for bit (3-D
    input, as the blocks feed it). And the other recipe's layer differs (the recipe matters on these inputs)."""
    root = _block_linear(64, 48)
    plain = copy.deepcopy(root.layers["0"]["q_proj"])
    x, go = _inputs(16, 64, 48)
    x, go = x.reshape(2, 8, 64), go.reshape(2, 8, 48)
    ours = _forward_backward(_converted(root, recipe), x, go)
    ref = _forward_backward(_torchao_reference(plain, recipe), x, go)
    for name, a, b in zip(("output", "input gradient", "weight gradient"), ours, ref):
        assert torch.equal(a, b), (recipe, name, (a - b).abs().max().item())
    other = _forward_backward(_torchao_reference(plain, next(r for r in float8.RECIPES if r != recipe)), x, go)
    assert all(not torch.equal(a, b) for a, b in zip(ours, other))


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_a_converted_layer_computes_the_fp8_products_of_its_recipe(recipe):
    """Forward and backward of one converted layer against the FP8 products written out (`_fp8_matmul`): each of
    y = x w^T, grad_input = go w and grad_weight = go^T x within fp32's accumulation bound of the exact product of
    the recipe's fp8-cast operands, and within FP8's rounding bound of the exact full-precision product. Both bounds
    are derived per element (no tolerance taken from a run). The other recipe's products and the full-precision
    ones lie outside the accumulation bound (so FP8 ran, with this recipe's scales)."""
    root = _block_linear(64, 48)
    w = root.layers["0"]["q_proj"].weight.detach().clone()
    x, go = _inputs(16, 64, 48)
    y, gx, gw = _forward_backward(_converted(root, recipe), x, go)
    other = next(r for r in float8.RECIPES if r != recipe)
    for name, got, a, b in (("y", y, x, w.T), ("grad_input", gx, go, w), ("grad_weight", gw, go.T, x)):
        ref, acc, fp8 = _fp8_matmul(a, b, CAST_DTYPES[recipe][name], recipe)
        got = got.double()
        assert ((got - ref).abs() <= acc).all(), (recipe, name, ((got - ref).abs() / acc).max().item())
        exact = a.double() @ b.double()
        assert ((got - exact).abs() <= fp8).all(), (recipe, name, ((got - exact).abs() / fp8).max().item())
        assert ((got - exact).abs() > 10 * acc).any(), (recipe, name)  # the FP8 rounding is visible
        ref_other, acc_other, _ = _fp8_matmul(a, b, CAST_DTYPES[other][name], other)
        assert ((got - ref_other).abs() > 10 * (acc + acc_other)).any(), (recipe, name, other)


def _expected_config(recipe: str):
    from torchao.float8 import Float8LinearConfig
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)


@pytest.mark.parametrize("layers", ["all", "auto"])
@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_the_converted_modules_their_recipe_and_what_auto_converts(recipe, layers, caplog):
    """Which nn.Linear became which module: on a 1B-shaped model (2048 x 16 heads, GQA 8, hidden 5632; two blocks
    on the meta device), --float8_layers=all turns all 7 block linears of each block into torchao Float8Linear;
    auto only those worth_fp8 picks (tensorwise: all but k/v, N 1024 K 2048; rowwise: gate/up, N 5632). Every
    other module keeps its exact type (the LM head stays nn.Linear), each converted module keeps its weight
    Parameter, and carries the recipe's config: scaling granularity (one scale per tensor vs per row), the fp8
    dtypes, power-of-2 scales, emulation on CPU. The count returned and the log line name what was converted."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    with torch.device("meta"):
        model = Transformer(ModelConfig(vocab_size=64, n_layers=2, max_seq_len=16, dim=2048, n_heads=16,
                                        n_kv_heads=8, hidden_dim=5632))
    before = {fqn: (type(m), getattr(m, "weight", None)) for fqn, m in model.named_modules()}
    with caplog.at_level("INFO", logger="parallel.transforms.float8"):
        n = float8.apply(model, None, SimpleNamespace(float8=recipe, float8_layers=layers), device=torch.device("cpu"))
    kinds = {"all": float8.BLOCK_LINEARS,
             "auto": {"tensorwise": ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                      "rowwise": ("gate_proj", "up_proj")}[recipe]}[layers]
    expect = {f"layers.{i}.{a}.{k}" for i in range(2) for k in kinds
              for a in (("self_attn",) if k in ("q_proj", "k_proj", "v_proj", "o_proj") else ("mlp",))}
    after = dict(model.named_modules())
    assert set(after) == set(before)  # the same tree, the same names
    converted = {fqn for fqn, m in after.items() if type(m) is not before[fqn][0]}
    assert converted == expect, sorted(converted ^ expect)
    assert n == len(expect)
    granularity = ScalingGranularity.TENSORWISE if recipe == "tensorwise" else ScalingGranularity.AXISWISE
    for fqn in expect:
        m = after[fqn]
        assert type(m) is Float8Linear and before[fqn][0] is nn.Linear
        assert m.weight is before[fqn][1] and m.weight.dtype == torch.float32
        assert m.config == _expected_config(recipe)
        c = m.config
        for cast in (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output,
                     c.cast_config_input_for_grad_weight, c.cast_config_weight_for_grad_input,
                     c.cast_config_grad_output_for_grad_weight):
            assert cast.scaling_granularity is granularity
        assert c.cast_config_grad_output.target_dtype == (E5M2 if recipe == "tensorwise" else E4M3)
        assert c.cast_config_input.target_dtype == c.cast_config_weight.target_dtype == E4M3
        assert c.round_scales_to_power_of_2 is (recipe == "rowwise") and c.emulate is True
    assert type(model.lm_head) is nn.Linear
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith(f"--float8={recipe}:"))
    assert f"{len(expect)} of 14 block linears in FP8 ({', '.join(sorted(kinds))})" in line, line


def _trainer_shaped_model() -> Transformer:
    """The trainer test's model: dim 32, 2 blocks, 4 heads, hidden 96 (--multiple_of=16's), its tokenizer's
    vocabulary of 384 and sequences of 32 (tests/conftest.py `tiny_pretrain_data`)."""
    torch.manual_seed(7)
    return Transformer(ModelConfig(vocab_size=384, dim=32, n_layers=2, n_heads=4, hidden_dim=96, max_seq_len=32))


@pytest.mark.parametrize("recipe", float8.RECIPES)
def test_a_converted_model_matches_torchao_and_stays_within_fp8s_first_order_bound(recipe):
    """The whole model converted by --float8 against the same model converted by torchao itself (every block
    linear, the recipe's config): loss and every parameter's gradient equal bit for bit.

    And the loss against full precision on the same inputs, bounded from FP8's rounding. To first order (the
    second-order terms carry another factor of the rounding step) the loss moves by the sum over the block linears
    of <dL/dy, dy>, with dy = dx w^T + x dw^T from the rounding errors dx, dw of the e4m3 casts of the input and the
    weight (each element within `_fp8_matmul`'s per-element bound e; dL/dy from the full-precision backward on the
    same inputs). Worst case, every error aligned: |L_fp8 - L| <= sum <|dL/dy|, bound of dy>. Round-to-nearest
    errors are zero-mean and independent across elements (the same input cast for q, k and v is one error), so the
    sum is one of independent bounded terms c = e * |coefficient| and Hoeffding's inequality bounds it by
    sqrt(2 ln(2 / 1e-6) * sum c^2) but with probability 1e-6: the bound asserted. Relative to the loss, that bound on
    the trainer test's model at initialization is under 2^-10, the bound that test holds its step-1 loss to.
    """
    from torchao.float8 import convert_to_float8_training
    model = _trainer_shaped_model()
    g = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 384, (4, 32), generator=g), torch.randint(0, 384, (4, 32), generator=g)
    ours, ref = copy.deepcopy(model), copy.deepcopy(model)
    assert float8.apply(ours, None, SimpleNamespace(float8=recipe, float8_layers="all"),
                        device=torch.device("cpu")) == 14
    convert_to_float8_training(ref, config=_expected_config(recipe),
                               module_filter_fn=lambda m, fqn: fqn.rsplit(".", 1)[-1] in float8.BLOCK_LINEARS)
    loss_ours, loss_ref = ours(ids, labels=labels), ref(ids, labels=labels)
    loss_ours.backward()
    loss_ref.backward()
    assert torch.equal(loss_ours, loss_ref), (loss_ours.item(), loss_ref.item())
    grads_ref = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p.grad, grads_ref[name].grad), name

    seen = {}
    def keep(fqn):
        def hook(mod, inp, out):
            out.retain_grad()
            seen[fqn] = (inp[0].detach(), mod.weight.detach(), out)
        return hook
    for fqn, m in model.named_modules():
        if hasattr(m, "fused_qkv"):
            m.fused_qkv = False  # each projection its own matmul (same product), so that its hook sees it
        if fqn.rsplit(".", 1)[-1] in float8.BLOCK_LINEARS:
            m.register_forward_hook(keep(fqn))
    loss = model(ids, labels=labels)
    loss.backward()
    assert len(seen) == 14
    worst, squares = 0.0, 0.0
    (h, s), rowwise = FP8_HALF_STEP[E4M3], recipe == "rowwise"
    def cast_error(t):  # each element's FP8 rounding error bound, as in `_fp8_matmul`
        _, scale = _cast(t, E4M3, -1 if rowwise else None, rowwise)
        return (h + 2 * U32) * t.double().abs() + s / scale
    shared = {}  # q/k/v (and gate/up) cast the same input with the same scales: one rounding error for them
    for x, w, y in seen.values():
        x, dy = x.reshape(-1, x.shape[-1]), y.grad.reshape(-1, y.shape[-1]).double()
        _, _, bound = _fp8_matmul(x, w.T, CAST_DTYPES[recipe]["y"], recipe)
        worst += (dy.abs() * bound).sum().item()
        squares += ((cast_error(w) * (dy.T @ x.double())) ** 2).sum().item()
        shared.setdefault((x.data_ptr(), x.shape), [x, 0])[1] += dy @ w.double()
    for x, dx in shared.values():
        squares += ((cast_error(x) * dx) ** 2).sum().item()
    likely = math.sqrt(2 * math.log(2 / 1e-6) * squares)
    diff = abs(loss_ours.item() - loss.item())
    assert 0 < diff <= likely <= worst, (diff, likely, worst)
    assert likely / loss.item() < 2 ** -10, likely / loss.item()


def test_the_mtp_depths_blocks_are_converted_and_train():
    """A model with a multi-token prediction depth (DeepSeek-V3 ran its MTP modules in FP8 like the trunk): the
    depth's 7 block linears become Float8Linear like the model's, its [2 dim -> dim] projection and the LM head stay
    nn.Linear; a training forward records the depth's loss and every depth weight gets a finite gradient."""
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, hidden_dim=64, max_seq_len=16,
                                    mtp_num_layers=1))
    assert float8.apply(model, None, SimpleNamespace(float8="tensorwise", float8_layers="all"),
                        device=torch.device("cpu")) == 14
    depth = model.mtp.depths[0]
    assert all(type(getattr(depth.block.self_attn, k)) is Float8Linear for k in ("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"))
    assert all(type(getattr(depth.block.mlp, k)) is Float8Linear for k in ("gate_proj", "up_proj", "down_proj"))
    assert type(depth.eh_proj) is nn.Linear and type(model.lm_head) is nn.Linear
    x = torch.randint(0, 64, (2, 12))
    loss = model(x, labels=torch.roll(x, -1, 1), reduction="sum")
    mtp_sum, stats = model.mtp.take()
    (loss + mtp_sum).backward()
    assert stats[0, 1] > 0 and all(p.grad is not None and torch.isfinite(p.grad).all() for p in depth.parameters())


def test_latent_attentions_projections_are_converted_and_train():
    """Multi-head latent attention (model/mla.py): its four latent projections and o_proj become Float8Linear with the
    MLP's (DeepSeek-V3 trained them in FP8), its latent norms and the LM head stay; a step's gradients are finite."""
    from torchao.float8.float8_linear import Float8Linear
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_seq_len=16,
                                    kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=16,
                                    v_head_dim=8))
    assert float8.apply(model, None, SimpleNamespace(float8="tensorwise", float8_layers="all"),
                        device=torch.device("cpu")) == 8 * 2
    a = model.layers[0].self_attn
    assert all(type(getattr(a, k)) is Float8Linear for k in float8.MLA_LINEARS + ("o_proj",))
    assert type(model.lm_head) is nn.Linear and type(a.kv_a_layernorm).__name__ == "RMSNorm"
    x = torch.randint(0, 64, (2, 12))
    model(x, labels=torch.roll(x, -1, 1)).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_a_layer_whose_dimensions_are_not_multiples_of_16_is_never_converted(caplog):
    """The FP8 matmul needs both dimensions of a weight to be multiples of 16: such a layer is left in full
    precision (skipped, not refused: it is not counted among the candidates either), with --float8_layers=all and
    with auto where it would be large enough to gain."""
    lin = lambda n, k: nn.Linear(k, n, bias=False, device="meta")  # noqa: E731
    for recipe in float8.RECIPES:
        for layers in ("all", "auto"):
            assert float8.converts("layers.0.mlp.gate_proj", lin(8192, 4096), recipe, layers)
            assert not float8.converts("layers.0.mlp.gate_proj", lin(8200, 4096), recipe, layers)
            assert not float8.converts("layers.0.mlp.down_proj", lin(4096, 8200), recipe, layers)
            assert not float8.converts("layers.0.mlp.down_proj", lin(4104, 8192), recipe, layers)
    # all: hidden 72 = 16 * 4.5 -> q/k/v/o (32 x 32) converted, gate/up (72 x 32) and down (32 x 72) not
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, hidden_dim=72, max_seq_len=16))
    with caplog.at_level("INFO", logger="parallel.transforms.float8"):
        assert float8.apply(model, None, SimpleNamespace(float8="tensorwise", float8_layers="all"),
                            device=torch.device("cpu")) == 8
    kinds = {fqn.rsplit(".", 1)[-1]: type(m).__name__ for fqn, m in model.named_modules()
             if fqn.rsplit(".", 1)[-1] in float8.BLOCK_LINEARS}
    assert kinds == {k: "Float8Linear" for k in ("q_proj", "k_proj", "v_proj", "o_proj")} | {
        k: "Linear" for k in ("gate_proj", "up_proj", "down_proj")}
    assert "8 of 8 block linears in FP8" in caplog.text
    x = torch.randint(0, 64, (2, 16))
    assert torch.isfinite(model(x)).all()  # the mixed model runs
    # auto at 1B shape with hidden 5640 = 16 * 352.5: gate/up/down would gain but are skipped; q and o converted
    with torch.device("meta"):
        big = Transformer(ModelConfig(vocab_size=64, n_layers=1, max_seq_len=16, dim=2048, n_heads=16,
                                      n_kv_heads=8, hidden_dim=5640))
    assert float8.apply(big, None, SimpleNamespace(float8="tensorwise", float8_layers="auto"),
                        device=torch.device("cpu")) == 2
    assert sorted(fqn.rsplit(".", 1)[-1] for fqn, m in big.named_modules()
                  if type(m).__name__ == "Float8Linear") == ["o_proj", "q_proj"]


def test_fp8_support_by_compute_capability():
    assert fp8_matmul_problem("cpu") is None  # emulation
    assert fp8_matmul_problem("cuda", capability=(9, 0)) is None
    assert fp8_matmul_problem("cuda", capability=(8, 9)) is None
    line = fp8_matmul_problem("cuda", capability=(8, 0))
    assert line and "compute capability 8.0" in line and "8.9" in line


@pytest.mark.parametrize("flags, expect", [
    (["--float8=fp4"], "--float8='fp4' (off | tensorwise | rowwise)"),
    (["--float8=rowwise", "--parallel=fsdp", "--tensor_parallel_size=2"],
     "--float8=rowwise cannot be combined with --tensor_parallel_size=2 yet"),
])
def test_layouts_fp8_cannot_run_are_one_line(flags, expect):
    from trainer.config import TrainConfig, TrainingError
    from trainer.validation import validate_config
    from utils.configurator import parse_config
    cfg = parse_config(TrainConfig(), ["--data_dir=d", "--tokenizer_dir=t", *flags])
    with pytest.raises(TrainingError) as e:
        validate_config(cfg, world_size=2, torch_free=True)
    assert expect in str(e.value)


def _losses(out) -> list[float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [r["loss"] for r in (json.loads(line) for line in f if line.strip()) if "loss" in r]


@pytest.mark.parametrize("engine, nproc, recipe", [("ddp", 1, "tensorwise"), ("ddp", 1, "rowwise"),
                                                  ("fsdp", 2, "tensorwise")])
def test_the_trainer_trains_with_fp8_close_to_full_precision(engine, nproc, recipe, tiny_pretrain_run_args, tmp_path):
    """3 steps with --float8 against the same run without (our DDP at 1 process, FSDP2 at 2). Step 1: both runs
    hold the same weights and batch, only the forward's FP8 rounding differs: the losses differ (FP8 ran) by less
    than 2^-10 relative, the first-order bound of FP8's rounding for this model at initialization that
    test_a_converted_model_matches_torchao_and_stays_within_fp8s_first_order_bound derives and checks on its shape
    (Hoeffding over the e4m3 casts' independent rounding errors, 1e-6 failure probability). Steps 2-3 also carry
    AdamW updates from FP8 gradients, for which no bound is derived here: held only to a coarse 2^-3. These
    losses are not where a wrong FP8 layer is caught (at initialization the blocks move this loss by the same
    order as the step-1 bound, even when they output zeros): the layer and model tests above compare the outputs
    and gradients themselves."""
    from tests.conftest import child_env, run_cmd, train_cmd
    env = child_env()
    batch = ["--batch_size=2"] if nproc == 2 else []
    losses = {}
    for name, extra in (("full", []), ("fp8", [f"--float8={recipe}"])):
        out = tmp_path / name
        proc = run_cmd(train_cmd([*tiny_pretrain_run_args, *batch, f"--out_dir={out}", "--max_iters=3",
                                  f"--parallel={engine}", *extra, "--float8_layers=all"], nproc), env=env)
        assert (name == "fp8") == (f"FP8 block matmuls ({recipe}, every layer)" in proc.stdout)
        losses[name] = _losses(out)
    assert len(losses["fp8"]) == len(losses["full"]) == 3
    rel = [abs(a - b) / abs(b) for a, b in zip(losses["fp8"], losses["full"])]
    print(f"[float8] {engine} {recipe}: losses {losses}, relative differences {rel}")
    assert 0 < rel[0] < 2 ** -10, (losses, rel)
    assert max(rel) < 2 ** -3, (losses, rel)
