"""GRPO's prompts: records read from a .jsonl / .json / .parquet file or a folder of them (the SFT reader's inputs), or
a Hugging Face `datasets` save_to_disk folder (its train split),
each a prompt (plain text, encoded after <s>, or chat messages rendered with the chat template up to the
assistant's header, as SFT renders them) and a reference answer; the field names are flags.

Owns: `read_prompts_file` (the encoded prompts, bad records named and counted, the [data] account), `PromptSet`
(index -> prompt, what the resumable loader shuffles: a batch is a tensor of prompt indices).
Must never: drop a record without counting it, or tokenize a prompt differently from how sample.py / SFT do.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from data_preprocess.readers import RECORD_KINDS, find_input_files, iter_records, lone_surrogate, skip_counter
from data_preprocess.sft_format import ROLE_MAP, record_tools
from data_preprocess.shard_format import DataError


@dataclass
class Prompt:
    ids: list          # the encoded prompt, ending where the completion starts
    text: str          # what the reward functions get as `prompt` (the plain text, or the last user turn)
    answer: Any        # the record's reference answer (None when it has none)
    record: dict       # the whole record (a user reward function gets it)
    where: str         # file:line, for errors that name the record
    tools: list = field(default_factory=list)  # the tool schemas offered in the prompt (--tools: those it may call)


class PromptSet:
    """The prompts by index; `collate` turns a list of indices into {"prompt_index": LongTensor, "prompts": [Prompt]}."""

    def __init__(self, prompts: list) -> None:
        self.prompts = prompts

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> int:
        return int(i)

    def collate(self, items: list) -> dict:
        import torch
        return {"prompt_index": torch.tensor(items, dtype=torch.long), "prompts": [self.prompts[i] for i in items]}


def prompt_messages(turns: Any) -> list:
    """A record's chat messages normalised to {"role", "content"} (ValueError naming what is wrong)."""
    if not isinstance(turns, list) or not turns:
        raise ValueError("must be a non-empty list of messages")
    out = []
    for t in turns:
        role = t.get("role", t.get("from")) if isinstance(t, dict) else None
        content = t.get("content", t.get("value")) if isinstance(t, dict) else None
        if not isinstance(role, str) or role.lower() not in ROLE_MAP or not isinstance(content, str):
            raise ValueError("a message is not {\"role\": user|assistant|system|tool, \"content\": str}")
        out.append({"role": ROLE_MAP[role.lower()], "content": content})
    return out


def _inputs(path: str) -> list:
    """The files of `path`, or a Hugging Face `datasets` save_to_disk folder's train split as one input."""
    if any(os.path.isfile(os.path.join(path, n)) for n in ("state.json", "dataset_dict.json")):
        from tokenizer.corpus import CorpusConfigError, CorpusError
        from tokenizer.dataset_source import open_dataset_source
        try:
            return [open_dataset_source(path, "train")]
        except (CorpusError, CorpusConfigError) as e:
            raise DataError(str(e)) from None
    return find_input_files(path, kinds=RECORD_KINDS, what="GRPO prompt")


def offered_tools(rec: dict, run_tools: Optional[dict]) -> Optional[list]:
    """The tool schemas a chat prompt offers: the record's `tools` (checked as SFT's), or with --tools (`run_tools`,
    name -> schema) the run's, a record's own then naming only functions the run defines (ValueError otherwise)."""
    own = record_tools(rec)
    if not run_tools:
        return own
    if not own:
        return list(run_tools.values())
    unknown = [s.get("function", s).get("name") for s in own if s.get("function", s).get("name") not in run_tools]
    if unknown:
        raise ValueError(f"its 'tools' name {unknown[0]!r}, which --tools does not define")
    return [run_tools[s.get("function", s)["name"]] for s in own]


def read_prompts_file(path: str, cfg: Any, tok: Any, tok_meta: dict, needs_answer: bool,
                      log: Optional[Callable[[str], None]], run_tools: Optional[dict] = None) -> list:
    """Every usable record of `path` as a Prompt, in file order. A record without the prompt field(s), with a
    prompt longer than --max_prompt_length tokens, or (when a built-in answer reward runs) without an answer is
    a counted skip, the first ones named in the log; the account is one [data] line. `run_tools` (--tools: name ->
    schema): every prompt must be a chat, offering them (`offered_tools`)."""
    from tokenizer import encode_chat, encode_prompts
    from tokenizer.chat import check_chat
    from tokenizer.chat_template import parse_template_kwargs
    extra = parse_template_kwargs(str(getattr(cfg, "chat_template_kwargs", "")))
    files = _inputs(path)
    if not files:
        raise DataError(f"{path}: no prompt records (.jsonl, .json or .parquet)")
    skips = skip_counter()
    out, read, chat_checked = [], 0, False
    for f in files:
        for where, _, rec in iter_records(f, skips):
            read += 1
            if not isinstance(rec, dict):
                skips.skip(where, "record is not an object")
                continue
            msgs = rec.get(cfg.messages_field)
            text = rec.get(cfg.prompt_field)
            if msgs is None and isinstance(text, list):  # TRL's conversational prompt: "prompt" holds the messages
                msgs = text
            if msgs is not None and not chat_checked:  # a tokenizer that cannot render chats: one line, exit 2
                check_chat(tok)
                chat_checked = True
            try:
                if msgs is not None:
                    messages = prompt_messages(msgs)
                    if any(lone_surrogate(m["content"]) is not None for m in messages):
                        raise ValueError("holds a lone surrogate (cannot be encoded)")
                    offered = offered_tools(rec, run_tools)  # (the function schemas offered in the prompt)
                    kwargs = {**extra, "tools": offered} if offered else extra
                    ids = list(encode_chat(tok, messages, add_generation_prompt=True, template_kwargs=kwargs)[0])
                    shown = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
                elif isinstance(text, str) and text.strip():
                    if run_tools:
                        raise ValueError("a plain-text prompt; --tools needs chat messages (the template offers them)")
                    if lone_surrogate(text) is not None:
                        raise ValueError("holds a lone surrogate (cannot be encoded)")
                    ids, shown = encode_prompts(tok, tok_meta, [text])[0], text
                else:
                    raise ValueError(f"no '{cfg.messages_field}' list and no non-empty '{cfg.prompt_field}' string")
            except ValueError as e:
                skips.skip(where, "bad prompt", str(e))
                continue
            answer = rec.get(cfg.answer_field)
            if needs_answer and (answer is None or (isinstance(answer, str) and not answer.strip())):
                skips.skip(where, "no answer", f"field '{cfg.answer_field}' missing or empty")
                continue
            if len(ids) > cfg.max_prompt_length:
                skips.skip(where, "prompt too long", f"{len(ids)} tokens > --max_prompt_length={cfg.max_prompt_length}")
                continue
            out.append(Prompt(ids, shown, answer, rec, where, list(offered or []) if msgs is not None else []))
    if log is not None:
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(skips.counts.items()))
        log(f"[data] grpo {path}: {read} records -> {len(out)} prompts, skipped {skips.total}"
            + (f" ({reasons})" if reasons else ""))
    if not out:
        raise DataError(f"{path}: no usable prompt among {read} records (skipped: "
                        f"{', '.join(f'{k} {v}' for k, v in sorted(skips.counts.items())) or 'none'}; first: "
                        f"{skips.first_locations[0] if skips.first_locations else '-'})")
    return out
