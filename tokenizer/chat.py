"""Conversations to token ids with an assistant mask, for SFT / DPO preprocessing, GRPO prompts and sampling.

Owns: ``encode_chat``, the one entry point, and what a chat stops at (``chat_stop_ids``). A tokenizer whose chat
template is ours (ChatML, what tokenizer.train_tokenizer writes), or that has none but ChatML's markers, is encoded
here directly: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, the marker ids inserted, the text encoded
with the injection-safe backend, the mask on assistant content and its ``<|im_end|>``. Any other template (an adopted
Llama 3, Qwen2.5, Gemma tokenizer's) is rendered as it is by ``tokenizer.chat_template``.
Must never: let message text produce special ids (a user writing "<|im_end|>" stays plain text), or drift from the
stored chat template: for benign content the ids equal ``tok.apply_chat_template(messages, tokenize=True)``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from tokenizer.chat_template import TemplateChat, is_trained, template_chat, uses_tools
from tokenizer.contract import CHATML_TEMPLATE, CHATML_TEMPLATE_BEFORE_TOOLS, MissingSpecialTokenError, chatml_turns
from tokenizer.loading import safe_backend


def chat_marker_ids(tok: Any) -> tuple[int, int]:
    """The ids of <|im_start|> and <|im_end|> (MissingSpecialTokenError, exit 2, when the tokenizer lacks them)."""
    backend = safe_backend(tok)
    ids = backend.token_to_id("<|im_start|>"), backend.token_to_id("<|im_end|>")
    if None in ids:
        raise MissingSpecialTokenError("the tokenizer has no chat template and no <|im_start|>/<|im_end|> tokens "
                                       "(ChatML, what our renderer writes without a template), which SFT, DPO and "
                                       "GRPO conversations need; add a chat_template to its tokenizer_config.json")
    return ids  # type: ignore[return-value]


def own_template(tok: Any) -> Optional[TemplateChat]:
    """The tokenizer's template to render with, or None where ChatML is written directly (ours, or no template)."""
    source = getattr(tok, "chat_template", None)
    if source is None or source in (CHATML_TEMPLATE, CHATML_TEMPLATE_BEFORE_TOOLS):
        return None
    return template_chat(tok, safe_backend(tok))


def check_chat(tok: Any) -> None:
    """Raise before any input is read when conversations cannot be encoded with `tok`: no template and no ChatML
    markers (MissingSpecialTokenError, exit 2), or a template that cannot render a user / assistant exchange
    (ValueError naming what it did)."""
    chat = own_template(tok)
    if chat is None:
        chat_marker_ids(tok)
        return
    try:
        chat.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
    except ValueError as e:
        raise MissingSpecialTokenError(f"the tokenizer's chat template cannot be used for training: {e}") from None


def chat_stop_ids(tok: Any, special: Mapping[str, Mapping[str, Any]]) -> list[int]:
    """What a generated reply ends at: the tokenizer meta's eos and the token closing an assistant turn (ChatML's
    <|im_end|>, Llama 3's <|eot_id|>, ...), each once."""
    out = [int(special["eos"]["id"])]
    chat = own_template(tok)
    if chat is not None:
        end = chat.end_of_turn_id()
    else:
        end = safe_backend(tok).token_to_id("<|im_end|>")
    if end is not None and end not in out:
        out.append(int(end))
    return out


def encode_chat(tok: Any, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False,
                train_roles: Sequence[str] = ("assistant",), template_kwargs: Optional[Mapping[str, Any]] = None
                ) -> tuple[list[int], list[int]]:
    """Return (input_ids, assistant_mask), mask 1 on content tokens of ``train_roles`` and what closes their turns
    (a message with ``"weight": 0`` is not learned). A `Conversation`'s tools reach the template as `tools`.
    `template_kwargs`: extra variables for a tokenizer's own template (Qwen3's enable_thinking; ChatML reads only
    `tools`). Tool calls under ChatML: Qwen2.5's format (tokenizer/contract.py CHATML_TEMPLATE, `chatml_turns`).

    ChatML, directly: role header and content are encoded as ONE segment ("{role}\\n{content}", exactly the text the
    template puts between the markers) so BPE merges match apply_chat_template; token offsets then
    tell header from content. A token straddling the boundary counts as content (it holds content bytes).
    """
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i}: 'role' and 'content' must be strings, got {dict(m)!r}")
    if getattr(messages, "tools", None):  # (a Conversation's tools: the template's `tools` variable)
        template_kwargs = {**(template_kwargs or {}), "tools": messages.tools}
    offered = (template_kwargs or {}).get("tools")
    chat = own_template(tok)
    if chat is not None:
        return chat.encode(messages, add_generation_prompt, train_roles, template_kwargs)
    trained_turns = [is_trained(m, train_roles) for m in messages]
    if offered or uses_tools(messages):
        if getattr(tok, "chat_template", None) != CHATML_TEMPLATE:
            raise ValueError("tool calls, tool results and offered tools need a chat template that writes them: this "
                             "tokenizer's ChatML template predates tool calling (one trained by this version writes "
                             "them, Qwen2.5's format)")
        turns = chatml_turns(messages, offered, trained_turns)
    else:
        turns = [(m["role"], m["content"], t) for m, t in zip(messages, trained_turns)]
    im_start, im_end = chat_marker_ids(tok)
    backend = safe_backend(tok)
    headers = [role + "\n" for role, _, _ in turns]
    segments = [h + text for h, (_, text, _) in zip(headers, turns)] + ["\n", "assistant\n"]
    encs = backend.encode_batch(segments, add_special_tokens=False)
    newline = encs[len(turns)].ids
    ids: list[int] = []
    mask: list[int] = []
    for (_, _, trained), header, enc in zip(turns, headers, encs):
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
