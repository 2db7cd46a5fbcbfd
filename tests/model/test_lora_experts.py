"""LoRA on the routed experts (model/lora_experts.py, through model/lora.py): the adapted model equals a plain model
whose expert weights are W + (alpha / r) B_e A_e written out per expert, under every expert backend (values and the
adapters' gradients; the frozen weights take none); merged, it is that plain model; saved in the PEFT layout and
loaded back, the very tensors (one projection or both, gpt-oss's interleaved rows); what cannot be adapted is refused.
PEFT's own PeftModel reading these files is tests/model/test_hf_glm4_moe.py's and test_hf_gpt_oss.py's."""
import copy
import json

import pytest
import torch

from model import ModelConfig, Transformer
from model.lora import apply_lora, load_lora, merge_lora, save_lora
from model.lora_experts import grouped_experts
from model.moe_experts import grouped_mm_supported

VOCAB = 64


def _model(**kw) -> Transformer:
    torch.manual_seed(0)
    fields = dict(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=24, max_seq_len=16, moe_num_experts=4,
                  moe_top_k=2, moe_hidden_dim=8, moe_shared_experts=1)
    fields.update(kw)
    m = Transformer(ModelConfig(**fields))
    for layer in m.layers:  # a router sharp enough that no choice is a near tie
        if hasattr(layer.mlp, "router"):
            torch.nn.init.normal_(layer.mlp.router.weight, std=0.5)
    return m


def _adapted(model: Transformer, targets: str = "q_proj,experts", r: int = 2, alpha: float = 6.0) -> Transformer:
    apply_lora(model, r=r, alpha=alpha, target_modules=targets)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # B away from zero (it starts at zero), A redrawn
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * 0.3)
    return model


def _written_out(base: Transformer, adapted: Transformer) -> Transformer:
    """`base` (a copy) with each expert's weights W_e + s B_e A_e, one expert at a time, and the q_proj adapters
    folded as W + s B A: no adapters left."""
    plain = copy.deepcopy(base)
    sd = adapted.state_dict()
    with torch.no_grad():
        for name, experts in grouped_experts(plain):
            s = adapted.get_submodule(name).lora_scaling
            for proj in ("gate_up_proj", "down_proj"):
                if f"{name}.{proj}_lora_A" not in sd:
                    continue
                a, b, w = sd[f"{name}.{proj}_lora_A"], sd[f"{name}.{proj}_lora_B"], getattr(experts, proj)
                for e in range(w.shape[0]):
                    w[e] += s * (b[e] @ a[e])
        for name, lin in plain.named_modules():
            if f"{name}.lora_A.weight" in sd:
                s = adapted.get_submodule(name).scaling
                lin.weight += s * (sd[f"{name}.lora_B.weight"] @ sd[f"{name}.lora_A.weight"])
    return plain


def _batch():
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, VOCAB, (2, 12), generator=g)
    return x, torch.randint(0, VOCAB, (2, 12), generator=g)


def test_the_adapted_experts_are_the_written_out_weights_under_every_backend():
    """(rank 4: the grouped matmul takes fp32 rows of 16 bytes, and adds the update to the outputs)"""
    x, y = _batch()
    base = _model().double()
    model = _adapted(copy.deepcopy(base), r=4)
    plain = _written_out(base, model)
    eps64 = torch.finfo(torch.float64).eps
    with torch.no_grad():
        want = plain(x)
        assert (want - base(x)).abs().max() > 0.1  # the adapters change the logits
    got = model(x)
    assert (got - want).abs().max() <= 64 * eps64 * want.abs().max()

    def adapter_grads(m, backend):
        for _, ex in grouped_experts(m):
            ex.backend = backend
        m.zero_grad(set_to_none=True)
        m(x, labels=y).backward()
        for _, ex in grouped_experts(m):  # the frozen expert weights take no gradient
            assert not ex.gate_up_proj.requires_grad and ex.gate_up_proj.grad is None
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    loop = adapter_grads(model, "loop")
    assert sorted(loop) == sorted(n for n, _ in model.named_parameters() if "lora_" in n)
    assert any("experts.gate_up_proj_lora_A" in n for n in loop) and all(g.abs().max() > 0 for g in loop.values())
    fused = adapter_grads(model, "fused_loop")
    for n, g in loop.items():
        assert (fused[n] - g).abs().max() <= 64 * eps64 * g.abs().max(), n
    m32 = model.float()
    if grouped_mm_supported(torch.zeros(1)):  # the grouped matmul (fp32 on the CPU): within 2x the loop's fp32 error
        ref32, grouped = adapter_grads(m32, "loop"), adapter_grads(m32, "grouped_mm")
        for n, g in loop.items():
            bound = 2 * (ref32[n].double() - g).abs().max() + 8 * torch.finfo(torch.float32).eps * g.abs().max()
            assert (grouped[n].double() - g).abs().max() <= bound, n


