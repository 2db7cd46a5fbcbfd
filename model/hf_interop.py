"""Hugging Face Llama checkpoints, both ways, with no custom code on the HF side (Qwen2 / Qwen3 / SmolLM3-shaped ones as
their family; Gemma 3, OLMo 2 / 3, Phi-3 / Phi-4 and DeepSeek-V3 / V2 as theirs: model/hf_gemma3.py, model/hf_olmo.py,
model/hf_phi3.py, model/hf_deepseek_v3.py; an MoE model as a Mixtral, a Qwen3-MoE, a Qwen2-MoE, a GLM-4-MoE or (with
attention sinks) a gpt-oss: `moe_family`; fine-grained FP8 and MXFP4 checkpoints read dequantized: model/hf_fp8.py).

Owns: the mapping ModelConfig <-> LlamaConfig (config.json) and our parameter names <-> HF names
(ours + the `model.` prefix, `lm_head.weight` as is). Both use the half-split RoPE layout, so weights
are copied unpermuted (DeepSeek's interleaved RoPE rows are permuted: model/hf_deepseek_v3.py). `export_hf` writes
config.json + model.safetensors + generation_config.json (+ tokenizer files: model/hf_files.py) atomically,
every file with the mode a plain `open` gives it (0644 under umask 022; safetensors alone would write 0600);
generation_config.json stops at the end ids (</s> and <|im_end|>, or what the caller read from the tokenizer's chat
template) and samples with sample.py's defaults
(utils/constants.py), so `transformers` generate / pipeline stop and sample where sample.py does;
`import_hf` reads such a directory (single or sharded safetensors, or a weights_only torch .bin).

Must never: unpickle arbitrary objects (torch.load only with weights_only=True), write the output
directory in place (a `<out_dir>.tmp` directory published by utils/publish.py), or download anything.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import torch
from safetensors.torch import save_file

from model import (hf_deepseek_v3, hf_files, hf_fp8, hf_gemma, hf_gemma2, hf_gemma3, hf_glm4_moe, hf_gpt_oss,
                   hf_granite, hf_ministral3, hf_mixtral, hf_mtp, hf_olmo, hf_phi3, hf_qwen2_moe, hf_qwen3_moe,
                   hf_score, hf_seed_oss, hf_vision_language)
from model.hf_window import window_from_hf, window_to_hf
from model.config import ModelConfig
from model.llama import Transformer
from model.rotary import RotaryEmbedding
from utils.publish import staged_dir
from utils.rope_config import rope_scaling_from_hf, rope_scaling_to_hf
from utils.run_dir import HF_MODEL_TYPES

# families transformers has that our model does not hold: why, in the refusal
REFUSED_TYPES = {
    "recurrent_gemma": "RecurrentGemma's recurrent blocks are not in our model (Gemma 1, 2 and 3 are read)",
}


def hf_config_dict(cfg: ModelConfig, torch_dtype: str = "float32", special_ids: Optional[dict] = None) -> dict:
    """The config.json of `cfg`'s family (a reward model: its *ForSequenceClassification, model/hf_score.py)."""
    d = _causal_config_dict(cfg, torch_dtype, special_ids)
    return hf_score.score_config(d, cfg.num_labels, special_ids) if cfg.num_labels else d


