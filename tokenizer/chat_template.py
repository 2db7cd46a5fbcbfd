"""A tokenizer's own chat template (Llama 3's header tokens, Qwen's default system prompt, Gemma's turns ...) rendered
and tokenized as ``apply_chat_template`` does, with the mask of the tokens a model learns.

Owns: `TemplateChat`, built once per tokenizer (`template_chat`, cached on the tokenizer object): the template
compiled in a sandboxed Jinja environment set up as transformers sets it up (trim_blocks, lstrip_blocks, loop
controls, a `{% generation %}` block that renders its body, `tojson`, `raise_exception`, `strftime_now`), so the text
equals ``tok.apply_chat_template(messages, tokenize=False)``; then the ids, where message text is encoded with the
injection-safe backend (a user writing "<|eot_id|>" stays plain text) and only the template's own text is split at
the tokenizer's added tokens. For benign content the ids equal ``apply_chat_template(tokenize=True)``.

How the content is found in the rendered text: the template is rendered once with each message's content replaced by
a marker and once with the real content; the marked render gives the template's text around each content, the real one
says what the template made of it (as it is, or trimmed: Llama 3 trims every message). A content holding one
reasoning block, `<think>reasoning</think>answer`, is marked part by part, the `<think>` / `</think>` markers left as
they are, so a template that rewrites the block (Qwen3 and DeepSeek-R1's) or drops it from earlier turns (Qwen3's) is
followed too. A template that writes a content twice, or changes it otherwise beyond trimming whitespace, is a
ValueError for that conversation (the pretokenizers count and name it).

The mask: what the model says in a trained turn, from the end of its generation prompt (the text of
`messages[:i]` rendered with add_generation_prompt, where the conversation's text begins so: Qwen3's `<think>` block
is then learned as the model writes it) or else the content's first token, through what closes the turn: the
template's text after the content up to and including the next added token, when that text is only whitespace
(Llama 3's <|eot_id|>, ChatML's <|im_end|>, Llama 2's " </s>", Gemma's <end_of_turn>). A template that prints
today's date (Llama 3.2's) gets a fixed one, 26 Jul 2024 (Llama 3.1's own default), so the ids of a run never depend
on the day it started or resumed. Extra variables (`parse_template_kwargs`: TRL's chat_template_kwargs, Qwen3's
enable_thinking) go to every render of a call.

Must never import transformers or torch: the pretokenizer's workers build it from a backend and strings.
"""
from __future__ import annotations

import datetime
import json
import re
from typing import Any, Mapping, Optional, Sequence

FIXED_DATE = datetime.datetime(2024, 7, 26)
_MARK = "\ue000{}\ue001"  # private-use characters around a message's number
_MARK_RE = re.compile("\ue000([0-9]+)\ue001")
_TOKEN_VARS = ("bos_token", "eos_token", "pad_token", "unk_token")
_CACHE_ATTR = "_template_chat"


def compile_template(source: str) -> Any:
    """The template in a sandboxed Jinja environment with what transformers' chat templates may use."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (templates marking assistant text): the body as it is."""
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=FIXED_DATE.strftime)
    return env.from_string(source)


class Conversation(list):
    """Messages and the tools the model is offered (`tools`: function schemas, the templates' `tools` variable), as
    a tool-calling SFT record gives them (data_preprocess/sft_tools.py); a plain list of messages has none."""

    def __init__(self, messages: Sequence[Mapping[str, Any]] = (), tools: Optional[list] = None):
        super().__init__(messages)
        self.tools = tools


