"""The trainer's configuration: every flag of train_my_ddp.py with its default and help, and how a start reads
them.

Owns: `TrainConfig` (plain values, overridden by config files and `--key=value` through
utils/configurator.py; HF Trainer / torchtitan spellings such as `--lr` or `--max_steps` are aliases, see
utils/cli.py), `TrainingError` (an error with its exit code), whether a start continues the run in --out_dir
(`--resume`, `continues_run`), and the small derivations of flags (warmup, epochs, the implied engine, the
parallel section). The validation is trainer/validation.py's, the torch-free pre-check trainer/precheck.py's.
Must never: import torch, touch devices or start processes; read anything but the config files,
tokenizer_meta.json and --eval_tasks files named on the command line and --out_dir's listing and JSON (never a
checkpoint's tensors).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from parallel.config import ParallelFlags
from trainer.tasks.grpo_flags import GRPOFlags
from utils.configurator import flag
from utils.constants import EXIT_BAD_CONFIG
from utils.errors import TrainingError, one_line  # noqa: F401  (re-exported: the trainer and tests use them)
from utils.mla_flags import MLAFlags
from utils.moe_flags import MoEFlags


_f = flag  # utils/configurator.py: a flag's default and help


@dataclass
class RunFlags:
    """Where the run writes, what it reads, where it starts."""
    # ---- run and data
    out_dir: str = _f("out/run", "run directory: metrics.jsonl, checkpoints/, config.json")
    task_type: str = _f("pretrain", "pretrain | sft | dpo | kto (replies judged good or bad: labelled examples or DPO "
                                    "pairs) | reward (a reward model from DPO pairs: docs/training.md) | distill (SFT "
                                    "data, a --ref_model teacher's distributions) | grpo (online RL from --data_dir "
                                    "prompts: docs/grpo.md)")
    data_dir: str = _f("", "pretrain: directory of token shards + index_L<L>/; sft/dpo: a .jsonl file or a directory of them")
    data_mix: str = _f("", 'pretrain: JSON {"name": weight} (shard dirs under --data_dir) or {"name": {"path": dir, "weight": w}}')
    tokenizer_dir: str = _f("", "tokenizer directory (tokenizer_meta.json gives the vocab size and special ids)")
    val_ratio: float = _f(0.05, "sft/dpo: fraction of records held out for validation (unused with "
                          "--eval_data_dir)")
    eval_data_dir: str = _f("", "validation data read instead of a split of --data_dir (TRL's eval_dataset), all of "
                            "it: sft/dpo: a records file or folder, or a pretokenized folder (--val_ratio is then "
                            "unused: every record of --data_dir trains); pretrain: a folder of token shards, every "
                            "L+1-token sample of it (no index needed; with --data_dir's index its val split is "
                            "unused); grpo: held-out prompts (as --data_dir's), answered greedily at each "
                            "evaluation and scored by the rewards: val_reward (greedy pass@1 for a 0/1 reward). The "
                            "start warns when validation has fewer than 20 samples")
    prefetch_batches: int = _f(-1, "training batches drawn ahead on a background thread (collated, and pinned for "
                               "a GPU) while the step runs; -1 = auto: 2 on an accelerator, 0 (off) on the CPU, where "
                               "the thread would compete with the compute threads. Batches and checkpoints are the "
                               "same either way")
    sft_packing: bool = _f(False, "sft: pack several samples per row (attention restricted to each sample)")
    init_from: str = _f("scratch", "what a new run starts from: scratch | <our run or checkpoint dir> | <Hugging Face "
                        "model dir> (a run that continues, see --resume, ignores it); resume = --resume=always")
    init_checkpoint: str = _f("latest", "which checkpoint of the --init_from run to start from: latest | best (the "
                              "lowest validation loss among its valid checkpoints; a GRPO run's: the highest "
                              "val_reward) | step_N; the load line names it")
    resume: str = _f("auto", "auto: continue the run in --out_dir from its newest valid checkpoint, or, with none yet, "
                     "as its run_start.json records it started; a new run from --init_from when --out_dir holds "
                     "neither | always: continue, exit 2 when there is nothing to continue (unless "
                     "--resume_fallback) | never: a new run, exit 2 when --out_dir holds checkpoints")
    resume_fallback: str = _f("", "--resume=always (--init_from=resume) with no checkpoint and no run_start.json: start "
                              "from this (scratch | <weights dir>) instead of exiting 2")
    ref_model: str = _f("", "dpo: weights of the frozen reference model (default: the initial weights)")
    allow_data_change: bool = _f(False, "a run that continues: accept data that differs from the saved run's (data "
                                 "flags: data_dir, data_mix, seed, ...; or the same --data_dir holding other shards, "
                                 "its index rebuilt): the weights, optimizer and step count carry on and the new "
                                 "data is read from its start (epoch 0); without it such a resume is exit 2")


@dataclass
class ModelFlags:
    """The model's shape and kernels (a checkpoint's model_config.json wins over them)."""
    # ---- model (ignored when initialising from a checkpoint, whose model_config.json wins)
    dim: int = _f(256, "model width")
    n_layers: int = _f(4, "transformer blocks")
    n_heads: int = _f(8, "attention heads")
    n_kv_heads: int = _f(0, "key/value heads for GQA (0 = n_heads)")
    hidden_dim: int = _f(0, "SwiGLU width (0 = Llama formula)")
    multiple_of: int = _f(32, "round the SwiGLU width up to this")
    max_seq_len: int = _f(256, "tokens per training sample")
    vocab_size: int = _f(0, "0 = from the tokenizer (padded to a multiple of 64)")
    rope_theta: float = _f(10000.0, "RoPE base")
    rope_scaling: str = _f("", "RoPE scaling, transformers' kinds and fields: TYPE:FACTOR (yarn:4, linear:2, "
                           "dynamic:2) or JSON ({\"type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1, "
                           "\"high_freq_factor\": 4}). A new model gets it; weights from --init_from get it in place "
                           "of their own (context extension: their trained length becomes "
                           "original_max_position_embeddings and max_seq_len grows to --max_seq_len)")
    dropout: float = _f(0.0, "attention and residual dropout")
    tie_embeddings: bool = _f(False, "share the embedding and LM-head weights")
    qkv_bias: bool = _f(False, "biases on the q/k/v projections (Qwen2's attention; exported as Qwen2ForCausalLM)")
    o_bias: bool = _f(False, "a bias on the attention's output projection too (gpt-oss's attention_bias)")
    attn_sinks: bool = _f(False, "gpt-oss's attention sinks: a learned logit per query head in every softmax's "
                          "denominator (with --moe_act=gpt_oss experts: exported as GptOssForCausalLM)")
    head_dim: int = _f(0, "width of each attention head where n_heads x head_dim is not --dim (Qwen3's 128 at "
                       "--dim=1024 --n_heads=16); 0 = dim / n_heads")
    qk_norm: bool = _f(False, "RMSNorm over each head's q and k before RoPE (Qwen3's attention; exported as "
                       "Qwen3ForCausalLM)")
    sliding_window: int = _f(0, "sliding-window attention in every layer: a query sees its last this many positions "
                             "(Mistral v0.1's 4096; exported as MistralForCausalLM); 0 = the whole sequence")
    sliding_layers: str = _f("", "with --sliding_window: only these layers slide, as 0,2,4 or every:N:K (every N-th "
                             "layer from K: gpt-oss's every:2:0); empty = every layer")
    gradient_checkpointing: bool = _f(False, "recompute each layer in backward to save activation memory (= "
                                      "--activation_checkpoint=full)")
    activation_checkpoint: str = _f("none", "none | full | selective | memory_budget: what the blocks recompute in the "
                                    "backward instead of keeping (torchtitan's activation_checkpoint.mode): full = each "
                                    "block whole, selective = as --selective_ac_option says, memory_budget = the "
                                    "compiled graphs' partitioner keeps --activation_memory_budget of their "
                                    "activations (needs --compile)")
    activation_memory_budget: float = _f(0.5, "with --activation_checkpoint=memory_budget: the share of the compiled "
                                         "graphs' activations to keep, 0 (recompute all it can) to 1 (the compiler's "
                                         "default); the cheapest to recompute go first (torch._functorch's "
                                         "activation_memory_budget)")
    selective_ac_option: str = _f("op", "with --activation_checkpoint=selective: op = inside every block keep the "
                                  "attention's and every other matmul's outputs and recompute the rest (norms, RoPE, "
                                  "SwiGLU, the other matmuls); an integer N = recompute every N-th block whole and keep "
                                  "the others' activations")
    mtp_num_layers: int = _f(0, "multi-token prediction (DeepSeek-V3's MTP, model/mtp.py): this many extra blocks, "
                             "depth k predicting the token k + 1 after the next from the previous depth's hidden "
                             "state and the next token's embedding, trained beside the loss (pretrain, sft); 0 = off")
    mtp_loss_weight: float = _f(0.1, "weight of the MTP loss: weight x the mean over depths of each depth's loss is "
                                "added to what backpropagates (Megatron's mtp_loss_scaling_factor; DeepSeek-V3 used "
                                "0.3, then 0.1); the logged loss stays the next-token one, mtp_loss is logged beside")
    fused_kernels: str = _f("auto", "auto|true (per device: Triton kernels on CUDA, Inductor-fused references for the "
                            "norms/RoPE/SwiGLU under --compile; hand-written autograd kernels on CPU) | triton | torch "
                            "(force one implementation) | false (plain PyTorch references, as HF)")
    fa4: str = _f("auto", "auto (FlashAttention-4 for causal and cu_seqlens-packed batches in fp16/bf16 where it runs: "
                  "CUDA sm90/sm100 with flash-attn-4 installed and torch's FA4 override; else the other kernels) | "
                  "true (exit 2 naming why where it cannot run) | false (never; recorded in model_config.json like "
                  "--fused_kernels: a new run's choice)")
    compile: bool = _f(False, "torch.compile the model")


@dataclass
class TrainableFlags:
    """What trains: everything, the embeddings, LoRA adapters."""
    # ---- what trains
    trainable: str = _f("all", "all (full fine-tuning; with --lora_rank>0 the adapters) | embeddings (only the "
                        "embedding and LM head; with --lora_rank>0 those plus the adapters)")
    # ---- LoRA
    lora_rank: int = _f(0, "0 = full fine-tuning; >0 = LoRA adapters of this rank, base frozen")
    lora_alpha: float = _f(16.0, "LoRA scaling numerator")
    lora_dropout: float = _f(0.0, "dropout on the LoRA input")
    lora_targets: str = _f("q_proj,v_proj", "comma-separated linear names, 'all' (every linear), and on an "
                                         "MoE model 'experts' (the routed experts' stacked weights; or one of "
                                         "experts.gate_up_proj / experts.down_proj)")
    lora_train_embeddings: bool = _f(False, "also train the embedding and LM head (continued pretraining)")


@dataclass
class OptimizationFlags:
    """Batch, schedule, AdamW, precision, seed."""
    # ---- optimisation
    batch_size: int = _f(8, "samples per micro-batch per rank")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    max_iters: int = _f(1000, "optimizer steps")
    num_train_epochs: float = _f(0.0, "passes over the training set (0 = off; fractions allowed): sets --max_iters to "
                                 "ceil(epochs x (training samples // global batch)), logged at start; the LR decay "
                                 "follows. A --max_iters given explicitly (command line or config file) wins")
    learning_rate: float = _f(6e-4, "peak learning rate")
    min_lr: float = _f(6e-5, "floor of the decay")
    warmup_iters: int = _f(-1, "linear warmup steps (-1 = auto: --warmup_ratio x max_iters when --warmup_ratio > 0, "
                           "else pretrain min(100, 10% of max_iters), sft/dpo 3% of max_iters; at least 1). The steps "
                           "chosen are logged at start and saved with the run")
    warmup_ratio: float = _f(0.0, "linear warmup as a fraction of max_iters (HF Trainer's warmup_ratio), used when "
                             "--warmup_iters is not given (-1); e.g. 0.03")
    lr_decay_iters: int = _f(0, "0 = max_iters")
    lr_schedule: str = _f("cosine", "cosine | linear | wsd | constant")
    weight_decay: float = _f(0.1, "AdamW weight decay, applied to matrices only")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    grad_clip: float = _f(1.0, "clip by the global norm over all ranks (0 = off)")
    neftune_noise_alpha: float = _f(0.0, "NEFTune (HF Trainer's and TRL's neftune_noise_alpha; Jain et al. 2023): in "
                                    "training forwards, uniform noise in [-a, a], a = alpha / sqrt(row length x dim), "
                                    "added to the input embeddings (sft, pretrain; 5 is the paper's usual value); "
                                    "0 = off")
    optimizer: str = _f("adamw", "adamw | muon: Muon on the hidden 2-D matrices of the blocks (q/k/v/o, gate/up/down, "
                        "LoRA adapters; an MoE block's router and each expert's matrices), AdamW (the flags above) on "
                        "embeddings, LM head and norms (docs/optimizer.md)")
    muon_lr: float = _f(0.0, "Muon's peak learning rate (0 = --learning_rate: with --muon_adjust_lr=match_rms_adamw an "
                        "AdamW-tuned rate carries over); the schedule scales it like --learning_rate")
    muon_momentum: float = _f(0.95, "Muon's momentum (Nesterov)")
    muon_weight_decay: float = _f(0.1, "Muon's decoupled weight decay: p <- p (1 - lr x wd)")
    muon_adjust_lr: str = _f("match_rms_adamw", "match_rms_adamw (Moonlight: update RMS 0.2, AdamW's lr carries "
                             "over) | original (Keller Jordan: sqrt(max(1, rows/cols)))")
    muon_experts: bool = _f(True, "--optimizer=muon with an MoE model: Muon on the stacked routed experts too (each "
                            "expert's gate, up and down apart); false keeps AdamW on them, as Muon runs saved before "
                            "it stepped experts did (resume those with false)")
    optimizer_state_dtype: str = _f("fp32", "fp32 | bf16: AdamW's moments (exp_avg, exp_avg_sq) in bf16 with "
                                    "stochastic rounding, as DeepSeek-V3 keeps them: 8 bytes a parameter less to "
                                    "keep and to stream each step (--parallel=ddp's one-launch AdamW; "
                                    "docs/optimizer.md)")
    dtype: str = _f("fp32", "fp32 | bf16 | fp16 model precision (fp32 main params in the optimizer)")
    seed: int = _f(1337, "seed of initialisation and data order")
    deterministic: bool = _f(False, "torch.use_deterministic_algorithms (bit-exact resume on GPU)")


# --dpo_loss's choices (trainer/tasks/dpo.py computes them); the reference-free ones load no reference model
DPO_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "sppo_hard", "apo_zero", "apo_down",
              "discopop", "aot", "aot_unpaired", "aot_pair", "bco_pair", "simpo", "orpo")
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
KTO_LOSSES = ("kto", "apo_zero_unpaired", "bco")  # --kto_loss's choices (trainer/tasks/kto.py computes them)


@dataclass
class DPOFlags:
    """DPO's loss."""
    # ---- DPO
    dpo_beta: float = _f(0.1, "DPO temperature (orpo: the odds-ratio term's weight lambda; simpo: its beta, "
                              "2 to 10 in the SimPO paper)")
    dpo_loss: str = _f("sigmoid", "sigmoid | ipo | hinge | robust | exo_pair | nca_pair | sppo_hard | apo_zero | "
                                  "apo_down | discopop | aot | aot_unpaired (= aot_pair; the AOT two sort over each "
                                  "micro-batch's pairs) | bco_pair (BCO: the rewards shifted by their running "
                                  "mean, kept in checkpoints) (against the frozen reference model; TRL's loss_type "
                                  "of the same name) | simpo | orpo (reference-free: none is loaded); or a sum: "
                                  "comma-separated reference-based losses and sft (the chosen reply's NLL), e.g. "
                                  "MPO's sigmoid,bco_pair,sft with --dpo_loss_weights=0.8,0.2,1")
    dpo_loss_weights: str = _f("", "comma-separated weight per --dpo_loss term (TRL's loss_weights; default 1 each)")
    ld_alpha: float = _f(1.0, "LD-DPO (Liu et al. 2024; TRL's ld_alpha): the policy's log-probability of a reply "
                              "counts its first min(chosen, rejected length) tokens whole and the rest x ld_alpha, "
                              "against verbosity (0..1; 1 = off)")
    dpo_label_smoothing: float = _f(0.0, "conservative DPO label smoothing (sigmoid and simpo losses)")
    simpo_gamma: float = _f(0.5, "dpo_loss=simpo: the target reward margin gamma (TRL's simpo_gamma)")
    discopop_tau: float = _f(0.05, "dpo_loss=discopop: its temperature tau (TRL's discopop_tau)")
    rpo_alpha: float = _f(0.0, "DPO + this weight x the chosen reply's per-token NLL (RPO, TRL's rpo_alpha; the "
                          "reference-based losses); 0 = off")
    # ---- KTO (--task_type=kto; its beta is --dpo_beta)
    kto_loss: str = _f("kto", "kto (with the KL estimate of each micro-batch's mismatched rows) | apo_zero_unpaired "
                              "(TRL's loss_type of the same name) | bco (TRL's BCOTrainer: rewards shifted by their "
                              "running mean)")
    kto_desirable_weight: float = _f(1.0, "KTO's lambda_D: the desirable (chosen) examples' weight")
    kto_undesirable_weight: float = _f(1.0, "KTO's lambda_U: the undesirable (rejected) examples' weight")
    # ---- distillation (--task_type=distill; the teacher is --ref_model)
    distill_loss: str = _f("forward_kl", "distill: forward_kl (KL(teacher || student), Hinton's) | reverse_kl "
                                         "(KL(student || teacher)) | jsd (the generalized Jensen-Shannon divergence of "
                                         "GKD, Agarwal et al. 2024, TRL's GKDTrainer: --distill_beta) per target token")
    distill_beta: float = _f(0.5, "distill: jsd's interpolation, in (0, 1): beta KL(teacher || M) + (1 - beta) "
                                  "KL(student || M), M = beta teacher + (1 - beta) student (TRL's beta; near 0 it "
                                  "behaves as forward_kl, near 1 as reverse_kl)")
    distill_temperature: float = _f(1.0, "distill: both models' logits divided by this; the KL term is multiplied by "
                                         "its square")
    distill_alpha: float = _f(0.0, "distill: the loss is alpha x the student's cross-entropy on the reference token + "
                                   "(1 - alpha) x the KL term")
    distill_lmbda: float = _f(0.0, "distill: the share of steps trained on replies the student samples itself from "
                                   "each row's prompt (GKD's on-policy lambda, Agarwal et al. 2024; TRL's lmbda), the "
                                   "teacher scoring the student's own tokens; each step draws from (seed, step); "
                                   "sampled as GRPO's rollouts (--max_completion_length, --temperature, --top_p, "
                                   "--top_k, --min_p, --repetition_penalty); 0 = the data's replies only")
    distill_seq_kd: bool = _f(False, "distill: the steps not on the student's own replies train on replies the teacher "
                                     "samples from each row's prompt (sequence-level KD, Kim & Rush 2016; TRL's "
                                     "seq_kd), sampled as --distill_lmbda's; false = the data's replies")
    # ---- reward modelling (--task_type=reward)
    reward_center_coef: float = _f(0.0, "reward: + this x (r_chosen + r_rejected)^2 per pair, keeping the scores "
                                        "centred on 0 (TRL's center_rewards_coefficient; 0.01 in Eisenstein et al. "
                                        "2023); 0 = off")


