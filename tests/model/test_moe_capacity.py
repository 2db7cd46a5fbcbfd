"""MoE capacity (model/moe.py dispatch_capacity / combine_capacity, --moe_capacity_factor): the layer against every
token through the experts that kept it, written out with each expert's pairs ranked by hand (both drop policies,
every expert backend), the gradients against the dropless computation with the dropped pairs' weights zeroed, a
capacity no expert reaches equal to dropless, static shapes, the dropped count, evaluation dropless."""
import math

import pytest
import torch
import torch.nn.functional as F

from model.moe import combine, dispatch, dispatch_capacity, expert_capacity, route
from tests.model.test_moe import layer

E, K, D = 4, 2, 16


def kept_by_hand(m, x: torch.Tensor, cap: int, policy: str) -> tuple[list, list]:
    """Each token's (expert, weight) pairs (float64 routing, written out) and, per pair, whether its expert kept it:
    an expert's pairs ranked by weight, largest first, ties by (token, slot) (probs), or by (token, slot)
    (position); the first `cap` kept."""
    pairs = []
    for n in range(x.shape[0]):
        t = x[n].double()
        s = torch.softmax(m.router.weight.double() @ t, -1)
        chosen = sorted(range(E), key=lambda e: -(s[e] + m.expert_bias[e].double()).item())[:K]
        w = torch.stack([s[e] for e in chosen])
        w = w / w.sum()
        pairs.append([(e, float(we)) for e, we in zip(chosen, w)])
    keep = [[False] * K for _ in pairs]
    for e in range(E):
        mine = [(n, j, w) for n, row in enumerate(pairs) for j, (ee, w) in enumerate(row) if ee == e]
        if policy == "probs":
            mine.sort(key=lambda p: (-p[2], p[0], p[1]))
        for n, j, _ in mine[:cap]:
            keep[n][j] = True
    return pairs, keep


def by_hand(m, x: torch.Tensor, pairs: list, keep: list) -> torch.Tensor:
    ex, out = m.experts, torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        t = x[n].double()
        for (e, w), kept in zip(pairs[n], keep[n]):
            if kept:
                gate, up = ex.gate_up_proj[e].double().chunk(2, dim=0)
                out[n] += w * (ex.down_proj[e].double() @ (F.silu(gate @ t) * (up @ t)))
    return out


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("backend", ["loop", "fused_loop", "grouped_mm"])
def test_layer_equals_the_kept_pairs_by_hand(policy, backend):
    m = layer(moe_hidden_dim=8, moe_capacity_factor=0.75, moe_token_drop_policy=policy)
    m.experts.backend = backend
    x = torch.randn(2, 6, D)
    flat = x.reshape(-1, D)
    cap = expert_capacity(flat.shape[0], K, E, 0.75)  # ceil(0.75 * 12 * 2 / 4) = 5 of 24 pairs per expert
    pairs, keep = kept_by_hand(m, flat, cap, policy)
    assert 0 < sum(not k for row in keep for k in row) < 24  # some pairs are dropped, not all
    y = m(x).reshape(-1, D).double()
    ref = by_hand(m, flat, pairs, keep)
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-4), (y - ref).abs().max()
    assert float(m.take_dropped()) == sum(not k for row in keep for k in row)


def test_policies_keep_different_pairs():
    m = layer(moe_hidden_dim=8)
    flat = torch.randn(12, D)
    cap = expert_capacity(12, K, E, 0.5)
    (_, by_w), (_, by_pos) = (kept_by_hand(m, flat, cap, p) for p in ("probs", "position"))
    assert by_w != by_pos


def test_gradients_are_the_dropless_ones_with_the_dropped_weights_zeroed():
    """Through dispatch_capacity / combine_capacity every gradient (input, router, experts) equals the dropless
    computation whose dropped pairs' weights are multiplied by 0 (they then add nothing, value or gradient)."""
    m = layer(moe_hidden_dim=8, moe_capacity_factor=0.75, moe_token_drop_policy="probs")
    m.experts.backend = "loop"
    x = torch.randn(12, D, requires_grad=True)
    g = torch.randn(12, D)
    cap = expert_capacity(12, K, E, 0.75)
    (m(x) * g).sum().backward()
    got = [t.grad.clone() for t in (x, m.router.weight, m.experts.gate_up_proj, m.experts.down_proj)]
    _, keep = kept_by_hand(m, x.detach(), cap, "probs")
    for t in (x, m.router.weight, m.experts.gate_up_proj, m.experts.down_proj):
        t.grad = None
    idx, w, _, _ = route(x, m.router.weight, m.expert_bias, K, "softmax")
    rows, counts, order = dispatch(x, idx, E)
    (combine(m.experts(rows, counts), order, w * torch.tensor(keep)) * g).sum().backward()
    want = [x.grad, m.router.weight.grad, m.experts.gate_up_proj.grad, m.experts.down_proj.grad]
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (a - b).abs().max()


def test_a_capacity_no_expert_reaches_is_dropless_and_evaluation_is_dropless():
    x = torch.randn(2, 6, D, requires_grad=True)
    outs = []
    for factor in (0.0, E / K):  # E / K: C = N, more than any expert can be chosen by
        m = layer(moe_hidden_dim=8, moe_capacity_factor=factor)
        m.experts.backend = "loop"
        y = m(x)
        outs.append((y, torch.autograd.grad(y.square().sum(), (x, m.experts.down_proj))))
        assert float(m.take_dropped()) == 0.0
    (y0, g0), (y1, g1) = outs
    assert torch.allclose(y0, y1, atol=1e-6) and all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g0, g1))
    m = layer(moe_hidden_dim=8, moe_capacity_factor=0.25).eval()
    m.experts.backend = "loop"
    dropless = layer(moe_hidden_dim=8).eval()
    dropless.experts.backend = "loop"
    with torch.no_grad():
        assert torch.equal(m(x), dropless(x))  # same seed, same weights: evaluation never drops


def test_rows_are_static_whatever_the_routing():
    for seed in (0, 1):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(10, D, generator=g)
        idx = torch.randint(0, E, (10, K), generator=g)
        w = torch.rand(10, K, generator=g)
        cap = expert_capacity(10, K, E, 1.0)
        rows, counts, slot, _ = dispatch_capacity(x, idx, w, E, cap, "position")
        assert rows.shape == (E * cap, D) and counts.tolist() == [cap] * E
        routed = torch.bincount(idx.reshape(-1), minlength=E)
        assert int((slot == E * cap).sum()) == int((routed - cap).clamp(min=0).sum())
    assert expert_capacity(10, K, E, 1.0) == math.ceil(10 * K / E) and expert_capacity(1, 1, 64, 0.1) == 1
