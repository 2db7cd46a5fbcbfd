"""Knowledge distillation on SFT data (Hinton et al. 2015; the supervised KD of TRL's GKDTrainer with lmbda = 0): a
frozen teacher (--ref_model) and the student both score every target token of a conversation's assistant replies,
and the student learns the teacher's whole next-token distribution there, not only the reference token.

Per target token t (labels != -100), with p = softmax(teacher logits / T) and q = softmax(student logits / T):
  forward_kl (default):  T^2 KL(p || q) = T^2 sum_v p_v (log p_v - log q_v)      (the student covers the teacher)
  reverse_kl:            T^2 KL(q || p)                                             (the student seeks its modes)
  jsd:                   T^2 (beta KL(p || m) + (1 - beta) KL(q || m)), m = beta p + (1 - beta) q   (GKD's
                         generalized Jensen-Shannon divergence, Agarwal et al. 2024, as TRL's GKDTrainer computes
                         it; --distill_beta, 0.5 by default as TRL's)
  loss = --distill_alpha x CE(student, the reference token) + (1 - alpha) x that KL
summed over the step's target tokens and averaged as SFT's loss is (model/distill_head.py has the formulas). The
teacher's final hidden states are taken at the target positions only, and its logits formed from them chunk by chunk
beside the student's in the student's LM head, --loss_chunk_size tokens at a time, neither side's [N, V] ever whole
(nor their softmaxes and gradient); under FSDP2, whose teacher's head weight lives only inside its forward, the
teacher's logits at the targets come whole ([N, V], its boolean logits_to_keep, in its compute dtype). The teacher
must share the student's tokenizer, checked at the start (reference_problem: a row for each of the tokenizer's ids;
vocabularies padded to other sizes are compared over their common rows).

On-policy (GKD, Agarwal et al. 2024; TRL's GKDTrainer lmbda): with --distill_lmbda = l, a step is trained on the
student's own replies with probability l (a draw from (seed, step), every rank alike): before the step each row's last
assistant reply is replaced by one the student samples from the row's prompt (everything before that reply; earlier
replies become context, untrained), sampled as GRPO's rollouts are (trainer/tasks/grpo_rollout.py sample_groups, from a
generator seeded by (seed, step, the row's tokens): the same reply whichever rank or micro-batch holds the row, bit for
bit with --rollout_batch_prompts=1, else up to the rounding of the rows decoded together), up to
--max_completion_length tokens and the row's --max_seq_len; the loss is then the same divergence at the sampled
tokens: the teacher's whole distribution where the student actually goes. With --distill_seq_kd the other steps'
replies are the teacher's own samples, drawn alike (sequence-level KD, Kim & Rush 2016; TRL's seq_kd).
"""
from __future__ import annotations

import random
import zlib
from typing import Any, Callable, Optional, Sequence

import torch

from dataset.chat_dataset import right_pad
from model.distill_head import distill_head, teacher_hidden
from trainer.tasks.base import lm_inputs
from trainer.tasks.grpo_rollout import every_rank_done, rollout_seed, sample_in_calls
from trainer.tasks.sft import SFTTask
from utils.constants import IGNORE_INDEX


def replies_from_student(seed: int, step: int, lmbda: float) -> bool:
    """Whether step `step` trains on the student's own replies: a draw from (seed, step) below `lmbda`."""
    if lmbda <= 0 or lmbda >= 1:
        return lmbda >= 1
    return random.Random(rollout_seed(seed, step, -1)).random() < lmbda


def last_reply_prompt(input_ids: torch.Tensor, labels: torch.Tensor, length: int) -> list[int]:
    """The tokens of a padded row (its first `length`) before its last reply: input_ids[:s + 1], s the position
    whose target is the last reply's first token (the whole row where it has no target)."""
    on = (labels[:length] != IGNORE_INDEX).nonzero().flatten().tolist()
    if not on:
        return input_ids[:length].tolist()
    i = len(on) - 1
    while i > 0 and on[i - 1] == on[i] - 1:
        i -= 1
    return input_ids[:on[i] + 1].tolist()


def reply_rows(rows: Sequence[tuple[list[int], list[int]]], pad_id: int, pad_to: Optional[int] = None) -> dict:
    """A micro-batch of (prompt, reply) rows shifted as SFT's (input_ids = (prompt + reply)[:-1], labels the next
    tokens, -100 on the prompt's), right-padded."""
    ids = [(p + r)[:-1] for p, r in rows]
    labels = [[IGNORE_INDEX] * (len(p) - 1) + list(r) for p, r in rows]
    x, y, mask = right_pad(ids, labels, pad_id, pad_to)
    return {"input_ids": x, "labels": y, "attention_mask": mask}


