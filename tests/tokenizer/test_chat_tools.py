"""Tool-calling SFT records (OpenAI's fine-tuning shape, transformers' messages): under a tokenizer whose template
writes tools (Qwen2.5's tool branch, as its tokenizer_config.json holds it; Llama 3.1's, abridged: the tools in the
first user turn, one call a turn), the ids are apply_chat_template's with the record's tools, the learned tokens are
what the model writes after each generation prompt (its calls and the token closing the turn, its final answer), never
the tool's result; the same files from 2 worker processes; our own tokenizers' ChatML writes Qwen2.5's tool format
(one trained before it says it has none); malformed calls and schemas are refused with their reason."""
import json
import os
import re

import numpy as np
import pytest

from data_preprocess.sft_format import RecordError, sft_messages
from tests.tokenizer.test_chat_templates import DATE, _backend
from tokenizer import encode_chat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN25_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
LLAMA31_TOOLS = """{{- bos_token }}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- set first_user_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {{- message.content }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# OpenAI's fine-tuning shape: the call's arguments a JSON text, the assistant's content null, the tools a list
RECORD = {"tools": [WEATHER], "messages": [
    {"role": "system", "content": "Answer with the tools."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "4 C, rain"},
    {"role": "assistant", "content": "Paris: 18 C and sunny. Oslo: 4 C with rain."}]}
# what the model writes: both calls and <|im_end|>, then the answer and <|im_end|>; never the results
LEARNED = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
           '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>'
           'Paris: 18 C and sunny. Oslo: 4 C with rain.<|im_end|>')


ONE_CALL = dict(RECORD, messages=RECORD["messages"][:2] + [
    dict(RECORD["messages"][2], tool_calls=RECORD["messages"][2]["tool_calls"][:1]), RECORD["messages"][3],
    dict(RECORD["messages"][5], content="Paris: 18 C and sunny.")])
LLAMA_LEARNED = ('{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
                 'Paris: 18 C and sunny.<|eot_id|>')

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|finetune_right_pad_id|>"]
# name: (template, added tokens, bos, eos, pad, the record (Llama 3.1 calls one tool a turn), what the model writes)
FAMILIES = {
    "qwen2.5": (QWEN25_TOOLS, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", "<|endoftext|>",
                RECORD, LEARNED),
    "llama3.1": (LLAMA31_TOOLS, LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", "<|finetune_right_pad_id|>",
                 ONE_CALL, LLAMA_LEARNED),
}


def _hub_tokenizer(name: str, path: str):
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast
    template, specials, bos, eos = FAMILIES[name][:4]
    backend = _backend(specials)
    if name == "qwen2.5":  # (its <tool_call> markers are added tokens in Qwen2.5's vocabulary)
        backend.add_tokens([AddedToken(t, special=False) for t in ("<tool_call>", "</tool_call>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tok.chat_template = template
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (transformers' tokenizer with the family's tool template, its Hub directory)."""
    out = {}
    for name in FAMILIES:
        hub = str(tmp_path_factory.mktemp("hub") / name)
        out[name] = (_hub_tokenizer(name, hub), hub)
    return out


@pytest.fixture(scope="module")
def qwen_tools(families, tmp_path_factory):
    """(transformers' tokenizer, its Hub directory, the directory adopted as ours) of the Qwen2.5 family."""
    from tokenizer.extend_tokenizer import main
    tok, hub = families["qwen2.5"]
    ours = str(tmp_path_factory.mktemp("adopted") / "qwen_tools")
    assert main([f"--base_tokenizer_dir={hub}", "--num_new_tokens=0", f"--out_dir={ours}",
                 "--pad_token=<|endoftext|>"]) == 0
    return tok, hub, ours


def _learned(tok, ids, mask) -> str:
    return tok.decode([t for t, m in zip(ids, mask) if m])