def uses_tools(messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a conversation offers, calls or answers tools."""
    return bool(getattr(messages, "tools", None)) or any(m.get("tool_calls") or m["role"] == "tool"
                                                         for m in messages)


def is_trained(message: Mapping[str, Any], train_roles: Sequence[str]) -> bool:
    """Whether a message's tokens are learned: its role is one of `train_roles` and it does not carry `"weight": 0`
    (OpenAI's fine-tuning format; the SFT readers set it on a prompt's earlier assistant turns, data_preprocess/)."""
    return message["role"] in train_roles and message.get("weight", 1) != 0


class TemplateChat:
    """One tokenizer's chat template, ready to encode conversations (see the module docstring)."""

    def __init__(self, source: str, backend: Any, token_strings: Mapping[str, Optional[str]]):
        """`backend`: the injection-safe `tokenizers.Tokenizer`; `token_strings`: bos_token, eos_token, ... as the
        template reads them (None where the tokenizer has none)."""
        self.template = compile_template(source)
        self.backend = backend
        self.added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        names = sorted(self.added, key=len, reverse=True)
        self.split_re = re.compile("|".join(re.escape(n) for n in names)) if names else None
        self.variables = {k: v for k, v in token_strings.items() if k in _TOKEN_VARS}
        self.variables["date_string"] = FIXED_DATE.strftime("%d %b %Y")

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               extra: Optional[Mapping[str, Any]] = None) -> str:
        """The template's text; `extra`: more variables for it (TRL's chat_template_kwargs: Qwen3's
        enable_thinking), over the tokenizer's."""
        import jinja2
        try:
            variables = {**self.variables, **(extra or {})}
            return self.template.render(messages=[dict(m) for m in messages],
                                        add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:  # the template's own refusal (roles must alternate ...)
            raise ValueError(f"the tokenizer's chat template refused the conversation: {e}") from None

    def pieces(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               extra: Optional[Mapping[str, Any]] = None) -> tuple[list[tuple[str, int]], str]:
        """(pieces, text): the rendered text, and it as (text, owner) pieces in order: owner -1 for the template's
        text, i for (a part of) message i's content as the template wrote it. A content holding one reasoning block
        (`<think>...</think>answer`, what Qwen3's and DeepSeek-R1's templates split apart) is marked part by part."""
        for i, m in enumerate(messages):
            if "\ue000" in m["content"] or "\ue001" in m["content"]:
                raise ValueError(f"message {i}: holds U+E000 / U+E001, which the chat renderer reserves")
        texts: list[str] = []  # the marked parts' own text
        owner_of: list[int] = []  # the message each marked part belongs to
        marked_msgs = []
        for i, m in enumerate(messages):
            marked = []
            for text, literal in _content_parts(m["content"]):
                if literal or not text:  # (an empty content stays empty: templates test it, a tool call's)
                    marked.append(text)
                else:
                    marked.append(_MARK.format(len(texts)))
                    texts.append(text)
                    owner_of.append(i)
            marked_msgs.append(dict(m, content="".join(marked)))
        marked = self.render(marked_msgs, add_generation_prompt, extra)
        real = self.render(messages, add_generation_prompt, extra)
        parts = _MARK_RE.split(marked)  # text, index, text, index, ..., text
        literals, marks = parts[0::2], [int(k) for k in parts[1::2]]
        if len(set(marks)) != len(marks):
            raise ValueError("the chat template writes a message's content more than once")
        out: list[tuple[str, int]] = []
        pos = 0
        for j, lit in enumerate(literals):
            if not real.startswith(lit, pos):
                raise ValueError("the chat template renders its text differently around the messages' content")
            out.append((lit, -1))
            pos += len(lit)
            if j == len(marks):
                break
            k, nxt = marks[j], literals[j + 1]
            t = texts[k]
            for cand in dict.fromkeys((t, t.strip(), t.lstrip(), t.rstrip(), t.strip("\n"), t.lstrip("\n"),
                                       t.rstrip("\n"))):
                if real.startswith(cand + nxt, pos):
                    out.append((cand, owner_of[k]))
                    pos += len(cand)
                    break
            else:
                raise ValueError(f"the chat template changes message {owner_of[k]}'s content beyond trimming "
                                 "whitespace, so its tokens cannot be told from the template's")
        if pos != len(real):
            raise ValueError("the chat template renders its text differently around the messages' content")
        return [(t, o) for t, o in out if t], real

    def encode(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               train_roles: Sequence[str] = ("assistant",), extra: Optional[Mapping[str, Any]] = None
               ) -> tuple[list[int], list[int]]:
        """(input_ids, mask): mask 1 on what the model says in `train_roles` turns (see `_mask`)."""
        # items: ("id", token id, its offset) for an added token of the template's text, ("text", segment, (its offset,
        # spans)) otherwise, a segment being the text between two added tokens (the template's and the contents'
        # together, encoded as one piece so BPE merges match apply_chat_template) and spans its contents' (start,
        # end, message index); offsets are in the rendered text
        if uses_tools(messages) or (extra or {}).get("tools"):
            self._check_tool_text(messages, extra)
        pieces, real = self.pieces(messages, add_generation_prompt, extra)
        items: list[tuple[str, Any, Any]] = []
        seg: list[str] = []
        spans: list[tuple[int, int, int]] = []
        seg_len, seg_at, pos = 0, 0, 0

        def close() -> None:
            nonlocal seg, spans, seg_len, seg_at
            if seg:
                items.append(("text", "".join(seg), (seg_at, spans)))
            seg, spans, seg_len, seg_at = [], [], 0, pos

        for text, owner in pieces:
            if owner >= 0:
                seg.append(text)
                spans.append((seg_len, seg_len + len(text), owner))
                seg_len += len(text)
                pos += len(text)
                continue
            start = 0
            for m in (self.split_re.finditer(text) if self.split_re is not None else ()):
                if m.start() > start:
                    seg.append(text[start:m.start()])
                    seg_len += m.start() - start
                pos += m.start() - start
                close()
                items.append(("id", self.added[m.group()], pos))
                pos += m.end() - m.start()
                seg_at = pos
                start = m.end()
            if start < len(text):
                seg.append(text[start:])
                seg_len += len(text) - start
                pos += len(text) - start
        close()
        encs = iter(self.backend.encode_batch([it[1] for it in items if it[0] == "text"], add_special_tokens=False))
        ids: list[int] = []
        owner_of: list[int] = []  # per token: message index of the content it holds, -1 for the template's
        ends: list[int] = []  # per token: where it ends in the rendered text
        for kind, value, where in items:
            if kind == "id":
                ids.append(value)
                owner_of.append(-1)
                ends.append(where + len(self.backend.id_to_token(value) or ""))
                continue
            at, sp = where
            enc = next(encs)
            for tid, (start, end) in zip(enc.ids, enc.offsets):
                ids.append(tid)
                owner_of.append(_owner(start, end, sp))
                ends.append(at + end)
        trained = [i for i, m in enumerate(messages) if is_trained(m, train_roles)]
        return ids, self._mask(messages, real, ids, owner_of, ends, trained, extra)

    def _mask(self, messages: Sequence[Mapping[str, Any]], real: str, ids: list[int], owner_of: list[int],
              ends: list[int], trained: list[int], extra: Optional[Mapping[str, Any]] = None) -> list[int]:
        """1 on what the model says in each trained turn: from the end of the turn's generation prompt (the text of
        `render(messages[:i], add_generation_prompt=True)`, where that is how the conversation's text begins: Qwen3's
        `<think>` is then the model's, as it is when it generates) or else its content's first token, through the
        token closing the turn (the template's whitespace after the content, then the next added token: Llama 3's
        <|eot_id|>, ChatML's <|im_end|>, Llama 2 / Mistral's " </s>", Gemma's <end_of_turn>)."""
        mask = [0] * len(ids)
        added_ids = set(self.added.values())
        for i in trained:
            if messages[i].get("tool_calls"):
                start, end = self._tool_turn_span(messages, i, real, ids, ends, added_ids, extra)
                mask[start:end + 1] = [1] * (end + 1 - start)
                continue
            own = [t for t, o in enumerate(owner_of) if o == i]
            if not own:
                continue  # (the template left this turn's content out)
            first, last = own[0], own[-1]
            start = first
            prompt = self._prompt_text(messages[:i], extra)
            if prompt is not None and real.startswith(prompt) and 0 < len(prompt) < ends[first]:
                start = next(t for t in range(first + 1) if ends[t] > len(prompt))  # (a straddling token: the turn's)
                if any(owner_of[t] not in (-1, i) for t in range(start, first)):
                    start = first  # (another message's content in between: the prompt text is not this turn's)
            j = last + 1  # the template's whitespace, then the added token closing the turn
            while j < len(ids) and owner_of[j] == -1 and ids[j] not in added_ids \
                    and not self.backend.decode([ids[j]], skip_special_tokens=False).strip():
                j += 1
            end = j if j < len(ids) and owner_of[j] == -1 and ids[j] in added_ids else last
            for t in range(start, end + 1):
                mask[t] = 1
        return mask

    def _tool_turn_span(self, messages: Sequence[Mapping[str, Any]], i: int, real: str, ids: list[int],
                        ends: list[int], added_ids: set, extra: Optional[Mapping[str, Any]]) -> tuple[int, int]:
        """(first, last) token of what the model writes in turn i, which calls tools: from the end of the generation
        prompt before it through the added token closing it, the conversation rendered up to it marking its end (the
        calls are the template's text, not the content's)."""
        prompt = self._prompt_text(messages[:i], extra) or ""
        upto = self.render(messages[:i + 1], False, extra)
        if not (real.startswith(prompt) and real.startswith(upto) and len(prompt) < len(upto)):
            raise ValueError(f"message {i}: the chat template renders the conversation up to this tool-calling turn "
                             "differently from the start of the whole, so the turn's tokens cannot be told")
        start = next(t for t in range(len(ids)) if ends[t] > len(prompt))
        stop = max(t for t in range(len(ids)) if ends[t] <= len(upto))
        return start, next((t for t in range(stop, start - 1, -1) if ids[t] in added_ids), stop)

    def _check_tool_text(self, messages: Sequence[Mapping[str, Any]], extra: Optional[Mapping[str, Any]]) -> None:
        """Tool calls, results' names and offered tools are the template's text, which is split at added tokens: one
        holding an added token's text (`<|im_end|>`) would make it a control token, so it is refused."""
        if self.split_re is None:
            return
        fields = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in messages]
        text = json.dumps([fields, (extra or {}).get("tools")], ensure_ascii=False)
        found = self.split_re.search(text)
        if found:
            raise ValueError(f"a tool call or tool schema holds {found.group(0)!r}, a control token's text")

    def _prompt_text(self, messages: Sequence[Mapping[str, Any]], extra: Optional[Mapping[str, Any]] = None
                     ) -> Optional[str]:
        """The rendered text of `messages` with the generation prompt, or None where the template refuses it."""
        if not messages:
            return None
        try:
            return self.render(messages, True, extra)
        except ValueError:
            return None

    def end_of_turn_id(self) -> Optional[int]:
        """The added token that closes an assistant turn (what generation stops at), or None."""
        ids, mask = self.encode([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}])
        last = max((t for t, m in enumerate(mask) if m), default=None)
        if last is None or ids[last] not in set(self.added.values()):
            return None
        return ids[last]


