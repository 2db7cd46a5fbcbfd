"""GRPO's flags (--task_type=grpo), named as TRL's GRPOConfig names them where it has the knob, and their checks.

Owns: `GRPOFlags` (mixed into trainer/config.py's TrainConfig), `grpo_problems` (what validate_config adds for a
GRPO run), `reward_specs` (the reward functions and weights the flags name, without importing them).
Must never: import torch or a user's reward module (the trainer's pre-check runs it without torch).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from utils.configurator import flag as _f

BUILTIN_REWARDS = ("exact_match", "numeric_match", "format", "soft_overlong")
MODEL_REWARD = "reward_model"  # --reward_model's reward (trainer/tasks/grpo_reward_model.py)
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo")  # (trainer/tasks/grpo_loss.py reads these three)
IS_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")
FUNCTION_SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # module:function (--reward_funcs, --tools)


@dataclass
class GRPOFlags:
    """Online RL with group-relative advantages (--task_type=grpo)."""
    num_generations: int = _f(4, "grpo: completions sampled per prompt (G, the group whose rewards are normalised); "
                              "--batch_size counts prompts, so a micro-batch trains batch_size x G completions")
    max_prompt_length: int = _f(128, "grpo: prompt tokens at most (a longer prompt is a counted, named skip); every "
                                "training row is max_prompt_length + max_completion_length tokens (<= --max_seq_len)")
    max_completion_length: int = _f(64, "grpo, --distill_lmbda: tokens generated per completion at most (it stops "
                                    "earlier at <|im_end|> or </s>, which is trained on)")
    temperature: float = _f(1.0, "grpo, --distill_lmbda: sampling temperature of the rollouts (> 0); GRPO's "
                            "log-probabilities trained on are those of logits / temperature, as in TRL")
    top_p: float = _f(1.0, "grpo, --distill_lmbda: nucleus sampling of the rollouts (1 = off)")
    top_k: int = _f(0, "grpo, --distill_lmbda: the rollouts sample from the k most probable tokens only (0 = off)")
    min_p: float = _f(0.0, "grpo, --distill_lmbda: the rollouts drop tokens less probable than min_p x the most "
                      "probable one, after top-k / top-p (0 = off; TRL's min_p)")
    repetition_penalty: float = _f(1.0, "grpo, --distill_lmbda: the rollouts' draws penalise tokens already in the "
                                   "prompt or the completion (transformers' rule, > 1 discourages; 1 = off; TRL's "
                                   "repetition_penalty); the log-probabilities trained on stay logits / temperature's")
    eval_num_generations: int = _f(0, "grpo: held-out answers per prompt (--eval_data_dir): 0 = one greedy answer "
                                   "(val_reward is pass@1 for a 0/1 reward); k >= 1 = k sampled at --temperature / "
                                   "--top_p, the means logged and val_reward_best, the best of the k (pass@k)")
    beta: float = _f(0.0, "grpo: weight of the KL penalty to the frozen reference model (the initial weights, or "
                     "--ref_model), k3 estimator (DeepSeekMath, Shao et al. 2024); 0 = no reference (DAPO, Dr. GRPO "
                     "and current practice drop it)")
    teacher_kl_coef: float = _f(0.0, "grpo: on-policy distillation / KL in the reward: each completion token's "
                                "advantage gains -coef x (log p_sampler(o_t) - log p_ref(o_t)), the per-token reverse "
                                "KL to the frozen --ref_model (the teacher; else the starting weights, InstructGPT's "
                                "per-token KL reward) on the policy's own samples (Agarwal et al. 2024; Thinking "
                                "Machines' on-policy distillation, 2025); the reward functions are then optional; "
                                "0 = off")
    epsilon: float = _f(0.2, "grpo: clip range of the probability ratio, 1 - epsilon .. 1 + epsilon_high (PPO, "
                        "Schulman et al. 2017)")
    epsilon_high: float = _f(0.0, "grpo: upper clip bound 1 + epsilon_high (0 = epsilon); DAPO's clip-higher (Yu "
                             "et al. 2025) uses 0.28")
    num_iterations: int = _f(1, "grpo: optimizer steps per rollout batch (GRPO's mu): the rollouts of a step are "
                             "reused by the next num_iterations - 1 steps, the ratio taken against the policy that "
                             "sampled them (those steps draw no prompts of their own)")
    loss_type: str = _f("dapo", "grpo: how token losses are averaged: grpo = per completion, then over completions "
                        "(DeepSeekMath, Shao et al. 2024; length-biased) | dr_grpo = summed per completion over "
                        "max_completion_length (Dr. GRPO, Liu et al. 2025) | dapo = over every completion token of "
                        "the step, all ranks (DAPO, Yu et al. 2025; the default of recent TRL releases) | bnpo = "
                        "over each micro-batch's completion tokens, then the mean over micro-batches (TRL's; depends "
                        "on --batch_size) | cispo = "
                        "dapo's average of CISPO's term: the importance weight capped at 1 + epsilon_high and "
                        "detached, times the log-probability (MiniMax-M1, Chen et al. 2025; no token's gradient "
                        "is dropped) | sapo = grpo's average of SAPO's soft gate in place of the clip, "
                        "-(4/tau) sigmoid(tau (ratio - 1)) A (Gao et al. 2025; --sapo_temperature_pos / _neg)")
    sapo_temperature_pos: float = _f(1.0, "grpo: SAPO's gate temperature for tokens of positive advantage (TRL's; "
                                     "larger = a narrower trust region)")
    sapo_temperature_neg: float = _f(1.05, "grpo: SAPO's gate temperature for tokens of negative advantage (the "
                                     "paper keeps it above the positive one: negative updates fade sooner)")
    delta: float = _f(0.0, "grpo: two-sided clipping: the unclipped term's ratio is capped at delta too (INTELLECT-2; "
                      "TRL's delta), > 1 + epsilon_high; 0 = off")
    importance_sampling_level: str = _f("token", "grpo: token = one probability ratio per token | sequence = one per "
                                        "completion, exp of the mean of its tokens' log-ratios, clipped as a whole "
                                        "(GSPO, Zheng et al. 2025; use its small epsilons, e.g. --epsilon=3e-4 "
                                        "--epsilon_high=4e-4)")
    scale_rewards: str = _f("group", "grpo: the advantage is the reward minus its group's mean, divided by: group = "
                            "the group's reward std (GRPO, DeepSeekMath; TRL's default) | batch = the std of every "
                            "reward of the step, all micro-batches and ranks (TRL's batch; Liu et al. 2025, 'Tricks "
                            "or Traps?') | none = nothing (Dr. GRPO, Liu et al. 2025: the division favours too easy "
                            "and too hard prompts)")
    reward_funcs: str = _f("exact_match", "grpo: comma-separated rewards: exact_match (the text after "
                           "--answer_marker equals the record's answer) | numeric_match (the first number after the "
                           "marker within --numeric_tolerance of the answer) | format (--format_regex matches the "
                           "completion) | soft_overlong (DAPO's length penalty, see --soft_punish_cache) | "
                           "module:function (your own, see --reward_fn)")
    reward_weights: str = _f("", "grpo: comma-separated weight per reward function, in order (default: 1 each); the "
                             "reward is their weighted sum")
    reward_model: str = _f("", "grpo: a reward model scoring each prompt + completion (a --task_type=reward run or "
                           "checkpoint, or a Hugging Face *ForSequenceClassification directory) with the run's "
                           "tokenizer; a reward named reward_model, after --reward_funcs and --reward_fn")
    reward_fn: str = _f("", "grpo: your reward, module:function (importable from the working directory), called as "
                        "fn(prompt=str, completion=str, record=dict) and returning a finite number; appended to "
                        "--reward_funcs. A reward that raises or returns a non-number stops the run (exit 3) with "
                        "one line naming the function and the record")
    soft_punish_cache: int = _f(0, "grpo: the soft_overlong reward's buffer L_cache (DAPO, Yu et al. 2025; TRL's "
                                "soft_punish_cache): a completion of L tokens (through its stop token) scores 0 up to "
                                "--max_completion_length - L_cache, then falls linearly to -1 at the maximum")
    answer_marker: str = _f("####", "grpo: exact_match / numeric_match read the text after the last occurrence of "
                            "this in the completion (empty: the whole completion)")
    numeric_tolerance: float = _f(1e-6, "grpo: numeric_match accepts |x - answer| <= tolerance x max(1, |answer|)")
    format_regex: str = _f(r"(?s).*####\s*-?\d+.*", "grpo: the format reward is 1 when this regex matches the whole "
                           "completion (re.fullmatch), else 0")
    prompt_field: str = _f("prompt", "grpo: the record's field holding the prompt as plain text (encoded after <s>), "
                           "or as chat messages (TRL's conversational prompt)")
    messages_field: str = _f("messages", "grpo: the record's field holding the prompt as chat messages (chat template "
                             "applied as in SFT, ending with the assistant's header); used when present")
    chat_template_kwargs: str = _f("", "grpo: a JSON object of extra variables for the tokenizer's chat template "
                                   "when it renders the prompts (TRL's chat_template_kwargs; Qwen3's "
                                   "'{\"enable_thinking\": false}' asks for answers without reasoning)")
    answer_field: str = _f("answer", "grpo: the record's field holding the reference answer (a record without one is a "
                           "counted skip when a built-in answer reward is used)")
    mask_truncated_completions: bool = _f(False, "grpo: completions cut at --max_completion_length (no stop token) are "
                                          "left out of the loss (DAPO's overlong filtering, Yu et al. 2025); their "
                                          "rewards still count in their group's advantages")
    top_entropy_quantile: float = _f(1.0, "grpo: the policy term trains on this share of each micro-batch's "
                                     "completion tokens, those of highest entropy (Wang et al. 2025, 'Beyond the "
                                     "80/20 Rule': 0.2; TRL's name, which takes the quantile over every process's "
                                     "tokens, ours over this rank's); the KL term keeps every token; 1 = all")
    importance_sampling_correction: bool = _f(False, "grpo: weight each token's loss by min(p_trainer / p_sampler, "
                                              "--importance_sampling_cap), the truncated importance-sampling "
                                              "correction for a generator whose probabilities differ from the "
                                              "trainer's (Yao et al. 2025, TRL's vllm_importance_sampling_correction)")
    importance_sampling_cap: float = _f(2.0, "grpo: the cap of that weight (> 0)")
    generation_kv_cache: bool = _f(True, "grpo: rollouts decode with the KV cache (fast); false = each new token from "
                                   "a whole-row forward of the training shape: the recorded log-probabilities then "
                                   "equal the trainer's bit for bit in fp32 on the CPU (docs/grpo.md)")
    rollout_batch_prompts: int = _f(1, "grpo, --distill_lmbda: prompts whose completions decode together, K x G "
                                    "rows of one batch, the prompts left-padded (model/decode.py prefill_groups): "
                                    "fewer, fuller decode steps; 0 = every prompt of the micro-batch. 1 = one group at "
                                    "a time: its tokens are then a function of (seed, step, prompt) bit for bit in any "
                                    "layout; with K > 1 each group still draws from its own generator, but its logits "
                                    "round as the batch they share does (docs/grpo.md)")
    chunked_logprobs: bool = _f(False, "grpo: the trainer's per-token log-probabilities and entropies (policy, "
                                "reference, old policy) computed --loss_chunk_size tokens at a time from the LM head, "
                                "never the whole [rows x tokens x vocabulary] logits; under tensor parallelism on "
                                "each rank's vocabulary shard, never gathered (model/token_logprobs.py). Equal to "
                                "the whole-logits values within fp32 rounding, so not bit-equal to the sampler's "
                                "with --generation_kv_cache=false")
    tools: str = _f("", "grpo: Python functions the policy may call during its rollouts (TRL's tools), comma-separated "
                    "module:function: each offered in every chat prompt with the schema its type hints and docstring "
                    "give (transformers' get_json_schema), its calls (<tool_call> JSON blocks: Qwen2.5 / Qwen3 / "
                    "Hermes and our ChatML; or Llama 3.1's JSON turn) run and their results fed back, never trained "
                    "on (docs/grpo.md)")
    max_tool_calling_iterations: int = _f(0, "grpo, --tools: calling turns run per completion at most (TRL's name); "
                                          "0 = as many as --max_completion_length holds")
    log_completions: bool = _f(True, "grpo: write prompts, completions and rewards to <out_dir>/samples.jsonl every "
                               "--log_interval steps (rank 0's first --num_completions_to_print)")
    num_completions_to_print: int = _f(4, "grpo: completions written per logged step")


def reward_specs(cfg: Any) -> list[tuple[str, float]]:
    """[(reward name, weight)] in order: --reward_funcs, then --reward_fn, then --reward_model's (named
    reward_model); ValueError naming the flag when the weights do not match the functions."""
    names = [n.strip() for n in str(cfg.reward_funcs).split(",") if n.strip()]
    if str(cfg.reward_fn).strip():
        names.append(str(cfg.reward_fn).strip())
    if str(getattr(cfg, "reward_model", "")).strip():
        names.append(MODEL_REWARD)
    raw = [w.strip() for w in str(cfg.reward_weights).split(",") if w.strip()]
    if not raw:
        return [(n, 1.0) for n in names]
    try:
        weights = [float(w) for w in raw]
    except ValueError:
        raise ValueError(f"--reward_weights={cfg.reward_weights!r}: not a comma-separated list of numbers") from None
    if len(weights) != len(names) or not all(math.isfinite(w) for w in weights):
        raise ValueError(f"--reward_weights={cfg.reward_weights!r}: {len(weights)} finite weights for "
                         f"{len(names)} reward functions ({', '.join(names)})")
    return list(zip(names, weights))


def needs_answer(cfg: Any) -> bool:
    """Whether a reward reads the record's reference answer (exact_match, numeric_match): a prompt without one is
    then a counted skip."""
    return any(n in ("exact_match", "numeric_match") for n, _ in reward_specs(cfg))


def sampling_problems(cfg: Any) -> list[str]:
    """The checks of the flags that sample completions from the policy: GRPO's rollouts, on-policy distillation's
    replies (--distill_lmbda)."""
    out = []
    for ok, name, rule in (
            (cfg.max_completion_length >= 1, "max_completion_length", "must be >= 1"),
            (math.isfinite(cfg.temperature) and cfg.temperature > 0, "temperature", "must be a finite number > 0"),
            (math.isfinite(cfg.top_p) and 0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]"),
            (cfg.top_k >= 0, "top_k", "must be >= 0 (0 = off)"),
            (math.isfinite(cfg.min_p) and 0 <= cfg.min_p <= 1, "min_p", "must be in [0, 1] (0 = off)"),
            (math.isfinite(cfg.repetition_penalty) and cfg.repetition_penalty > 0, "repetition_penalty",
             "must be a finite number > 0 (1 = off)"),
            (cfg.rollout_batch_prompts >= 0, "rollout_batch_prompts", "must be >= 0 (0 = the whole micro-batch)")):
        if not ok:
            out.append(f"--{name}={getattr(cfg, name)}: {rule}")
    return out


def grpo_problems(cfg: Any, resume_policy: str) -> list[str]:
    """What a --task_type=grpo run cannot work with (none for another task)."""
    if cfg.task_type != "grpo":  # (--reward_model belongs to GRPO)
        model = str(getattr(cfg, "reward_model", "")).strip()
        return [f"--reward_model={model}: scores GRPO's completions; it needs --task_type=grpo"] if model else []
    out = []

    def need(ok: bool, name: str, rule: str) -> None:
        if not ok:
            out.append(f"--{name}={getattr(cfg, name)}: {rule}")
    distill = math.isfinite(cfg.teacher_kl_coef) and cfg.teacher_kl_coef > 0
    try:
        specs = reward_specs(cfg)
    except ValueError as e:
        out.append(str(e))
        specs = []
    if specs or not distill:  # (a teacher's KL alone compares each completion with the teacher, not with its group)
        need(cfg.num_generations >= 2, "num_generations", "must be >= 2 (advantages compare completions of a group)")
    else:
        need(cfg.num_generations >= 1, "num_generations", "must be >= 1")
    need(cfg.max_prompt_length >= 1, "max_prompt_length", "must be >= 1")
    out += sampling_problems(cfg)
    if cfg.max_prompt_length + cfg.max_completion_length > cfg.max_seq_len:
        out.append(f"--max_prompt_length={cfg.max_prompt_length} + --max_completion_length="
                   f"{cfg.max_completion_length} must be <= --max_seq_len={cfg.max_seq_len}")
    need(0 <= cfg.eval_num_generations <= 1024, "eval_num_generations", "must be in [0, 1024] (0 = one greedy answer)")
    need(math.isfinite(cfg.beta) and cfg.beta >= 0, "beta", "must be a finite number >= 0")
    need(math.isfinite(cfg.teacher_kl_coef) and cfg.teacher_kl_coef >= 0, "teacher_kl_coef",
         "must be a finite number >= 0 (0 = off)")
    if distill and cfg.beta > 0:
        out.append(f"--beta={cfg.beta:g} with --teacher_kl_coef={cfg.teacher_kl_coef:g}: both penalise the KL to "
                   "--ref_model (beta in the loss, teacher_kl_coef in each token's advantage): choose one")
    if distill and not specs and cfg.eval_data_dir:
        out.append(f"--eval_data_dir={cfg.eval_data_dir}: the held-out answers are scored by the reward functions, and "
                   "this run has none (--teacher_kl_coef alone): drop it, or name a reward (at weight 0 it is "
                   "watched, not trained on: --reward_funcs=exact_match --reward_weights=0)")
    need(math.isfinite(cfg.epsilon) and 0 < cfg.epsilon < 1, "epsilon", "must be in (0, 1)")
    need(math.isfinite(cfg.epsilon_high) and cfg.epsilon_high >= 0, "epsilon_high", "must be >= 0 (0 = --epsilon)")
    need(cfg.num_iterations >= 1, "num_iterations", "must be >= 1")
    if cfg.num_iterations > 1 and cfg.checkpoint_interval % cfg.num_iterations:
        out.append(f"--checkpoint_interval={cfg.checkpoint_interval} must be a multiple of --num_iterations="
                   f"{cfg.num_iterations}: a checkpoint inside a cycle would resume without its rollouts")
    need(cfg.loss_type in LOSS_TYPES, "loss_type", " | ".join(LOSS_TYPES))
    need(cfg.importance_sampling_level in IS_LEVELS, "importance_sampling_level", " | ".join(IS_LEVELS))
    high = 1 + (cfg.epsilon_high or cfg.epsilon)
    need(math.isfinite(cfg.delta) and (cfg.delta == 0 or cfg.delta > high), "delta",
         f"must be 0 (off) or > 1 + epsilon_high = {high:g}")
    if cfg.delta and cfg.loss_type in ("cispo", "sapo"):
        out.append(f"--delta: two-sided clipping is the clipped objective's; --loss_type={cfg.loss_type} "
                   + ("caps its weight at 1 + epsilon_high already" if cfg.loss_type == "cispo" else
                      "has no clip (its gate is soft)"))
    need(math.isfinite(cfg.top_entropy_quantile) and 0 < cfg.top_entropy_quantile <= 1, "top_entropy_quantile",
         "must be in (0, 1]")
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        need(math.isfinite(getattr(cfg, name)) and getattr(cfg, name) > 0, name, "must be a finite number > 0")
    need(cfg.scale_rewards in SCALE_REWARDS, "scale_rewards", " | ".join(SCALE_REWARDS))
    need(math.isfinite(cfg.numeric_tolerance) and cfg.numeric_tolerance >= 0, "numeric_tolerance", "must be >= 0")
    need(math.isfinite(cfg.importance_sampling_cap) and cfg.importance_sampling_cap > 0, "importance_sampling_cap",
         "must be a finite number > 0")
    need(cfg.num_completions_to_print >= 0, "num_completions_to_print", "must be >= 0")
    for name in ("prompt_field", "messages_field", "answer_field"):
        need(bool(str(getattr(cfg, name)).strip()), name, "must name a record field")
    from tokenizer.chat_template import parse_template_kwargs  # (torch-free, like this module)
    try:
        parse_template_kwargs(str(cfg.chat_template_kwargs))
    except ValueError as e:
        out.append(str(e))
    if not specs and not distill:
        out.append("--reward_funcs / --reward_fn / --reward_model: name at least one reward (or distil from a teacher: "
                   "--teacher_kl_coef)")
    model = bool(str(getattr(cfg, "reward_model", "")).strip())
    for k, (name, _) in enumerate(specs):
        if name == MODEL_REWARD and (not model or k < len(specs) - 1):  # (only the flag's, appended last)
            out.append(f"--reward_funcs: {MODEL_REWARD} is --reward_model's reward: pass --reward_model=<dir> alone")
        elif name not in BUILTIN_REWARDS and name != MODEL_REWARD and not FUNCTION_SPEC.fullmatch(name):
            out.append(f"--reward_funcs: {name!r} is neither a built-in reward ({' | '.join(BUILTIN_REWARDS)}) nor "
                       "module:function")
    if any(n == "soft_overlong" for n, _ in specs) and not 0 < cfg.soft_punish_cache <= cfg.max_completion_length:
        out.append(f"--reward_funcs=soft_overlong needs 0 < --soft_punish_cache <= --max_completion_length "
                   f"({cfg.max_completion_length}), not {cfg.soft_punish_cache}")
    if any(n == "format" for n, _ in specs):
        try:
            re.compile(cfg.format_regex)
        except re.error as e:
            out.append(f"--format_regex={cfg.format_regex!r}: not a regular expression ({e})")
    out += tool_problems(cfg)
    if cfg.init_from == "scratch" and resume_policy != "always":
        out.append("--task_type=grpo starts from pretrained (SFT) weights: pass --init_from=<run dir>")
    return out


def tool_problems(cfg: Any) -> list[str]:
    """--tools / --max_tool_calling_iterations' checks (the functions are imported at the start: grpo_tools.py)."""
    out = []
    if cfg.max_tool_calling_iterations < 0:
        out.append(f"--max_tool_calling_iterations={cfg.max_tool_calling_iterations}: must be >= 0 (0 = no limit)")
    items = [s.strip() for s in str(cfg.tools).split(",") if s.strip()]
    for item in items:
        if not FUNCTION_SPEC.fullmatch(item):
            out.append(f"--tools: {item!r} is not module:function")
    return out
