"""model/moe.py: routing and combine against every token through its top-k experts by hand, the grouped matmul
and the fused loop against the loop (values and gradients; frozen experts), an expert that receives no tokens, the balancing losses against their
formulas (and HF Mixtral's), DeepSeek-V3's bias update rule, and the statistics a training forward leaves."""
import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from model.moe import (MoEFeedForward, combine, dispatch, load_balancing_loss, moe_layers, route, router_z_loss,
                       take_aux_losses, update_expert_bias)
from model.moe_experts import choose_expert_backend, experts_fused_loop, experts_grouped, experts_loop

DEV = torch.device("cpu")


def cfg(**kw):
    base = dict(vocab_size=64, dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_seq_len=16, moe_num_experts=4,
                moe_top_k=2, fused_rmsnorm=False, fused_rope=False, fused_swiglu=False, fused_qkv=False)
    base.update(kw)
    return ModelConfig(**base)


def layer(seed=0, **kw):
    torch.manual_seed(seed)
    m = MoEFeedForward(cfg(**kw))
    m.experts.init_weights(0.2)
    torch.nn.init.normal_(m.router.weight, std=0.5)
    return m


def by_hand(m: MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """Every token through its top-k experts, one token and one expert at a time, in float64."""
    m = m.double()
    ex, out = m.experts, torch.zeros(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        t = x[n].double()
        logits = m.router.weight @ t
        s = torch.softmax(logits, -1) if m.score == "softmax" else torch.sigmoid(logits)
        chosen = sorted(range(m.num_experts), key=lambda e: -(s[e] + m.expert_bias[e]).item())[:m.top_k]
        w = torch.stack([s[e] for e in chosen])
        if m.top_k > 1:
            w = w / w.sum()
        for e, we in zip(chosen, w):
            gate, up = ex.gate_up_proj[e].chunk(2, dim=0)
            h = F.silu(gate @ t) * (up @ t)
            out[n] += we * (ex.down_proj[e] @ h)
        if m.shared_experts is not None:
            sh = m.shared_experts
            out[n] += sh.down_proj.weight @ (F.silu(sh.gate_proj.weight @ t) * (sh.up_proj.weight @ t))
    m.float()
    return out


@pytest.mark.parametrize("score,top_k,shared", [("softmax", 2, 0), ("sigmoid", 3, 1), ("softmax", 1, 2)])
@pytest.mark.parametrize("backend", ["loop", "fused_loop", "grouped_mm"])
def test_layer_equals_every_token_by_hand(score, top_k, shared, backend):
    m = layer(moe_score=score, moe_top_k=top_k, moe_shared_experts=shared, moe_hidden_dim=8)
    m.experts.backend = backend
    m.expert_bias.copy_(torch.tensor([0.0, 0.05, -0.05, 0.02]))  # the bias steers the choice only
    x = torch.randn(2, 5, 16)
    y = m(x).reshape(-1, 16).double()
    ref = by_hand(m, x.reshape(-1, 16))
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-4), (y - ref).abs().max()


def test_dispatch_sorts_by_expert_and_combine_inverts_it():
    idx = torch.tensor([[2, 0], [0, 3], [2, 1]])
    x = torch.arange(3.0)[:, None].expand(3, 2)
    rows, counts, order = dispatch(x, idx, 5)
    assert counts.tolist() == [2, 1, 2, 1, 0]  # expert 4 receives nothing
    assert rows[:, 0].tolist() == [0.0, 1.0, 2.0, 0.0, 2.0, 1.0]  # expert 0: tokens 0,1; 1: 2; 2: 0,2; 3: 1
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 0.0]])
    assert torch.equal(combine(rows, order, w), x)  # identity experts: weights summing to 1 give the input back


