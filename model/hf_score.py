"""Reward models as Hugging Face writes them: a family's *ForSequenceClassification (LlamaForSequenceClassification,
Qwen2ForSequenceClassification, ...), whose head `score.weight` [num_labels, hidden] is our `lm_head.weight` when
ModelConfig.num_labels > 0 (model/score_head.py), with `id2label` giving the number of labels and `pad_token_id`
telling transformers where each row's last real token is.

Owns: the class name of a family's reward model, the config fields it adds, the head's name both ways, and reading
num_labels back. Must never: import transformers (the names are written out; tests/model/test_reward_model.py
loads them through transformers).
"""
from __future__ import annotations

from typing import Optional

CAUSAL, SCORE = "ForCausalLM", "ForSequenceClassification"
HUB_HEAD = "score.weight"
# a causal family whose reward model has another name, or none in transformers
RENAMED = {"Gemma3ForCausalLM": "Gemma3TextForSequenceClassification"}
NO_SCORE_CLASS = ("Glm4MoeForCausalLM", "GraniteForCausalLM")


def is_score_config(d: dict) -> bool:
    """Whether a config.json dict is a reward model's (its architecture a *ForSequenceClassification)."""
    return any(str(a).endswith(SCORE) for a in d.get("architectures") or ())


def fields_from_hf(d: dict) -> dict:
    """The ModelConfig fields a *ForSequenceClassification config sets: num_labels (its id2label's size, else
    num_labels, else transformers' default 2), no tied LM head (it has none) and no cap on the LM head's logits
    (Gemma 2's final_logit_softcapping) or divisor (Granite's logits_scaling): the classifiers apply neither to their
    scores; {} for a language model."""
    if not is_score_config(d):
        return {}
    n = len(d.get("id2label") or {}) or int(d.get("num_labels") or 2)
    return {"num_labels": n, "tie_embeddings": False, "final_softcap": None, "logits_scaling": None}


def architecture(causal: str) -> str:
    """The reward-model class of the family whose language model is `causal` (ValueError where transformers has
    none)."""
    if causal in NO_SCORE_CLASS:
        raise ValueError(f"transformers has no sequence-classification class for {causal}: a reward model of this "
                         "family cannot be exported")
    return RENAMED.get(causal, causal[:-len(CAUSAL)] + SCORE)


def score_config(d: dict, num_labels: int, special_ids: Optional[dict]) -> dict:
    """A language model's config.json dict `d` made its family's reward model's: the class, the labels, and the pad
    id transformers reads each row's last real token by (a batch of more than one row needs it)."""
    out = dict(d, architectures=[architecture(d["architectures"][0])], num_labels=num_labels,
               id2label={str(i): f"LABEL_{i}" for i in range(num_labels)},
               label2id={f"LABEL_{i}": i for i in range(num_labels)})
    pad = (special_ids or {}).get("pad_token_id")
    if pad is not None:
        out["pad_token_id"] = pad
    return out


def hub_name(name: str, num_labels: int) -> str:
    """The Hub's name of one of our top-level tensors: the head is `score.weight` in a reward model, `lm_head.weight`
    otherwise; the rest under `model.`."""
    if name == "lm_head.weight":
        return HUB_HEAD if num_labels else name
    return "model." + name
