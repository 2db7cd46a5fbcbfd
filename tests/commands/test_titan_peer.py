"""The torchtitan peer row (bench/titan_peer.py, model `titan` of bench/bench_model_gpu.py) on the CPU: torchtitan
0.2.2's Llama 3 built at our tiny config holds our weights (the parameter count equal, the logits, loss and every
gradient equal to our model's within what fp32 rounding gives against a float64 run of ours, the same batch), and the
bench row runs its trainer's recipe (bf16 autocast over fp32 parameters, fused AdamW, clipping) for a few steps.
Skipped, saying why, where torchtitan is not importable (`make venv-dev` installs it: requirements-peers.txt)."""
import copy
import json
import os
import subprocess

import pytest
import torch

from tests.conftest import PY, ROOT

from bench import titan_peer  # noqa: E402  (imports no torchtitan at module import)



@pytest.fixture(autouse=True)
def _titan():
    """Skipped, saying why, without torchtitan. Asked when a test of this file runs, not at collection: importing
    torchtitan takes ~3 s, which every pytest worker would pay while collecting the suite."""
    why = titan_peer.titan_unavailable()
    if why is not None:
        pytest.skip(why)

EPS32 = torch.finfo(torch.float32).eps


@pytest.fixture
def bench(monkeypatch):
    import importlib.util
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # the bench module sets it on import; restored after
    spec = importlib.util.spec_from_file_location("bench_model_gpu_titan",
                                                  os.path.join(ROOT, "bench", "bench_model_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ours_and_batch(bench):
    """Our seed-0 Transformer at the bench's tiny config and the bench's batch (make_step's)."""
    from model import ModelConfig, Transformer
    spec = bench.CONFIGS["tiny"]
    torch.manual_seed(0)
    ours = Transformer(ModelConfig(**spec["model"]))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, spec["model"]["vocab_size"], (spec["batch"], spec["seq"]), generator=g)
    y = torch.cat((x[:, 1:], torch.full((spec["batch"], 1), -100)), dim=1)
    return ours, x, y


def _ours_loss_and_grads(model, x, y):
    """Our loss (mean over the target tokens) and its gradients as an HF-named state dict."""
    from model.hf_interop import to_hf_state_dict
    model.zero_grad(set_to_none=True)
    loss = model(x, labels=y)
    loss.backward()
    holder = copy.deepcopy(model)
    with torch.no_grad():
        for (_, p), (_, q) in zip(model.named_parameters(), holder.named_parameters()):
            q.copy_(p.grad)
    return loss.detach(), to_hf_state_dict(holder)


def test_titan_holds_our_weights_and_matches_our_logits_loss_and_gradients(bench):
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Llama3StateDictAdapter
    ours, x, y = _ours_and_batch(bench)
    T = x.shape[1]
    ours64 = copy.deepcopy(ours).double()
    titan = titan_peer.build_titan(ours, T, "cpu")
    assert sum(p.numel() for p in titan.parameters()) == sum(p.numel() for p in ours.parameters())

    with torch.no_grad():
        truth, ours32, got = ours64(x), ours(x), titan(x)
    tol = (ours32.double() - truth).abs().max().item()  # what fp32 rounding alone gives
    assert 0 < tol < 1e-4
    assert (got.double() - truth).abs().max().item() <= 4 * tol

    # its loss as its trainer computes it: the sum over tokens divided by the count of target tokens
    loss = cross_entropy_loss(titan(x), y) / (y != -100).sum().float()
    loss.backward()
    holder = copy.deepcopy(titan)
    with torch.no_grad():
        for (_, p), (_, q) in zip(titan.named_parameters(), holder.named_parameters()):
            q.copy_(p.grad)
    args = titan_peer.titan_args(ours.cfg, T)
    titan_grads = Llama3StateDictAdapter(args, None).to_hf(holder.state_dict())  # q/k permuted back to HF's

    loss64, grads64 = _ours_loss_and_grads(ours64, x, y)
    loss32, grads32 = _ours_loss_and_grads(ours, x, y)
    # (floors: a few fp32 steps of the value, where ours happens to round to float64's value)
    assert abs(loss.item() - loss64.item()) <= 4 * abs(loss32.item() - loss64.item()) + 4 * EPS32 * loss64.item()
    assert set(titan_grads) == set(grads64)
    for name, g64 in grads64.items():
        gtol = (grads32[name].double() - g64).abs().max().item()
        err = (titan_grads[name].double() - g64).abs().max().item()
        assert err <= 4 * gtol + 4 * EPS32 * g64.abs().max().item(), (name, err, gtol)


def test_its_rope_scaling_is_off_and_a_wrong_permutation_would_show(bench):
    """Its Llama 3 RoPE scales long wavelengths by default (Llama 3.1's scaling_factor 8); the row switches that off,
    and the logit check above would see it on, as it would see q/k loaded without its un-permutation."""
    from torchtitan.models.llama3 import Transformer
    from torchtitan.models.llama3.model.args import RoPEScalingArgs
    ours, x, _ = _ours_and_batch(bench)
    with torch.no_grad():
        truth = copy.deepcopy(ours).double()(x)
        tol = (ours(x).double() - truth).abs().max().item()
        scaled_args = titan_peer.titan_args(ours.cfg, x.shape[1])
        scaled_args.rope_scaling_args = RoPEScalingArgs(scaling_factor=8.0, original_max_position_embeddings=8)
        titan = titan_peer.build_titan(ours, x.shape[1], "cpu")
        scaled = Transformer(scaled_args)
        scaled.load_state_dict(titan.state_dict())
        assert (scaled(x).double() - truth).abs().max().item() > 100 * tol
        from model.hf_interop import to_hf_state_dict
        titan.layers["0"].attention.wq.weight.copy_(to_hf_state_dict(ours)["model.layers.0.self_attn.q_proj.weight"])
        assert (titan(x).double() - truth).abs().max().item() > 100 * tol


def test_without_datasets_it_imports_through_a_stand_in():
    """The GPU image has no `datasets`; torchtitan 0.2's llama3 package imports it. In a fresh interpreter where
    importing `datasets` fails, the row's modules import (the stand-in), and calling the stand-in raises."""
    code = ("import sys, importlib.abc\n"
            "class Block(importlib.abc.MetaPathFinder):\n"
            "    def find_spec(self, name, path, target=None):\n"
            "        if name == 'datasets' or name.startswith('datasets.'): raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from bench import titan_peer\n"
            "assert titan_peer.titan_unavailable() is None, titan_peer.titan_unavailable()\n"
            "import datasets\n"
            "try:\n"
            "    datasets.load_dataset('x')\n"
            "except RuntimeError as e:\n"
            "    print('raised:', e)\n")
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "raised: bench/titan_peer.py: `datasets` is not installed" in r.stdout


def test_the_titan_bench_row_runs_its_recipe(tmp_path, bench):
    """`--rows titan:titan:eager` on the CPU: a row with a speed, whose first loss is our model's on the same
    weights and batch within bf16 rounding (its trainer's autocast computes in bf16: one bf16 step of the loss
    value, 2**-8 relative), and whose loss falls over the steps (its AdamW steps)."""
    ours, x, y = _ours_and_batch(bench)
    with torch.no_grad():
        ref = ours(x, labels=y).item()
    out = tmp_path / "rows.json"
    r = subprocess.run([PY, os.path.join(ROOT, "bench", "bench_model_gpu.py"), "--device", "cpu", "--configs", "tiny",
                        "--rows", "titan:titan:eager", "--steps", "2", "--warmup", "1", "--json-out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row, row
    assert row["model"] == "titan" and row["precision"] == "titan" and row["tokens_per_s"] > 0
    assert abs(row["first_loss"] - ref) <= ref * 2 ** -8
    assert row["last_loss"] < row["first_loss"]
    assert "| tiny | titan | torchtitan's recipe" in r.stdout


def test_titan_runs_only_its_own_recipe(bench):
    for model_name, precision in (("titan", "trainer"), ("ours", "titan")):
        with pytest.raises(ValueError, match="model titan runs only at precision titan"):
            bench.make_step("tiny", model_name, "eager", precision, "cpu")


def test_without_torchtitan_the_row_says_not_installed(monkeypatch, bench):
    from types import SimpleNamespace
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name, *a: None if name == "torchtitan"
                        else real(name, *a))
    args = SimpleNamespace(configs=["tiny"], models=list(bench.MODELS), modes=["eager"], precisions=["titan"],
                           rows=["titan:titan:eager"], budget_s=0, json_out="", device="cpu", steps=1, warmup=0,
                           window=0, timeout=60, meta={})
    (row,) = bench.child_rows(args)
    assert row["skipped"].startswith("torchtitan not installed") and "tokens_per_s" not in row