@dataclass
class TrainConfig(GRPOFlags, ParallelFlags, DPOFlags, OptimizationFlags, TrainableFlags, MoEFlags, MLAFlags,
                  ModelFlags, RunFlags):
    """Every training flag, flat (`--key=value`), composed of typed sections in this order: RunFlags,
    ModelFlags, TrainableFlags, OptimizationFlags, DPOFlags, the parallel engine's (parallel/config.py
    ParallelFlags, declared once there), then evaluation, logging, checkpoints and the guard below."""
    # a flag added after runs were saved without it, whose default changed what those runs did: the value they ran
    # with, which a resume of such a run takes (utils/run_config.py config_from_saved)
    BEFORE_THE_FLAG: ClassVar[dict] = {"muon_experts": False}
    # ---- evaluation, logging, checkpoints
    eval_interval: int = _f(100, "evaluate every N steps (0 = only at the end)")
    eval_iters: int = _f(20, "validation micro-batches per rank per evaluation (>= 1)")
    eval_on_start: bool = _f(False, "evaluate the starting weights before the first step of a new run (HF Trainer's "
                             "eval_on_start): a metrics row at step 0 with the validation values, the curve's baseline "
                             "(a resumed run has it already); needs --eval_interval > 0")
    early_stopping_patience: int = _f(0, "stop the run, saved (exit 0), once this many evaluations in a row have not "
                                         "improved the best val_loss (GRPO: val_reward) by more than "
                                         "--early_stopping_threshold (Hugging Face's EarlyStoppingCallback); 0 = off")
    early_stopping_threshold: float = _f(0.0, "--early_stopping_patience: the improvement that counts")
    log_interval: int = _f(10, "log a line every N steps")
    checkpoint_interval: int = _f(100, "checkpoint every N steps (and at the end)")
    exit_duration_in_mins: float = _f(0.0, "a time budget (Megatron's --exit-duration-in-mins): once this process has "
                                           "run this many minutes (set-up included), the step in progress finishes, "
                                           "is saved, and the run exits 75 to be continued by the same command (a "
                                           "cluster job's time limit); 0 = off")
    keep_last: int = _f(3, "keep this many newest checkpoints (plus the best by validation loss, GRPO: reward)")
    async_checkpoint: bool = _f(False, "save checkpoints in the background: the saving step copies the state to host "
                                "memory (pinned on a GPU, reused) and goes on; one writer thread writes, verifies, "
                                "publishes and prunes as a synchronous save does. One save in flight (the next save, "
                                "the end of the run and SIGTERM wait for it); a crash during the write leaves the "
                                "previous checkpoint the latest (docs/checkpoints.md)")
    # ---- stability guard (docs/monitor.md, "Loss spikes")
    spike_guard: bool = _f(False, "stop with exit 76 and record the step in <out_dir>/spike.json when a step's loss "
                           "is non-finite or above --spike_factor x the median of the previous --spike_window steps "
                           "(judged once that many were seen); monitor_process.py then rolls back, replays the steps "
                           "once, and skips their data if the spike comes back")
    spike_factor: float = _f(3.0, "--spike_guard: a loss above this multiple of the running median is a spike (> 1)")
    spike_window: int = _f(50, "--spike_guard: steps in the running median, and the warm-up before the first check")
    skip_data_steps: str = _f("", "data steps never trained on, e.g. 12,13 or 10-13 (data step N = the global batch "
                              "step N reads when nothing is skipped): drawn from the loader and discarded, the step "
                              "trains on the next data. Kept in checkpoints: a resume skips them without the flag")
    eval_tasks: str = _f("", "multiple-choice task files (local jsonl: HellaSwag / ARC / PIQA / MMLU-style or generic, "
                         "comma-separated) scored at every evaluation on rank 0 as lm-evaluation-harness scores them "
                         "(eval_lm.py), --batch_size choices per forward: val_<task>_acc and val_<task>_acc_norm in "
                         "metrics.jsonl; the files are checked before the start (exit 3 naming file:line); not with "
                         "--parallel=fsdp or pipeline stages (no rank holds the whole model)")
    eval_tasks_limit: int = _f(0, "--eval_tasks: score only each file's first N records (0 = all)")
    sample_every: int = _f(0, "every N optimizer steps (0 = off), after that step's evaluation, rank 0 generates a "
                           "continuation of each --sample_prompts prompt with the run's tokenizer: console, "
                           "<out_dir>/samples.jsonl, TensorBoard text, a W&B table. Training is unchanged (RNG "
                           "states restored). Not with --parallel=fsdp or --pipeline_parallel_size > 1")
    sample_prompts: str = _f("", "--sample_every: prompts separated by |, or a text file with one prompt per line "
                             "(default: 'Once upon a time'); sft/dpo runs wrap each in the chat template as a "
                             "user turn")
    sample_max_new_tokens: int = _f(32, "--sample_every: tokens generated per prompt (fewer when </s> or <|im_end|> "
                                    "comes first)")
    sample_temperature: float = _f(0.0, "--sample_every: 0 = greedy; > 0 samples with a private generator seeded by "
                                   "(--seed, step), never the training's random numbers")
    tensorboard: bool = _f(False, "also log to <out_dir>/tensorboard when tensorboard is installed")
    wandb: bool = _f(False, "also log to Weights & Biases (WANDB_MODE=offline works without network); a resumed "
                     "run continues the same W&B run")
    wandb_project: str = _f("myllm", "W&B project")
    wandb_run_name: str = _f("", "W&B run name (default: W&B's own)")
    progress: bool = _f(True, "progress bar with ETA on rank 0 (when stdout is a terminal)")
    device: str = _f("auto", "auto | cpu | cuda | cuda:N")
    threads: int = _f(0, "CPU compute threads per process (0 = auto: OMP_NUM_THREADS when set, as torchrun sets it "
                      "per rank; else the cores this process may use, shared among the node's ranks, and on CPU "
                      "one thread while that is measured faster: beside other busy processes PyTorch's spinning "
                      "threads train several times slower; not with --deterministic=true). Said in the [layout] "
                      "line; a fixed count keeps a CPU run bit-reproducible (docs/training.md \"CPU threads\")")
    peak_flops: float = _f(0.0, "peak FLOP/s per device for MFU (0 = the data-sheet table for known GPUs, else a "
                           "measured matmul peak, the best ever seen on this machine, kept in peak_flops.json under "
                           "$MYLLM_CACHE_DIR or ~/.cache/myllm: an estimate, MFU shown as mfu~)")