def _grads(backend, m, x):
    m.zero_grad()
    m.experts.backend = backend
    xx = x.clone().requires_grad_()
    y = m(xx)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return [y.detach(), xx.grad] + [p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("backend", ["grouped_mm", "fused_loop"])
def test_backend_equals_loop_values_and_gradients(backend):
    m = layer(seed=1, moe_num_experts=6, moe_top_k=2, moe_shared_experts=1)
    m.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -10.0]))  # expert 5 gets no token
    x = torch.randn(3, 7, 16)
    fast, loop = _grads(backend, m, x), _grads("loop", m.double(), x.double())
    m.float()
    fp32_loop = _grads("loop", m, x)
    for g, ref, l32 in zip(fast, loop, fp32_loop):
        # as close to the float64 loop as the float32 loop is (its own rounding)
        err, own = (g.double() - ref).abs().max(), (l32.double() - ref).abs().max()
        assert err <= 4 * own + 1e-7 * ref.abs().max(), (err, own)
    assert m.take_counts()[5] == 0
    for p in (m.experts.gate_up_proj, m.experts.down_proj):  # zeros, never None (DDP's hooks fire)
        assert p.grad is not None and torch.count_nonzero(p.grad[5]) == 0 and torch.count_nonzero(p.grad[0]) > 0


def test_expert_functions_agree_on_an_empty_expert():
    torch.manual_seed(0)
    w_gate, w_up, w_down = torch.randn(3, 8, 4), torch.randn(3, 8, 4), torch.randn(3, 4, 8)
    w_gate_up = torch.cat((w_gate, w_up), dim=1)
    rows, counts = torch.randn(5, 4), torch.tensor([2, 0, 3])
    a, b = experts_grouped(rows, counts, w_gate_up, w_down), experts_loop(rows, counts, w_gate_up, w_down)
    assert torch.allclose(a, b, atol=1e-5)
    assert torch.allclose(experts_fused_loop(rows, counts, w_gate_up, w_down), b, atol=1e-5)
    with pytest.raises(ValueError, match="counts sum to 4, but 5 rows"):
        experts_fused_loop(rows, torch.tensor([2, 0, 2]), w_gate_up, w_down)
    by_rows = [F.linear(F.silu(F.linear(rows[i], w_gate[e])) * F.linear(rows[i], w_up[e]), w_down[e])
               for i, e in enumerate([0, 0, 2, 2, 2])]
    assert torch.allclose(a, torch.stack(by_rows), atol=1e-5)


@pytest.mark.parametrize("frozen", ["experts", "rows"])
def test_fused_loop_gradients_of_what_requires_them(frozen):
    """Frozen expert weights (LoRA on an MoE model) or input rows: the fused loop returns the gradients of the rest,
    the loop's, an empty expert's zero."""
    torch.manual_seed(0)
    w_gate_up, w_down = torch.randn(3, 16, 4, dtype=torch.float64), torch.randn(3, 4, 8, dtype=torch.float64)
    rows, counts = torch.randn(7, 4, dtype=torch.float64), torch.tensor([4, 0, 3])
    grad = torch.randn(7, 4, dtype=torch.float64)
    results = []
    for fn in (experts_loop, experts_fused_loop):
        leaves = [t.clone().requires_grad_(frozen != ("rows" if t is rows else "experts"))
                  for t in (rows, w_gate_up, w_down)]
        fn(leaves[0], counts, leaves[1], leaves[2]).backward(grad)
        results.append([t.grad for t in leaves])
    for a, b in zip(*results):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-12, atol=1e-12))
    if frozen == "rows":
        assert torch.count_nonzero(results[1][1][1]) == 0 and torch.count_nonzero(results[1][2][1]) == 0


def test_fused_loop_under_autocast_computes_as_the_loop():
    """CPU bf16 autocast: the loop's F.linear runs in bf16; the fused loop casts once and gives the same output and
    the same fp32 weight gradients (bf16 matmuls, then cast back)."""
    torch.manual_seed(0)
    w_gate_up, w_down = torch.randn(3, 16, 8), torch.randn(3, 8, 8)
    rows, counts, grad = torch.randn(9, 8), torch.tensor([4, 0, 5]), torch.randn(9, 8)
    results = []
    for fn in (experts_loop, experts_fused_loop):
        leaves = [t.clone().requires_grad_() for t in (rows, w_gate_up, w_down)]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn(leaves[0], counts, leaves[1], leaves[2])
        out.backward(grad.to(out.dtype))
        results.append([out.detach()] + [t.grad for t in leaves])
    assert results[0][0].dtype == results[1][0].dtype == torch.bfloat16
    for a, b in zip(*results):  # the same bf16 matmuls: within one bf16 rounding (2^-8) of the largest value
        err = (a.float() - b.float()).abs().max()
        assert a.dtype == b.dtype and err <= 2 ** -8 * a.float().abs().max(), err


