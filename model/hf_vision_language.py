"""The text model of a vision-language checkpoint: Gemma 3 4B-27B (`Gemma3ForConditionalGeneration`, model_type
`gemma3`), Mistral Small 3.x (`Mistral3ForConditionalGeneration`, `mistral3`), LLaVA (`LlavaForConditionalGeneration`,
`llava`). Their config.json holds the language model's config as `text_config`, and their weights hold it under
`language_model.model.` / `language_model.lm_head.` (transformers 4.x, and what transformers 5 still saves) or
`model.language_model.` / `lm_head.` (transformers 5's modules): read as the text model alone (the vision tower and the
projector left out, counted), which trains and exports as its own family (model/hf_interop.py).
Must never: import transformers (plain dicts and tensors only).
"""
from __future__ import annotations

import torch

# a wrapper's model_type -> its text model's when text_config does not say (transformers' sub-config defaults)
WRAPPERS = {"gemma3": "gemma3_text", "mistral3": "mistral", "llava": "llama"}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))  # a wrapper's names -> a text model's


def is_wrapper(d: dict) -> bool:
    """Whether a config.json dict is a vision-language wrapper whose text model we read."""
    return d.get("model_type") in WRAPPERS


def text_config(d: dict) -> dict:
    """The text model's config.json dict of a wrapper's (`text_config`, its model_type filled in; the wrapper's
    tie_word_embeddings where the text config has none)."""
    text = dict(d.get("text_config") or {})
    text.setdefault("model_type", WRAPPERS[d["model_type"]])
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in d:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    return text


def text_weights(sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
    """A wrapper's text-model tensors under a text checkpoint's names (`model.`, `lm_head.`), and how many tensors (the
    vision tower's, the projector's) were left out."""
    out, left_out = {}, 0
    for name, t in sd.items():
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                out[new + name[len(old):]] = t
                break
        else:
            if name == "lm_head.weight":
                out[name] = t
            else:
                left_out += 1
    return out, left_out
