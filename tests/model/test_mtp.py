"""Multi-token prediction (model/mtp.py): the shifted targets against a loop written out position by position, the
depths' losses and every gradient against DeepSeek-V3's formula written out in plain torch (float64), packed samples
equal to the same samples as separate rows (no target crosses a sample), the paths that must not run it, and a
model without MTP unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from model.moe import MoEFeedForward
from model.mtp import targets
from utils.constants import IGNORE_INDEX

V = 48


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=V, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, max_seq_len=32,
                mtp_num_layers=2, loss_chunk_size=5)
    return ModelConfig(**{**base, **kw})


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    return Transformer(_cfg(**kw)).double().train()


def _batch(B=2, T=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.roll(x, -1, dims=1)
    y[:, -1] = IGNORE_INDEX
    y[0, 3] = IGNORE_INDEX  # a masked label inside a row (an SFT prompt token)
    return x, y


def _targets_by_loop(k, x, y, pos=None, docs=None, mask=None):
    B, T = x.shape
    ids = torch.zeros_like(x)
    lab = torch.full_like(y, IGNORE_INDEX)
    for b in range(B):
        for i in range(T):
            j = i + k
            if j >= T:
                continue
            ids[b, i] = x[b, j]
            same = (pos is None or int(pos[b, j]) == int(pos[b, i]) + k) and \
                (docs is None or int(docs[b, j]) == int(docs[b, i])) and (mask is None or int(mask[b, j]) == 1)
            lab[b, i] = y[b, j] if same else IGNORE_INDEX
    return ids, lab


def test_targets_shift_and_stay_in_their_sample():
    x, y = _batch(B=2, T=10)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], list(range(10))])
    docs = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2, 2], [0] * 10])
    mask = torch.tensor([[1] * 10, [1] * 7 + [0] * 3])
    for kw in ({}, {"pos": pos}, {"docs": docs}, {"mask": mask}, {"pos": pos, "mask": mask}):
        got = targets(3, x, y, position_ids=kw.get("pos"), doc_ids=kw.get("docs"), attention_mask=kw.get("mask"))
        for k, (ids, lab) in enumerate(got, start=1):
            want_ids, want_lab = _targets_by_loop(k, x, y, **kw)
            assert torch.equal(ids, want_ids) and torch.equal(lab, want_lab), (kw, k)
    # position_ids of shape [1, T] (one row for the batch) broadcast
    one = targets(1, x, y, position_ids=torch.arange(10)[None])[0][1]
    assert torch.equal(one, _targets_by_loop(1, x, y)[1])


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _written_out(model, x, y):
    """The next-token loss and each depth's summed loss in plain torch: the trunk's output captured before the
    final norm and normed, then per depth eh_proj([rms(E[t_i+k]); rms(h_i)]) -> its block -> rms (the next depth's
    h) -> the LM head -> cross-entropy against t_i+k+1 (labels from the loop above)."""
    seen = {}
    hook = model.norm.register_forward_pre_hook(lambda mod, args: seen.setdefault("h", args[0]))
    model(x, labels=y, reduction="sum")
    hook.remove()
    model.mtp.take()  # the model's own MTP forward, dropped
    h, eps, W, E = seen["h"], model.cfg.norm_eps, model.lm_head.weight, model.embed_tokens.weight
    h = _rms(h, model.norm.weight, eps)
    main = F.cross_entropy((h @ W.T).reshape(-1, V), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
    T = x.shape[1]
    cos, sin = model.rotary.table(0, T)
    from model.attention import build_spec
    spec = build_spec(x.shape[0], T, torch.arange(T)[None].expand(x.shape[0], T), head_dim=model.cfg.head_dim)
    per_depth = []
    for k, depth in enumerate(model.mtp.depths, start=1):
        ids, lab = _targets_by_loop(k, x, y)
        inp = torch.cat([_rms(E[ids], depth.enorm.weight, eps), _rms(h, depth.hnorm.weight, eps)], dim=-1)
        h = _rms(depth.block(inp @ depth.eh_proj.weight.T, cos, sin, spec, None), depth.norm.weight, eps)
        logits = h @ W.T
        per_depth.append(F.cross_entropy(logits.reshape(-1, V), lab.reshape(-1), ignore_index=IGNORE_INDEX,
                                         reduction="sum"))
    return main, per_depth


def _grads(model, loss_fn):
    model.zero_grad()
    loss_fn().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_losses_and_gradients_equal_the_formula(checkpointing):
    """The model in float64; its loss head computes in fp32 by design (model/loss.py), so the tolerance is the
    next-token loss's own error against the float64 formula, on the same inputs, times 8."""
    model = _model(gradient_checkpointing=checkpointing)
    x, y = _batch()
    out = {}

    def ours():
        out["main"] = model(x, labels=y, reduction="sum")
        out["total"], out["stats"] = model.mtp.take()
        return out["main"] + 0.3 * out["total"]
    got = _grads(model, ours)
    ref = {}

    def formula():
        ref["main"], ref["depths"] = _written_out(model, x, y)
        return ref["main"] + 0.3 * sum(ref["depths"])
    want = _grads(model, formula)
    main_only = _grads(model, lambda: model(x, labels=y, reduction="sum"))
    model.mtp.take()
    main_formula = _grads(model, lambda: _written_out(model, x, y)[0])
    eps32 = torch.finfo(torch.float32).eps
    loss_tol = 8 * max(abs(float(out["main"]) / float(ref["main"]) - 1), eps32)
    for k, depth_ref in enumerate(ref["depths"]):
        assert abs(float(out["stats"][k, 0]) / float(depth_ref) - 1) <= loss_tol, (k, out["stats"], ref["depths"])
        assert int(out["stats"][k, 1]) == int((_targets_by_loop(k + 1, x, y)[1] != IGNORE_INDEX).sum())
    assert abs(float(out["total"]) / float(sum(ref["depths"])) - 1) <= loss_tol
    trunk = [n for n in main_only if not n.startswith("mtp.")]
    grad_tol = 8 * max(max(_rel(main_only[n], main_formula[n]) for n in trunk), eps32)
    for n in got:
        assert _rel(got[n], want[n]) <= grad_tol, (n, _rel(got[n], want[n]), grad_tol)
    assert got["mtp.depths.1.eh_proj.weight"].abs().sum() > 0  # the last depth trains
    q = "layers.0.self_attn.q_proj.weight"  # the trunk's gradient holds the MTP term
    assert _rel(got[q], main_only[q]) > 100 * grad_tol