@pytest.mark.parametrize("name", FAMILIES)
def test_ids_are_apply_chat_templates_and_the_calls_are_learned(families, name):
    tok = families[name][0]
    record, learned = FAMILIES[name][5:]
    conv = sft_messages(record)
    assert conv.tools == [WEATHER]
    assert conv[2]["tool_calls"][-1] == {"type": "function", "id": "c2" if name == "qwen2.5" else "c1", "function": {
        "name": "get_weather", "arguments": {"city": "Oslo" if name == "qwen2.5" else "Paris"}}}
    ids, mask = encode_chat(tok, conv)
    want = list(tok.apply_chat_template([dict(m) for m in conv], tools=[WEATHER], tokenize=True, return_dict=False,
                                        date_string=DATE))
    assert ids == want and '"get_weather"' in tok.decode(ids)
    assert _learned(tok, ids, mask) == learned
    runs = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])) != 0).reshape(-1, 2)
    assert len(runs) == 2  # the results between the two turns are not learned
    # transformers' call shape (arguments an object, no wrapper) and a JSON text of the tools read the same
    other = dict(record, tools=json.dumps([WEATHER]), messages=[
        dict(m, tool_calls=[{"name": c["function"]["name"], "id": c["id"],
                             "arguments": json.loads(c["function"]["arguments"])} for c in m["tool_calls"]])
        if m.get("tool_calls") else m for m in record["messages"]])
    assert encode_chat(tok, sft_messages(other)) == (ids, mask)
    # a calling turn with weight 0 is context: only the answer is learned
    weighted = dict(record, messages=[dict(m, weight=0) if m.get("tool_calls") else m for m in record["messages"]])
    w_ids, w_mask = encode_chat(tok, sft_messages(weighted))
    assert w_ids == ids and _learned(tok, w_ids, w_mask) == learned[learned.index("Paris:"):]
    # trying the model: sample.py --chat --chat_template_kwargs='{"tools": [...]}' offers them in the prompt
    from sample import build_prompt_ids
    user = record["messages"][1]
    assert build_prompt_ids(tok, {}, user["content"], True, {"tools": [WEATHER]}) == list(tok.apply_chat_template(
        [user], tools=[WEATHER], add_generation_prompt=True, tokenize=True, return_dict=False, date_string=DATE))


@pytest.mark.parametrize("which", ["qwen2.5", "ours"])
def test_pretokenized_in_workers_as_apply_chat_template_writes_them(qwen_tools, tmp_path, tiny_pretrain_data, which):
    """Also our own tokenizers: their ChatML template writes tools in Qwen2.5's format (the same learned text), and the
    direct encoder gives its ids."""
    from transformers import AutoTokenizer

    from data_preprocess.pretokenize_sft_data import pretokenize_sft
    tok_dir = qwen_tools[2] if which == "qwen2.5" else tiny_pretrain_data["tokenizer_dir"]
    tok = qwen_tools[0] if which == "qwen2.5" else AutoTokenizer.from_pretrained(tok_dir)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "t.jsonl").write_text(json.dumps(RECORD) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}) + "\n",
        encoding="utf-8")
    outs = [str(tmp_path / f"out{w}") for w in (1, 2)]
    for w, out in zip((1, 2), outs):
        assert pretokenize_sft(str(tmp_path / "in"), tok_dir, 1024, out, num_workers=w)["num_samples"] == 2
    for f in ("input_ids.bin", "labels.bin", "samples.npy"):
        assert open(os.path.join(outs[0], f), "rb").read() == open(os.path.join(outs[1], f), "rb").read(), f
    with open(os.path.join(outs[1], "sft_meta.json"), encoding="utf-8") as f:
        dtype = np.dtype(json.load(f)["dtype"])
    ids = np.fromfile(os.path.join(outs[1], "input_ids.bin"), dtype=dtype)
    labels = np.fromfile(os.path.join(outs[1], "labels.bin"), dtype="<i4")
    off, length = np.load(os.path.join(outs[1], "samples.npy"))[0][:2]
    assert tok.decode(labels[off:off + length][labels[off:off + length] != -100]) == LEARNED
    conv = sft_messages(RECORD)
    from tokenizer import load_tokenizer
    want = list(tok.apply_chat_template([dict(m) for m in conv], tools=[WEATHER], tokenize=True, return_dict=False))
    assert encode_chat(load_tokenizer(tok_dir), conv)[0] == want
    sample = ids[off:off + length].tolist()  # (the sample ends at the last learned token: ChatML's "\n" after it cut)
    assert sample == want[:len(sample)] and len(sample) >= len(want) - 1


