"""model/distill_head.py: distillation's loss chunk by chunk in the LM head, against the whole logits.

The truth is `distill_loss` on whole logits in float64 (its formulas are checked on hand values in
tests/trainer/test_distill.py); the chunked fp32 loss and its gradients (hidden state, head weight) may be at most 4x
the whole-logits fp32 path's error against it, plus 8 fp32 ulps of the value's scale. Through a model: the `head`
hook gets the final normed hidden state and the head weight, and its loss and every parameter's gradient equal those
of the model's logits at the kept positions put through the reference."""
from __future__ import annotations

import pytest
import torch

from model import ModelConfig, Transformer
from model.distill_head import TeacherHidden, chunked_distill_loss, distill_head, distill_loss, teacher_hidden
from tests.model.test_token_logprobs import _within  # (the same bound: 4x the whole path's error + 8 fp32 ulps)


def _loss_and_grads(fn, h, w, teacher, y):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss, div, ce = fn(h, w, teacher, y)
    (loss * 0.37).backward()  # an upstream gradient other than 1 (the trainer's 1 / units)
    return loss.detach(), div, ce, h.grad, w.grad


def _whole(**kw):
    def fn(h, w, teacher, y):
        losses, div, ce = distill_loss(h @ w.t(), teacher, y, **kw)
        return losses.sum(), div.sum(), ce.sum()
    return fn


@pytest.mark.parametrize("loss_type, temperature, alpha, chunk", [
    ("forward_kl", 1.0, 0.0, 7), ("forward_kl", 2.0, 0.3, 64), ("reverse_kl", 1.0, 0.0, 1),
    ("reverse_kl", 0.7, 0.5, 5), ("jsd", 1.0, 0.0, 4), ("jsd", 1.5, 0.2, 100)])
def test_chunked_equals_whole_logits_loss_and_gradients(loss_type, temperature, alpha, chunk):
    torch.manual_seed(0)
    h, w = torch.randn(23, 16) * 2, torch.randn(50, 16)
    teacher = torch.randn(23, 50) * 3
    y = torch.randint(0, 50, (23,))
    kw = dict(temperature=temperature, alpha=alpha, loss_type=loss_type, beta=0.3)
    got = _loss_and_grads(lambda *a: chunked_distill_loss(*a, chunk_size=chunk, **kw), h, w, teacher, y)
    ref = _loss_and_grads(_whole(**kw), h, w, teacher, y)
    truth = _loss_and_grads(_whole(**kw), h.double(), w.double(), teacher.double(), y)
    for name, a, b, t in zip(("loss", "divergence", "cross-entropy", "d hidden", "d weight"), got, ref, truth):
        _within(a, b, t, name)
    assert got[1] > 0 and not got[1].requires_grad and not got[2].requires_grad


def test_the_models_head_hook_equals_its_logits_through_the_reference():
    """Transformer.forward(head=distill_head(...)): the student's kept positions in row-major order, its final norm
    applied, the chunk size its own; the loss and every parameter's gradient as from the model's logits."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=16,
                      loss_chunk_size=5)
    model = Transformer(cfg)
    x = torch.randint(0, 61, (3, 12))
    keep = torch.rand(3, 12) > 0.4
    teacher = torch.randn(int(keep.sum()), 61)
    y = torch.randint(0, 61, (int(keep.sum()),))
    _head_equals_the_logits_through_the_reference(model, x, keep, teacher, teacher, y,
                                                  dict(temperature=1.5, alpha=0.25, loss_type="reverse_kl"))


def _head_equals_the_logits_through_the_reference(model, x, keep, teacher, teacher_logits, y, kw) -> torch.Tensor:
    """model(x, head=distill_head(keep, teacher, ...)): its loss, divergence, cross-entropy and every parameter's
    gradient as from the model's logits at `keep` through `distill_loss` against `teacher_logits`; returns the loss."""
    loss, div, ce = model(x, head=distill_head(keep, teacher, y, **kw))
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    want, want_div, want_ce = distill_loss(model(x, logits_to_keep=keep), teacher_logits, y, **kw)
    want.sum().backward()
    torch.testing.assert_close(loss, want.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(div, want_div.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ce, want_ce.sum(), rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)
    return loss.detach()


@pytest.mark.parametrize("teacher_form", ["hidden", "logits"])
def test_soft_capped_student_and_teacher_equal_their_capped_logits_through_the_reference(teacher_form):
    """Gemma 2's capped logits (final_softcap, caps that bind on these logits): the model hands its cap to the head,
    the student's chunks are capped with the cap's derivative in their gradient, and the teacher's capped logits come
    from its TeacherHidden (or its own forward: whole logits); the loss and every gradient as from the capped
    logits through the reference."""
    from model.distill_head import teacher_hidden
    torch.manual_seed(0)
    base = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=16,
                loss_chunk_size=5, initializer_range=0.3)
    model, teacher_model = (Transformer(ModelConfig(**base, final_softcap=cap)) for cap in (1.5, 2.5))
    x = torch.randint(0, 61, (3, 12))
    keep = torch.rand(3, 12) > 0.4
    y = torch.randint(0, 61, (int(keep.sum()),))
    with torch.no_grad():
        teacher = teacher_hidden(teacher_model, x, keep) if teacher_form == "hidden" else \
            teacher_model(x, logits_to_keep=keep)
        teacher_logits = teacher_model(x, logits_to_keep=keep)
    assert teacher_form == "logits" or teacher.cap == 2.5
    kw = dict(temperature=1.5, alpha=0.25, loss_type="forward_kl")
    loss = _head_equals_the_logits_through_the_reference(model, x, keep, teacher, teacher_logits, y, kw)
    model.cfg.final_softcap = None  # (the caps bind: without the student's the loss moves)
    assert abs(float(model(x, head=distill_head(keep, teacher, y, **kw))[0]) - float(loss)) > 1e-2