def trains_embeddings(run: Any) -> bool:
    """Whether a run (TrainConfig or its saved config dict) trains the embedding and LM head while
    freezing the rest: --trainable=embeddings, or LoRA with --lora_train_embeddings=true."""
    get = run.get if isinstance(run, dict) else lambda k, d=None: getattr(run, k, d)
    return get("trainable", "all") == "embeddings" or (get("lora_rank", 0) > 0 and bool(get("lora_train_embeddings")))




# ---------------------------------------------------------------------------- how a run starts (--resume)

RESUME_CHOICES = ("auto", "always", "never")


def resume_policy(cfg: TrainConfig) -> str:
    """--resume, with --init_from=resume read as its alias --resume=always."""
    return "always" if cfg.init_from == "resume" else cfg.resume


def resume_flag(cfg: TrainConfig) -> str:
    """The flag that chose the policy, as messages name it."""
    return "--init_from=resume" if cfg.init_from == "resume" else f"--resume={cfg.resume}"


def continues_run(cfg: TrainConfig) -> bool:
    """Whether this start continues the run in --out_dir (from its newest valid checkpoint or, with none
    yet, as its run_start.json records it started) rather than starting a new run from --init_from.

    Told from the directory's listing alone (no torch, nothing verified: a continuing run whose every
    checkpoint is damaged exits 5 later), so the pre-check and every rank decide alike; the trainer
    decides on every rank before any of them can write there (train_my_ddp.main)."""
    from utils.run_dir import has_run_start, listed_checkpoints
    policy = resume_policy(cfg)
    return policy == "always" or (policy == "auto" and (bool(listed_checkpoints(cfg.out_dir))
                                                        or has_run_start(cfg.out_dir)))