def _causal_config_dict(cfg: ModelConfig, torch_dtype: str, special_ids: Optional[dict]) -> dict:
    kind = cfg.rope_scaling["type"] if cfg.rope_scaling else "default"
    scaling = rope_scaling_to_hf(cfg.rope_scaling)  # every field transformers reads for the kind
    rope_parameters = {"rope_type": kind, **scaling, "rope_theta": float(cfg.rope_theta)}
    d = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.initializer_range, "tie_word_embeddings": cfg.tie_embeddings,
        # both spellings: transformers >= 5 reads rope_parameters, 4.x reads rope_theta/rope_scaling
        "rope_theta": float(cfg.rope_theta), "rope_parameters": rope_parameters,
        "rope_scaling": {"type": kind, "rope_type": kind, **scaling} if scaling else None,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": cfg.attn_dropout,
        "pretraining_tp": 1, "use_cache": True, "torch_dtype": torch_dtype, "dtype": torch_dtype,
    }
    if hf_seed_oss.applies(cfg):  # (a Llama with an o_proj bias, or q/k/v biases on heads of their own width)
        return _own_family(d, hf_seed_oss.config_fields(cfg), (), special_ids)
    if hf_granite.applies(cfg):  # (a Llama with Granite's multipliers)
        return _own_family(d, hf_granite.config_fields(cfg), (), special_ids)
    if hf_gemma.applies(cfg):  # (a Llama with the scaled embedding and GeGLU: Gemma 1)
        return _own_family(d, hf_gemma.config_fields(cfg), (), special_ids)
    if hf_gemma2.applies(cfg):  # (Gemma's block without q / k norms: Gemma 2, the Llama's sizes and RoPE kept)
        return _own_family(d, hf_gemma2.config_fields(cfg), ("hidden_act",), special_ids)
    if hf_gemma3.is_gemma(cfg):  # (Gemma 3's block: written as its own family, the Llama's sizes kept)
        return _own_family(d, hf_gemma3.config_fields(cfg, rope_parameters), ("hidden_act",), special_ids)
    if hf_olmo.is_olmo(cfg):  # (OLMo 2 / 3: the output norms only)
        return _own_family(d, hf_olmo.config_fields(cfg, rope_parameters), ("head_dim",), special_ids)
    if hf_deepseek_v3.is_deepseek(cfg):  # (multi-head latent attention: DeepSeek-V3, its experts or dense blocks)
        return _own_family(d, hf_deepseek_v3.config_fields(cfg), (), special_ids)
    if hf_gpt_oss.is_gpt_oss(cfg):  # (attention sinks, gpt-oss's experts: checked by the tensors' export)
        return _own_family(d, hf_gpt_oss.config_fields(cfg), (), special_ids)
    glm = bool(cfg.moe_num_experts) and cfg.moe_score == "sigmoid"  # (GLM-4-MoE: biases, partial rotary too)
    if cfg.query_pos_scale_beta is not None and not cfg.moe_num_experts:  # (Ministral 3's query scale)
        if [f for f in cfg.block_fields if f != "query_pos_scale_beta"] or cfg.qkv_bias or cfg.qk_norm:
            raise ValueError("a model with a position-dependent query scale is written as Ministral 3, which holds "
                             "none of its other switches")
        fields = {**window_to_hf(cfg, "llama"), **hf_ministral3.config_fields(cfg, rope_parameters)}
        return _own_family(d, fields, ("attention_bias",), special_ids)
    odd = [f for f in cfg.block_fields if f != "partial_rotary_factor"]  # (GLM-4-MoE and Phi-3 hold a partial one)
    if odd:
        raise ValueError(f"a model with {', '.join(odd)} (but not Gemma's or OLMo's whole block) has no transformers "
                         "family here")
    if hf_phi3.needs_phi3(cfg):  # LongRoPE or a partial rotary (Phi-3.5, Phi-4-mini): a Phi-3
        return _own_family(d, hf_phi3.config_fields(cfg, rope_parameters), ("head_dim", "attention_bias"),
                           special_ids)
    if cfg.partial_rotary_factor != 1.0 and not glm:
        raise ValueError("a partial rotary with MoE blocks is written as GLM-4-MoE (a sigmoid router) only")
    if cfg.qkv_bias and not glm and (cfg.qk_norm or cfg.moe_num_experts) and not hf_qwen2_moe.is_qwen2_moe(cfg):
        raise ValueError("a model with q/k/v biases and " + ("q / k norms" if cfg.qk_norm else "MoE blocks")
                         + " has no transformers family here (Qwen2 has the biases; Qwen3, Qwen3-MoE the norms; "
                         "Mixtral and GLM-4-MoE no biases)")
    if cfg.nope_layers is not None:  # SmolLM3: a Llama with layers without RoPE (no_rope_layers: 1 = rotate)
        if cfg.qkv_bias or cfg.qk_norm or cfg.moe_num_experts:
            raise ValueError("a model with layers without RoPE has no transformers family here with q/k/v biases, "
                             "q / k norms or experts (SmolLM3 has none)")
        d.update(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", use_sliding_window=False,
                 sliding_window=None, no_rope_layers=[int(i not in cfg.nope_layers) for i in range(cfg.n_layers)])
        d.pop("pretraining_tp")
    if (cfg.qkv_bias or cfg.qk_norm) and not cfg.moe_num_experts:
        # a Qwen2 (q/k/v biases, none on o_proj), a Qwen3 (q / k norms, no biases); an MoE Qwen3: below
        d.update(architectures=[_causal_family(cfg)], model_type="qwen2" if cfg.qkv_bias else "qwen3",
                 use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
        for key in ("mlp_bias", "pretraining_tp") + (("attention_bias",) if cfg.qkv_bias else ()):
            d.pop(key)
    if cfg.moe_num_experts:  # a Mixtral, a Qwen3-MoE or a GLM-4-MoE (`moe_family`)
        d.update(moe_family(cfg)[0].config_fields(cfg))
        if "partial_rotary_factor" in d:  # (GLM's rotary reads it from rope_parameters)
            d["rope_parameters"] = dict(rope_parameters, partial_rotary_factor=d["partial_rotary_factor"])
    d.update(window_to_hf(cfg, d["model_type"]))  # (a Llama whose every layer slides: a Mistral)
    for key, val in (special_ids or {}).items():
        d[key] = val
    return d


def _own_family(d: dict, fields: dict, drop: tuple, special_ids: Optional[dict]) -> dict:
    """A Llama config dict made another family's: its `fields` over it, the Llama-only keys (mlp_bias, pretraining_tp
    and `drop`) removed, the tokenizer's ids last."""
    d.update(fields)
    for key in ("mlp_bias", "pretraining_tp") + drop:
        d.pop(key)
    d.update(special_ids or {})
    return d


def moe_family(cfg: ModelConfig):
    """The Hugging Face family an MoE model is written as: (its module, its class name); one with a gated shared expert
    is Qwen2-MoE (model/hf_qwen2_moe.py); a softmax router's Mixtral (model/hf_mixtral.py), or Qwen3-MoE with q / k
    norms (model/hf_qwen3_moe.py); a sigmoid router's (DeepSeek-V3's) GLM-4-MoE (model/hf_glm4_moe.py). (With
    multi-head latent attention: DeepSeek-V3 / V2, model/hf_deepseek_v3.py, whatever the router.)"""
    if hf_gpt_oss.is_gpt_oss(cfg):  # (attention sinks, biases, its clamped SwiGLU: gpt-oss's)
        return hf_gpt_oss, hf_gpt_oss.ARCHITECTURE
    if hf_qwen2_moe.is_qwen2_moe(cfg):  # (a gated shared expert: Qwen2-MoE's)
        return hf_qwen2_moe, hf_qwen2_moe.ARCHITECTURE
    if cfg.moe_score == "sigmoid":
        return hf_glm4_moe, "Glm4MoeForCausalLM"
    if cfg.qk_norm:
        return hf_qwen3_moe, "Qwen3MoeForCausalLM"
    return hf_mixtral, "MixtralForCausalLM"


def hf_family(cfg: ModelConfig) -> str:
    """The transformers class an export of `cfg` loads as (a reward model: its family's *ForSequenceClassification)."""
    causal = _causal_family(cfg)
    return hf_score.architecture(causal) if cfg.num_labels else causal


def _causal_family(cfg: ModelConfig) -> str:
    if hf_deepseek_v3.is_deepseek(cfg):
        return hf_deepseek_v3.architecture(cfg)
    if cfg.moe_num_experts or hf_gpt_oss.is_gpt_oss(cfg):
        return moe_family(cfg)[1]
    if hf_gemma3.is_gemma(cfg):
        return hf_gemma2.ARCHITECTURE if hf_gemma2.applies(cfg) else hf_gemma3.ARCHITECTURE
    if hf_gemma.applies(cfg):
        return hf_gemma.ARCHITECTURE
    if hf_granite.applies(cfg):
        return hf_granite.ARCHITECTURE
    if hf_seed_oss.applies(cfg):
        return hf_seed_oss.ARCHITECTURE
    if hf_olmo.is_olmo(cfg):
        return "Olmo3ForCausalLM" if cfg.sliding_window else "Olmo2ForCausalLM"
    if hf_phi3.needs_phi3(cfg):
        return "Phi3ForCausalLM"
    if cfg.query_pos_scale_beta is not None:
        return "Ministral3ForCausalLM"
    if cfg.nope_layers is not None:
        return "SmolLM3ForCausalLM"
    return "Qwen2ForCausalLM" if cfg.qkv_bias else "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def config_from_hf(d: dict) -> ModelConfig:
    """A ModelConfig from an HF Llama, Mistral, Phi-3, Qwen2, Qwen3, SmolLM3, Gemma 3 (text), OLMo 2 / 3, Mixtral,
    Qwen3-MoE, GLM-4-MoE or DeepSeek-V3 config.json dict (transformers 4.x or 5.x spelling). A Mistral is a Llama
    whose attention may slide; a Qwen2 a Llama with q/k/v biases; a Qwen3 a Llama with q / k norms and heads sized on
    their own (head_dim: 16 x 128 at hidden_size 1024); a Gemma 3, an OLMo or a DeepSeek-V3 our block with their
    switches (model/hf_gemma3.py, model/hf_olmo.py, model/hf_deepseek_v3.py); a sliding window where one is on."""
    kind, score = d.get("model_type", "llama"), hf_score.fields_from_hf(d)  # (a *ForSequenceClassification's)
    if hf_vision_language.is_wrapper(d):  # (a vision-language checkpoint: its text model)
        d = hf_vision_language.text_config(d)
        kind = d["model_type"]
    if kind in hf_deepseek_v3.ALIASES:  # (Kimi K2: DeepSeek-V3 under its own model_type)
        kind = hf_deepseek_v3.ALIASES[kind]
        d = {**d, "model_type": kind}
    if kind == hf_gemma3.MODEL_TYPE:
        d = hf_gemma3.with_defaults(d)
    if kind == hf_gemma2.MODEL_TYPE:
        d = hf_gemma2.with_defaults(d)
    if kind == hf_gemma.MODEL_TYPE:
        d = hf_gemma.with_defaults(d)
    query_scale = hf_ministral3.fields_from_hf(d) if kind == hf_ministral3.MODEL_TYPE else {}
    if kind == hf_ministral3.MODEL_TYPE:
        d = hf_ministral3.rope_dict(d)
    if kind in REFUSED_TYPES:
        raise ValueError(f"model_type={kind!r}: {REFUSED_TYPES[kind]}")
    if kind not in HF_MODEL_TYPES:
        raise ValueError("only Llama, Mistral, Phi-3, Qwen2, Qwen3, SmolLM3, Gemma 1 / 2 / 3, Granite, Seed-OSS, "
                         "OLMo 2 / 3, Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4-MoE, DeepSeek-V2 / V3 and gpt-oss "
                         f"checkpoints are supported, got model_type={kind!r}")
    families = {"mixtral": hf_mixtral, "glm4_moe": hf_glm4_moe, "qwen3_moe": hf_qwen3_moe, "qwen2_moe": hf_qwen2_moe}
    partial = (d.get("rope_parameters") or {}).get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
    moe = families[kind].moe_fields(d) if kind in families else {}
    theta = (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta", 10000.0))
    # linear, dynamic, llama3 (Llama 3.1+), yarn; ValueError for others (Gemma 3: its full layers' rope dict)
    scaling = rope_scaling_from_hf(hf_gemma3.full_rope_dict(d) if kind in (hf_gemma3.MODEL_TYPE, "olmo3") else d)
    n_heads = d["num_attention_heads"]
    head_dim = d.get("head_dim") or d["hidden_size"] // n_heads
    if (d.get("attention_bias") and kind not in ("glm4_moe", hf_gpt_oss.MODEL_TYPE, hf_seed_oss.MODEL_TYPE)) \
            or d.get("mlp_bias"):
        # (Llama's, Qwen3's: o_proj's too; gpt-oss's are read)
        raise ValueError(f"{kind} checkpoints with biases are not supported (attention_bias / mlp_bias)")
    fields = dict(
        vocab_size=d["vocab_size"], dim=d["hidden_size"], n_layers=d["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=d.get("num_key_value_heads") or n_heads, hidden_dim=d["intermediate_size"],
        norm_eps=d.get("rms_norm_eps", 1e-6), max_seq_len=d.get("max_position_embeddings", 2048),
        rope_theta=float(theta), rope_scaling=scaling, tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        initializer_range=d.get("initializer_range", 0.02), attn_dropout=d.get("attention_dropout", 0.0) or 0.0,
        qkv_bias=kind == "qwen2" or (kind == "glm4_moe" and bool(d.get("attention_bias")))  # (GLM-4.5's: q/k/v's)
        or (kind == "qwen2_moe" and bool(d.get("qkv_bias", True))),
        qk_norm=kind in ("qwen3", "qwen3_moe") or bool(d.get("use_qk_norm")),
        partial_rotary_factor=float(partial if kind != "glm4_moe" else  # (transformers' GLM default: 0.5)
                                    (d.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                                         d.get("partial_rotary_factor", 0.5))),
        attn_head_dim=head_dim if head_dim * n_heads != d["hidden_size"] else None,
        nope_layers=_nope_layers(d, kind), **moe)
    if kind == hf_gemma3.MODEL_TYPE:
        fields.update(hf_gemma3.fields_from_hf(d, n_heads, head_dim))
    elif kind == hf_gemma2.MODEL_TYPE:
        fields.update(hf_gemma2.fields_from_hf(d, head_dim))
    elif kind == hf_gemma.MODEL_TYPE:
        fields.update(hf_gemma.fields_from_hf(d, head_dim))
    elif kind == hf_granite.MODEL_TYPE:
        fields.update(hf_granite.fields_from_hf(d, head_dim))
    elif kind == hf_seed_oss.MODEL_TYPE:
        fields.update(hf_seed_oss.fields_from_hf(d))
    elif kind in hf_olmo.MODEL_TYPES:
        fields.update(hf_olmo.fields_from_hf(d, kind))
    elif kind == hf_gpt_oss.MODEL_TYPE:  # (its experts, biases, sinks and window)
        fields.update(hf_gpt_oss.fields_from_hf(d))
    else:
        fields.update(window_from_hf(d, kind, d["num_hidden_layers"]), **query_scale)
    if kind in hf_deepseek_v3.MODEL_TYPES:  # (its latent attention's sizes, its experts)
        fields.update(hf_deepseek_v3.fields_from_hf(d))
    return ModelConfig(**{**fields, **score})


def _nope_layers(d: dict, kind: str) -> Optional[list]:
    """SmolLM3's layers without RoPE (its no_rope_layers: 1 = rotate, 0 = not), or None."""
    if kind != "smollm3":
        return None
    flags = d.get("no_rope_layers")
    if flags is None:  # transformers' default: every `no_rope_layer_interval`-th layer
        interval = int(d.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(d["num_hidden_layers"])]
    return [i for i, f in enumerate(flags) if not f]


def is_mtp_name(name: str) -> bool:
    """Whether a state-dict name is one of multi-token prediction's (left out of a Hugging Face export but for the
    families that keep MTP layers: `writes_mtp`)."""
    return name.startswith("mtp.")


def writes_mtp(cfg: ModelConfig) -> bool:
    """Whether an export of `cfg` keeps its multi-token prediction depths, as the MTP layers of DeepSeek-V3 and
    GLM-4.5 checkpoints (model/hf_mtp.py); the other families have no place for them."""
    if not cfg.mtp_num_layers:
        return False
    if hf_deepseek_v3.is_deepseek(cfg):
        return hf_deepseek_v3.architecture(cfg) == hf_deepseek_v3.ARCHITECTURE
    return bool(cfg.moe_num_experts) and moe_family(cfg)[0] is hf_glm4_moe


def to_hf_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """HF names -> tensors; an MoE model in the Hub's Mixtral, Qwen3-MoE or GLM-4-MoE layout (`moe_family`;
    ValueError naming what that family cannot hold). Multi-token prediction's depths (`mtp.*`, model/mtp.py) are
    written as DeepSeek-V3's / GLM-4.5's MTP layers (`writes_mtp`), else left out: the next-token model."""
    sd = {}
    keep_mtp = writes_mtp(model.cfg)
    ours = {k: v for k, v in model.state_dict().items() if keep_mtp or not is_mtp_name(k)}
    family = _moe_export_family(model.cfg, {n: t for n, t in ours.items() if is_expert_bias_name(n)})
    for name, t in _family_tensors(ours, model.cfg, family).items():
        if name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue  # HF re-ties it from embed_tokens; safetensors refuses shared storage anyway
        sd[hf_score.hub_name(name, model.cfg.num_labels)] = t  # (a reward model's head: score.weight)
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def is_expert_bias_name(name: str) -> bool:
    """Whether a state-dict name is an MoE layer's selection bias (model/moe.py `expert_bias`)."""
    return name.endswith(".mlp.expert_bias")


def _family_tensors(tensors: dict[str, torch.Tensor], cfg: ModelConfig, family) -> dict[str, torch.Tensor]:
    """Our tensors (names without `model.`; any group of them) in the names and layout of `cfg`'s family (`family`:
    an MoE model's, `_moe_export_family`)."""
    if writes_mtp(cfg):  # (the depths as layers after the model's, converted below as any layer)
        tensors = hf_mtp.to_hub(tensors, cfg)
    if family is not None:
        tensors = family.to_hub(tensors, cfg)
    for module, applies in ((hf_gemma3, hf_gemma3.is_gemma), (hf_olmo, hf_olmo.is_olmo)):
        tensors = module.to_hub(tensors) if applies(cfg) else tensors
    if hf_gemma.applies(cfg):  # (Gemma 1: the (1 + w) norms under a Llama's names)
        tensors = hf_gemma3.to_hub(tensors, rename=False)
    return hf_phi3.fuse(tensors) if hf_phi3.needs_phi3(cfg) else tensors


def _moe_export_family(cfg: ModelConfig, biases: dict[str, torch.Tensor]):
    """The family module an MoE model (or one with multi-head latent attention, DeepSeek-V3's) is written as
    (`moe_family`), None for the others; ValueError naming what it cannot hold."""
    if not cfg.moe_num_experts and not hf_deepseek_v3.is_deepseek(cfg):
        return None
    family = hf_deepseek_v3 if hf_deepseek_v3.is_deepseek(cfg) else moe_family(cfg)[0]
    problems = family.export_problems(cfg, biases)
    if problems:
        raise ValueError(f"this MoE model cannot be written as a Hugging Face {family.LAYOUT.family}: "
                         + "; ".join(problems))
    return family


def from_hf_state_dict(sd: dict[str, torch.Tensor], cfg: ModelConfig,
                       rope_interleave: bool = True) -> dict[str, torch.Tensor]:
    """HF names -> ours; Phi-3's fused `qkv_proj` (q, k, v rows) and `gate_up_proj` (gate, up rows) split into the
    Llama projections they hold; DeepSeek-V3's RoPE rows, interleaved where `rope_interleave`, in halves."""
    out = {}
    for name, t in hf_phi3.split(sd, cfg).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # derived buffer some old checkpoints saved
        if name.startswith("model."):
            out[name[len("model."):]] = t
        elif name in ("lm_head.weight", hf_score.HUB_HEAD):  # (score.weight: a reward model's head)
            out["lm_head.weight"] = t
        else:
            raise ValueError(f"unexpected tensor {name!r} in a Llama checkpoint")
    if hf_deepseek_v3.is_deepseek(cfg):
        out = hf_deepseek_v3.from_hub(out, cfg, rope_interleave)
    elif cfg.moe_num_experts:
        out = moe_family(cfg)[0].from_hub(out, cfg)
    if hf_gemma3.is_gemma(cfg) or hf_gemma.applies(cfg):
        out = hf_gemma3.from_hub(out, rename=not hf_gemma.applies(cfg))
    if hf_olmo.is_olmo(cfg):
        out = hf_olmo.from_hub(out)
    if cfg.tie_embeddings or "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return hf_mtp.from_hub(out, cfg) if cfg.mtp_num_layers else out


def export_hf(model: Transformer, out_dir: str, tokenizer_dir: Optional[str] = None,
              special_ids: Optional[dict] = None, stop_ids: Optional[list[int]] = None) -> str:
    """Write an HF LlamaForCausalLM directory (config.json, model.safetensors, tokenizer files).

    special_ids: optional {"bos_token_id", "eos_token_id", "pad_token_id"}; read from the tokenizer's
    tokenizer_meta.json when omitted and a tokenizer_dir is given. stop_ids: what generation_config.json stops
    at (model/hf_files.py `generation_config_dict`).
    """
    sd = to_hf_state_dict(model)
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
        next(iter(sd.values())).dtype]
    if special_ids is None:
        special_ids = hf_files.special_ids(tokenizer_dir)
    out_dir = os.path.abspath(out_dir)
    with staged_dir(out_dir, replace=True) as tmp:  # `<out_dir>.tmp/`, renamed over an old export
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config_dict(model.cfg, dtype, special_ids), f, indent=2)
        save_file(sd, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        hf_files.copy_tokenizer(tokenizer_dir, tmp)
        hf_files.write_generation_config(tokenizer_dir, tmp, stop_ids)
        hf_files.plain_file_modes(tmp)
    return out_dir


def export_hf_streaming(cfg: ModelConfig, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], load_group,
                        out_dir: str, tokenizer_dir: Optional[str] = None,
                        max_shard_bytes: int = 2 * 2**30, stop_ids: Optional[list[int]] = None) -> tuple[str, int]:
    """Write an HF directory as sharded safetensors (model-0000i-of-0000N.safetensors + index.json),
    reading the weights one shard's worth at a time: `load_group(names) -> {name: tensor}` of our
    names, `specs` {name: (shape, dtype)}. Peak memory is one shard (<= max_shard_bytes, or one
    tensor larger than that), never the whole model. An MoE model is written as its family (`moe_family`), each
    tensor of a group renamed or split per expert as it is read. Returns (out_dir, number of shards)."""
    names = [n for n in specs if not (cfg.tie_embeddings and n == "lm_head.weight")
             and (writes_mtp(cfg) or not is_mtp_name(n))]
    # an MoE model's tensors map one by one onto its family's (split per expert, renamed): each group as it is read
    biases = [n for n in names if is_expert_bias_name(n)]
    family = _moe_export_family(cfg, load_group(biases) if biases else {})
    if family is not None and not family.LAYOUT.holds_biases():  # (never a shard file with nothing in it)
        names = [n for n in names if not is_expert_bias_name(n)]
    dtypes = {specs[n][1] for n in names if not is_expert_bias_name(n)}  # (the biases: fp32 buffers)
    if len(dtypes) != 1:
        raise ValueError(f"mixed weight dtypes {sorted(map(str, dtypes))}: export needs one")
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtypes.pop()]
    groups, cur, cur_bytes = [], [], 0
    together = hf_phi3.group_key if hf_phi3.needs_phi3(cfg) else (lambda n: n)  # (Phi-3's fused weights)
    for n in names:
        shape, dt = specs[n]
        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        if cur and cur_bytes + nbytes > max_shard_bytes and together(n) != together(cur[-1]):
            groups.append(cur)
            cur, cur_bytes = [], 0
        cur.append(n)
        cur_bytes += nbytes
    if cur:
        groups.append(cur)
    out_dir = os.path.abspath(out_dir)
    with staged_dir(out_dir, replace=True) as tmp:  # `<out_dir>.tmp/`, renamed over an old export
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf_config_dict(cfg, dtype, hf_files.special_ids(tokenizer_dir)), f, indent=2)
        weight_map, total = {}, 0
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            tensors = _family_tensors(load_group(group), cfg, family)
            sd = {hf_score.hub_name(n, cfg.num_labels): t.contiguous() for n, t in tensors.items()}
            total += sum(t.numel() * t.element_size() for t in sd.values())
            save_file(sd, os.path.join(tmp, fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in sd})
            del tensors, sd
        with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        hf_files.copy_tokenizer(tokenizer_dir, tmp)
        hf_files.write_generation_config(tokenizer_dir, tmp, stop_ids)
        hf_files.plain_file_modes(tmp)
    return out_dir, len(groups)