def _copies_kept(model: Transformer, x: torch.Tensor) -> int:
    """How many tensors the forward keeps for backward whose storage is an expert weight's size but no parameter's:
    adapted copies of the weights."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes = {ex.gate_up_proj.untyped_storage().nbytes() for _, ex in grouped_experts(model)} | \
        {ex.down_proj.untyped_storage().nbytes() for _, ex in grouped_experts(model)}
    copies = set()

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and st.nbytes() in sizes:
            copies.add(st.data_ptr())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum()
    return len(copies)


@pytest.mark.skipif(not grouped_mm_supported(torch.zeros(1)), reason="torch without the grouped matmul")
def test_on_the_grouped_matmul_no_adapted_copy_of_the_expert_weights_is_kept():
    """The loops run on W + s B A formed per forward (a copy of both weights kept for backward in each MoE layer);
    the grouped matmul adds s (x A^T) B^T to the outputs instead, and keeps none (rank 4: fp32 rows of 16 bytes;
    at rank 2 it falls back to the weights' update, and keeps them); `auto` takes it wherever it runs."""
    x, _ = _batch()
    layers = sum(1 for _ in grouped_experts(_model()))
    for r, backend, kept in ((4, "loop", 2 * layers), (4, "grouped_mm", 0), (4, "auto", 0),
                             (2, "grouped_mm", 2 * layers), (2, "auto", 2 * layers)):
        model = _adapted(_model(), r=r)
        for _, ex in grouped_experts(model):
            ex.backend = backend
        assert _copies_kept(model, x) == kept, (r, backend)


def test_merged_is_the_written_out_model_and_has_its_keys():
    x, _ = _batch()
    base = _model().double()
    model = _adapted(copy.deepcopy(base))
    with torch.no_grad():
        want, adapted = _written_out(base, model)(x), model(x)
        merge_lora(model)
        got = model(x)
    assert sorted(model.state_dict()) == sorted(base.state_dict())
    assert all(getattr(ex, "lora_scaling") is None for _, ex in grouped_experts(model))
    tol = 64 * torch.finfo(torch.float64).eps * want.abs().max()
    assert (got - want).abs().max() <= tol and (got - adapted).abs().max() <= tol


@pytest.mark.parametrize("targets, gpt_oss", [("q_proj,experts", False), ("experts.down_proj", False),
                                              ("v_proj,experts.gate_up_proj", True), ("experts", True)],
                         ids=["both", "down-only", "gate-up-only-gpt-oss", "both-gpt-oss"])
def test_saved_in_the_peft_layout_and_loaded_back(tmp_path, targets, gpt_oss):
    kw = dict(moe_act="gpt_oss", moe_expert_biases=True, attn_sinks=True, moe_shared_experts=0) if gpt_oss else {}
    model = _adapted(_model(**kw), targets)
    save_lora(model, str(tmp_path))
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    named = sorted(t for t in targets.split(",") if t.startswith("experts"))
    on_experts = ["experts.gate_up_proj", "experts.down_proj"] if named == ["experts"] else named
    assert sorted(cfg["target_parameters"]) == sorted(f"mlp.{t}" for t in on_experts)
    assert cfg["target_modules"] == (sorted(t for t in targets.split(",") if not t.startswith("experts")) or None)
    from safetensors.torch import load_file
    keys = load_file(str(tmp_path / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.mlp.experts"
    if len(on_experts) == 2:  # PEFT nests its wrappers: gate/up's under base_layer (shapes: [E r, in], [out, r E])
        assert keys[f"{prefix}.base_layer.lora_A.weight"].shape == (4 * 2, 16)
        assert keys[f"{prefix}.base_layer.lora_B.weight"].shape == (2 * 8, 2 * 4)
        assert keys[f"{prefix}.lora_A.weight"].shape == (4 * 2, 8)
    else:
        assert keys[f"{prefix}.lora_A.weight"].shape == (4 * 2, 16 if on_experts[0].endswith("gate_up_proj") else 8)
    again = load_lora(_model(**kw), str(tmp_path))
    a, b = model.state_dict(), again.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if not torch.equal(a[k], b[k])]

    if on_experts == ["experts.gate_up_proj"]:  # a file without the tensors its config names: refused by name
        from safetensors.torch import save_file
        save_file({k: v for k, v in keys.items() if ".experts.lora_B" not in k},
                  str(tmp_path / "adapter_model.safetensors"))
        with pytest.raises(ValueError, match=r"gate_up_proj .* no base_model\.model\.model\.layers\.0\.mlp\.experts"
                                             r"\.lora_B\.weight"):
            load_lora(_model(**kw), str(tmp_path))


def test_what_cannot_be_adapted_is_refused():
    with pytest.raises(ValueError, match="lora_dropout=0.1 with the routed experts"):
        apply_lora(_model(), r=2, target_modules="experts", dropout=0.1)
    with pytest.raises(ValueError, match="no MoE layers"):
        apply_lora(_model(moe_num_experts=0), r=2, target_modules="q_proj,experts")
    model = apply_lora(_model(), r=2, target_modules="all,experts")  # `all`: the linears, beside the experts
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".o_proj.lora_A" in n for n in names) and any("experts.down_proj_lora_B" in n for n in names)
    assert not any(n.endswith(("experts.gate_up_proj", "router.weight")) for n in names)


def test_the_trainer_refuses_expert_targets_it_cannot_adapt_in_one_line(tiny_pretrain_run_args, tmp_path, capsys):
    from tests.trainer.test_errors import assert_one_error_line, run_main
    base = [*tiny_pretrain_run_args, f"--out_dir={tmp_path / 'run'}", "--max_iters=1", "--lora_rank=2"]
    code, err = run_main([*base, "--lora_targets=q_proj,experts"], capsys)  # a dense model
    assert code == 2
    assert_one_error_line(err, "--lora_*: the LoRA targets name the routed experts, but the model has no MoE layers")
    code, err = run_main([*base, "--moe_num_experts=4", "--lora_targets=experts", "--lora_dropout=0.1"], capsys)
    assert code == 2
    assert_one_error_line(err, "lora_dropout=0.1 with the routed experts as targets")


@pytest.mark.skipif(not grouped_mm_supported(torch.zeros(1)), reason="torch without the grouped matmul")
def test_the_grouped_update_compiles_as_one_graph_in_bf16():
    """torch.compile(fullgraph=True) (aot_eager) of the bf16 model whose experts run the grouped matmul with the
    update on the outputs (rank 8: bf16 rows of 16 bytes, CUDA's default path): one graph; the loss and the adapters'
    gradients within 2x the eager bf16 model's own error against the fp64 model (+ 8 bf16 ulps)."""
    x, y = _batch()
    truth_model = _adapted(_model(), r=8).double().eval()
    model = copy.deepcopy(truth_model).bfloat16()
    for _, ex in grouped_experts(model):
        ex.backend = "grouped_mm"

    def loss_and_grads(m, params_of=None):
        params_of = params_of or m
        params_of.zero_grad(set_to_none=True)
        loss = m(x, labels=y)
        loss.backward()
        return {"loss": loss.detach().double(), **{n: p.grad.double() for n, p in params_of.named_parameters()
                                                   if p.requires_grad}}
    truth, eager = loss_and_grads(truth_model), loss_and_grads(model)
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    torch._dynamo.reset()
    got = loss_and_grads(torch.compile(model, backend=counting, fullgraph=True), params_of=model)
    assert len(graphs) == 1
    ulp = torch.finfo(torch.bfloat16).eps
    for n, t in truth.items():
        bound = 2 * (eager[n] - t).abs().max() + 8 * ulp * t.abs().max()
        assert (got[n] - t).abs().max() <= bound, n
