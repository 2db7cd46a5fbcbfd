"""Model configuration: one dataclass with a JSON round trip.

Owns: every architectural hyper-parameter of the Llama2-style model, the kernel switches and the
memory/speed knobs (activation checkpointing, loss chunk size). Must never import torch modules of
the model or touch a device: a config is plain data that is saved next to every checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class ModelConfig:
    # --- architecture (Llama2 names; HF names in comments for interop) ---
    vocab_size: int = 32000            # vocab_size (= tokenizer_meta.json "vocab_size")
    dim: int = 4096                    # hidden_size
    n_layers: int = 32                 # num_hidden_layers
    n_heads: int = 32                  # num_attention_heads
    n_kv_heads: Optional[int] = None   # num_key_value_heads; None = n_heads (no GQA)
    hidden_dim: Optional[int] = None   # intermediate_size; None = Llama formula from the two below
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5             # rms_norm_eps
    max_seq_len: int = 2048            # max_position_embeddings
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # {"type": linear|dynamic|llama3|yarn, "factor": f, ...} (HF semantics)
    attn_dropout: float = 0.0          # dropout on attention probabilities (training only)
    resid_dropout: float = 0.0         # dropout on each residual branch output (training only)
    tie_embeddings: bool = False       # tie_word_embeddings
    qkv_bias: bool = False             # biases on the q/k/v projections (Qwen2's attention; o_proj has none)
    o_bias: bool = False               # a bias on o_proj too (gpt-oss: attention_bias sets all four)
    attn_sinks: bool = False           # gpt-oss's sinks: a learned logit per query head in each softmax's denominator
    attn_head_dim: Optional[int] = None  # head_dim where n_heads x head_dim != dim (Qwen3); None = dim // n_heads
    qk_norm: bool = False              # RMSNorm over each head's q and k before RoPE (Qwen3's q_norm / k_norm)
    sliding_window: Optional[int] = None  # sliding-window attention: a query sees its last this many positions
    sliding_layers: Optional[list] = None  # the layers that slide (layer_types' "sliding_attention"); None = all
    nope_layers: Optional[list] = None  # the layers whose attention has no RoPE (SmolLM3's no_rope_layers zeros)
    partial_rotary_factor: float = 1.0  # RoPE turns the first int(head_dim x this) dimensions of a head (GLM-4.5: 0.5)
    # Ministral 3's position-dependent query scale: q x (1 + beta ln(1 + floor(position / length))), beta its
    # llama_4_scaling_beta
    query_pos_scale_beta: Optional[float] = None
    query_pos_scale_length: int = 16384  # (its rope_parameters' original_max_position_embeddings)
    # Gemma 3's block (model/hf_gemma3.py), each off in a Llama; its RMSNorms' (1 + w) are stored as the w' = 1 + w ours
    # multiplies by (the same model: norm weights take no weight decay, and the gradient of w' is the gradient of w)
    scale_embeddings: bool = False     # the embedding's output times sqrt(dim) (Gemma's normalizer)
    sandwich_norms: bool = False       # an RMSNorm on each sublayer's output before the residual add (Gemma 2 / 3)
    mlp_act: str = "silu"              # the gated MLP's activation: silu (SwiGLU) | gelu_tanh (GeGLU, Gemma's)
    query_scale: Optional[float] = None  # attention scores are q.k / sqrt(this) (query_pre_attn_scalar); None: head_dim
    rope_local_theta: Optional[float] = None  # the sliding layers' RoPE base, unscaled (rope_local_base_freq)
    # Gemma 2's logit soft-capping (model/softcap.py: z -> cap tanh(z / cap)); None = off
    attn_softcap: Optional[float] = None  # on the attention scores (attn_logit_softcapping; a math-path attention)
    final_softcap: Optional[float] = None  # on the LM head's logits (final_logit_softcapping), in every loss head
    # IBM Granite's multipliers (model/hf_granite.py; its attention_multiplier is query_scale = 1 / multiplier^2)
    embedding_multiplier: Optional[float] = None  # the embedding's output times this
    residual_multiplier: Optional[float] = None  # each sublayer's output times this before the residual add
    logits_scaling: Optional[float] = None  # the LM head's logits divided by this (the normed hidden state, before it)
    # OLMo 2 / 3's block (model/hf_olmo.py): only the sublayers' output norms, and q / k norms over all the heads
    pre_norms: bool = True             # the RMSNorms before attention and MLP (False: OLMo's, with sandwich_norms)
    qk_norm_full: bool = False         # with qk_norm: one norm over all heads' q (and all k), before the heads split
    initializer_range: float = 0.02
    # a reward model (model/score_head.py): the head gives this many scores per position instead of the vocabulary's
    # logits (HF *ForSequenceClassification's `score`, num_labels); 0 = a language model
    num_labels: int = 0

    # --- mixture of experts (model/moe.py; 0 experts = every block dense)
    moe_num_experts: int = 0           # routed experts per MoE block (HF num_local_experts / num_experts)
    moe_top_k: int = 2                 # experts per token (num_experts_per_tok)
    moe_shared_experts: int = 0        # always-on experts, merged into one SwiGLU of this many x the expert width ...
    moe_shared_hidden_dim: Optional[int] = None  # ... or of this width (Qwen2-MoE's shared_expert_intermediate_size)
    moe_shared_gate: bool = False      # the shared experts' output times sigmoid(x . g) (Qwen2-MoE's expert gate)
    moe_hidden_dim: Optional[int] = None  # expert width (moe_intermediate_size); None = hidden_dim
    moe_first_dense_layers: int = 0    # the first k blocks keep a dense MLP (DeepSeek's first_k_dense_replace)
    moe_score: str = "softmax"         # router scores: softmax | sigmoid
    moe_n_groups: int = 1              # DeepSeek-V3's group-limited routing: experts in this many groups (n_group) ...
    moe_topk_groups: int = 1           # ... a token's experts chosen from its best this many groups (topk_group), ...
    moe_group_score: str = "top2"      # ... a group ranked by its 2 best scores (V3) or its best (max: V2's)
    moe_routed_scaling: float = 1.0    # the routed experts' weights times this (routed_scaling_factor)
    moe_norm_topk: bool = True         # top_k > 1: the chosen weights renormalised to sum 1 (norm_topk_prob); or raw
    moe_capacity_factor: float = 0.0   # training: rows per expert at most ceil(f N k / E), padded (0 = dropless)
    moe_token_drop_policy: str = "probs"  # past capacity drop the smallest weights (probs) or the latest (position)
    # gpt-oss's MoE (model/hf_gpt_oss.py): a bias in the router's logits, biases on each expert's projections, and
    # its clamped SwiGLU: min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, +-limit) + 1)
    moe_router_bias: bool = False      # the router's logits x W^T + b
    moe_expert_biases: bool = False    # each expert's gate / up and down projections have biases
    moe_act: str = "silu"              # the experts' activation: silu (SwiGLU) | gpt_oss (the clamped form above)
    moe_swiglu_limit: float = 7.0      # gpt_oss: the clamp (swiglu_limit)
    moe_swiglu_alpha: float = 1.702    # gpt_oss: the sigmoid's slope (swiglu_alpha)

    # --- multi-head latent attention (model/mla.py; DeepSeek-V2 / V3's MLA, transformers' DeepseekV3Config names;
    # utils/mla_flags.py): 0 = grouped-query attention (the Attention above)
    kv_lora_rank: int = 0              # keys and values from one latent of this width per token (0 = off)
    q_lora_rank: Optional[int] = None  # queries through a latent of this width (None: one q_proj)
    qk_nope_head_dim: int = 0          # each head's query / key dimensions without RoPE ...
    qk_rope_head_dim: int = 0          # ... and with RoPE (the key's shared by the heads)
    v_head_dim: int = 0                # each head's value width

    # --- multi-token prediction (model/mtp.py; DeepSeek-V3's sequential MTP, num_nextn_predict_layers)
    mtp_num_layers: int = 0            # extra blocks, depth k predicting the token k + 1 after the next (0 = off)

    # --- kernel switches: each has a pure-PyTorch reference path (model/kernels.py) ---
    fused_rmsnorm: bool = True         # hand-written autograd RMSNorm (saves less, recomputes)
    fused_rope: bool = True            # autograd RoPE whose backward is a rotation by -theta
    fused_swiglu: bool = True          # hand-written autograd silu(g)*u
    fused_qkv: bool = True             # one matmul for q,k,v and one for gate,up (parameters stay separate)
    fused_cross_entropy: bool = True   # chunked linear+CE (model/loss.py); False = full logits + F.cross_entropy
    flash_attn: bool = True            # use flash-attn (2) functions when installed and on an accelerator
    fa4: str = "auto"                  # auto | true | false: FlashAttention-4 on Hopper/Blackwell (model/fa4.py)
    kernel_backend: str = "auto"       # auto | triton | torch: which implementation of the fused ops (model/kernels.py)

    # --- memory / speed ---
    gradient_checkpointing: bool = False  # recompute activations in backward (torch.utils.checkpoint) ...
    checkpoint_policy: str = "full"    # ... of each block (full), selectively per op (op), of every N-th block ("N")
    loss_chunk_size: int = 512         # tokens per chunk of the linear+CE (smaller = less memory; 256-1024 measured alike)

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        from utils.model_bounds import head_shape_problem  # torch-free: the trainer's pre-check asks it too
        problem = head_shape_problem(self.dim, self.n_heads, self.n_kv_heads, self.attn_head_dim) \
            if not self.kv_lora_rank or self.n_heads < 1 else None  # (MLA's heads are sized on their own)
        if problem:
            raise ValueError(problem)
        if self.hidden_dim is None:
            self.hidden_dim = llama_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)
        # linear | dynamic | llama3 | yarn | longrope, completed to its canonical dict (utils/rope_config.py)
        from utils.rope_config import normalize_rope_scaling  # torch-free
        self.rope_scaling = normalize_rope_scaling(self.rope_scaling, self.max_seq_len)
        from utils.model_bounds import checkpoint_policy_problem  # torch-free
        problem = checkpoint_policy_problem(self.checkpoint_policy)
        if problem:
            raise ValueError(f"checkpoint_policy: {problem}")
        if self.moe_group_score not in ("top2", "max"):
            raise ValueError(f"moe_group_score must be top2 or max, got {self.moe_group_score!r}")
        if self.kernel_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"kernel_backend must be auto, triton or torch, got {self.kernel_backend!r}")
        if self.fa4 not in ("auto", "true", "false"):
            raise ValueError(f"fa4 must be auto, true or false, got {self.fa4!r}")
        if self.moe_num_experts:
            from utils.moe_flags import moe_shape_problems  # torch-free: the trainer's pre-check asks it too
            problem = moe_shape_problems(self.moe_num_experts, self.moe_top_k, self.moe_shared_experts,
                                         self.moe_hidden_dim or 0, self.moe_first_dense_layers, self.moe_score,
                                         n_groups=self.moe_n_groups, topk_groups=self.moe_topk_groups,
                                         routed_scaling=self.moe_routed_scaling,
                                         capacity_factor=self.moe_capacity_factor,
                                         drop_policy=self.moe_token_drop_policy)
            if problem:
                raise ValueError("; ".join(problem))
        if self.sliding_window is not None or self.sliding_layers is not None:
            from utils.model_bounds import window_problem  # torch-free: the trainer's pre-check asks it too
            problem = window_problem(self.sliding_window, self.sliding_layers, self.n_layers)
            if problem:
                raise ValueError(problem)
        if self.nope_layers is not None and not (isinstance(self.nope_layers, (list, tuple)) and all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < self.n_layers for i in self.nope_layers)):
            raise ValueError(f"nope_layers={self.nope_layers!r} must list layer indices in [0, {self.n_layers})")
        problem = self._mla_problem() or self._gemma_problem() or self._shared_expert_problem() or \
            self._gpt_oss_problem()
        if problem:
            raise ValueError(problem)
        if not 0 <= self.mtp_num_layers <= 16:
            raise ValueError(f"mtp_num_layers must be in [0, 16], got {self.mtp_num_layers}")
        if isinstance(self.num_labels, bool) or not isinstance(self.num_labels, int) or self.num_labels < 0:
            raise ValueError(f"num_labels={self.num_labels!r} must be an integer >= 0")
        if self.num_labels and (self.tie_embeddings or self.mtp_num_layers):
            raise ValueError("num_labels > 0 (a reward model's score head) has no LM head to tie to the embedding or "
                             "to predict further tokens with (tie_embeddings, mtp_num_layers)")
        if self.loss_chunk_size < 1:
            raise ValueError("loss_chunk_size must be >= 1")

    def _gemma_problem(self) -> Optional[str]:
        """What is wrong with Gemma's and OLMo's block fields (or their mix with the rest), or None."""
        if self.mlp_act not in ("silu", "gelu_tanh"):
            return f"mlp_act must be silu or gelu_tanh, got {self.mlp_act!r}"
        if self.mlp_act != "silu" and self.moe_num_experts:
            return "mlp_act=gelu_tanh: the MoE experts are SwiGLU (no Gemma MoE)"
        for name in ("query_scale", "rope_local_theta", "attn_softcap", "final_softcap", "embedding_multiplier",
                     "residual_multiplier", "logits_scaling"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
                return f"{name}={v!r} must be a number > 0"
        if self.rope_local_theta is not None and not self.sliding_window:
            return "rope_local_theta is the sliding layers' RoPE base: it needs sliding_window"
        f = self.partial_rotary_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1 or self.rotary_dim < 2 \
                or self.rotary_dim % 2:
            return (f"partial_rotary_factor={f!r} must be in (0, 1] and turn an even number >= 2 of a head's "
                    f"{self.head_dim} dimensions")
        if self.query_pos_scale_beta is not None and not (isinstance(self.query_pos_scale_length, int)
                                                          and self.query_pos_scale_length >= 1):
            return f"query_pos_scale_length={self.query_pos_scale_length!r} must be an integer >= 1"
        if not self.pre_norms and not self.sandwich_norms:
            return "pre_norms=false leaves the blocks no norm: it needs sandwich_norms (OLMo 2's block)"
        if self.qk_norm_full and not self.qk_norm:
            return "qk_norm_full is the width of the q / k norms: it needs qk_norm"
        if self.final_softcap is not None and (self.num_labels or self.mtp_num_layers):
            return "final_softcap caps a language model's logits: not with num_labels (a score head) or mtp_num_layers"
        if self.attn_softcap is not None and self.kv_lora_rank:
            return "attn_softcap is grouped-query attention's (Gemma 2's): not with kv_lora_rank"
        if self.attn_softcap is not None and self.attn_sinks:
            return "attn_softcap and attn_sinks: no model has both (each has its own attention path)"
        if self.mtp_num_layers and not self.llama_block:
            return ("multi-token prediction's depths are Llama / DeepSeek blocks: not with Gemma's or OLMo's block "
                    "fields or a partial rotary")
        return None

    @property
    def moe_shared_width(self) -> int:
        """The width of the shared experts' one SwiGLU (0: none)."""
        if not self.moe_shared_experts:
            return 0
        return self.moe_shared_hidden_dim or self.moe_shared_experts * (self.moe_hidden_dim or self.hidden_dim)

    def _shared_expert_problem(self) -> Optional[str]:
        """What is wrong with the shared experts' own width or gate (they need shared experts), or None."""
        w = self.moe_shared_hidden_dim
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            return (f"moe_shared_hidden_dim={w!r} must be an integer >= 1 (or None: moe_shared_experts x the expert "
                    "width)")
        if (w is not None or self.moe_shared_gate) and not (self.moe_num_experts and self.moe_shared_experts):
            return ("moe_shared_hidden_dim / moe_shared_gate describe the shared experts: they need moe_shared_experts "
                    ">= 1")
        return None

    def _gpt_oss_problem(self) -> Optional[str]:
        """What is wrong with gpt-oss's attention and MoE fields (or their mix with the rest), or None."""
        if self.moe_act not in ("silu", "gpt_oss"):
            return f"moe_act must be silu or gpt_oss, got {self.moe_act!r}"
        for name in ("moe_swiglu_limit", "moe_swiglu_alpha"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                return f"{name}={v!r} must be a number > 0"
        moe = [n for n in ("moe_router_bias", "moe_expert_biases") if getattr(self, n)]
        if self.moe_act != "silu":
            moe.append(f"moe_act={self.moe_act}")
        if moe and not self.moe_num_experts:
            return f"{', '.join(moe)} describe the MoE experts: they need moe_num_experts >= 1"
        if moe and self.moe_shared_experts:
            return f"{', '.join(moe)}: gpt-oss's experts, not with shared experts (moe_shared_experts)"
        if (self.attn_sinks or self.o_bias) and self.kv_lora_rank:
            return "attn_sinks / o_bias are grouped-query attention's (gpt-oss's): not with kv_lora_rank"
        return None

    def _mla_problem(self) -> Optional[str]:
        """What is wrong with the multi-head latent attention fields (or their mix with the rest), or None."""
        if not self.kv_lora_rank:
            named = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
            odd = [n for n in named if getattr(self, n)]
            return f"{', '.join(odd)} need kv_lora_rank (multi-head latent attention)" if odd else None
        from utils.mla_flags import MLA_EXCLUDES, mla_shape_problem  # torch-free
        problem = mla_shape_problem(self.kv_lora_rank, self.q_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                    self.v_head_dim)
        if problem:
            return problem
        odd = [n for n in MLA_EXCLUDES if getattr(self, n) not in (None, False)] + list(self.block_fields)
        if self.n_kv_heads != self.n_heads:
            odd.append(f"n_kv_heads={self.n_kv_heads}")
        return (f"multi-head latent attention (kv_lora_rank) cannot be combined with {', '.join(odd)} (DeepSeek's "
                "block has its own head sizes and no GQA, biases, q / k norms or window)") if odd else None

    @property
    def block_fields(self) -> tuple[str, ...]:
        """The fields set that make the blocks other than Llama's (Gemma's, OLMo's, a partial rotary)."""
        changed = {"scale_embeddings": self.scale_embeddings, "sandwich_norms": self.sandwich_norms,
                   "mlp_act": self.mlp_act != "silu", "qk_norm_full": self.qk_norm_full,
                   "query_scale": self.query_scale is not None, "rope_local_theta": self.rope_local_theta is not None,
                   "pre_norms": not self.pre_norms, "partial_rotary_factor": self.partial_rotary_factor != 1.0,
                   "query_pos_scale_beta": self.query_pos_scale_beta is not None,
                   "attn_softcap": self.attn_softcap is not None, "final_softcap": self.final_softcap is not None,
                   **{k: getattr(self, k) is not None
                      for k in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}}
        return tuple(k for k, v in changed.items() if v)

    @property
    def llama_block(self) -> bool:
        """Whether the blocks are Llama's (`block_fields` empty): model/decode.py's fast path computes those."""
        return not self.block_fields

    def slides(self, layer_idx: int) -> bool:
        """Whether block `layer_idx` attends through the sliding window (multi-token prediction's depths, past the
        layers, slide when every layer does)."""
        return bool(self.sliding_window) and (self.sliding_layers is None or layer_idx in self.sliding_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether block `layer_idx` has the MoE feed-forward (model/moe.py) instead of the dense MLP."""
        return self.moe_num_experts > 0 and layer_idx >= self.moe_first_dense_layers

    @property
    def head_dim(self) -> int:
        """A head's query / key width (multi-head latent attention's: nope + rope dimensions)."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.attn_head_dim or self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head RoPE turns (the first ones; transformers' int(head_dim x partial_rotary_factor);
        multi-head latent attention's qk_rope_head_dim, its last ones)."""
        if self.kv_lora_rank:
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict; unknown keys are an error (a typo must not be silently ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys: {unknown}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "ModelConfig":
        return cls.from_dict(json.loads(s))


def llama_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: Optional[float]) -> int:
    """The SwiGLU width of Llama2: 2/3 of 4*dim, optionally scaled, rounded up to multiple_of."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * math.ceil(hidden / multiple_of)


def read_model_config(ckpt_dir: str) -> ModelConfig:
    """The ModelConfig recorded in a checkpoint's model_config.json, every value type-checked against the
    field it sets (utils.errors.CheckpointError naming the file and the key: never a TypeError from
    the config's own checks)."""
    import typing

    from utils.checkpoint_json import read_checkpoint_json
    from utils.errors import CheckpointError
    from utils.checkpoint_layout import MODEL_CONFIG
    from utils.configurator import ConfigError, coerce_value
    from utils.errors import one_line
    raw = read_checkpoint_json(ckpt_dir, MODEL_CONFIG)
    where = f"checkpoint {ckpt_dir}: {MODEL_CONFIG}"
    hints = typing.get_type_hints(ModelConfig)
    values = {}
    for k, v in raw.items():
        if k in hints:
            try:
                values[k] = coerce_value(k, v, hints[k], where)
            except ConfigError as e:
                raise CheckpointError(one_line(e)) from e
        else:
            values[k] = v  # from_dict names unknown keys
    try:
        return ModelConfig.from_dict(values)
    except (ValueError, TypeError, ZeroDivisionError) as e:
        raise CheckpointError(f"{where}: {one_line(e)}") from e
