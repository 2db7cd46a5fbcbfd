"""Multi-token prediction layers (model/mtp.py) in the Hub layout of DeepSeek-V3 and GLM-4.5, both ways.

Those checkpoints keep each MTP module as one more decoder layer numbered after the model's, `model.layers.{L + k}`
(L = num_hidden_layers, k = 0 .. num_nextn_predict_layers - 1), holding the decoder layer's own tensors (its
attention, its MoE or dense MLP, its two norms: our `mtp.depths.k.block.*`) beside
    enorm.weight, hnorm.weight, eh_proj.weight         -> mtp.depths.k.enorm / hnorm / eh_proj
    shared_head.norm.weight                            -> mtp.depths.k.norm (the depth's final norm)
    embed_tokens.weight, shared_head.head.weight       copies of the model's embedding and LM head (shared: read
                                                       only to check they are those, written for vLLM / SGLang)
transformers' DeepseekV3 / Glm4Moe models leave those layers out of a plain load (its MtpModel reads them for
`generate(use_mtp=True)`); so does `import_hf` unless a run asks for depths (`mtp_layers`).
Names here are without the `model.` prefix, after the family's own conversion (experts stacked, RoPE rows in
halves): a layer L + k is converted like any other layer, then renamed.
Must never: import transformers, or drop a copy that differs from the model's tensor (refused by name).
"""
from __future__ import annotations

import re
from typing import Any

import torch

_DEPTH = re.compile(r"mtp\.depths\.(\d+)\.(.+)$")
_OWN = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
        "norm.weight": "shared_head.norm.weight"}  # ours (under mtp.depths.k.) -> the Hub's (under layers.L+k.)
_COPIES = {"embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}
_HUB_OWN, _HUB_COPIES = ({hub: ours for ours, hub in d.items()} for d in (_OWN, _COPIES))
CONFIG_KEY = "num_nextn_predict_layers"  # the released configs' name (transformers 5: num_mtp_layers, an alias)


def held(raw: dict, names, n_layers: int) -> int:
    """How many MTP layers a checkpoint of config.json dict `raw` and tensor names `names` holds: those its config
    counts whose `eh_proj` is there (some re-uploads strip them)."""
    have = set(names)
    count = int(raw.get(CONFIG_KEY) or 0)
    k = 0
    while k < count and f"model.layers.{n_layers + k}.eh_proj.weight" in have:
        k += 1
    return k


def held_in_dir(hf_dir: str) -> int:
    """`held` of an HF directory, from its config.json and its tensor names (nothing loaded)."""
    import json
    import os

    from model.hf_files import tensor_names
    with open(os.path.join(hf_dir, "config.json")) as f:
        raw = json.load(f)
    return held(raw, tensor_names(hf_dir), int(raw["num_hidden_layers"])) if raw.get(CONFIG_KEY) else 0


def from_hub(sd: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """Layers n_layers .. n_layers + mtp_num_layers - 1 of `sd` (our names otherwise) -> `mtp.depths.k.*`; their
    embedding and head copies checked against the model's and dropped (ValueError naming one that differs)."""
    out = {}
    for name, t in sd.items():
        m = re.match(r"layers\.(\d+)\.(.+)$", name)
        k = int(m.group(1)) - cfg.n_layers if m is not None else -1
        if not 0 <= k < cfg.mtp_num_layers:
            out[name] = t
            continue
        rest = m.group(2)
        if rest in _HUB_OWN:
            out[f"mtp.depths.{k}.{_HUB_OWN[rest]}"] = t
        elif rest in _HUB_COPIES:  # (from_hf_state_dict has set lm_head.weight, tied or not)
            main = sd.get(_HUB_COPIES[rest])
            if main is None or main.shape != t.shape or not torch.equal(main, t.to(main.dtype)):
                raise ValueError(f"the MTP layer model.layers.{cfg.n_layers + k}.{rest} is not the model's "
                                 f"{_HUB_COPIES[rest]}: our MTP depths share the model's embedding and head")
        else:
            out[f"mtp.depths.{k}.block.{rest}"] = t
    return out


def to_hub(sd: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """Our `mtp.depths.k.*` -> layers n_layers + k (the block's tensors under the layer's own names, for the family
    to convert next); the embedding (and the LM head, or the embedding where tied) also copied into every depth's
    layer. Each tensor maps on its own (a streaming export converts any group of them)."""
    out = {}
    for name, t in sd.items():
        m = _DEPTH.match(name)
        if m is None:
            out[name] = t
            if name in _COPIES:
                for k in range(cfg.mtp_num_layers):
                    out[f"layers.{cfg.n_layers + k}.{_COPIES[name]}"] = t.clone()  # (safetensors: no shared memory)
                    if name == "embed_tokens.weight" and cfg.tie_embeddings:
                        out[f"layers.{cfg.n_layers + k}.{_COPIES['lm_head.weight']}"] = t.clone()
            continue
        k, rest = int(m.group(1)), m.group(2)
        layer = f"layers.{cfg.n_layers + k}"
        out[f"{layer}.{_OWN[rest]}" if rest in _OWN else f"{layer}.{rest[len('block.'):]}"] = t
    return out
