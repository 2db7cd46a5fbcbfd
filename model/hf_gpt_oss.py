"""Hugging Face gpt-oss (`GptOssForCausalLM`: OpenAI's gpt-oss-20b / 120b) checkpoints of our models with attention
sinks and gpt-oss's experts, both ways (model/hf_interop.py calls these for such a config, or a checkpoint with
model_type "gpt_oss"; its MXFP4 experts are dequantized first: model/hf_mxfp4.py).

Why it maps one to one: gpt-oss is our block with grouped-query attention whose q / k / v / o projections have biases
(`qkv_bias`, `o_bias`) and whose softmax has a learned sink logit per head (`attn_sinks`), sliding-window and full
layers (`sliding_window`, `sliding_layers`: its layer_types), YaRN RoPE in halves (as ours), and in every layer an MoE
of routed experts only: a router with a bias (`moe_router_bias`), a softmax over the top k's logits (ours: softmax over
every expert, renormalised over the top k, the same weights), experts with biases (`moe_expert_biases`) and its clamped
SwiGLU (`moe_act` gpt_oss, `moe_swiglu_limit`, `moe_swiglu_alpha`). What it cannot hold is refused in one line (shared
experts, dense blocks, sigmoid or group-limited routing, raw top-k weights, a selection bias, plain SwiGLU experts, no
sinks, q / k norms, a partial rotary, layers without RoPE); missing biases are written as zeros (the same model).

The tensors: the Hub's `mlp.experts.gate_up_proj` [E, D, 2I] holds gate and up interleaved along its last dimension
(gate = [..., 0::2], up = [..., 1::2]) and its bias [E, 2I] alike; `mlp.experts.down_proj` is [E, I, D] (x @ W):
ours are nn.Linear's [out, in] per expert with gate rows then up rows, and flat biases (model/moe_experts.py).
`self_attn.sinks`, `mlp.router.weight` / `.bias` have the same names on both sides.
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import re

import torch

from model import hf_moe_layout as hub_layout

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
# (the family's name in messages, and no selection bias; its stacked tensors are moved here, not by hub_layout)
LAYOUT = hub_layout.HubLayout("gpt-oss", block="mlp", bias=None, projections=("gate_up_proj", "gate_up_proj",
                                                                             "down_proj"))
_EXPERTS = re.compile(r"(layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?$")
_ATTN_WEIGHT = re.compile(r"(layers\.\d+\.self_attn\.)(q|k|v|o)_proj\.weight$")
_ROUTER = re.compile(r"(layers\.\d+\.mlp\.)router\.weight$")


def is_gpt_oss(cfg) -> bool:
    """Whether `cfg` is written as gpt-oss: attention sinks or gpt-oss's experts."""
    return bool(cfg.attn_sinks) or cfg.moe_act == "gpt_oss"


def export_problems(cfg, biases: dict[str, torch.Tensor]) -> list[str]:
    """Why a model of config `cfg` and selection biases `biases` cannot be written as a gpt-oss checkpoint."""
    if not cfg.moe_num_experts:
        return ["no MoE blocks (every gpt-oss block is MoE)"]
    p = hub_layout.softmax_family_problems(cfg, biases, "gpt-oss")
    if cfg.moe_first_dense_layers:
        p.append(f"moe_first_dense_layers={cfg.moe_first_dense_layers} (every gpt-oss block is MoE)")
    if cfg.moe_act != "gpt_oss":
        p.append(f"moe_act={cfg.moe_act} (gpt-oss's experts use its clamped SwiGLU: moe_act=gpt_oss)")
    if not cfg.attn_sinks:
        p.append("no attention sinks (gpt-oss's attention has them: attn_sinks)")
    odd = [n for n in ("qk_norm", "nope_layers", "query_pos_scale_beta") if getattr(cfg, n) not in (None, False)]
    odd += [f for f in cfg.block_fields if f != "query_pos_scale_beta"]
    if odd:
        p.append(f"{', '.join(odd)} (gpt-oss's block is Llama's with biases and sinks)")
    return p


def config_fields(cfg) -> dict:
    """The config.json fields that make a Llama dict a gpt-oss one."""
    layers = range(cfg.n_layers)
    types = ["sliding_attention" if cfg.slides(i) else "full_attention" for i in layers]
    return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "num_local_experts": cfg.moe_num_experts,
            "num_experts_per_tok": cfg.moe_top_k, "intermediate_size": cfg.moe_hidden_dim or cfg.hidden_dim,
            "swiglu_limit": float(cfg.moe_swiglu_limit), "swiglu_alpha": float(cfg.moe_swiglu_alpha),
            "attention_bias": True, "layer_types": types, "sliding_window": cfg.sliding_window or cfg.max_seq_len,
            "router_aux_loss_coef": 0.0, "output_router_logits": False}


