"""LoRA: low-rank adapters on chosen linear layers, saved in the PEFT layout.

Owns: `apply_lora` (wrap linears by name suffix, freeze the rest, optionally keep the embedding and
the LM head trainable), `train_only_embeddings`, `select_trainable` (the trainer's choice among full
fine-tuning, embeddings only, LoRA, LoRA + embeddings), `trainable_parameters` (the report), `merge_lora` (fold adapters into the
weights and unwrap), `lora_state_dict` / `save_lora` (adapter_config.json + adapter_model.safetensors
with PEFT key names, loadable by `peft.PeftModel.from_pretrained` on the model written by
model.hf_interop.export_hf) and `load_lora`.

A wrapped layer keeps its base parameter as `<name>.weight` (so the base checkpoint keys are unchanged)
and adds `<name>.lora_A.weight` [r, in] and `<name>.lora_B.weight` [out, r], as in PEFT. The routed experts of an
MoE model (targets `experts`, `experts.gate_up_proj`, `experts.down_proj`) take per-expert adapters beside their
stacked weights (model/lora_experts.py), saved as PEFT's `target_parameters` adapters.

Must never: change the base weights before merge_lora, or save base weights into the adapter file
(except the explicitly trained embedding / LM head, as PEFT's modules_to_save).
"""
from __future__ import annotations

import json
import math
import os
from typing import Iterable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from model.lora_experts import (add_expert_adapters, expert_targets, expert_tensors_from_peft, grouped_experts,
                                is_expert_target, merge_expert_adapters, peft_expert_tensors)
from utils.publish import atomic_path, atomic_write_text

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # (the last four: model/mla.py's)