def test_a_chatml_template_from_before_tool_calling_refuses_them(tiny_pretrain_data):
    import copy

    from tokenizer import load_tokenizer
    from tokenizer.contract import CHATML_TEMPLATE_BEFORE_TOOLS
    ours = load_tokenizer(tiny_pretrain_data["tokenizer_dir"])
    old = copy.copy(ours)
    old.chat_template = CHATML_TEMPLATE_BEFORE_TOOLS
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert encode_chat(old, plain) == encode_chat(ours, plain)  # (still ChatML, written directly)
    # without tools, the template writes the old one's text, so the old exports and the new read alike
    from transformers import AutoTokenizer
    from tokenizer.contract import CHATML_TEMPLATE
    ref = AutoTokenizer.from_pretrained(tiny_pretrain_data["tokenizer_dir"])
    assert ref.chat_template == CHATML_TEMPLATE != CHATML_TEMPLATE_BEFORE_TOOLS
    for conv in (plain, [{"role": "system", "content": "S"}] + plain + [{"role": "user", "content": "more\n"}]):
        for gen in (False, True):
            texts = [ref.apply_chat_template(conv, chat_template=t, tokenize=False, add_generation_prompt=gen)
                     for t in (ref.chat_template, CHATML_TEMPLATE_BEFORE_TOOLS)]
            assert texts[0] == texts[1] and "<|im_start|>user\nhi<|im_end|>\n" in texts[0]
    with pytest.raises(ValueError, match="predates tool calling"):
        encode_chat(old, sft_messages(RECORD))