def test_the_traced_branch_caps_as_the_chunks_do(monkeypatch):
    """Under torch.compile (the traced branch, run eagerly here) the whole logits are capped as the chunks are: the
    same loss and gradients within the chunked path's bound."""
    torch.manual_seed(2)
    h, w = torch.randn(23, 16) * 2, torch.randn(50, 16)
    teacher = TeacherHidden(torch.randn(23, 24), torch.randn(50, 24) * 0.5, 2.0)
    y = torch.randint(0, 50, (23,))
    kw = dict(temperature=1.5, alpha=0.2, loss_type="jsd", beta=0.3, softcap=1.5)
    got = _loss_and_grads(lambda *a: chunked_distill_loss(*a, chunk_size=4, **kw), h, w, teacher, y)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = _loss_and_grads(lambda *a: chunked_distill_loss(*a, chunk_size=4, **kw), h, w, teacher, y)
    for name, a, b in zip(("loss", "divergence", "cross-entropy", "d hidden", "d weight"), got, traced):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_bad_arguments_are_refused():
    h, w = torch.randn(4, 8), torch.randn(11, 8)
    teacher, y = torch.randn(4, 11), torch.arange(4)
    with pytest.raises(ValueError, match="unknown distillation loss 'kl'"):
        chunked_distill_loss(h, w, teacher, y, loss_type="kl")
    with pytest.raises(ValueError, match="jsd needs 0 < beta < 1"):
        chunked_distill_loss(h, w, teacher, y, loss_type="jsd", beta=1.0)


@pytest.mark.parametrize("loss_type, temperature, alpha, chunk, compiling", [
    ("forward_kl", 1.0, 0.0, 7, False), ("reverse_kl", 0.7, 0.5, 1, False), ("jsd", 1.5, 0.2, 100, False),
    ("jsd", 1.0, 0.3, 4, True)])
def test_a_teacher_given_by_its_hidden_states_equals_its_logits(loss_type, temperature, alpha, chunk, compiling,
                                                                monkeypatch):
    """TeacherHidden (the teacher's hidden states [N, D'] and head weight [V, D'], of another width than the
    student's): its logits formed chunk by chunk beside the student's; the loss and gradients within the bound of
    the whole-logits path with the teacher's logits hidden @ weight.T. compiling: the traced branch (the whole
    logits of both, as torch.compile sees it), run eagerly."""
    torch.manual_seed(1)
    h, w = torch.randn(23, 16) * 2, torch.randn(50, 16)
    ht, wt = torch.randn(23, 24), torch.randn(50, 24) * 0.5
    y = torch.randint(0, 50, (23,))
    kw = dict(temperature=temperature, alpha=alpha, loss_type=loss_type, beta=0.3)
    if compiling:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = _loss_and_grads(lambda *a: chunked_distill_loss(*a, chunk_size=chunk, **kw), h, w, TeacherHidden(ht, wt), y)
    monkeypatch.undo()
    ref = _loss_and_grads(_whole(**kw), h, w, ht @ wt.t(), y)
    truth = _loss_and_grads(_whole(**kw), h.double(), w.double(), ht.double() @ wt.double().t(), y)
    for name, a, b, t in zip(("loss", "divergence", "cross-entropy", "d hidden", "d weight"), got, ref, truth):
        _within(a, b, t, name)


