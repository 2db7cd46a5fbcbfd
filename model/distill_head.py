"""Distillation's loss in the student's LM head, chunk by chunk: the student's [target tokens x vocabulary] logits,
their softmax and their gradient are never whole (--task_type=distill, trainer/tasks/distill.py).

Owns: `distill_loss` (per-token losses from whole student and teacher logits: the formulas, and the reference the
chunked path is tested against), `chunked_distill_loss` and `distill_head` (the callable the task hands to
`Transformer.forward(head=...)`, which calls it with the final normed hidden state and the LM head's weight: whole
there, under FSDP2 too, as the root unit holds the head).

Per target token, with p = softmax(teacher logits / T), q = softmax(student logits / T), z the student's logits:
  forward_kl  D = KL(p || q)                                         dD/d(z/T) = q - p
  reverse_kl  D = KL(q || p)                                         dD/d(z/T) = q (log q - log p - D)
  jsd         D = beta KL(p || m) + (1 - beta) KL(q || m),           dD/d(z/T) = q (g - sum q g),
              m = beta p + (1 - beta) q                              g = (1 - beta) (log q - log m)
  loss = alpha CE(z, target) + (1 - alpha) T^2 D,
  d loss / dz = alpha (softmax(z) - onehot(target)) + (1 - alpha) T dD/d(z/T)
The loss is a sum over tokens, so its gradients are computed in the forward, chunk by chunk while each chunk's logits
are live (two matmuls per chunk besides the logits', as the chunked cross-entropy's "sum", model/loss.py), and the
backward only scales them: the fp32 weight-gradient accumulator [V, D] and the hidden state's gradient [N, D] are
what is kept. The matmuls run in the compute dtype (autocast's: bf16 on a GPU), the softmaxes, the divergence and
the weight gradient's sum in fp32. The teacher's side is either `TeacherHidden`, its hidden states [N, D'] and head
weight, whose logits each chunk forms beside the student's, or its logits [N, V] (whole: its own forward made them,
under FSDP2 when fewer target tokens than its width make them smaller than a copy of its gathered weight);
`teacher_hidden` picks.

Soft-capped logits (Gemma 2's final_softcap, model/softcap.py): the model hands its cap to the head (`softcap`), which
caps each chunk of the student's logits in place and multiplies its gradient by the cap's derivative, and a
`TeacherHidden` carries the teacher's cap (whole teacher logits come capped from its forward).

Under torch.compile (a whole-model graph) the reference from whole logits is traced instead (the Function's loop would
not trace), as model/token_logprobs.py does.

Must never: materialise the student's logits for every target token at once (eagerly), or run under tensor
parallelism (the weight would be a vocabulary shard: refused).
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from model.loss_precision import accumulate_fp32_, compute_dtype
from model.softcap import softcap as softcap_logits
from model.softcap import softcap_
from utils.constants import DISTILL_LOSSES


def _mixture(t: torch.Tensor, s: torch.Tensor, beta: float) -> torch.Tensor:
    """log(beta exp(t) + (1 - beta) exp(s)), the log of the JSD's mixture (TRL's generalized_jsd_loss)."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1, got {beta}")
    return torch.logaddexp(t + math.log(beta), s + math.log(1.0 - beta))