def existing_run_error(cfg: TrainConfig) -> TrainingError:
    """--resume=never on an --out_dir that holds checkpoints."""
    return TrainingError(f"--out_dir={cfg.out_dir} already holds checkpoints of a run and --resume=never does not "
                         "continue it; continue it with --resume=auto (the default), or start a new run in another "
                         "--out_dir", EXIT_BAD_CONFIG)


def nothing_to_continue_error(cfg: TrainConfig, ckpt_root: str) -> TrainingError:
    """--resume=always with no checkpoint, no run_start.json and no --resume_fallback."""
    return TrainingError(f"{resume_flag(cfg)}: no complete checkpoint in {ckpt_root} and no record of how the run "
                         "started (run_start.json); start it with --init_from=scratch or --init_from=<weights dir> "
                         "(and --resume=auto), or pass --resume_fallback", EXIT_BAD_CONFIG)


def no_weights_message(flag: str, path: str) -> str:
    """A weights path (--init_from, --ref_model, --resume_fallback) with nothing loadable there."""
    from utils.run_dir import no_weights_detail
    return f"{flag}={path}: no complete checkpoint or Hugging Face model there{no_weights_detail(path)}"


def init_checkpoint_problem(cfg: TrainConfig) -> Optional[str]:
    """Why --init_checkpoint (other than latest) names nothing of --init_from, told from names and JSON only."""
    if cfg.init_checkpoint == "latest":
        return None
    from utils.run_dir import checkpoint_choice_problem, is_hf_dir
    if cfg.init_from in ("scratch", "resume") or is_hf_dir(cfg.init_from):
        return (f"--init_checkpoint={cfg.init_checkpoint} chooses among the checkpoints of an --init_from run "
                f"directory; --init_from={cfg.init_from} is not one")
    choice = checkpoint_choice_problem(cfg.init_from, cfg.init_checkpoint)
    return "--init_checkpoint: " + choice.replace("--checkpoint=", "--init_checkpoint=") if choice else None