def test_auto_backend_on_the_cpu():
    x = torch.zeros(2, 4)
    assert choose_expert_backend(x, "auto") == "fused_loop"
    with pytest.raises(ValueError, match="expert backend"):
        choose_expert_backend(x, "bmm")


def test_balancing_loss_is_one_when_uniform_and_hf_mixtral_over_k():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    torch.manual_seed(0)
    x = torch.randn(40, 8)
    idx, _, scores, logits = route(x, torch.randn(8, 8), None, 2, "softmax")
    counts = torch.bincount(idx.reshape(-1), minlength=8)
    ours = load_balancing_loss(scores, counts, 2, "softmax")
    hf = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert torch.allclose(ours * 2, hf, rtol=1e-5)
    uniform = load_balancing_loss(torch.full((10, 4), 0.25), torch.tensor([5, 5, 5, 5]), 2, "softmax")
    assert torch.allclose(uniform, torch.tensor(1.0))
    assert torch.allclose(router_z_loss(logits), (torch.log(torch.exp(logits).sum(-1)) ** 2).mean())


def test_bias_update_follows_deepseek_v3_rule():
    bias = torch.tensor([0.1, 0.0, -0.2, 0.0])
    update_expert_bias(bias, torch.tensor([5.0, 1.0, 3.0, 3.0]), rate=0.01)  # mean 3: over, under, even, even
    assert torch.allclose(bias, torch.tensor([0.09, 0.01, -0.2, 0.0]))


def test_bias_changes_the_choice_not_the_weight():
    m = layer()
    x = torch.randn(6, 16)
    idx0, w0, s0, _ = route(x, m.router.weight, None, 1, "softmax")
    bias = torch.zeros(4)
    bias[(idx0[0, 0] + 1) % 4] = 10.0  # every token now picks that expert
    idx1, w1, s1, _ = route(x, m.router.weight, bias, 1, "softmax")
    assert (idx1 == (idx0[0, 0] + 1) % 4).all()
    assert torch.equal(w1, s0.gather(-1, idx1))  # its weight is the unbiased score