def distill_loss(student: torch.Tensor, teacher: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                 alpha: float = 0.0, loss_type: str = "forward_kl",
                 beta: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token losses [N] of the student's and the teacher's logits [N, V] at N target tokens `targets` [N] (fp32
    inside), and the two terms: (alpha CE + (1 - alpha) T^2 D, D [N] detached, CE [N] detached), D the divergence
    `loss_type` names (jsd: `beta`'s generalized Jensen-Shannon divergence)."""
    if loss_type not in DISTILL_LOSSES:
        raise ValueError(f"unknown distillation loss {loss_type!r}; expected one of {DISTILL_LOSSES}")
    dtype = torch.promote_types(student.dtype, torch.float32)  # (at least fp32; the tests' fp64 stays fp64)
    student, teacher = student.to(dtype), teacher.to(dtype)
    s = F.log_softmax(student / temperature, dim=-1)
    t = F.log_softmax(teacher / temperature, dim=-1)
    if loss_type == "forward_kl":
        div = (t.exp() * (t - s)).sum(-1)
    elif loss_type == "reverse_kl":
        div = (s.exp() * (s - t)).sum(-1)
    else:
        m = _mixture(t, s, beta)
        div = beta * (t.exp() * (t - m)).sum(-1) + (1.0 - beta) * (s.exp() * (s - m)).sum(-1)
    ce = F.cross_entropy(student, targets, reduction="none")
    losses = alpha * ce + (1 - alpha) * temperature ** 2 * div
    return losses, div.detach(), ce.detach()


def _divergence_and_grad(u: torch.Tensor, u_teacher: torch.Tensor, loss_type: str,
                         beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(D [c], dD/du [c, V]) of a chunk's student and teacher logits / T (u, both [c, V] in the accumulation dtype)."""
    s = F.log_softmax(u, dim=-1)
    t = F.log_softmax(u_teacher, dim=-1)
    q = s.exp()
    if loss_type == "forward_kl":
        p = t.exp()
        return t.sub_(s).mul_(p).sum(-1), q.sub_(p)  # (in place: a chunk's [c, V] buffers are the memory here)
    if loss_type == "reverse_kl":
        d = s.sub_(t)  # log q - log p (s is not needed after this)
        div = (q * d).sum(-1)
        return div, q.mul_(d.sub_(div[:, None]))
    m = _mixture(t, s, beta)
    div = beta * (t.exp() * (t - m)).sum(-1) + (1.0 - beta) * (q * (s - m)).sum(-1)
    g = s.sub_(m).mul_(1.0 - beta)
    return div, q.mul_(g.sub_((q * g).sum(-1, keepdim=True)))


class TeacherHidden(NamedTuple):
    """The teacher's side as its final normed hidden states at the N target tokens [N, D'] and its LM head's weight
    [V', D']: its logits hidden @ weight.T formed chunk by chunk beside the student's, never [N, V'] at once; `cap` the
    teacher's soft-cap on them (Gemma 2's; None: none)."""
    hidden: torch.Tensor
    weight: torch.Tensor
    cap: Optional[float] = None

    def logits(self, start: int = 0, end: Optional[int] = None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Rows start..end of the teacher's logits, the matmul in `dtype` (the hidden state's by default), capped."""
        h = self.hidden[start:end]
        dtype = dtype or h.dtype
        return softcap_logits(torch.mm(h.to(dtype), self.weight.to(dtype).t()), self.cap)


def _teacher_rows(teacher, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows start..end of the teacher's logits [c, V']: a slice of whole logits, or a chunk of TeacherHidden's."""
    return teacher.logits(start, end, dtype) if isinstance(teacher, TeacherHidden) else teacher[start:end]


class _ChunkedDistill(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, teacher, targets: torch.Tensor,
                temperature: float, alpha: float, loss_type: str, beta: float, chunk_size: int, cdtype: torch.dtype,
                cap: Optional[float]):
        n = hidden.shape[0]
        acc = torch.promote_types(cdtype, torch.float32)
        w = weight.to(cdtype)
        if isinstance(teacher, TeacherHidden):  # (its weight cast once, as the student's)
            teacher = teacher._replace(weight=teacher.weight.to(cdtype))
        d_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device)
        d_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        sums = torch.zeros(3, dtype=acc, device=hidden.device)  # loss, divergence, cross-entropy
        for s in range(0, n, chunk_size):
            h_c = hidden[s:s + chunk_size].to(cdtype)
            z = torch.mm(h_c, w.t()).to(acc)
            deriv = softcap_(z, cap)  # (the student's capped logits, in place; None without a cap)
            y = targets[s:s + chunk_size, None]
            zt = _teacher_rows(teacher, s, s + chunk_size, cdtype).to(acc)
            div, d_u = _divergence_and_grad(z if temperature == 1.0 else z / temperature,
                                            zt if temperature == 1.0 else zt / temperature, loss_type, beta)
            d_z = d_u.mul_((1.0 - alpha) * temperature)
            lse = torch.logsumexp(z, dim=-1)
            ce = lse - z.gather(1, y)[:, 0]
            if alpha:
                d_z.add_(torch.exp(z.sub_(lse[:, None])).scatter_add_(1, y, -torch.ones_like(y, dtype=acc)),
                         alpha=alpha)
            sums += torch.stack([(alpha * ce + (1.0 - alpha) * temperature ** 2 * div).sum(), div.sum(), ce.sum()])
            if deriv is not None:  # the gradient with respect to the uncapped logits
                d_z.mul_(deriv)
            g_z = d_z.to(cdtype)  # (the matmuls in the compute dtype, as the logits')
            d_h[s:s + chunk_size] = (g_z @ w).to(d_h.dtype)
            if acc == torch.float32:  # summed in fp32 (one mixed GEMM on an accelerator: model/loss_precision.py)
                accumulate_fp32_(d_w, g_z.t(), h_c, first=s == 0)
            else:
                d_w += d_z.t() @ h_c.to(acc)
        ctx.save_for_backward(d_h, d_w)
        ctx.weight_dtype = weight.dtype
        loss, div_sum, ce_sum = sums.unbind()
        ctx.mark_non_differentiable(div_sum, ce_sum)
        return loss, div_sum, ce_sum

    @staticmethod
    def backward(ctx, g: torch.Tensor, _g_div, _g_ce):
        d_h, d_w = ctx.saved_tensors
        return (d_h * g.to(d_h.dtype), (d_w * g.to(d_w.dtype)).to(ctx.weight_dtype),
                None, None, None, None, None, None, None, None, None)


def chunked_distill_loss(hidden: torch.Tensor, weight: torch.Tensor, teacher, targets: torch.Tensor, *,
                         temperature: float = 1.0, alpha: float = 0.0, loss_type: str = "forward_kl",
                         beta: float = 0.5, chunk_size: int = 512,
                         softcap: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the loss summed over the N target tokens, D summed, CE summed) of the student's hidden states [N, D] through
    the head `weight` [V, D] (its logits soft-capped at `softcap` where given) against the teacher's logits [N, V] (or
    its `TeacherHidden`, of V rows): `distill_loss`'s values, `chunk_size` tokens at a time; D and CE carry no
    gradient."""
    if loss_type not in DISTILL_LOSSES:
        raise ValueError(f"unknown distillation loss {loss_type!r}; expected one of {DISTILL_LOSSES}")
    from torch.distributed.tensor import DTensor
    if isinstance(weight, DTensor):
        raise ValueError("distillation's loss in the head takes the whole LM head weight (no tensor parallelism)")
    if torch.compiler.is_compiling():  # traced: the whole logits, which Inductor fuses
        whole = teacher.logits(dtype=compute_dtype(hidden)) if isinstance(teacher, TeacherHidden) else teacher
        losses, div, ce = distill_loss(softcap_logits(F.linear(hidden, weight), softcap), whole, targets,
                                       temperature=temperature, alpha=alpha, loss_type=loss_type, beta=beta)
        return losses.sum(), div.sum(), ce.sum()
    # the matmuls' dtype: autocast's where it is on (the logits as the whole-logits path's)
    return _ChunkedDistill.apply(hidden, weight, teacher, targets, float(temperature), float(alpha), loss_type,
                                 float(beta), max(1, int(chunk_size)), compute_dtype(hidden),
                                 None if softcap is None else float(softcap))


def _head(h: torch.Tensor, weight: torch.Tensor, chunk_size: int, softcap: Optional[float] = None, *,
          keep: torch.Tensor, teacher, targets: torch.Tensor, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(teacher, TeacherHidden):  # vocabularies padded differently beyond the tokenizer's ids
        common = min(weight.shape[0], teacher.weight.shape[0])
        teacher = teacher._replace(weight=teacher.weight[:common])
    else:
        common = min(weight.shape[0], teacher.shape[-1])
        teacher = teacher[:, :common]
    return chunked_distill_loss(h[keep], weight[:common], teacher, targets, chunk_size=chunk_size, softcap=softcap,
                                **kw)


def distill_head(keep: torch.Tensor, teacher, targets: torch.Tensor, **kw):
    """The `head` for Transformer.forward: the student's final hidden states at the True positions of `keep` [B, T]
    (row-major, as the teacher's boolean `logits_to_keep` orders its logits [N, V'], or `teacher_hidden` its hidden
    states) through `chunked_distill_loss` with the model's --loss_chunk_size; kw: temperature, alpha, loss_type,
    beta. Vocabularies of other sizes (the same tokenizer, padded differently) are compared over their first
    min(V, V') entries (the trainer checks that every id of the tokenizer is among them)."""
    return functools.partial(_head, keep=keep, teacher=teacher, targets=targets, **kw)


def teacher_hidden(teacher_model, x: torch.Tensor, keep: torch.Tensor, **kw):
    """The teacher's side of the loss at the True positions of `keep`: `TeacherHidden` (its final normed hidden
    states there and its LM head's weight, so that its logits are formed chunk by chunk beside the student's), or its
    logits [N, V'] (`logits_to_keep`). Where FSDP2 shards the weight (its forward gathers it and frees it after), the
    weight is copied out of the forward when the copy [V', D'] is smaller than the logits it spares [N, V'] (more
    target tokens than the teacher's width: `copy_weight_pays`), else the logits are formed whole. Call under
    no_grad."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    # (the module, not the weight's type: an FSDP2 root may hold its weight unsharded between forwards)
    sharded = isinstance(teacher_model, FSDPModule) or isinstance(teacher_model.lm_head.weight, DTensor)
    if sharded and not copy_weight_pays(int(keep.sum()), teacher_model.lm_head.weight.shape[1]):
        return teacher_model(x, logits_to_keep=keep, **kw)
    return teacher_model(x, head=lambda h, w, _chunk, cap=None: TeacherHidden(h[keep], w.clone() if sharded else w,
                                                                              cap), **kw)


def copy_weight_pays(n_tokens: int, dim: int) -> bool:
    """Whether a copy of a sharded teacher's head weight [V', dim] takes less memory than its logits at n_tokens
    positions [n_tokens, V'] (the same dtype: more tokens than width)."""
    return n_tokens > dim