def test_teacher_hidden_is_the_teachers_normed_hidden_state_at_the_kept_positions():
    torch.manual_seed(0)
    teacher = Transformer(ModelConfig(vocab_size=64, dim=24, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=16))
    x = torch.randint(0, 61, (3, 12))
    keep = torch.rand(3, 12) > 0.4
    with torch.no_grad():
        got = teacher_hidden(teacher, x, keep)
        want = teacher(x, logits_to_keep=keep)
    assert isinstance(got, TeacherHidden) and got.hidden.shape == (int(keep.sum()), 24)
    assert got.weight is teacher.lm_head.weight
    torch.testing.assert_close(got.logits(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("teacher_vocab, form", [(64, "logits"), (58, "logits"), (64, "hidden"), (58, "hidden")])
def test_vocabularies_padded_differently_are_compared_over_their_common_rows(teacher_vocab, form):
    """A teacher of the same tokenizer whose vocabulary is padded to another size: both distributions over the first
    min(V, V') entries; the student's head rows beyond them get no gradient (the teacher as logits or hidden
    states)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=61, dim=32, n_layers=1, n_heads=4, multiple_of=16, max_seq_len=16, loss_chunk_size=4)
    model = Transformer(cfg)
    x = torch.randint(0, 50, (2, 9))
    keep = torch.ones(2, 9, dtype=torch.bool)
    side = TeacherHidden(torch.randn(18, 12), torch.randn(teacher_vocab, 12))
    teacher = side.logits()
    y = torch.randint(0, 50, (18,))
    common = min(61, teacher_vocab)
    loss, _, _ = model(x, head=distill_head(keep, teacher if form == "logits" else side, y, alpha=0.5,
                                            loss_type="jsd"))
    loss.backward()
    got = model.lm_head.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    want, _, _ = distill_loss(model(x)[keep][:, :common], teacher[:, :common], y, alpha=0.5, loss_type="jsd")
    want.sum().backward()
    torch.testing.assert_close(loss, want.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got, model.lm_head.weight.grad, rtol=1e-4, atol=1e-6)
    assert float(got[common:].abs().sum()) == 0.0


def _sharded_teacher(rank: int, world: int, out_path: str) -> None:
    """2 ranks: an FSDP2-sharded fp64 teacher's side both ways (its weight copied out of the forward, its logits
    whole) through the chunked loss, against the same teacher unsharded; rank 0 writes the relative differences."""
    import json

    import copy

    from torch.distributed.fsdp import fully_shard

    import model.distill_head as dh
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, dim=24, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=16)
    plain = Transformer(cfg).double()
    # FSDP2 as the trainer lays a reference out (parallel/engine_fsdp.py place_reference): each block, then the root,
    # every one resharded after its forward (the root too: asked explicitly, FSDP2 frees its gathered weights)
    sharded = copy.deepcopy(plain)
    for block in sharded.layers:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(sharded, reshard_after_forward=True)
    torch.manual_seed(1)
    student = Transformer(cfg).double()
    x = torch.randint(0, 61, (3, 12))
    y = torch.randint(0, 61, (3, 12))
    keep = torch.rand(3, 12) > 0.4
    y[~keep] = -100

    def loss(teacher_model):
        with torch.no_grad():
            side = dh.teacher_hidden(teacher_model, x, keep)
        head = dh.distill_head(keep, side, y[keep], temperature=2.0, alpha=0.3, loss_type="forward_kl", beta=0.5)
        return float(student(x, head=head)[0]), type(side).__name__
    want, form = loss(plain)
    out = {"plain_form": form}
    for pays in (True, False):  # the copy of the weight, then the whole logits
        dh.copy_weight_pays = (lambda n, d, pays=pays: pays)
        got, form = loss(sharded)
        out[str(pays)] = [form, abs(got - want) / abs(want)]
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(out, f)


def test_an_fsdp2_sharded_teachers_weight_is_copied_out_when_it_is_smaller_than_its_logits(tmp_path):
    """FSDP2 frees a gathered weight after its forward: the teacher's side is then its logits, or (more target tokens
    than its width) its hidden states with the weight copied out of the forward; either gives the unsharded teacher's
    loss (fp64: within 1e-12)."""
    import json

    from model.distill_head import copy_weight_pays
    from tests.dist_helpers import spawn
    assert copy_weight_pays(25, 24) and not copy_weight_pays(24, 24)
    spawn(_sharded_teacher, 2, str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["plain_form"] == "TeacherHidden"
    assert out["True"][0] == "TeacherHidden" and out["False"][0] == "Tensor"
    assert out["True"][1] <= 1e-12 and out["False"][1] <= 1e-12, out