def _group_limited_reference(scores: torch.Tensor, bias: torch.Tensor, k: int, groups: int, top_groups: int,
                             scaling: float) -> tuple[list, list]:
    """DeepSeek-V3's routing written out token by token: the groups ranked by their 2 best biased scores, the k best
    experts of the best `top_groups` groups, weighted by their unbiased scores renormalised, times `scaling`."""
    ids, weights = [], []
    per = scores.shape[1] // groups
    for s in scores.tolist():
        biased = [v + b for v, b in zip(s, bias.tolist())]
        rank = [sum(sorted(biased[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(groups)]
        best = sorted(range(groups), key=lambda g: -rank[g])[:top_groups]
        allowed = [e for g in best for e in range(g * per, (g + 1) * per)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:k]
        total = sum(s[e] for e in chosen)
        ids.append(sorted(chosen))
        weights.append(sorted(s[e] / total * scaling for e in chosen))
    return ids, weights


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_group_limited_routing_and_scaling_follow_deepseek_v3(score):
    """--moe_n_groups / --moe_topk_groups / --moe_routed_scaling: the experts each token gets and their weights
    equal DeepSeek-V3's rule written out (fp64, a selection bias on); with every group allowed the choice is the
    ungrouped one; and the routing really is limited: the chosen experts span at most topk_groups groups, where the
    ungrouped choice spans more."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 16, generator=g, dtype=torch.float64), torch.randn(8, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(8, generator=g, dtype=torch.float64) * 0.1
    idx, weights, scores, _ = route(x, w, bias, 3, score, n_groups=4, topk_groups=2, scaling=2.5)
    want_ids, want_w = _group_limited_reference(scores, bias, 3, 4, 2, 2.5)
    assert sorted(map(sorted, idx.tolist())) == sorted(want_ids) and [sorted(r) for r in idx.tolist()] == want_ids
    assert torch.allclose(weights.sort(dim=-1).values, torch.tensor(want_w, dtype=torch.float64))
    assert max(len({e // 2 for e in row}) for row in idx.tolist()) <= 2
    plain = route(x, w, bias, 3, score)[0]
    assert max(len({e // 2 for e in row}) for row in plain.tolist()) == 3  # (the limit changed some tokens' choice)
    assert torch.equal(route(x, w, bias, 3, score, n_groups=4, topk_groups=4)[0], plain)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_wise_balancing_loss_is_each_sequences_switch_loss_averaged(score):
    """aux_per_sequence (--moe_aux_loss_type=sequence): the layer's balancing loss is the Switch loss of each
    sequence's own tokens (its own counts and mean probabilities) averaged over the sequences, computed here one
    sequence at a time by load_balancing_loss; it differs from the batch's loss (the sequences route differently),
    and its gradient reaches the router."""
    m = layer(moe_score=score).double()
    m.train()
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = []
    for row in x:  # one sequence at a time
        idx, _, scores, _ = route(row, m.router.weight, m.expert_bias, 2, score)
        want.append(load_balancing_loss(scores, torch.bincount(idx.reshape(-1), minlength=4), 2, score))
    m.aux_per_sequence = True
    m(x)
    got = m.take_aux()
    assert torch.allclose(got[0], torch.stack(want).mean(), rtol=1e-12) and got[2] == 1.0
    m.aux_per_sequence = False
    m(x)
    batch = m.take_aux()
    assert not torch.allclose(batch[0], got[0]) and torch.allclose(batch[1], got[1])  # (the z-loss is the same)
    m.aux_per_sequence = True
    m.router.weight.grad = None
    m(x)
    m.take_aux()[0].backward()
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0


def test_training_forward_statistics_taken_once_and_not_recomputed():
    def run(ckpt):
        torch.manual_seed(0)
        model = Transformer(cfg(gradient_checkpointing=ckpt, n_layers=3, moe_first_dense_layers=1))
        x = torch.randint(0, 64, (2, 8))
        model(x, labels=x).backward()
        layers = moe_layers(model)
        assert len(layers) == 2
        counts = [m.take_counts() for m in layers]
        assert all(c.sum() == 2 * 8 * 2 for c in counts)  # every token x top_k, counted once
        return take_aux_losses(layers), counts
    plain, with_ckpt = run(False), run(True)
    assert plain[0][:, 2].tolist() == with_ckpt[0][:, 2].tolist() == [1.0, 1.0]  # one forward each, not two
    assert torch.allclose(plain[0], with_ckpt[0]) and all(torch.equal(a, b) for a, b in zip(plain[1], with_ckpt[1]))
    torch.manual_seed(0)
    model = Transformer(cfg())
    with torch.no_grad():
        model(torch.randint(0, 64, (2, 8)))
    model.eval()
    model(torch.randint(0, 64, (2, 8)))
    assert take_aux_losses(moe_layers(model)) is None  # no-grad and eval forwards leave nothing


def test_bad_shapes_refused():
    with pytest.raises(ValueError, match="moe_top_k=5"):
        cfg(moe_top_k=5)
    with pytest.raises(ValueError, match="moe_score"):
        cfg(moe_score="relu")


def test_compiled_experts_do_not_recompile_for_each_split_of_the_tokens():
    """Under torch.compile (aot_eager) on the CPU the experts run outside the graph (model/moe_experts.py
    experts_eager_fused_loop): batches that split their tokens differently over the experts compile nothing new
    after the second (traced, the loop after the counts' host read was specialised on them: every new split compiled
    another graph until torch's limit). The compiled steps equal eager ones."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = Transformer(cfg(moe_num_experts=8))
    compiled = torch.compile(model, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    torch._dynamo.reset()
    counters.clear()
    graphs, splits = [], set()
    try:
        for _ in range(6):
            x = torch.randint(0, 64, (2, 8), generator=g)
            loss = compiled(x, labels=x)
            take_aux_losses(moe_layers(model))  # (they sum over the forwards since the last take: as the trainer)
            loss.backward()
            with torch.no_grad():
                assert torch.allclose(loss, model(x, labels=x), atol=1e-6)
            take_aux_losses(moe_layers(model))
            splits.add(tuple(moe_layers(model)[0].take_counts().tolist()))
            graphs.append(int(counters["stats"].get("unique_graphs", 0)))
    finally:
        torch._dynamo.reset()
    assert len(splits) == 6  # every batch split its tokens another way
    # (the second batch may compile once more: the loads' running sum is None only before a layer's first forward)
    assert graphs[0] >= 1 and graphs[-1] == graphs[1], graphs


def test_compiled_model_equals_eager():
    """torch.compile (aot_eager: Dynamo and AOTAutograd, not Inductor's code generation) through the MoE blocks:
    the same loss, router gradient, balancing losses and loads as eager (the loop's host read is a graph break)."""
    import torch._dynamo
    torch.manual_seed(0)
    model = Transformer(cfg())
    x = torch.randint(0, 64, (2, 8))

    def run(m):
        loss = m(x, labels=x)
        loss.backward()
        grad = model.layers[0].mlp.router.weight.grad.clone()
        model.zero_grad()
        layers = moe_layers(model)
        return loss.detach(), grad, take_aux_losses(layers), [layer.take_counts() for layer in layers]
    eager = run(model)
    torch._dynamo.reset()
    try:
        compiled = run(torch.compile(model, backend="aot_eager"))
    finally:
        torch._dynamo.reset()
    assert torch.allclose(eager[0], compiled[0], atol=1e-6) and torch.allclose(eager[1], compiled[1], atol=1e-6)
    assert torch.allclose(eager[2], compiled[2], atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(eager[3], compiled[3]))


def test_raw_weights_without_renormalisation_and_the_flag_that_asks_for_them():
    """normalize=False (--moe_norm_topk_prob=false; Qwen1.5 / Qwen2-MoE's and DeepSeek-V2's routing): the chosen
    experts are the same, their weights the raw softmax scores (times the routed scaling), not renormalised."""
    torch.manual_seed(3)
    x, w = torch.randn(30, 8), torch.randn(6, 8)
    idx, weights, scores, _ = route(x, w, None, 3, "softmax", scaling=1.5, normalize=False)
    ref_idx, ref_weights, _, _ = route(x, w, None, 3, "softmax", scaling=1.5)
    assert torch.equal(idx, ref_idx)
    assert torch.allclose(weights, 1.5 * scores.gather(-1, idx))
    assert torch.allclose(ref_weights, weights / weights.sum(-1, keepdim=True) * 1.5)
    assert (weights.sum(-1) < 1.5).all() and weights.sum(-1).min() < 1.2  # raw: less than the whole mass
    from trainer.config import TrainConfig
    from trainer.start import new_model_config
    cfg = new_model_config(TrainConfig(data_dir="d", tokenizer_dir="t", moe_num_experts=4, moe_norm_topk_prob=False),
                           {"vocab_size": 64})
    assert cfg.moe_norm_topk is False and MoEFeedForward(cfg).norm_topk is False


def test_groups_ranked_by_their_best_score_as_deepseek_v2():
    """group_score "max" (DeepSeek-V2's group_limited_greedy) ranks a group by its best score, "top2" (DeepSeek-V3's)
    by its two best: a token whose best expert sits in a group with nothing else good is routed there by the first
    and away from it by the second."""
    # 4 experts in 2 groups; sigmoid scores of logits: group 0 = (high, very low), group 1 = (mid, mid)
    logits = torch.tensor([[3.0, -6.0, 1.5, 1.5]])
    w = torch.eye(4)
    by_max = route(logits, w, None, 1, "sigmoid", n_groups=2, topk_groups=1, group_score="max")[0]
    by_top2 = route(logits, w, None, 1, "sigmoid", n_groups=2, topk_groups=1)[0]
    assert by_max.tolist() == [[0]] and by_top2.tolist()[0][0] in (2, 3)
    with pytest.raises(ValueError, match="moe_group_score must be top2 or max"):
        ModelConfig(moe_num_experts=4, moe_group_score="mean")