def test_packed_samples_equal_the_samples_as_rows():
    """Two samples packed in one row (position_ids restarting) give the depths the summed losses and target counts
    of the same samples as two rows: no target crosses into the next sample."""
    model = _model()
    a, b = _batch(B=2, T=8, seed=5)
    x, y = a.reshape(1, 16), b.reshape(1, 16)
    pos = torch.arange(8).repeat(2)[None]
    model(x, labels=y, reduction="sum", position_ids=pos)
    _, packed = model.mtp.take()
    model(a, labels=b, reduction="sum")
    _, rows = model.mtp.take()
    assert torch.allclose(packed, rows, rtol=1e-10), (packed, rows)
    model(x, labels=y, reduction="sum")  # without the restart: targets of the second sample from the first
    _, crossing = model.mtp.take()
    assert crossing[:, 1].sum() > rows[:, 1].sum()


def test_mtp_runs_only_beside_a_training_loss():
    model = _model()
    x, y = _batch()
    model(x, labels=y, reduction="none")  # DPO's per-token path
    model(x)  # logits
    with torch.no_grad():
        model(x, labels=y, reduction="sum")
    model.eval()
    model(x, labels=y, reduction="sum")  # validation
    assert model.mtp.take() == (None, None)
    model.train()
    model(x, labels=y, reduction="sum")
    model(x, labels=y, reduction="sum")
    total, stats = model.mtp.take()  # two forwards accumulate until taken
    model(x, labels=y, reduction="sum")
    once, stats1 = model.mtp.take()
    assert float(total) == pytest.approx(2 * float(once), rel=1e-12) and torch.equal(stats, 2 * stats1)


def test_without_mtp_the_model_is_unchanged_and_the_trunk_initialises_alike():
    torch.manual_seed(0)
    plain = Transformer(_cfg(mtp_num_layers=0))
    torch.manual_seed(0)
    with_mtp = Transformer(_cfg())
    assert not hasattr(plain, "mtp") and not any(k.startswith("mtp.") for k in plain.state_dict())
    sd, sd2 = plain.state_dict(), with_mtp.state_dict()
    assert set(sd) < set(sd2)
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)  # same seed: the trunk's weights are the plain model's
    assert {k.split(".")[3] for k in sd2 if k.startswith("mtp.")} == {"enorm", "hnorm", "eh_proj", "block", "norm"}


def test_an_moe_model_has_moe_depths_numbered_after_its_blocks():
    from trainer.moe import MoETraining
    cfg = _cfg(moe_num_experts=4, moe_top_k=2, moe_first_dense_layers=1, mtp_num_layers=1)
    model = Transformer(cfg)
    assert isinstance(model.mtp.depths[0].block.mlp, MoEFeedForward)
    knobs = dict(moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0, moe_bias_update_rate=0.0)
    training = MoETraining.of(type("Cfg", (), knobs)(), model, lambda b: 1)
    assert training.layer_ids == [1, 2] and training.all_ids == [1, 2]
    with pytest.raises(ValueError, match="mtp_num_layers"):
        _cfg(mtp_num_layers=-1)


def test_a_compiled_model_records_the_same_losses_and_gradients():
    """The whole model traced (aot_eager: the graph capture and its backward, without Inductor's compile time):
    the depths' recorded losses are the eager model's and every gradient is as close to the float64 truth (the
    model without the chunked loss head, which keeps fp32 statistics by design) as the eager model's, within 2x."""
    x, y = _batch()
    runs = []
    for compiled, fused in ((False, True), (True, True), (False, False)):
        model = _model(n_layers=1, mtp_num_layers=1, fused_cross_entropy=fused)
        if compiled:
            model.compile(backend="aot_eager")  # in place: model.mtp is the traced model's own
        main = model(x, labels=y, reduction="sum")
        total, stats = model.mtp.take()
        (main + total).backward()
        runs.append((stats, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (s0, g0), (s1, g1), (_, truth) = runs
    assert torch.allclose(s0, s1, rtol=1e-12)
    assert g0.keys() == g1.keys() == truth.keys()
    for n, t in truth.items():
        eager_err = float((g0[n] - t).abs().max())
        assert float((g1[n] - t).abs().max()) <= 2 * eager_err + 1e-12 * float(t.abs().max()), n