class LoRALinear(nn.Linear):
    """y = x W^T + (alpha / r) * dropout(x) A^T B^T, with W frozen and B initialised to zero."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        dev, dt = base.weight.device, base.weight.dtype
        self.lora_A = nn.Linear(self.in_features, r, bias=False, device=dev, dtype=dt)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, device=dev, dtype=dt)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init
        nn.init.zeros_(self.lora_B.weight)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def merged_linear(self) -> nn.Linear:
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            ct = torch.promote_types(self.weight.dtype, torch.float32)  # (fp32 at least; an fp64 model in fp64)
            delta = (self.lora_B.weight.to(ct) @ self.lora_A.weight.to(ct)) * self.scaling
            lin.weight.copy_(self.weight.to(ct) + delta)
            if self.bias is not None:
                lin.bias.copy_(self.bias)
        return lin


def _targets(target_modules: Union[str, Iterable[str]]) -> tuple[str, ...]:
    """The names, `all` standing for every linear projection (`all,experts`: those and the routed experts)."""
    if isinstance(target_modules, str):
        target_modules = [t.strip() for t in target_modules.split(",") if t.strip()]
    out = []
    for t in target_modules:
        out.extend(ALL_LINEAR if t == "all" else (t,))
    return tuple(out)


def apply_lora(model: nn.Module, r: int = 8, alpha: float = 16.0, dropout: float = 0.0,
               target_modules: Union[str, Iterable[str]] = ("q_proj", "v_proj"),
               train_embeddings: bool = False, train_lm_head: bool = False) -> nn.Module:
    """Wrap the linears whose name ends with one of `target_modules` ("all" = every linear projection of the
    layers) and give the routed experts adapters where named (`experts`: both projections, or
    `experts.gate_up_proj` / `experts.down_proj`), freeze every other parameter, and record the setup on
    `model.lora_config`."""
    targets = _targets(target_modules)
    on_experts = expert_targets(targets)
    targets = tuple(t for t in targets if not is_expert_target(t))
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Linear and child_name in targets and full != "lm_head":
                setattr(module, child_name, LoRALinear(child, r, alpha, dropout))
                wrapped.append(full)
    if on_experts:
        _adapt_experts(model, on_experts, r, alpha, dropout)
    elif not wrapped:
        raise ValueError(f"no linear layer matches target_modules={targets}")
    modules_to_save = []
    if train_embeddings:
        model.embed_tokens.weight.requires_grad_(True)
        modules_to_save.append("embed_tokens")
    if train_lm_head:
        model.lm_head.weight.requires_grad_(True)
        modules_to_save.append("lm_head")
    if modules_to_save and getattr(getattr(model, "cfg", None), "tie_embeddings", False) \
            and len(modules_to_save) == 1:
        raise ValueError("with tied embeddings, train the embedding and the LM head together or neither")
    model.lora_config = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout,
                         "target_modules": sorted(set(targets)), "modules_to_save": modules_to_save or None,
                         "target_parameters": [f"experts.{p}" for p in on_experts]}
    return model


def _adapt_experts(model: nn.Module, projections: tuple[str, ...], r: int, alpha: float, dropout: float) -> None:
    experts = grouped_experts(model)
    if not experts:
        raise ValueError("the LoRA targets name the routed experts, but the model has no MoE layers")
    if dropout:
        raise ValueError(f"lora_dropout={dropout} with the routed experts as targets: their adapters update the "
                         "weights (as PEFT's target_parameters), where an input dropout has no place; use 0")
    for _, m in experts:
        add_expert_adapters(m, projections, r, alpha)


def train_only_embeddings(model: nn.Module) -> nn.Module:
    """Freeze everything but the embedding and the LM head (continued pretraining on a new vocabulary,
    first stage), with no adapters."""
    for p in model.parameters():
        p.requires_grad_(False)
    model.embed_tokens.weight.requires_grad_(True)
    model.lm_head.weight.requires_grad_(True)
    return model


def select_trainable(model: nn.Module, lora_rank: int = 0, lora_alpha: float = 16.0, lora_dropout: float = 0.0,
                     lora_targets: Union[str, Iterable[str]] = ("q_proj", "v_proj"),
                     train_embeddings: bool = False) -> str:
    """Set which parameters train, and say so: full fine-tuning (everything), the embedding + LM head
    only, LoRA adapters, or adapters + embedding + LM head. Returns a description for the log line."""
    if lora_rank > 0:
        score = bool(getattr(model.cfg, "num_labels", 0))  # a reward model's new score head trains (PEFT's SEQ_CLS)
        apply_lora(model, r=lora_rank, alpha=lora_alpha, dropout=lora_dropout, target_modules=lora_targets,
                   train_embeddings=train_embeddings, train_lm_head=train_embeddings or score)
        names = lora_targets if isinstance(lora_targets, str) else ",".join(lora_targets)
        extra = " + embedding and LM head" if train_embeddings else " + the score head" if score else ""
        return f"[lora] rank {lora_rank} on {names}{extra}"
    if train_embeddings:
        train_only_embeddings(model)
        return "[trainable] embedding and LM head only"
    for p in model.parameters():
        p.requires_grad_(True)
    return "[trainable] full fine-tuning"


def trainable_parameters(model: nn.Module) -> dict:
    """{'trainable': n, 'total': n, 'percent': p} counting shared tensors once."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"trainable": trainable, "total": total, "percent": 100.0 * trainable / max(total, 1)}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight and put plain nn.Linear layers back (keys unchanged)."""
    for _, experts in grouped_experts(model):
        merge_expert_adapters(experts)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, child_name, child.merged_linear())
    for p in model.parameters():
        p.requires_grad_(True)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model


def _peft_prefix(name: str, score: bool = False) -> str:
    # our `layers.0...` is HF's `model.layers.0...`; PEFT wraps the HF model as base_model.model; a reward model's
    # head is HF's `score` (its *ForSequenceClassification: model/hf_score.py)
    if name.startswith("lm_head"):
        return "base_model.model." + ("score" + name[len("lm_head"):] if score else name)
    return "base_model.model.model." + name