def parallel_section(cfg: TrainConfig):
    """The parallel flags as parallel/config.py's typed section (same names)."""
    from parallel.config import ParallelConfig
    return ParallelConfig.from_flags(cfg)


def engine_needs(cfg: TrainConfig) -> dict[str, str]:
    """What this run asks of the engine, {the flag that asks: capability} (parallel/config.py CAPABILITIES):
    the engine's declarations decide what is refused, never a test of the engine's name here."""
    from trainer.tasks import TASKS, task_entry  # torch-free: the registrations only
    task_needs = task_entry(cfg.task_type).needs if cfg.task_type in TASKS else ""
    asked = ((bool(task_needs), f"--task_type={cfg.task_type}", task_needs),
             (cfg.lora_rank > 0, f"--lora_rank={cfg.lora_rank}", "frozen_parameters"),
             (cfg.trainable != "all", f"--trainable={cfg.trainable}", "frozen_parameters"),
             (cfg.tie_embeddings, "--tie_embeddings=true", "tied_embeddings"),
             (cfg.sample_every > 0, f"--sample_every={cfg.sample_every}", "whole_model_on_one_rank"),
             (bool(cfg.eval_tasks.strip(" ,")), "--eval_tasks", "whole_model_on_one_rank"),
             (cfg.optimizer_state_dtype != "fp32", f"--optimizer_state_dtype={cfg.optimizer_state_dtype}",
              "low_precision_optimizer_states"),
             (cfg.moe_num_experts > 0, f"--moe_num_experts={cfg.moe_num_experts}", "moe"),
             (cfg.mtp_num_layers > 0, f"--mtp_num_layers={cfg.mtp_num_layers}", "multi_token_prediction"),
             (cfg.distill_lmbda > 0, f"--distill_lmbda={cfg.distill_lmbda:g}", "rollouts"),
             (cfg.distill_seq_kd, "--distill_seq_kd=true", "rollouts"))
    return {asked_by: cap for on, asked_by, cap in asked if on}