def import_hf(hf_dir: str, dtype: Optional[torch.dtype] = torch.float32, mtp_layers: int = 0,
              **overrides) -> Transformer:
    """Load an HF Llama directory into our Transformer.

    dtype: parameter dtype of the result (fp32 by default, the usual master-weight precision; None keeps
    the checkpoint's dtype). mtp_layers: up to this many of the checkpoint's multi-token prediction layers
    (DeepSeek-V3's, GLM-4.5's: model/hf_mtp.py) become the model's MTP depths; 0 leaves them out, as transformers
    does. `overrides` set non-architectural ModelConfig fields (kernel switches, gradient_checkpointing,
    loss_chunk_size)."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        raw = json.load(f)
    cfg = config_from_hf(raw)
    for k, v in overrides.items():
        if k not in cfg.to_dict():
            raise ValueError(f"unknown ModelConfig field {k!r}")
        setattr(cfg, k, v)
    weights = hf_fp8.dequantize(hf_files.read_tensors(hf_dir), raw)  # (an FP8 checkpoint's weights multiplied out)
    if hf_vision_language.is_wrapper(raw):  # Gemma 3 4B-27B, Mistral Small 3.x, LLaVA: the text model alone
        weights = hf_vision_language.text_weights(weights)[0]
    if mtp_layers:
        cfg = dataclasses.replace(cfg, mtp_num_layers=min(mtp_layers, hf_mtp.held(raw, weights, cfg.n_layers)))
    sd = from_hf_state_dict(weights, cfg, hf_deepseek_v3.interleaved(raw))
    del weights  # (what `sd` renamed or replaced is freed as it is converted below)
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    if dtype is None:
        dtypes = {t.dtype for t in sd.values()}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"checkpoint in {hf_dir} does not match the config: missing={missing} unexpected={unexpected}")
    return _take_weights(model, sd, dtype)


def _take_weights(model: Transformer, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> Transformer:
    """A model built on the meta device takes `sd`'s tensors (emptied as it goes), each converted to `dtype` (a
    copy owning its memory) as its parameters and buffers themselves (`assign`: no second set of weights), the
    checkpoint's tensor dropped as soon as its copy exists: the peak is the result plus one tensor, not the
    checkpoint plus the result. The RoPE tables (non-persistent) are built on the CPU; the tied head re-tied."""
    taken = {}
    for name in list(sd):
        t = sd.pop(name)
        taken[name] = t.to(dtype, copy=True) if t.is_floating_point() else t.clone()
        del t
    model.load_state_dict(taken, strict=False, assign=True)
    del taken
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):  # (its _apply rebuilds the frequencies and tables in fp32)
            module.to_empty(device="cpu")
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"the checkpoint left {left[:5]} unset")
    return model
