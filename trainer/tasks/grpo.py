"""Online RL with GRPO (--task_type=grpo): before each step every rank samples G completions of each of its prompts
from the current policy (trainer/tasks/grpo_rollout.py), scores them (grpo_rewards.py), turns the group-normalised
rewards into advantages, and the step trains on those rows with the clipped policy-gradient loss (grpo_loss.py).
With --teacher_kl_coef the frozen reference (a teacher) scores the rows too and each completion token's advantage
gains minus coef x the sampled reverse KL to it (on-policy distillation).

Owns: `GRPOTask` (its prompt data and held-out prompts, the rollout phase before the step, the advantages, the
micro-batch loss, units and statistics, the held-out evaluation through grpo_eval.py), what a rollout step writes
to the samples file.
Must never: draw a completion from anything but (seed, step, prompt index) (a rollout never depends on the rank or
the layout: 2 ranks train what one process trains, a resumed run draws what the uninterrupted one drew), or read a
device value per micro-batch outside the rollout phase (which reads tokens to decode them anyway).

Statistics ride in the step row as sums (trainer/tasks/base.py): the rollout's (rewards, lengths) enter through each
rank's rows; the maximum logprob difference, which a sum cannot carry, is reduced with MAX over the ranks at the
step's last micro-batch and entered once (rank 0's last micro-batch, beside a 1 that says by what the row divided it).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from model.ring_attention import whole_sequences
from trainer.tasks.base import Task, TaskData
from trainer.tasks.grpo_data import PromptSet, read_prompts_file
from trainer.tasks.grpo_loss import (MICRO_BATCH_MEAN, TOKEN_AVERAGED, aggregate, batch_std, group_advantages,
                                     high_entropy_mask, per_token_terms, units_of)
from trainer.tasks.grpo_rewards import build_rewards
from trainer.tasks.grpo_rollout import (Group, completion_lengths, drop_truncated, every_rank_done, rollout_seed,
                                        sample_in_calls, token_logps, training_rows)
from utils.constants import EXIT_BAD_CONFIG
from utils.device import is_accelerator, parse_dtype, to_device
from utils.errors import TrainingError

_LOADED_LATER = object()  # --reward_model's place in the reward functions checked by `datasets`
_STEP_KEYS = ("completions", "completion_tokens", "reward", "reward_sq", "clipped", "kl", "entropy", "lp_diff_sum",
              "lp_diff_max", "one")


class GRPOTask(Task):
    name = "grpo"
    chat = True  # --sample_prompts of a GRPO run are user turns (the policy is an SFT'd chat model)

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        from trainer.tasks.grpo_flags import reward_specs
        self.reward_names = [n if ":" not in n else n.replace(":", ".") for n, _ in reward_specs(cfg)]
        self.units = ("completion tokens" if cfg.loss_type in TOKEN_AVERAGED else
                      "micro-batches" if cfg.loss_type in MICRO_BATCH_MEAN else "completions")
        self.stat_keys = _STEP_KEYS + tuple(f"{k}_{n}" for n in self.reward_names
                                           for k in ("reward", "reward_sq", "reward_count"))
        self.teacher_kl = getattr(cfg, "teacher_kl_coef", 0.0) > 0  # on-policy distillation: the reference teaches
        if self.teacher_kl:
            self.stat_keys += ("teacher_kl",)
        self._tools = None  # --tools: name -> grpo_tools.Tool, imported by `datasets`
        self._with_tools = bool(str(getattr(cfg, "tools", "")).strip())
        if self._with_tools:
            self.stat_keys += ("tool_calls", "tool_failures")
        self.needs_reference = cfg.beta > 0 or self.teacher_kl
        self.row_len = cfg.max_prompt_length + cfg.max_completion_length
        cp = int(getattr(cfg, "context_parallel_size", 1))
        if cp > 1:  # context parallelism splits each training row into 2 x cp chunks: padded to whole ones
            self.row_len = -(-self.row_len // (2 * cp)) * (2 * cp)
        self._cp = None  # the model's ContextParallel (--context_parallel_size > 1), read at each rollout
        self._rollout = None  # the batches of the last rollout (reused by num_iterations - 1 steps)
        self._tok = self._special = None
        self._stop_ids: list[int] = []  # a completion ends at eos or the chat's end of turn (trained on)
        self._rewards = None
        self._log = lambda line: None  # the run's log (rank 0's lines), set by `datasets`
        self._lp_max = None  # this step's running max |trainer - sampler| logprob, on the device

    # ------------------------------------------------------------------ data
    def datasets(self, tok_meta, val_ratio, fixed_shape, log):
        from tokenizer import load_tokenizer
        cfg = self.cfg
        self._log = log or self._log
        # the reward functions imported and checked now, at the start (--reward_model's loads with the tools)
        answers = build_rewards(cfg, model_reward=_LOADED_LATER).needs_answer
        tok = load_tokenizer(cfg.tokenizer_dir)
        run_tools = self._check_tools(tok, tok_meta) if str(cfg.tools).strip() else None
        prompts = read_prompts_file(cfg.data_dir, cfg, tok, tok_meta, answers, log, run_tools)
        train = PromptSet(prompts)
        if not cfg.eval_data_dir:
            return TaskData(train, PromptSet([]), train.collate, "prompts",
                            "none (the reward of each step's rollouts; --eval_data_dir: greedy rewards)", "")
        held = read_prompts_file(cfg.eval_data_dir, cfg, tok, tok_meta, answers, log, run_tools)
        return TaskData(train, PromptSet(held), train.collate, "prompts",
                        f"--eval_data_dir={cfg.eval_data_dir}, answered greedily: val_reward",
                        "give more held-out prompts in --eval_data_dir")

    def _check_tools(self, tok, tok_meta: dict) -> dict:
        """--tools imported, and the template's results turn rendered once for a call of the first: a tokenizer that
        cannot feed results back stops the run now, in one line (exit 2). name -> schema."""
        from tokenizer.chat import chat_stop_ids
        from tokenizer.chat_template import parse_template_kwargs
        from trainer.tasks.grpo_tools import ToolRunner, ToolsError, call_format, load_tools
        try:
            self._tools = load_tools(self.cfg.tools)
            call_format(tok)
        except ToolsError as e:
            raise TrainingError(str(e), EXIT_BAD_CONFIG) from None
        schemas = [t.schema for t in self._tools.values()]
        stops = chat_stop_ids(tok, tok_meta["special_tokens"])
        kwargs = parse_template_kwargs(str(self.cfg.chat_template_kwargs))
        runner = ToolRunner(tok, self._tools, [schemas], stops, kwargs)
        call = {"type": "function", "function": {"name": schemas[0]["function"]["name"], "arguments": {}}}
        try:
            runner.results_ids({"role": "assistant", "content": "", "tool_calls": [call]},
                               [{"role": "tool", "name": call["function"]["name"], "content": "0"}])
        except ValueError as e:
            raise TrainingError(f"--tools: the chat template cannot feed a call's results back: {e}",
                                EXIT_BAD_CONFIG) from None
        return {name: t.schema for name, t in self._tools.items()}

    def _runner(self, prompts: list):
        """A grpo_tools.ToolRunner for a call's prompts (--tools): each may call the tools its prompt offers."""
        from tokenizer.chat_template import parse_template_kwargs
        from trainer.tasks.grpo_tools import ToolRunner
        cfg = self.cfg
        return ToolRunner(self._tok, self._tools, [p.tools for p in prompts], self._stop_ids,
                          parse_template_kwargs(str(cfg.chat_template_kwargs)), cfg.max_tool_calling_iterations)

    def evaluate(self, engine, val, info):
        """The held-out prompts answered (greedily, or --eval_num_generations samples each), scored by the run's
        rewards (trainer/tasks/grpo_eval.py): the prompts dealt to the data-parallel ranks, their sums added over the
        ranks."""
        from trainer.tasks.grpo_eval import held_out_metrics, held_out_sums
        cfg = self.cfg
        self._load_tools(info.device)
        engine.optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
        samples = cfg.eval_num_generations
        with whole_sequences(engine.module):  # (the cp ranks of a replica answer its prompts alike)
            sums = held_out_sums(engine.module, val.prompts, self._rewards,
                                 lambda ids: self._tok.decode(ids, skip_special_tokens=True),
                                 rows=cfg.batch_size * cfg.num_generations, max_new_tokens=cfg.max_completion_length,
                                 stop_ids=self._stop_ids, device=info.device,
                                 rank=engine.dp_rank, world=engine.dp_size, samples=samples,
                                 temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
                                 cuts=dict(top_k=cfg.top_k or None, min_p=cfg.min_p or None,
                                           repetition_penalty=cfg.repetition_penalty),
                                 tools=self._runner if self._tools else None,
                                 use_cache=getattr(cfg, "generation_kv_cache", True))
        if engine.dp_size > 1:
            sums = engine.sum_over_data(sums, info.device).tolist()
        return held_out_metrics(sums, self.reward_names, samples)

    def _load_tools(self, device) -> None:
        """The tokenizer, its special ids and the reward functions (--reward_model's loaded on `device`), once."""
        if self._tok is None:
            from tokenizer import load_tokenizer, load_tokenizer_meta
            from tokenizer.chat import chat_stop_ids
            cfg = self.cfg
            self._tok = load_tokenizer(cfg.tokenizer_dir)
            self._special = load_tokenizer_meta(cfg.tokenizer_dir)["special_tokens"]
            self._stop_ids = chat_stop_ids(self._tok, self._special)
            scorer = None
            if cfg.reward_model:
                from trainer.tasks.grpo_reward_model import load_model_reward
                dtype = parse_dtype(cfg.dtype) if is_accelerator(device) else torch.float32
                scorer = load_model_reward(cfg.reward_model, self._tok, self.row_len, device, dtype,
                                           int(self._special["pad"]["id"]), self._log, cfg.messages_field)
            self._rewards = build_rewards(cfg, scorer)

    # ------------------------------------------------------------------ the rollout phase
    def steps_per_draw(self) -> int:
        return self.cfg.num_iterations  # a rollout trains num_iterations steps (TRL repeats its batch as many times)

    def before_step(self, loop: Any, draw: Callable[[], tuple]) -> tuple[list, list]:
        """(this rank's training micro-batches, data steps skipped): the prompts drawn and rolled out, or, inside a
        --num_iterations cycle, the last rollout again."""
        cfg, p = self.cfg, loop.progress
        if self._rollout is not None and p.step % cfg.num_iterations != 0:
            return self._mark(self._rollout, loop), []
        if p.step % cfg.num_iterations != 0:  # a resume inside a cycle: the policy that sampled it is gone
            loop.log(f"[grpo] step {p.step + 1} is inside a --num_iterations={cfg.num_iterations} cycle whose "
                     "rollouts were not saved: new rollouts from the resumed weights (an uninterrupted run reused "
                     "the old ones); periodic checkpoints fall on cycle boundaries, a stop signal may not")
        batches, skipped = draw()
        self._load_tools(loop.info.device)
        loop.engine.optimizer.finish_param_sync()  # ZeRO's all-gather of the updated weights has landed
        model, device = loop.engine.module, loop.info.device
        if self.row_len > model.cfg.max_seq_len:  # the model's own length (a checkpoint's model_config wins)
            raise TrainingError(f"--max_prompt_length={cfg.max_prompt_length} + --max_completion_length="
                                f"{cfg.max_completion_length} = {self.row_len} tokens per row, more than the model's "
                                f"max_seq_len {model.cfg.max_seq_len}", EXIT_BAD_CONFIG)
        samples = []
        all_done = None
        if loop.info.world_size > 1:  # every rank decodes as many tokens (a forward may all-gather: FSDP)
            all_done = every_rank_done(loop.engine, device)
        # whole sequences on every rank while decoding (context parallelism: the cp ranks of a replica roll out its
        # prompts alike, from the same seeds); the training rows are split again
        with whole_sequences(model) as self._cp:
            rollout = [self._roll(model, device, b, p.step, samples, all_done) for b in batches]
        self._advantages(rollout, loop, device)
        if self.teacher_kl:
            self._teacher_advantages(rollout, loop.ref_model, device)
        if cfg.num_iterations > 1:  # the ratio of the later steps is taken against the policy that sampled
            with torch.no_grad():
                for rows in rollout:
                    x = to_device(rows["input_ids"], device)
                    rows["old_logps"] = self._token_logps(model, x)[0].float().cpu()
        self._rollout = rollout
        if cfg.log_completions and loop.info.is_main and (p.step + 1) % cfg.log_interval == 0 and samples:
            loop.metrics.write_samples(samples[:cfg.num_completions_to_print])
        return self._mark(rollout, loop), skipped

    def _roll(self, model, device, batch: dict, step: int, samples: list, all_done=None) -> dict:
        """One micro-batch of prompts -> its training rows (G per prompt) with rewards and advantages."""
        cfg, sp = self.cfg, self._special
        stop_ids = self._stop_ids
        pad = int(sp["pad"]["id"])
        groups, values, lengths, tool_counts = [], [], [], []
        items = list(zip(batch["prompt_index"].tolist(), batch["prompts"]))
        runner = self._runner([p for _, p in items]) if self._tools else None  # (the calls run as the model writes)
        rolled = sample_in_calls(
            model, [prompt.ids for _, prompt in items], [rollout_seed(cfg.seed, step, idx) for idx, _ in items],
            cfg.rollout_batch_prompts, cfg.num_generations, cfg.max_completion_length, device=device,
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
            repetition_penalty=cfg.repetition_penalty, stop_ids=stop_ids, pad_id=pad,
            use_cache=cfg.generation_kv_cache, row_len=self.row_len, all_done=all_done,
            turn_end=runner.turn_end if runner is not None else None)
        for k, ((idx, prompt), (toks, mask, lps)) in enumerate(zip(items, rolled)):
            trained = drop_truncated(toks, mask, stop_ids) if cfg.mask_truncated_completions else mask
            groups.append(Group(idx, toks, trained, lps))
            lengths.append(completion_lengths(trained))
            kept = [row[:n] for row, n in zip(toks.tolist(), completion_lengths(mask).tolist())]  # through the stop
            messages = shown = None
            if runner is None:
                texts = [self._tok.decode([t for t in c if t not in stop_ids], skip_special_tokens=True) for c in kept]
            else:  # the rewards read the last turn's text (ours) or the transcript (TRL's); the samples the whole
                done = [runner.finish(k, j, c) for j, c in enumerate(kept)]
                texts, messages = [d[0] for d in done], [d[1] for d in done]
                tool_counts += [(d[2].calls, d[2].failures) for d in done]
                shown = [self._tok.decode(c, skip_special_tokens=False) for c in kept]
            scores = self._rewards.score_many(prompt.text, texts, prompt.record, prompt.answer, prompt.where,
                                              prompt.ids, kept, messages)
            for j, (text, vals) in enumerate(zip(texts, scores)):
                values.append(vals)
                if len(samples) < cfg.num_completions_to_print:
                    samples.append({"step": step + 1, "prompt": prompt.text,
                                    "completion": text if shown is None else shown[j],
                                    "reward": self._rewards.total(vals),
                                    **{f"reward_{n}": v if v == v else None for n, v in zip(self.reward_names, vals)}})
        rows = training_rows([pr.ids for pr in batch["prompts"]], groups, self.row_len, pad)
        per_fn = torch.tensor(values, dtype=torch.float64)  # (NaN: a reward not applicable to that completion)
        weighted = per_fn * torch.tensor(self._rewards.weights, dtype=torch.float64)
        total = torch.where(per_fn.isnan(), torch.zeros_like(weighted), weighted).sum(1)
        rows["rewards"], rows["reward"] = per_fn, total
        prompt_lengths = torch.tensor([len(pr.ids) for pr in batch["prompts"] for _ in range(cfg.num_generations)])
        real = torch.cat(lengths).cpu() + prompt_lengths  # prompt + completion tokens: what count_tokens counts
        rows["attention_mask"] = (torch.arange(self.row_len)[None] < real[:, None]).long()
        if runner is not None:  # each completion's calls run and how many failed (the step's tool statistics)
            rows["tool_calls"], rows["tool_failures"] = torch.tensor(tool_counts, dtype=torch.float64).T
        return rows

    def _advantages(self, rollout: list, loop: Any, device) -> None:
        """Each row's advantage (grpo_loss.group_advantages); --scale_rewards=batch divides by the std of every
        reward of the step, all micro-batches and ranks: its mean, then the squared deviations from it, each
        summed over the ranks in float64."""
        cfg, std = self.cfg, None
        if cfg.scale_rewards == "batch":
            rewards = [rows["reward"] for rows in rollout]
            n, total = float(sum(r.numel() for r in rewards)), sum(float(r.sum()) for r in rewards)
            if loop.info.world_size > 1:
                n, total = loop.engine.sum_over_data([n, total], device).tolist()
            mean = total / max(n, 1.0)
            dev = sum(float(((r - mean) ** 2).sum()) for r in rewards)
            if loop.info.world_size > 1:
                dev = float(loop.engine.sum_over_data([dev], device)[0])
            std = batch_std(n, dev)
        for rows in rollout:
            rows["advantages"] = group_advantages(rows["reward"], cfg.num_generations, cfg.scale_rewards,
                                                  std).float()

    def _teacher_advantages(self, rollout: list, teacher, device) -> None:
        """On-policy distillation (--teacher_kl_coef): each completion token's advantage [R, T - 1] is the row's
        minus coef x (log p_sampler(o_t) - log p_teacher(o_t)), the sampled estimate of the per-token reverse KL to
        the teacher (the frozen reference), 0 off the completion; that estimate is kept for the statistics."""
        coef = self.cfg.teacher_kl_coef
        for rows in rollout:
            with torch.no_grad():
                teacher_logps = self._token_logps(teacher, to_device(rows["input_ids"], device))[0].float().cpu()
            mask = rows["completion_mask"].float()
            rkl = (rows["gen_logps"].float() - teacher_logps) * mask
            rows["teacher_kl"] = rkl
            rows["advantages"] = rows["advantages"][:, None] * mask - coef * rkl

    def reference_problem(self, model_cfg, ref_cfg, vocab: int = 0):
        """The reference scores the policy's sampled ids: it needs a row for every id the policy can draw (its
        vocabulary at least the policy's: padding rows beyond the tokenizer's ids may differ)."""
        if ref_cfg.vocab_size < model_cfg.vocab_size or ref_cfg.num_labels:
            return (f"--ref_model has {ref_cfg.num_labels or ref_cfg.vocab_size} outputs, the policy "
                    f"{model_cfg.vocab_size}: its log-probabilities of the policy's tokens need the policy's "
                    "vocabulary (one tokenizer's; a larger one padded beyond it serves)")
        return None

    @staticmethod
    def _mark(batches: list, loop: Any) -> list:
        """Which micro-batch ends the step, and whether this rank enters the step's maxima (data-parallel rank 0)."""
        out = []
        for i, b in enumerate(batches):
            out.append(dict(b, _last=i == len(batches) - 1, _enters_max=loop.engine.dp_rank == 0,
                            _dp_size=loop.engine.dp_size))
        return out

    # ------------------------------------------------------------------ the step
    def _token_logps(self, model, x: torch.Tensor, with_entropy: bool = False) -> tuple:
        """log p(x[:, t + 1]) [R, T - 1] under `model`'s logits / temperature at t, and the entropies when asked:
        from the whole logits, or chunk by chunk in the model's head (--chunked_logprobs)."""
        cfg = self.cfg
        if not cfg.chunked_logprobs:
            return token_logps(model(x), x, cfg.temperature, with_entropy=with_entropy, cp=self._cp)
        nxt = torch.cat([x[:, 1:], x[:, :1]], dim=1)  # shifted as labels (the last position's value is dropped)
        logps, entropy = model(x, logprobs_of=nxt, temperature=cfg.temperature)
        return logps[:, :-1], (entropy[:, :-1] if with_entropy else None)

    def micro_batch_loss(self, model, ref_model, batch, device):
        cfg = self.cfg
        x = to_device(batch["input_ids"], device)
        mask = to_device(batch["completion_mask"], device)
        gen = to_device(batch["gen_logps"], device)
        adv = to_device(batch["advantages"], device)
        logps, entropy = self._token_logps(model, x, with_entropy=True)
        old = to_device(batch["old_logps"], device) if "old_logps" in batch else logps.detach()
        ref = None
        if cfg.beta > 0:
            with torch.no_grad():
                ref = self._token_logps(ref_model, x)[0]
        is_w = None
        if cfg.importance_sampling_correction:  # truncated importance sampling: trainer / sampler, capped
            is_w = torch.exp(old - gen).clamp(max=cfg.importance_sampling_cap)
        if cfg.top_entropy_quantile < 1.0:  # the policy term on the most uncertain tokens only (the KL on all)
            keep = high_entropy_mask(entropy, mask, cfg.top_entropy_quantile)
            is_w = keep if is_w is None else is_w * keep
        terms = per_token_terms(logps, old, adv, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high or cfg.epsilon,
                                beta=cfg.beta, ref_logps=ref, is_weights=is_w, loss_type=cfg.loss_type,
                                delta=cfg.delta, level=cfg.importance_sampling_level, mask=mask,
                                sapo_temperatures=(cfg.sapo_temperature_pos, cfg.sapo_temperature_neg))
        loss = aggregate(terms["loss"], mask, cfg.loss_type, cfg.max_completion_length)
        on = mask > 0
        diff = torch.where(on, (old - gen).abs(), torch.zeros_like(gen))  # trainer vs sampler, same policy
        m = diff.max() if diff.numel() else diff.new_zeros(())
        self._lp_max = m if self._lp_max is None else torch.maximum(self._lp_max, m)
        stats = {"completions": float(x.shape[0]), "completion_tokens": mask.sum(),
                 "reward": batch["reward"].sum().item(), "reward_sq": (batch["reward"] ** 2).sum().item(),
                 "clipped": (terms["clipped"] * mask).sum(), "kl": (terms["kl"] * mask).sum(),
                 "entropy": (entropy * mask).sum(), "lp_diff_sum": diff.sum(), "lp_diff_max": 0.0, "one": 0.0}
        if self.teacher_kl:
            stats["teacher_kl"] = batch["teacher_kl"].sum().item()  # a host value
        if self._with_tools:
            stats["tool_calls"], stats["tool_failures"] = (float(batch[k].sum()) for k in ("tool_calls",
                                                                                          "tool_failures"))
        for k, n in enumerate(self.reward_names):  # host values: no device read; a reward not applicable left out
            col = batch["rewards"][:, k]
            stats[f"reward_{n}"] = col.nan_to_num(nan=0.0).sum().item()
            stats[f"reward_sq_{n}"] = (col ** 2).nan_to_num(nan=0.0).sum().item()
            stats[f"reward_count_{n}"] = float((~col.isnan()).sum())
        if batch.get("_last", True):
            mx = self._lp_max.detach().float().reshape(1)
            self._lp_max = None
            if batch.get("_dp_size", 1) > 1 and dist.is_available() and dist.is_initialized():
                dist.all_reduce(mx, op=dist.ReduceOp.MAX)
            if batch.get("_enters_max", True):
                stats["lp_diff_max"], stats["one"] = mx[0], 1.0
        return loss, stats

    def count_units(self, batch):
        return units_of(self.cfg.loss_type, int(batch["input_ids"].shape[0]), int(batch["completion_mask"].sum()))

    def tokens_seen(self, units, tokens):
        """The tokens trained on (prompt and completion, padding excluded)."""
        return int(tokens)

    def step_metrics(self, per_unit: dict) -> dict:
        n, t = max(per_unit["completions"], 1e-30), max(per_unit["completion_tokens"], 1e-30)
        mean = per_unit["reward"] / n
        out = {"reward": mean, "reward_std": math.sqrt(max(0.0, per_unit["reward_sq"] / n - mean * mean))}
        for k in self.reward_names:  # over the completions it applied to (all, unless a function returned None)
            c = per_unit[f"reward_count_{k}"]
            if c > 0:
                m = per_unit[f"reward_{k}"] / c
                out[f"reward_{k}"] = m
                out[f"reward_{k}_std"] = math.sqrt(max(0.0, per_unit[f"reward_sq_{k}"] / c - m * m))
        out.update(completion_length=per_unit["completion_tokens"] / n, clip_ratio=per_unit["clipped"] / t,
                   entropy=per_unit["entropy"] / t, logprob_diff_mean=per_unit["lp_diff_sum"] / t,
                   logprob_diff_max=per_unit["lp_diff_max"] / per_unit["one"] if per_unit["one"] else float("nan"))
        if self.cfg.beta > 0:
            out["kl"] = per_unit["kl"] / t
        if self.teacher_kl:  # the mean per-token reverse KL to the teacher on the rollouts (sampled estimate)
            out["teacher_kl"] = per_unit["teacher_kl"] / t
        if self._with_tools:  # TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (per call)
            out["tool_call_frequency"] = per_unit["tool_calls"] / n
            out["tool_failure_frequency"] = per_unit["tool_failures"] / max(per_unit["tool_calls"], 1e-30)
        return out
