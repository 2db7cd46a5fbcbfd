"""The parallel layout of a run as one typed section (`ParallelConfig`), what each engine can do
(`CAPABILITIES`), and every refusal of a combination, in one place. Imports no torch: the trainer's
pre-check answers with the same lines before torch is loaded.

    pc = ParallelConfig.from_flags(train_cfg)          # the fields are the flag names (--parallel, ...)
    pc.engine_kinds()                                  # ("ddp",) | ("fsdp",) | ("pipeline", "ddp") ...
    pc.problems(world_size=8, needs={"--task_type=dpo": "sequence_logprobs"})   # one line per refusal

`needs` says what the run asks of the engine, as {the flag that asks: capability}; a capability
that an engine of this layout does not declare is refused with one line naming both flags and why.
The trainer describes its run (trainer/config.py `engine_needs`) and never asks which engine runs.

Owns: the flag names of the parallel section, the engine kinds and their capabilities, the mesh sizes'
validation (through parallel/mesh.py), and the start-up layout line's engine words.
Must never: import torch, or build anything (parallel/build.py does).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from parallel.mesh import MeshLayout, layout_problem
from utils.configurator import flag

PIPELINE_SCHEDULES = ("gpipe", "1f1b")
DP_ENGINES = ("ddp", "fsdp")
COMM_HOOKS = ("allreduce", "reduce_scatter", "fp16", "bf16", "powersgd")
FLOAT8_CHOICES = ("off", "tensorwise", "rowwise")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

# What each engine can do: a capability a run asks for that is missing here is refused (`problems`) with the
# reason given in WHY_NOT (light_checkpoints, no_process_group and state_per_parameter_name are read, not asked for;
# state_per_parameter_name: the optimizer keeps each parameter's state by name over ranges of the whole tensor, so
# its checkpoints load at any split of the parameters over ranks: ZeRO shards, pipeline stages). A task asks for what it
# needs beyond a plain forward/backward (trainer/tasks/__init__.py TASKS): padded_batches (SFT's padding or packed
# documents), sequence_logprobs (DPO's per-sequence sums), rollouts (GRPO's token-by-token generation), task_forwards
# (forwards of the task's own beside the training ones: KTO's KL rows), sequence_scores (a reward model's score head
# read at each row's last token), token_logits (the whole vocabulary's logits at chosen positions: distillation). A
# pipeline's capabilities are those of "pipeline" AND of the dp engine that runs its stages.
CAPABILITIES: dict[str, frozenset] = {
    "ddp": frozenset({"compile", "padded_batches", "sequence_logprobs", "rollouts", "task_forwards", "sequence_scores",
                      "token_logits", "frozen_parameters", "light_checkpoints", "state_per_parameter_name",
                      "whole_model_on_one_rank", "comm_hooks", "overlap_optim_step", "zero", "tied_embeddings",
                      "no_process_group", "float8", "context_parallel", "low_precision_optimizer_states", "moe",
                      "expert_parallel", "multi_token_prediction"}),
    "fsdp": frozenset({"compile", "padded_batches", "sequence_logprobs", "rollouts", "task_forwards", "sequence_scores",
                       "token_logits", "frozen_parameters", "tensor_parallel", "sequence_parallel", "hsdp",
                       "cpu_offload", "tied_embeddings", "float8", "context_parallel", "moe", "expert_parallel",
                       "multi_token_prediction"}),
    "pipeline": frozenset({"compile", "zero", "tensor_parallel", "sequence_parallel", "hsdp", "cpu_offload",
                           "frozen_parameters", "padded_batches", "sequence_logprobs", "float8", "moe",
                           "expert_parallel", "context_parallel", "multi_token_prediction"}),
}
WHY_NOT: dict[str, str] = {
    "rollouts": "sampling (GRPO's rollouts, on-policy distillation's replies) runs a forward per generated token on "
                "every rank; pipeline stages would pass each token's hidden state between ranks: not built",
    "whole_model_on_one_rank": "no rank holds the whole model",
    "task_forwards": "KTO's KL rows are forwards of the task's own beside the training ones; pipeline stages run the "
                     "schedule's forwards only: not built",
    "sequence_scores": "a reward model's scores are read at each row's last token of the last stage's output, which "
                       "the schedule's loss does not see: not built",
    "token_logits": "distillation compares the teacher's and the student's logits at the target positions of the last "
                    "stage's output, which the schedule's loss does not see: not built",
    "comm_hooks": "only the engine's own gradient reduction runs there",
    "overlap_optim_step": "its per-bucket step needs our DDP's buckets and one stage's gradients",
    "zero": "ZeRO-1/2 belongs to our DDP; FSDP already shards parameters, gradients and optimizer state",
    "tensor_parallel": "it runs on FSDP2's mesh: needs --parallel=fsdp",
    "sequence_parallel": "it runs on FSDP2's mesh with tensor parallelism: needs --parallel=fsdp",
    "hsdp": "it runs on FSDP2's 2-D mesh: needs --parallel=fsdp",
    "cpu_offload": "offloading is FSDP2's: needs --parallel=fsdp",
    "tied_embeddings": "the embedding on the first stage and the LM head on the last would be one weight on two ranks",
    "low_precision_optimizer_states": "the bf16 moments live in our DDP's one-launch AdamW over its flat buffers "
                                      "(one stage's gradient norm only)",
}
# what a dimension of the mesh refuses of a run's needs (a task's, or the trainer's), and why (one line each)
CP_REFUSES: dict[str, str] = {
    "whole_model_on_one_rank": "samples and task evaluation run whole prompts through a KV cache on one rank; "
                               "the model under cp takes split sequences only",
    "sequence_scores": "a row's score is read at its last token, which one rank's chunk holds: not built",
    "token_logits": "the logits at chosen positions of the whole rows are not gathered over the cp ranks: not built",
}
# what tensor parallelism refuses (--tensor_parallel_size > 1)
TP_REFUSES: dict[str, str] = {
    "sequence_scores": "the LM head is split over the tensor ranks by vocabulary rows; a reward model's score head "
                       "has one output",
    "token_logits": "the LM head's logits are split over the tensor ranks by vocabulary rows; distillation's KL needs "
                    "the whole rows: not built",
}
# what expert parallelism under our DDP refuses (--parallel=ddp --expert_parallel_size > 1), and why
EP_DDP_REFUSES: dict[str, str] = {
    "whole_model_on_one_rank": "samples and task evaluation run the model on rank 0 alone; each rank holds only "
                               "its experts and every forward exchanges tokens with the other expert-parallel ranks",
    "overlap_optim_step": "its per-bucket step clips by a norm per bucket; the experts' norm is summed over the "
                          "expert-parallel ranks",
    "low_precision_optimizer_states": "the bf16 moments live in the one-launch AdamW, which does not step "
                                      "expert-parallel shards",
}
# what pipeline stages refuse beside context or tensor parallelism (the stages' activations split over cp or tp)
PP_SPLIT_REFUSES: dict[str, str] = {
    "multi_token_prediction": "the depths' embedded inputs travel between the stages beside the hidden state, "
                              "which is built for whole sequences and whole hidden states: not built",
}
# what sequence parallelism refuses (--sequence_parallel=true)
SP_REFUSES: dict[str, str] = {
    "rollouts": "decoding feeds one position per row at a time, which sequence parallelism cannot split over the "
                "tensor ranks",
}


_f = flag  # utils/configurator.py: a flag's default and help


@dataclass
class ParallelFlags:
    """The parallel engine's flags, declared once: the trainer's TrainConfig has them as its own
    (`--parallel=...`, same names, defaults and help), and ParallelConfig reads them back from it."""
    parallel: str = _f("ddp", "ddp (our DDP, + ZeRO-1/2 with --use_distributed_optimizer) | fsdp (torch FSDP2: "
                       "parameters, gradients and optimizer state sharded)")
    reshard_after_forward: bool = _f(True, "fsdp: free gathered parameters after forward (ZeRO-3); false keeps "
                                     "them until backward (ZeRO-2-like, more memory, less communication)")
    cpu_offload: bool = _f(False, "fsdp: keep sharded parameters, gradients and optimizer state on the CPU")
    use_distributed_optimizer: bool = _f(False, "ZeRO: shard optimizer state and fp32 main params")
    zero_stage: int = _f(1, "1 or 2 (2 also releases gradients of shards a rank does not own)")
    comm_hook: str = _f("allreduce", "allreduce | reduce_scatter | fp16 | bf16 | powersgd")
    overlap_grad_reduce: bool = _f(True, "launch a bucket's reduction as soon as its gradients are ready")
    overlap_param_gather: bool = _f(False, "ZeRO: all-gather parameters during the next forward")
    overlap_optim_step: bool = _f(False, "step the optimizer per bucket as its reduction ends (see docs/parallel.md)")
    bucket_size: int = _f(4_000_000, "elements per gradient bucket")
    grad_reduce_in_fp32: bool = _f(True, "reduce bf16/fp16 gradients in fp32")
    powersgd_rank: int = _f(4, "PowerSGD rank")
    powersgd_start_iter: int = _f(10, "plain all-reduce before this step")
    powersgd_min_compression_rate: float = _f(2.0, "tensors compressing less than this go uncompressed")
    powersgd_warm_start: bool = _f(True, "reuse Q between steps")
    pipeline_parallel_size: int = _f(1, "pipeline stages P (1 = off): the layers split into P stages on a pp x dp mesh "
                                     "(WORLD_SIZE = P x dp; dp uses --parallel); the micro-batches are "
                                     "--gradient_accumulation_steps; pretrain and sft only (see docs/parallel.md)")
    pipeline_schedule: str = _f("1f1b", "gpipe (all forwards, then all backwards) | 1f1b (less activation memory; "
                                "needs --gradient_accumulation_steps >= --pipeline_parallel_size)")
    tensor_parallel_size: int = _f(1, "tensor-parallel ranks T (1 = off): each block's matmuls, the embedding and the "
                                   "LM head split over T neighbouring ranks (Megatron layout on DTensor); needs "
                                   "--parallel=fsdp, which shards over the rest (WORLD_SIZE = dp x T); see docs/parallel.md")
    sequence_parallel: bool = _f(False, "with --tensor_parallel_size > 1: split the norms' activations and the residual "
                                 "stream on the sequence between the tensor-parallel regions (all-gather / "
                                 "reduce-scatter instead of all-reduce); batch lengths must be multiples of T")
    dp_replicate_size: int = _f(1, "HSDP: data-parallel replicas R (1 = off): FSDP2 shards within each of R groups "
                                "and all-reduces gradients across them (WORLD_SIZE = R x shard x T); needs --parallel=fsdp")
    float8: str = _f("off", "off | tensorwise | rowwise: FP8 matmuls in the blocks' linear layers (torchao float8 "
                     "training, dynamic scales per tensor or per row; weights, optimizer and checkpoints unchanged); "
                     "needs an FP8 GPU (compute capability 8.9+: Ada, Hopper); on CPU torchao's emulation (slow, for "
                     "checking). Not with --tensor_parallel_size > 1 or pipeline stages yet")
    float8_layers: str = _f("auto", "with --float8: auto = only the block linears large enough for FP8 to pay for "
                            "its scaling casts (torchao's H100 thresholds per recipe, parallel/transforms/float8.py: "
                            "at 124M only gate/up, at 1B all but k/v) | all = every block linear")
    context_parallel_size: int = _f(1, "context-parallel ranks C (1 = off): every sequence split over C ranks (each holds "
                                    "a head and a tail chunk of 2C, so causal work is balanced), keys/values passed "
                                    "around them (ring attention, model/ring_attention.py); parameters replicated, "
                                    "gradients reduced over dp x C (WORLD_SIZE = dp x C); --max_seq_len a multiple "
                                    "of 2C; pretraining, --parallel=ddp or fsdp (+ tensor parallel), not pipeline stages "
                                    "(see docs/parallel.md)")
    expert_parallel_size: int = _f(1, "expert-parallel ranks (1 = off): the routed experts of every MoE block split "
                                   "over ep data-parallel ranks (each holds E/ep; tokens sent to their experts' "
                                   "ranks and back by all-to-all); ep divides the data-parallel shard dimension; "
                                   "--parallel=ddp (+ ZeRO-1/2: the experts reduced and sharded over the ranks "
                                   "holding the same ones) or fsdp (see docs/parallel.md)")
    compile_mode: str = _f("default", "with --compile=true: torch.compile's mode (default | reduce-overhead | max-autotune | "
                           "max-autotune-no-cudagraphs); reduce-overhead and max-autotune replay the compiled forward "
                           "and backward as CUDA graphs on a GPU (Inductor's cudagraph trees; no effect on CPU); the "
                           "optimizer step stays outside the graphs")
    compile_tuning: bool = _f(False, "with --compile=true: Inductor's coordinate-descent tuning: while compiling, each "
                              "generated Triton kernel's block sizes and warps are timed on the GPU around the "
                              "heuristic's pick (longer compile; Inductor's CPU kernels are not tuned; the "
                              "max-autotune modes include it)")
    compile_backend: str = _f("inductor", "with --compile=true: torch.compile's backend (inductor | aot_eager | eager); "
                              "aot_eager traces forward and backward (Dynamo + AOTAutograd) without Inductor's code "
                              "generation, eager runs Dynamo's graphs as they are: for telling a numerical "
                              "difference or a failure of Inductor's kernels from one of the tracing")


@dataclass
class ParallelConfig(ParallelFlags):
    """The parallel section of a run: its flags, plus the values of other sections the engines read."""
    compile: bool = False                  # the compile transform (parallel/transforms/compile.py)
    gradient_checkpointing: bool = False   # the activation checkpointing transform: on (full) ...
    activation_checkpoint: str = "none"    # ... or none | full | selective ...
    selective_ac_option: str = "op"        # ... selective's policy (op | N); model/checkpointing.py
    activation_memory_budget: float = 0.5  # ... memory_budget's share (the compile transform)
    gradient_accumulation_steps: int = 1   # a pipeline's micro-batches per step
    seed: int = 1337                       # PowerSGD's random projections

    @classmethod
    def from_flags(cls, flags: Any) -> "ParallelConfig":
        """The section read from any object with the flag names as attributes (TrainConfig); missing names
        keep their defaults."""
        return cls(**{f.name: getattr(flags, f.name) for f in dataclasses.fields(cls) if hasattr(flags, f.name)})

    # ------------------------------------------------------------------ layout
    @property
    def pp(self) -> int:
        return int(self.pipeline_parallel_size)

    @property
    def tp(self) -> int:
        return int(self.tensor_parallel_size)

    @property
    def cp(self) -> int:
        return int(self.context_parallel_size)

    @property
    def ep(self) -> int:
        return int(self.expert_parallel_size)

    def layout(self, world_size: int) -> MeshLayout:
        """The mesh sizes for `world_size` processes; ValueError (one line) when they do not fit."""
        return MeshLayout.from_sizes(world_size, pp=self.pp, dp_replicate=int(self.dp_replicate_size), tp=self.tp,
                                     cp=self.cp, ep=self.ep)

    def data_parallel_size(self, world_size: int) -> int:
        """How many slices the global batch is split into at `world_size`: the ranks of one pipeline, of one
        context group and of one tensor group read the same batch."""
        return max(1, int(world_size) // max(1, self.pp * self.cp * self.tp))

    def describe_ranks(self, dp_size: int) -> str:
        """`N data-parallel ranks x P pipeline stages (schedule) x T tensor-parallel ranks`, for the start line."""
        words = f"{dp_size} data-parallel ranks"
        if self.pp > 1:
            words += f" x {self.pp} pipeline stages ({self.pipeline_schedule})"
        if self.cp > 1:
            words += f" x {self.cp} context-parallel ranks"
        if self.tp > 1:
            words += f" x {self.tp} tensor-parallel ranks"
        return words

    def engine_kinds(self) -> tuple[str, ...]:
        """The engines of this layout, outermost first: ("pipeline", dp engine) or (dp engine,)."""
        return ("pipeline", self.parallel) if self.pp > 1 else (self.parallel,)

    def capabilities(self) -> frozenset:
        """What every engine of this layout can do (the intersection of their declarations)."""
        caps = None
        for kind in self.engine_kinds():
            declared = CAPABILITIES.get(kind, frozenset())
            caps = declared if caps is None else caps & declared
        return caps or frozenset()

    def engine_lacking(self, capability: str) -> Optional[str]:
        """The flag that chose the (outermost) engine of this layout that does not declare `capability`,
        for the refusal's line; None when every engine declares it."""
        for kind in self.engine_kinds():
            if capability not in CAPABILITIES.get(kind, frozenset()):
                return f"--pipeline_parallel_size={self.pp}" if kind == "pipeline" else f"--parallel={kind}"
        return None

    def implied_engine(self, given: set) -> Optional[str]:
        """--tensor_parallel_size > 1 or --dp_replicate_size > 1 run only on FSDP2's mesh: without an explicit
        --parallel, --parallel=fsdp is chosen here (an explicit --parallel=ddp is still refused by `problems`).
        Returns the line that says so, None when nothing was implied."""
        multi = [f"--{n}={getattr(self, n)}" for n in ("tensor_parallel_size", "dp_replicate_size")
                 if isinstance(getattr(self, n), int) and getattr(self, n) > 1]
        if not multi or "parallel" in given or self.parallel == "fsdp":
            return None
        self.parallel = "fsdp"
        return f"[layout] {' '.join(multi)} runs on FSDP2's 2-D mesh: --parallel=fsdp chosen (it was not given)"

    def needs_process_group(self) -> bool:
        """Whether one process needs a process group too: every engine but our DDP runs on a device mesh
        (the engines that run without one declare "no_process_group")."""
        return "no_process_group" not in self.capabilities()

    def needs_mesh(self) -> bool:
        """Whether the layout runs on parallel/mesh.py's device mesh: FSDP2, pipeline stages and every dimension
        past data parallelism do; our DDP / ZeRO alone reduces over a process group."""
        return (self.parallel == "fsdp" or self.pp > 1 or self.cp > 1 or self.tp > 1 or int(self.dp_replicate_size) > 1
                or self.ep > 1)

    def saves_light_checkpoints(self) -> bool:
        return "light_checkpoints" in self.capabilities()

    # ------------------------------------------------------------------ validation
    def layout_needs(self) -> dict[str, str]:
        """The capabilities the layout flags themselves ask for: {flag: capability}."""
        asked = ((self.tp > 1, f"--tensor_parallel_size={self.tp}", "tensor_parallel"),
                 (self.sequence_parallel, "--sequence_parallel=true", "sequence_parallel"),
                 (self.dp_replicate_size > 1, f"--dp_replicate_size={self.dp_replicate_size}", "hsdp"),
                 (self.cpu_offload, "--cpu_offload=true", "cpu_offload"),
                 (self.comm_hook != "allreduce", f"--comm_hook={self.comm_hook}", "comm_hooks"),
                 (self.overlap_optim_step, "--overlap_optim_step=true", "overlap_optim_step"),
                 (self.use_distributed_optimizer, "--use_distributed_optimizer=true", "zero"),
                 (self.compile, "--compile=true", "compile"),
                 (self.float8 != "off", f"--float8={self.float8}", "float8"),
                 (self.cp > 1, f"--context_parallel_size={self.cp}", "context_parallel"),
                 (self.ep > 1, f"--expert_parallel_size={self.ep}", "expert_parallel"))
        return {asked_by: cap for on, asked_by, cap in asked if on}

    def problems(self, world_size: Optional[int] = None, needs: Optional[dict[str, str]] = None) -> list[str]:
        """Every reason this layout cannot run, one line each: bad sizes or names, a world that does not lay
        out as pp x dp_replicate x dp_shard x tp, and each capability asked for (`needs` and the layout's
        own flags) that an engine of this layout does not declare."""
        out = []
        for name in ("pipeline_parallel_size", "tensor_parallel_size", "dp_replicate_size", "context_parallel_size",
                     "expert_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"--{name}={v!r}: must be an integer >= 1")
        if self.parallel not in DP_ENGINES:
            out.append(f"--parallel={self.parallel!r} (ddp | fsdp)")
        if str(self.pipeline_schedule).lower() not in PIPELINE_SCHEDULES:
            out.append(f"--pipeline_schedule={self.pipeline_schedule!r} (gpipe | 1f1b)")
        if self.comm_hook not in COMM_HOOKS:
            out.append(f"--comm_hook={self.comm_hook!r} ({' | '.join(COMM_HOOKS)})")
        if self.zero_stage not in (1, 2):
            out.append(f"--zero_stage={self.zero_stage} (1 | 2)")
        if self.float8 not in FLOAT8_CHOICES:
            out.append(f"--float8={self.float8!r} ({' | '.join(FLOAT8_CHOICES)})")
        if self.float8_layers not in ("auto", "all"):
            out.append(f"--float8_layers={self.float8_layers!r} (auto | all)")
        if self.compile_mode not in COMPILE_MODES:
            out.append(f"--compile_mode={self.compile_mode!r} ({' | '.join(COMPILE_MODES)})")
        if self.compile_backend not in COMPILE_BACKENDS:
            out.append(f"--compile_backend={self.compile_backend!r} ({' | '.join(COMPILE_BACKENDS)})")
        elif self.compile_backend != "inductor" and (self.compile_mode != "default" or self.compile_tuning):
            out.append(f"--compile_backend={self.compile_backend}: --compile_mode and --compile_tuning are Inductor's "
                       "(leave them at their defaults)")
        if out:
            return out
        if world_size is not None:
            problem = layout_problem(world_size, pp=self.pp, dp_replicate=int(self.dp_replicate_size), tp=self.tp,
                                     cp=self.cp, ep=self.ep)
            if problem:
                out.append(problem)
        out.extend(self._combination_problems())
        pp_split = f"--pipeline_parallel_size={self.pp} with " + (f"--context_parallel_size={self.cp}" if self.cp > 1
                                                                   else f"--tensor_parallel_size={self.tp}")
        for on, engine_flag, refuses in ((self.cp > 1, f"--context_parallel_size={self.cp}", CP_REFUSES),
                                         (self.tp > 1, f"--tensor_parallel_size={self.tp}", TP_REFUSES),
                                         (self.sequence_parallel and self.tp > 1, "--sequence_parallel=true",
                                          SP_REFUSES),
                                         (self.pp > 1 and (self.cp > 1 or self.tp > 1), pp_split, PP_SPLIT_REFUSES)):
            for asked_by, what in (needs or {}).items() if on else ():
                if what in refuses:
                    out.append(f"{asked_by} cannot be combined with {engine_flag} ({refuses[what]})")
        if self.ep > 1 and self.parallel == "ddp":
            for asked_by, what in {**self.layout_needs(), **(needs or {})}.items():
                if what in EP_DDP_REFUSES:
                    out.append(f"{asked_by} cannot be combined with --expert_parallel_size={self.ep} under "
                               f"--parallel=ddp ({EP_DDP_REFUSES[what]})")
        for asked_by, cap in {**self.layout_needs(), **(needs or {})}.items():
            engine = self.engine_lacking(cap) if cap else None  # "": nothing beyond a plain forward/backward
            if engine is not None:
                out.append(f"{asked_by} cannot be combined with {engine} ({WHY_NOT.get(cap, 'not supported')})")
        return out

    def model_problems(self, *, n_layers: int, n_heads: int, n_kv_heads: int, max_seq_len: int,
                       dropout: float, moe_num_experts: int = 0) -> list[str]:
        """What a model of this shape cannot do on this layout: layers that do not split into the pipeline's
        stages, heads that do not split over the tensor-parallel ranks, a sequence that does not, experts
        that do not split over the expert-parallel ranks (or none to split)."""
        out = []
        if self.ep > 1 and not moe_num_experts:
            out.append(f"--expert_parallel_size={self.ep} needs an MoE model (--moe_num_experts > 0)")
        elif self.ep > 1 and moe_num_experts % self.ep:
            out.append(f"--moe_num_experts={moe_num_experts} is not divisible by --expert_parallel_size={self.ep} "
                       f"(each rank holds experts/{self.ep})")
        if self.pp > 1 and n_layers % self.pp:
            out.append(f"--pipeline_parallel_size={self.pp}: --n_layers={n_layers} does not split into {self.pp} "
                       "equal stages (choose a divisor of n_layers)")
        if self.tp > 1:
            for name, v in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads)):
                if v % self.tp:
                    out.append(f"--{name}={v} is not divisible by --tensor_parallel_size={self.tp} (each rank "
                               f"computes {name}/{self.tp} heads)")
            if self.sequence_parallel and max_seq_len % self.tp:
                out.append(f"--sequence_parallel=true: --max_seq_len={max_seq_len} is not a multiple of "
                           f"--tensor_parallel_size={self.tp}")
            if self.sequence_parallel and dropout > 0:
                out.append(f"--sequence_parallel=true cannot be combined with --dropout={dropout} yet (each rank's "
                           "positions would need their own random stream)")
        if self.cp > 1 and max_seq_len % (2 * self.cp):
            out.append(f"--context_parallel_size={self.cp}: --max_seq_len={max_seq_len} is not a multiple of 2 x "
                       f"{self.cp} = {2 * self.cp} (each rank holds a head and a tail chunk of 2 x {self.cp})")
        return out

    def _combination_problems(self) -> list[str]:
        """Rules between the flags of this section that are not an engine's capability."""
        out = []
        if self.comm_hook == "reduce_scatter" and not self.use_distributed_optimizer \
                and self.engine_lacking("comm_hooks") is None:
            out.append("--comm_hook=reduce_scatter leaves each rank only its shard of the gradients: it needs "
                       "--use_distributed_optimizer=true (ZeRO), which steps exactly that shard")
        if self.float8 != "off" and self.tp > 1:
            out.append(f"--float8={self.float8} cannot be combined with --tensor_parallel_size={self.tp} yet (the "
                       "tensor-parallel plan splits plain nn.Linear layers; torchao's FP8 ones need its own plan)")
        if self.compile and self.compile_mode in ("reduce-overhead", "max-autotune") and (self.tp > 1 or self.pp > 1):
            what = f"--tensor_parallel_size={self.tp}" if self.tp > 1 else f"--pipeline_parallel_size={self.pp}"
            out.append(f"--compile_mode={self.compile_mode} cannot be combined with {what} yet (CUDA graphs are "
                       "marked per micro-batch of the whole-model compile; per-block and per-stage compiles are not)")
        if self.ep > 1 and self.parallel == "ddp" and self.comm_hook == "powersgd":
            out.append(f"--comm_hook=powersgd cannot be combined with --expert_parallel_size={self.ep} yet (its "
                       "low-rank state is per bucket over the whole data-parallel group; the experts' buckets are "
                       "reduced over the ranks holding the same experts)")
        if self.cp > 1 and self.sequence_parallel:
            out.append(f"--sequence_parallel=true cannot be combined with --context_parallel_size={self.cp} yet (both "
                       "split the sequence: the tensor ranks would split each cp rank's two chunks again, untested)")
        if self.sequence_parallel and self.tp == 1:
            out.append("--sequence_parallel=true splits the sequence over tensor-parallel ranks: it needs "
                       "--tensor_parallel_size > 1")
        if self.parallel == "fsdp" and self.zero_stage != 1:
            out.append(f"--zero_stage={self.zero_stage} belongs to --parallel=ddp with ZeRO; FSDP's stage is chosen "
                       "by --reshard_after_forward (true: ZeRO-3, false: ZeRO-2-like)")
        if self.parallel == "fsdp" and self.overlap_param_gather:
            out.append("--overlap_param_gather=true belongs to ZeRO under --parallel=ddp; FSDP prefetches "
                       "parameter all-gathers itself")
        if self.pp > 1:
            if str(self.pipeline_schedule).lower() == "1f1b" and self.gradient_accumulation_steps < self.pp:
                out.append(f"the 1F1B schedule needs at least as many micro-batches as stages: "
                           f"--gradient_accumulation_steps={self.gradient_accumulation_steps} < "
                           f"--pipeline_parallel_size={self.pp} (raise it or use --pipeline_schedule=gpipe)")
        return out

    # ------------------------------------------------------------------ the start-up line
    def describe_engine(self) -> str:
        """The engine words of the [layout] line."""
        dp = self.parallel
        if dp == "ddp" and self.use_distributed_optimizer:
            dp = f"ddp + ZeRO-{self.zero_stage}"
        elif dp == "fsdp":
            dp = (f"fsdp (FSDP2, {'ZeRO-3' if self.reshard_after_forward else 'ZeRO-2-like'}"
                  f"{', CPU offload' if self.cpu_offload else ''})")
        kind = f"pipeline ({self.pp} stages, {self.pipeline_schedule}) over {dp}" if self.pp > 1 else dp
        if self.tp > 1:
            kind += f" + tensor parallel {self.tp} (DTensor{', sequence parallel' if self.sequence_parallel else ''})"
        if self.dp_replicate_size > 1:
            kind += f", HSDP over {self.dp_replicate_size} replicas"
        if self.float8 != "off":
            kind += f", FP8 block matmuls ({self.float8}{', every layer' if self.float8_layers == 'all' else ''})"
        if self.cp > 1:
            kind += f" + context parallel {self.cp} (ring attention)"
        if self.ep > 1:
            kind += f" + expert parallel {self.ep} (all-to-all)"
        return kind