class DistillTask(SFTTask):
    """SFT's data and units (target tokens); the loss of `distill_loss` against the frozen teacher (the run's
    reference model, --ref_model)."""
    name = "distill"
    stat_keys = ("kl", "ce")
    val_stat_keys = ("kl", "ce")
    needs_reference = True

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.lmbda = float(getattr(cfg, "distill_lmbda", 0.0))
        self.seq_kd = bool(getattr(cfg, "distill_seq_kd", False))
        self.samples = self.lmbda > 0 or self.seq_kd  # some steps train on sampled replies
        if self.samples:  # the shares of rows on sampled replies, and the target tokens per row
            self.stat_keys = ("kl", "ce", "rows", "student_rows", "teacher_rows")
        self._pad_to, self._pad_id, self._stop_ids, self._vocab = None, 0, [], 2**62

    def datasets(self, tok_meta, val_ratio, fixed_shape, log):
        cfg = self.cfg
        self._pad_id = int(tok_meta["special_tokens"]["pad"]["id"])
        self._pad_to = cfg.max_seq_len if fixed_shape else None
        self._vocab = int(tok_meta.get("vocab_size") or self._vocab)
        if self.samples:
            from tokenizer import load_tokenizer
            from tokenizer.chat import chat_stop_ids
            self._stop_ids = chat_stop_ids(load_tokenizer(cfg.tokenizer_dir), tok_meta["special_tokens"])
        return super().datasets(tok_meta, val_ratio, fixed_shape, log)

    def before_step(self, loop: Any, draw: Callable[[], tuple]) -> tuple[list, list]:
        """The data's micro-batches, or the same rows with the student's own last replies (a step drawn for it,
        --distill_lmbda) or with the teacher's (the other steps under --distill_seq_kd)."""
        batches, skipped = draw()
        student = replies_from_student(self.cfg.seed, loop.progress.step, self.lmbda)
        if not student and not self.seq_kd:
            return batches, skipped
        loop.engine.optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
        model, device = (loop.engine.module if student else loop.ref_model), loop.info.device
        all_done = every_rank_done(loop.engine, device) if loop.info.world_size > 1 else None
        return [dict(self._sampled_replies(model, b, loop.progress.step, device, all_done),
                     _by="student" if student else "teacher") for b in batches], skipped

    def _sampled_replies(self, model, batch: dict, step: int, device, all_done) -> dict:
        """One micro-batch with each row's last reply sampled by `model` (`sample_in_calls`: --rollout_batch_prompts
        rows a call, each row from its own generator, as many calls on every rank, each generating
        --max_completion_length tokens at most, so that FSDP's ranks forward alike)."""
        cfg = self.cfg
        x, y = batch["input_ids"], batch["labels"]
        lengths = batch["attention_mask"].sum(1).tolist() if "attention_mask" in batch else [x.shape[1]] * len(x)
        room = min(cfg.max_seq_len, model.cfg.max_seq_len)  # a training row's positions
        prompts = [last_reply_prompt(x[r], y[r], int(n)) for r, n in enumerate(lengths)]
        seeds = [rollout_seed(cfg.seed, step, zlib.crc32(x[r, :int(n)].numpy().tobytes()))
                 for r, n in enumerate(lengths)]
        outs = sample_in_calls(model, prompts, seeds, cfg.rollout_batch_prompts, 1, cfg.max_completion_length,
                               device=device, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                               min_p=cfg.min_p, repetition_penalty=cfg.repetition_penalty, stop_ids=self._stop_ids,
                               pad_id=self._pad_id, all_done=all_done)
        rows = []
        for prompt, (toks, mask, _) in zip(prompts, outs):
            reply = toks[0][mask[0]].tolist()[:room + 1 - len(prompt)]
            # an id past the tokenizer's (a vocabulary padded beyond it) is no token: the reply ends before it
            cut = next((j for j, t in enumerate(reply) if t >= self._vocab), len(reply))
            rows.append((prompt, reply[:cut]))
        return reply_rows(rows, self._pad_id, self._pad_to)

    def micro_batch_loss(self, model, ref_model, batch, device):
        cfg = self.cfg
        x, y, kw = lm_inputs(batch, device)
        keep = y != IGNORE_INDEX
        with torch.no_grad():  # its hidden states at the target positions in row-major order (FSDP2: its logits)
            teacher = teacher_hidden(ref_model, x, keep, **kw)
        head = distill_head(keep, teacher, y[keep], temperature=cfg.distill_temperature, alpha=cfg.distill_alpha,
                            loss_type=cfg.distill_loss, beta=cfg.distill_beta)
        loss, kl, ce = model(x, head=head, **kw)  # the student's logits chunk by chunk in its head
        stats = {"kl": kl, "ce": ce}
        if self.samples:  # host values
            rows, by = float(x.shape[0]), batch.get("_by")
            stats.update(rows=rows, student_rows=rows if by == "student" else 0.0,
                         teacher_rows=rows if by == "teacher" else 0.0)
        return loss, stats

    def step_metrics(self, per_unit: dict) -> dict:
        out = {"kl": per_unit["kl"], "ce": per_unit["ce"]}
        if self.samples:  # (per_unit: sums over the step's target tokens)
            out.update(on_policy=per_unit["student_rows"] / per_unit["rows"], reply_length=1.0 / per_unit["rows"])
            if self.seq_kd:
                out["teacher_replies"] = per_unit["teacher_rows"] / per_unit["rows"]
        return out

    def reference_problem(self, student_cfg, teacher_cfg, vocab: int = 0) -> Optional[str]:
        """A teacher of the student's tokenizer: its vocabulary may differ from the student's by padding rows beyond
        the tokenizer's ids (Qwen2.5 7B's 152,064 against 0.5B's 151,936), then both distributions are compared over
        the first min(V_student, V_teacher) entries (model/distill_head.py)."""
        if teacher_cfg.num_labels or teacher_cfg.vocab_size < (vocab or student_cfg.vocab_size):
            return (f"--ref_model (the teacher) has {teacher_cfg.num_labels or teacher_cfg.vocab_size} outputs, the "
                    f"student {student_cfg.vocab_size}" + (f" and the tokenizer {vocab} ids" if vocab else "") +
                    ": distillation compares their distributions over one tokenizer's vocabulary")
        return None