def _peft_modules(modules: Iterable[str], score: bool) -> list:
    """modules_to_save under transformers' names (a reward model's head: `score`)."""
    return ["score" if score and m == "lm_head" else m for m in modules]


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors (and modules_to_save weights) under PEFT's saved key names."""
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("model has no LoRA adapters (call apply_lora first)")
    out = {}
    score = bool(getattr(model.cfg, "num_labels", 0))
    for name, t in model.state_dict().items():
        if ".lora_A." in name or ".lora_B." in name:
            out[_peft_prefix(name)] = t
    rows = _gate_up_rows(model.cfg, to_hub=True)
    for name, experts in grouped_experts(model):
        out.update(peft_expert_tensors(experts, _peft_prefix(name), rows))
    for mod in cfg["modules_to_save"] or []:
        out[_peft_prefix(f"{mod}.weight", score)] = model.state_dict()[f"{mod}.weight"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def _gate_up_rows(cfg, to_hub: bool):
    """The family's order of the experts' gate/up rows from ours, or back (None: the same order)."""
    from model.hf_gpt_oss import deinterleave_gate_up, interleave_gate_up, is_gpt_oss
    if not is_gpt_oss(cfg):
        return None
    return interleave_gate_up if to_hub else deinterleave_gate_up


def _peft_targets(cfg: dict) -> dict:
    """adapter_config.json's target fields: the linears' names, and the experts' parameters (PEFT's
    target_parameters, named under the MoE block `mlp.`)."""
    params = [f"mlp.{t}" for t in cfg.get("target_parameters") or []]
    if not params:
        return {"target_modules": cfg["target_modules"]}
    return {"target_modules": cfg["target_modules"] or None, "target_parameters": params}


def peft_moe_caveat(model: nn.Module) -> Optional[str]:
    """Why `peft.PeftModel` (0.21, on transformers 5) will not reproduce this MoE model's adapters on its Hugging Face
    export, or None: for the MLP targets (gate_proj / up_proj / down_proj: the dense blocks' and shared experts'
    linears here) it also wraps the routed experts' stacked weights of the same names and does not give our
    outputs (tests/model/test_hf_glm4_moe.py); attention adapters load exactly."""
    mlp = sorted(t for t in model.lora_config["target_modules"] if t in ("gate_proj", "up_proj", "down_proj"))
    if not getattr(model.cfg, "moe_num_experts", 0) or not mlp:
        return None
    return (f"peft.PeftModel on transformers' MoE families also wraps the routed experts for the MLP targets "
            f"({', '.join(mlp)}) and does not reproduce these adapters' outputs: our tools load them (sample.py "
            "--ckpt=<the run>), or export merged (without --adapters_out_dir)")


def save_lora(model: nn.Module, out_dir: str, base_model_name_or_path: Optional[str] = None) -> None:
    """adapter_config.json + adapter_model.safetensors in the PEFT layout."""
    cfg = model.lora_config
    os.makedirs(out_dir, exist_ok=True)
    score = bool(getattr(model.cfg, "num_labels", 0))  # a reward model: PEFT's sequence-classification adapters
    adapter_cfg = {
        "peft_type": "LORA", "task_type": "SEQ_CLS" if score else "CAUSAL_LM", "r": cfg["r"],
        "lora_alpha": cfg["lora_alpha"], "lora_dropout": cfg["lora_dropout"], **_peft_targets(cfg),
        "bias": "none", "modules_to_save": _peft_modules(cfg["modules_to_save"] or [], score) or None,
        "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "base_model_name_or_path": base_model_name_or_path,
    }
    # each file atomically (utils/publish.py): the weights first, the config that names them last
    with atomic_path(os.path.join(out_dir, "adapter_model.safetensors")) as tmp:
        save_file(lora_state_dict(model), tmp, metadata={"format": "pt"})
    atomic_write_text(os.path.join(out_dir, "adapter_config.json"), json.dumps(adapter_cfg, indent=2))


def load_lora(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Apply adapters saved by save_lora (or by PEFT for a Llama model) onto our model."""
    with open(os.path.join(adapter_dir, "adapter_config.json")) as f:
        c = json.load(f)
    mts = c.get("modules_to_save") or []
    on_experts = [t[len("mlp."):] if t.startswith("mlp.") else t for t in c.get("target_parameters") or []]
    apply_lora(model, r=c["r"], alpha=c["lora_alpha"], dropout=c.get("lora_dropout", 0.0),
               target_modules=list(c.get("target_modules") or []) + on_experts,
               train_embeddings="embed_tokens" in mts, train_lm_head="lm_head" in mts or "score" in mts)
    sd = load_file(os.path.join(adapter_dir, "adapter_model.safetensors"))
    ours = {}
    rows = _gate_up_rows(model.cfg, to_hub=False)
    for name, experts in grouped_experts(model):
        ours.update(expert_tensors_from_peft(sd, _peft_prefix(name), name, expert_targets(on_experts),
                                             experts.gate_up_proj.shape[0], rows))
    for k, v in sd.items():
        name = k[len("base_model.model."):] if k.startswith("base_model.model.") else k
        name = name[len("model."):] if name.startswith("model.") else name
        name = "lm_head" + name[len("score"):] if name.startswith("score.") else name  # (a reward model's head)
        ours[name.replace(".default.", ".")] = v
    missing, unexpected = model.load_state_dict(ours, strict=False)
    if unexpected:
        raise ValueError(f"adapter tensors that match no module: {unexpected}")
    return model