def _content_parts(content: str) -> list[tuple[str, bool]]:
    """A message's content as (text, literal) parts: one unmarked part, or for one reasoning block
    `pre<think>reasoning</think>answer` the three texts around the literal markers (which templates split on)."""
    if content.count("</think>") != 1:
        return [(content, False)]
    head, _, answer = content.partition("</think>")
    if head.count("<think>") > 1:
        return [(content, False)]
    pre, opened, reasoning = head.rpartition("<think>") if "<think>" in head else ("", "", head)
    return [(pre, False), (opened, True), (reasoning, False), ("</think>", True), (answer, False)]


def parse_template_kwargs(spec: str, flag: str = "--chat_template_kwargs") -> dict[str, Any]:
    """A flag's JSON object of extra chat-template variables ('' = none); ValueError naming the flag otherwise."""
    if not spec.strip():
        return {}
    try:
        value = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"{flag}={spec!r}: not JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag}={spec!r}: a JSON object of template variables, such as "
                         '\'{"enable_thinking": false}\'')
    reserved = sorted(set(value) & {"messages", "add_generation_prompt"})
    if reserved:
        raise ValueError(f"{flag}: {', '.join(reserved)} are set by the renderer, not by the flag")
    return value


def _owner(start: int, end: int, spans: Sequence[tuple[int, int, int]]) -> int:
    """The message whose content the token at [start, end) of its segment holds bytes of (a token straddling the
    template's text and a content counts as content), or -1."""
    for s, e, k in spans:
        if (start < e and end > s) or (start == end and s < end <= e):
            return k
    return -1


def template_chat(tok: Any, backend: Any) -> Optional[TemplateChat]:
    """The tokenizer's `TemplateChat`, built once and cached on it; None when it has no chat template."""
    cached = getattr(tok, _CACHE_ATTR, None)
    if cached is not None:
        return cached
    source = getattr(tok, "chat_template", None)
    if isinstance(source, dict):  # named templates: the default one
        source = source.get("default")
    if not isinstance(source, str) or not source:
        return None
    chat = TemplateChat(source, backend, {k: _token_string(getattr(tok, k, None)) for k in _TOKEN_VARS})
    try:
        setattr(tok, _CACHE_ATTR, chat)
    except AttributeError:
        pass
    return chat


def _token_string(value: Any) -> Optional[str]:
    return None if value is None else str(value)