def eval_task_paths(cfg: TrainConfig) -> list[str]:
    return [t.strip() for t in cfg.eval_tasks.split(",") if t.strip()]


SFT_DPO_WARMUP_RATIO = 0.03  # the warmup of the common SFT recipes (Alpaca, TRL examples): 3% of the run
PRETRAIN_WARMUP_STEPS = 100


def resolve_warmup(warmup_iters: int, warmup_ratio: float, max_iters: int, task_type: str) -> tuple[int, str]:
    """(warmup steps, how they were chosen): --warmup_iters when given (>= 0); else --warmup_ratio x max_iters
    when > 0; else the task's default: pretraining min(100, 10% of the run), SFT/DPO 3% of the run (a
    short fine-tuning run reaches its peak learning rate). At least 1 step when derived."""
    if warmup_iters >= 0:
        return warmup_iters, f"--warmup_iters={warmup_iters}"
    if warmup_ratio > 0:
        return max(1, round(warmup_ratio * max_iters)), f"--warmup_ratio={warmup_ratio:g} x {max_iters} steps"
    if task_type == "pretrain":
        steps = min(PRETRAIN_WARMUP_STEPS, max(1, max_iters // 10))
        return steps, f"the pretrain default, min({PRETRAIN_WARMUP_STEPS}, 10% of {max_iters} steps)"
    steps = max(1, round(SFT_DPO_WARMUP_RATIO * max_iters))
    return steps, f"the {task_type} default, {SFT_DPO_WARMUP_RATIO:.0%} of {max_iters} steps"


def imply_engine(cfg: TrainConfig, given: set) -> Optional[str]:
    """The engine a layout implies when --parallel was not given (parallel/config.py `implied_engine`), set
    on `cfg`; the line that says so, or None."""
    section = parallel_section(cfg)
    line = section.implied_engine(given)
    cfg.parallel = section.parallel
    return line


def max_iters_for_epochs(num_train_epochs: float, num_samples: int, samples_per_step: int, max_iters: int,
                         max_iters_given: bool, steps_per_draw: int = 1) -> tuple[int, str]:
    """--num_train_epochs: (the run's max_iters, the start-up line that says how it was set).

    An epoch is num_samples // samples_per_step data steps (dataset/loader.py drops the < one global batch left
    over), samples_per_step = batch_size x gradient_accumulation_steps x data-parallel ranks: a resume at another
    split of the same global batch (a resume must keep it) gets the same number. Each data step is trained on for
    `steps_per_draw` optimizer steps (GRPO's --num_iterations reuses a rollout: trainer/tasks/base.py). A
    fractional last step counts as a step (ceil). A --max_iters given explicitly wins (and the line says so)."""
    per_epoch = max(1, num_samples // samples_per_step) * steps_per_draw
    steps = max(1, math.ceil(round(num_train_epochs * per_epoch, 6)))  # round: 0.1 x 30 is 3, not 4
    each = f", each trained on for {steps_per_draw} steps" if steps_per_draw > 1 else ""
    head = (f"[schedule] --num_train_epochs={num_train_epochs:g}: 1 epoch = {per_epoch} steps of {samples_per_step} "
            f"samples{each} ({num_samples} training samples)")
    if max_iters_given:
        return max_iters, f"{head} -> {steps} steps, but --max_iters={max_iters} was given and wins"
    return steps, f"{head} -> max_iters={steps}"


# --fused_kernels value -> (fused switches on, ModelConfig.kernel_backend); model/kernels.py picks per op
KERNEL_CHOICES = {"auto": (True, "auto"), "true": (True, "auto"), "triton": (True, "triton"),
                  "torch": (True, "torch"), "false": (False, "auto")}


