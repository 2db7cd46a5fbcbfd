"""--float8 (parallel/transforms/float8.py): the blocks' linear layers become torchao's FP8 training layers. On
CPU torchao emulates the FP8 matmul (the same casts and scales, the product in higher precision), which is what
is checked here against a hand-written FP8 reference; the FP8 tensor cores themselves need a GPU (not run here)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from model import ModelConfig, Transformer
from utils.device import fp8_matmul_problem

torchao = pytest.importorskip("torchao.float8")
from parallel.transforms import float8  # noqa: E402

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


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


def _fp8_tensorwise(t: torch.Tensor) -> torch.Tensor:
    """The reference cast: one scale per tensor, amax -> the largest e4m3 value, round to e4m3, back."""
    scale = E4M3_MAX / t.abs().amax().double().clamp(min=1e-12)
    return (t.double() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double() / scale


def test_a_converted_layer_computes_with_fp8_inputs_and_weights():
    """Forward of one converted layer = (x cast to e4m3) @ (w cast to e4m3)^T with tensorwise scales, within
    the reference's own fp32-vs-fp64 rounding; and it is measurably NOT the plain linear (FP8 really ran)."""
    torch.manual_seed(1)
    layer = nn.Sequential()
    layer.add_module("layers", nn.ModuleDict({"0": nn.ModuleDict({"q_proj": nn.Linear(32, 48, bias=False)})}))
    x = torch.randn(8, 32)
    plain = layer.layers["0"]["q_proj"](x).detach()
    assert float8.apply(layer, None, SimpleNamespace(float8="tensorwise", float8_layers="all"),
                        device=torch.device("cpu")) == 1
    w = layer.layers["0"]["q_proj"].weight.detach()
    y = layer.layers["0"]["q_proj"](x).detach().double()
    ref64 = _fp8_tensorwise(x) @ _fp8_tensorwise(w).T
    ref32 = (_fp8_tensorwise(x).float() @ _fp8_tensorwise(w).float().T).double()
    tol = 4 * (ref64 - ref32).abs().max().item() + 1e-6
    assert (y - ref64).abs().max().item() <= tol
    assert (plain.double() - ref64).abs().max().item() > 100 * tol  # the FP8 rounding is visible


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
    (["--float8=tensorwise", "--pipeline_parallel_size=2", "--gradient_accumulation_steps=2"],
     "--float8=tensorwise cannot be combined with --pipeline_parallel_size=2"),
])
def test_layouts_fp8_cannot_run_are_one_line(flags, expect):
    from trainer.config import TrainConfig, TrainingError, validate_config
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
    """3 steps with --float8 against the same run without (our DDP at 1 process, FSDP2 at 2): the
    losses differ (FP8 ran) by less than e4m3's relative rounding step (2^-3: the inputs and weights of every
    block matmul carry at most half of it)."""
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
    assert 0 < max(rel) < 2 ** -3, (losses, rel)