def test_malformed_calls_and_schemas_are_refused_with_their_reason(qwen_tools):
    user, answer = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}

    def call(**fn):
        return {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": fn}]}
    for msgs, extra, said in (
            ([dict(user, tool_calls=[{"name": "f"}]), answer], {}, "'tool_calls' on a user turn"),
            ([user, call(name="f", arguments="{oops")], {}, "'arguments' is not JSON"),
            ([user, call(name="f", arguments=[1])], {}, "must be an object"),
            ([user, call(arguments={})], {}, "no function name"),
            ([user, {"role": "assistant", "tool_calls": "f()"}], {}, "'tool_calls' is str"),
            ([user, answer], {"tools": {"name": "f"}}, "'tools' must be a list"),
            ([user, answer], {"tools": "[oops"}, "'tools' is a text that is not JSON"),
            ([user, {"role": "assistant", "content": None}], {}, "content is NoneType")):
        with pytest.raises(RecordError, match=said):
            sft_messages({"messages": msgs, **extra})
    # a call holding a control token's text would become that token in the template's text: refused
    tok = qwen_tools[0]
    with pytest.raises(ValueError, match=re.escape("holds '<|im_end|>', a control token")):
        encode_chat(tok, sft_messages({"messages": [user, call(name="f", arguments={"x": "<|im_end|>"})]}))
    with pytest.raises(ValueError, match=re.escape("holds '<|im_end|>', a control token")):  # (a prompt's, as GRPO's)
        encode_chat(tok, [user], add_generation_prompt=True, template_kwargs={"tools": [{"name": "<|im_end|>"}]})


def test_grpo_prompts_offer_the_records_tools(tiny_pretrain_data, tmp_path):
    """A GRPO prompt record's `tools` are offered in its prompt (tool-use RL: the reward reads the call); bad ones
    are the record's counted skip."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from tokenizer import load_tokenizer, load_tokenizer_meta
    from trainer.tasks.grpo_data import read_prompts_file
    tok_dir = tiny_pretrain_data["tokenizer_dir"]
    user = [{"role": "user", "content": "Weather in Paris?"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"messages": user, "tools": [WEATHER]}, {"messages": user}, {"messages": user, "tools": "[oops"})),
        encoding="utf-8")
    cfg = SimpleNamespace(messages_field="messages", prompt_field="prompt", answer_field="answer",
                          max_prompt_length=1024)
    got = read_prompts_file(str(tmp_path / "p.jsonl"), cfg, load_tokenizer(tok_dir), load_tokenizer_meta(tok_dir),
                            needs_answer=False, log=None)
    ref = AutoTokenizer.from_pretrained(tok_dir)
    with_tools, plain = (list(ref.apply_chat_template(user, tools=t, add_generation_prompt=True, tokenize=True,
                                                      return_dict=False)) for t in ([WEATHER], None))
    assert [p.ids for p in got] == [with_tools, plain] and with_tools != plain


def test_the_bundled_tool_calls_read_whole_and_learn_calls_and_answers_only(tiny_pretrain_data):
    """data/sft_tools: every record kept (as the trainer reads raw records), each sample learning its calls and its
    final answer, never a tool's result, and the calling turn with weight 0 not learned."""
    from data_preprocess.pretokenize_sft_data import tokenize_sft_records
    from dataset.dataset_sft import SFTDataset
    from tokenizer import load_tokenizer
    path = os.path.join(ROOT, "data", "sft_tools")
    with open(os.path.join(path, "tool_calls.jsonl"), encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    tokens = tokenize_sft_records(path, tiny_pretrain_data["tokenizer_dir"], 1024)
    assert tokens.meta["num_samples"] == len(recs) == 8 and tokens.meta["files"][0]["skipped"] == {}
    ds, tok = SFTDataset(tokens), load_tokenizer(tiny_pretrain_data["tokenizer_dir"])
    for i, rec in enumerate(recs):
        labels = ds[i]["labels"]
        learned = tok.decode(labels[labels != -100].tolist())
        msgs = rec["messages"]
        assert learned.endswith(msgs[-1]["content"] + "<|im_end|>")
        assert "<tool_response>" not in learned and "# Tools" not in learned  # (the results, the offered schemas)
        for m in msgs:
            for call in m.get("tool_calls") or []:
                name = f'"name": "{call["function"]["name"]}"'
                assert (name in learned) == (m.get("weight", 1) == 1), (i, learned)
    assert "Let me compute that." not in tok.decode(ds[5]["labels"][ds[5]["labels"] != -100].tolist())


@pytest.mark.parametrize("which", ["qwen2.5", "ours"])
def test_preference_pairs_over_tool_calls(qwen_tools, tiny_pretrain_data, tmp_path, which):
    """DPO pairs whose replies call tools (TRL's DPO with `tools`; the explicit shape and the implicit one): each
    branch is apply_chat_template's text with the record's tools, and learns its own reply only, the call of one and
    the refusal of the other."""
    from transformers import AutoTokenizer

    from data_preprocess.pretokenize_dpo_data import tokenize_dpo_records
    from dataset.dataset_dpo import DPODataset
    tok_dir = qwen_tools[2] if which == "qwen2.5" else tiny_pretrain_data["tokenizer_dir"]
    ref = qwen_tools[0] if which == "qwen2.5" else AutoTokenizer.from_pretrained(tok_dir)
    user = {"role": "user", "content": "Weather in Paris?"}
    chosen = {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    rejected = {"role": "assistant", "content": "I cannot check the weather."}
    records = [{"tools": [WEATHER], "prompt": [user], "chosen": [chosen], "rejected": [rejected]},
               {"tools": [WEATHER], "chosen": [user, chosen], "rejected": [user, rejected]}]
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    ds = DPODataset(tokenize_dpo_records(str(tmp_path / "p"), tok_dir, 1024), 1024)
    assert len(ds) == 2
    normal = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    for i in range(2):
        for side, reply, learned in (("chosen", normal, call), ("rejected", rejected,
                                                                  "I cannot check the weather.<|im_end|>")):
            x, y = ds[i][f"{side}_input_ids"].tolist(), ds[i][f"{side}_labels"]
            want = list(ref.apply_chat_template([user, reply], tools=[WEATHER], tokenize=True, return_dict=False))
            assert x == want[:len(x)] and len(x) >= len(want) - 2 and "# Tools" in ref.decode(x)
            assert ref.decode(y[y != -100].tolist()) == learned