def fields_from_hf(d: dict) -> dict:
    """The ModelConfig fields of a gpt-oss config.json dict beyond the Llama ones: its experts, biases, sinks and
    window (transformers' default layer_types where it has none: sliding and full layers in turn, sliding first)."""
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ValueError(f"gpt-oss layer_types {types!r}: expected {n} of sliding_attention / full_attention")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    window = d.get("sliding_window")
    if window is None or window >= d.get("max_position_embeddings", 2048):
        sliding = []
    problems = hub_layout.norm_topk_problem({**d, "norm_topk_prob": True}, True)
    if problems:
        raise ValueError("this gpt-oss checkpoint cannot be read: " + "; ".join(problems))
    bias = bool(d.get("attention_bias", True))
    return {"moe_num_experts": int(d["num_local_experts"]), "moe_top_k": int(d.get("num_experts_per_tok", 4)),
            "moe_hidden_dim": int(d["intermediate_size"]), "moe_score": "softmax", "moe_norm_topk": True,
            "moe_router_bias": True, "moe_expert_biases": True, "moe_act": "gpt_oss",
            "moe_swiglu_limit": float(d.get("swiglu_limit", 7.0)),
            "moe_swiglu_alpha": float(d.get("swiglu_alpha", 1.702)), "attn_sinks": True, "qkv_bias": bias, "o_bias": bias,
            "sliding_window": int(window) if sliding else None,
            "sliding_layers": None if not sliding or len(sliding) == n else sliding}


def interleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] as gate then up -> gate and up interleaved (gate at the even places)."""
    gate, up = t.chunk(2, dim=-1)
    return torch.stack((gate, up), dim=-1).flatten(-2)


def deinterleave_gate_up(t: torch.Tensor) -> torch.Tensor:
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


def to_hub(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """Our state dict (names without `model.`) -> gpt-oss's (without `model.`); the selection biases (zero: checked)
    left out, a bias the model does not have written as zeros beside its weight. Each tensor maps on its own (with
    its missing bias), so a streaming export converts any group of them."""
    out = {}
    for name, t in sd.items():
        m = _EXPERTS.match(name)
        if name.endswith(".mlp.expert_bias"):
            continue
        if m is None:
            out[name] = t
        elif m.group(3):  # biases: flat [E * n] -> [E, n] (gate_up's interleaved)
            b = t.view(cfg.moe_num_experts, -1)
            out[name] = interleave_gate_up(b) if m.group(2) == "gate_up_proj" else b
        else:
            w = t.transpose(1, 2)  # [E, out, in] -> [E, in, out]
            out[name] = interleave_gate_up(w) if m.group(2) == "gate_up_proj" else w
            if not cfg.moe_expert_biases:
                out[name + "_bias"] = t.new_zeros(t.shape[0], t.shape[1])
        attn, router = _ATTN_WEIGHT.match(name), _ROUTER.match(name)
        if attn is not None and not (cfg.o_bias if attn.group(2) == "o" else cfg.qkv_bias):
            out[name[:-len("weight")] + "bias"] = t.new_zeros(t.shape[0])
        if router is not None and not cfg.moe_router_bias:
            out[name[:-len("weight")] + "bias"] = t.new_zeros(t.shape[0])
    return out


def from_hub(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """gpt-oss's names (without `model.`) -> ours, with zero selection biases; ValueError for an expert tensor of an
    unexpected shape."""
    out = {}
    for name, t in sd.items():
        m = _EXPERTS.match(name)
        if m is None:
            out[name] = t
            continue
        n = cfg.moe_num_experts
        if t.shape[0] != n:
            raise ValueError(f"{name}: {tuple(t.shape)}, expected {n} experts first")
        if m.group(3):
            out[name] = (deinterleave_gate_up(t) if m.group(2) == "gate_up_proj" else t).reshape(-1)
        else:
            out[name] = (deinterleave_gate_up(t) if m.group(2) == "gate_up_proj" else t).transpose(1, 2)
        if m.group(2) == "down_proj" and not m.group(3):  # (layers.N.mlp.expert_bias: no selection bias)
            block = m.group(1)[:-len("experts.")]
            out[block + "expert_bias"] = torch.zeros(n)
    return {k: v.contiguous() for k, v in out.items()}
