"""ChatML conversations to token ids with an assistant mask, for SFT/DPO preprocessing.

Owns: ``encode_chat``, which builds ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message by
inserting the marker ids itself and encoding the text with the injection-safe backend, and marks the
tokens a model should learn (assistant content and its ``<|im_end|>``).
Must never: let message text produce special ids (a user writing "<|im_end|>" stays plain text), or
drift from the stored chat template: for benign content the ids equal
``tok.apply_chat_template(messages, tokenize=True)``.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from tokenizer.contract import MissingSpecialTokenError
from tokenizer.loading import safe_backend


def chat_marker_ids(tok: Any) -> tuple[int, int]:
    """The ids of <|im_start|> and <|im_end|> (MissingSpecialTokenError, exit 2, when the tokenizer lacks them)."""
    backend = safe_backend(tok)
    ids = backend.token_to_id("<|im_start|>"), backend.token_to_id("<|im_end|>")
    if None in ids:  # (a Llama 3 tokenizer: its chats use header tokens, not ChatML)
        raise MissingSpecialTokenError("the tokenizer has no <|im_start|>/<|im_end|> tokens, which our chat "
                                       "renderer (ChatML) needs for SFT, DPO and GRPO conversations")
    return ids  # type: ignore[return-value]


def encode_chat(tok: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False,
                train_roles: Sequence[str] = ("assistant",)) -> tuple[list[int], list[int]]:
    """Return (input_ids, assistant_mask), mask 1 on content tokens of ``train_roles`` and their <|im_end|>.

    Role header and content are encoded as ONE segment ("{role}\\n{content}", exactly the text the
    template puts between the markers) so BPE merges match apply_chat_template; token offsets then
    tell header from content. A token straddling the boundary counts as content (it holds content bytes).
    """
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: 'role' and 'content' must be strings, got {dict(m)!r}")
    im_start, im_end = chat_marker_ids(tok)
    backend = safe_backend(tok)
    headers = [m["role"] + "\n" for m in messages]
    segments = [h + m["content"] for h, m in zip(headers, messages)] + ["\n", "assistant\n"]
    encs = backend.encode_batch(segments, add_special_tokens=False)
    newline = encs[len(messages)].ids
    ids: list[int] = []
    mask: list[int] = []
    for m, header, enc in zip(messages, headers, encs):
        trained = m["role"] in train_roles
        hlen = len(header)
        ids.append(im_start)
        mask.append(0)
        for tid, (_, end) in zip(enc.ids, enc.offsets):
            ids.append(tid)
            mask.append(1 if trained and end > hlen else 0)
        ids.append(im_end)
        mask.append(1 if trained else 0)
        ids.extend(newline)
        mask.extend([0] * len(newline))
    if add_generation_prompt:
        ids.append(im_start)
        mask.append(0)
        ids.extend(encs[-1].ids)
        mask.extend([0] * len(encs[-1].ids))
    return ids, mask
