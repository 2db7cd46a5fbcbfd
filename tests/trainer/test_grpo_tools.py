"""GRPO with tools (--tools, trainer/tasks/grpo_tools.py): the rollout feeds a tool's results to the row that called
it and samples on, the fed ids recorded as context (mask 0, log-probability 0) while the sampled ones keep the
trainer's values (bit for bit from whole rows, within rounding from the KV cache); the results' ids are the
template's own (the whole row equals apply_chat_template of the transcript, Qwen2.5's template and our ChatML); a
tool's failure is the result the model reads; the task assembles rows, rewards (TRL's read the transcript), tool
statistics and held-out answers from a scripted policy."""
from __future__ import annotations

import json

import pytest
import torch

from tests.trainer.test_grpo_data import _cfg, _user_module
from tests.trainer.test_grpo_parity import PAD, PROMPTS, _model, _trainer_logps
from trainer.tasks.grpo_rollout import Group, rollout_seed, sample_group, token_logps, training_rows
from trainer.tasks.grpo_tools import ToolRunner, ToolsError, load_tools, parse_calls, run_call

FED = [50, 51, 52]  # what a "tool" feeds back: 50 and 51 are stop ids too (a result's closing token must not end it)
STOPS = list(range(51, 96))  # (a random model then ends its turns often)
MAX_NEW = 24


def _feeding(rounds: int, log: list):
    """A turn_end feeding FED after each of a row's first `rounds` turns (when it fits), logging what it saw."""
    seen: dict = {}

    def turn_end(k, j, turn, room):
        log.append((k, j, list(turn), room))
        seen[(k, j)] = seen.get((k, j), 0) + 1
        return FED if seen[(k, j)] <= rounds and len(FED) < room else None
    return turn_end


def _rollout(model, use_cache: bool, log: list) -> list:
    out = []
    for i, ids in enumerate(PROMPTS):
        g = torch.Generator().manual_seed(rollout_seed(3, 0, i))
        toks, mask, lps = sample_group(model, ids, 4, MAX_NEW, temperature=0.9, top_p=1.0, stop_ids=STOPS,
                                       pad_id=PAD, generator=g, use_cache=use_cache, row_len=7 + MAX_NEW,
                                       turn_end=_feeding(2, log))
        out.append(Group(i, toks, mask, lps))
    return out


@pytest.mark.parametrize("use_cache", [False, True])
def test_fed_results_are_context_and_the_sampled_tokens_keep_the_trainers_values(use_cache):
    model = _model()
    log: list = []
    groups = _rollout(model, use_cache, log)
    fed_spans = 0
    for g in groups:
        for row, m, lp in zip(g.tokens.tolist(), g.mask.tolist(), g.logps.tolist()):
            t = 0
            while t < len(row) and (m[t] or row[t] == FED[0]):
                if not m[t]:  # a fed span: right after a stop id the model drew, all of FED, then sampling again
                    assert row[t - 1] in STOPS and m[t - 1] and row[t:t + 3] == FED and lp[t:t + 3] == [0.0] * 3
                    assert m[t + 3] == 1, "the row samples on after its results"
                    fed_spans += 1
                    t += 3
                    continue
                t += 1
            assert not any(m[t:]), "after the row's end nothing is trained on"
    assert fed_spans >= 8 and len(log) > fed_spans  # (rows fed twice, then ended by their next stop)
    assert all(turn[-1] in STOPS and FED[0] not in turn[:1] for _, _, turn, _ in log)
    rows = training_rows(PROMPTS, groups, 7 + MAX_NEW, PAD)
    on = rows["completion_mask"] > 0
    with torch.no_grad():
        trainer = _trainer_logps(model, rows)
    if not use_cache:  # whole rows: the sampler's values are the training forward's, bit for bit
        assert torch.equal(trainer[on], rows["gen_logps"][on])
    else:  # KV cache: rounding only (a result not fed to the cache would put the later tokens far off)
        exact = token_logps(_model().double()(rows["input_ids"]), rows["input_ids"], 0.9)[0][on]
        err_trainer = (trainer[on].double() - exact).abs().max().item()
        err_decode = (rows["gen_logps"][on].double() - exact).abs().max().item()
        assert 0 < err_trainer < 1e-4 and err_decode <= 4 * err_trainer, (err_decode, err_trainer)
    # the draws are the group's generator's as without tools: the tokens before the first feed are the same
    plain = sample_group(model, PROMPTS[0], 4, MAX_NEW, temperature=0.9, top_p=1.0, stop_ids=STOPS, pad_id=PAD,
                         generator=torch.Generator().manual_seed(rollout_seed(3, 0, 0)), use_cache=use_cache,
                         row_len=7 + MAX_NEW)
    for row, ref in zip(groups[0].tokens.tolist(), plain[0].tolist()):
        first = next(i for i, t in enumerate(ref) if t in STOPS)
        assert row[:first + 1] == ref[:first + 1]


def test_prompts_decoded_together_feed_each_row_its_own_results():
    """--rollout_batch_prompts (sample_in_calls): one prompt a call or both in one left-padded call, turn_end hears
    each row's prompt index in the micro-batch; decoded together, the sampled tokens keep the trainer's values within
    its fp32 rounding."""
    from trainer.tasks.grpo_rollout import sample_in_calls
    model = _model()
    for per_call in (1, 2):
        log: list = []
        rolled = sample_in_calls(model, PROMPTS, [rollout_seed(3, 0, i) for i in range(2)], per_call, 4, MAX_NEW,
                                 device=torch.device("cpu"), temperature=0.9, top_p=1.0, stop_ids=STOPS, pad_id=PAD,
                                 turn_end=_feeding(1, log))
        assert {k for k, _, _, _ in log} == {0, 1}, per_call
        groups = [Group(i, *r) for i, r in enumerate(rolled)]
        for k, j, turn, _ in log:  # each logged turn is that row's own tokens, through the stop id it drew
            row = groups[k].tokens[j].tolist()
            assert any(row[s:s + len(turn)] == turn for s in range(len(row))), (per_call, k, j)
    resumed = sum(int((~m[:-1] & m[1:]).sum()) for g in groups for m in g.mask)  # sampling again after a feed
    assert resumed >= 4
    rows = training_rows(PROMPTS, groups, 7 + MAX_NEW, PAD)
    on = rows["completion_mask"] > 0
    with torch.no_grad():
        trainer = _trainer_logps(model, rows)
        exact = token_logps(_model().double()(rows["input_ids"]), rows["input_ids"], 0.9)[0][on]
    err_trainer = (trainer[on].double() - exact).abs().max().item()
    err_decode = (rows["gen_logps"][on].double() - exact).abs().max().item()
    assert 0 < err_trainer < 1e-4 and err_decode <= 4 * err_trainer, (err_decode, err_trainer)


def test_calls_are_parsed_run_and_their_failures_fed_back(tmp_path, monkeypatch):
    _user_module(tmp_path, monkeypatch, "my_tools", '''
def get_weather(city: str) -> str:
    """The weather in a city now.

    Args:
        city: The city's name.
    """
    if city == "Atlantis":
        raise KeyError(city)
    return {"Paris": "18 C, sunny"}.get(city, "unknown")


def add(a: int, b: int) -> dict:
    """Adds two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return {"sum": a + b}


def undocumented(x):
    return x
''')
    tools = load_tools("my_tools:get_weather, my_tools:add")
    assert list(tools) == ["get_weather", "add"]
    fn = tools["add"].schema["function"]  # (transformers' get_json_schema: what apply_chat_template offers)
    assert (fn["name"], fn["description"], fn["parameters"]["required"]) == ("add", "Adds two numbers.", ["a", "b"])
    assert fn["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first."}
    for spec, said in (("my_tools:undocumented", "no JSON schema"), ("my_tools:nothing", "cannot import it"),
                       ("my_tools:add,my_tools:add", "two functions named 'add'")):
        with pytest.raises(ToolsError, match=said):
            load_tools(spec)
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}\n</tool_call>')
    content, calls, problem = parse_calls(text)
    assert (content, problem) == ("Let me look.", None)
    assert calls == [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                     {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    for bad, said in (("<tool_call>{oops}</tool_call>", "not JSON"), ('<tool_call>["x"]</tool_call>', "not {"),
                      ('<tool_call>{"name": "add"', "unclosed")):
        got = parse_calls(bad)
        assert got[:2] == (bad, []) and said in got[2], got
    assert parse_calls("just an answer") == ("just an answer", [], None)
    offered = ["get_weather", "add"]
    assert [run_call(tools, offered, c) for c in calls] == [("18 C, sunny", False), ('{"sum": 5}', False)]

    def call(name, **args):
        return {"type": "function", "function": {"name": name, "arguments": args}}
    assert run_call(tools, offered, call("get_weather", city="Atlantis")) == ('{"error": "KeyError: \'Atlantis\'"}',
                                                                             True)
    text, failed = run_call(tools, offered, call("add", a=1))
    assert failed and "missing 1 required" in text
    assert run_call(tools, ["add"], call("get_weather", city="Paris")) == (
        '{"error": "no tool named \'get_weather\'"}', True)


WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture
def weather_tools(tmp_path, monkeypatch):
    _user_module(tmp_path, monkeypatch, "weather_tools", '''
def get_weather(city: str) -> str:
    """The weather in a city now.

    Args:
        city: The city's name.
    """
    if city != "Paris":
        raise KeyError(city)
    return "18 C, sunny"
''')
    return load_tools("weather_tools:get_weather")


# Qwen3's template with its tool branches (as Qwen3's tokenizer_config.json holds it): a calling turn after the last
# user query keeps no empty reasoning block once results follow, the last turn does
QWEN3_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""


def _qwen3_tokenizer():
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from tests.tokenizer.test_chat_templates import _backend
    backend = _backend(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    backend.add_tokens([AddedToken(t, special=False) for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>")
    tok.chat_template = QWEN3_TOOLS
    return tok


@pytest.mark.parametrize("which", ["qwen2.5", "ours", "llama3.1", "qwen3"])
def test_the_fed_ids_are_the_templates_so_the_row_is_apply_chat_templates(which, weather_tools, tiny_pretrain_data,
                                                                          tmp_path):
    """A scripted turn calling the tool: prompt + the call turn + the ids fed + the answer is transformers'
    apply_chat_template of the transcript (up to its last "\\n"), under Qwen2.5's template and ours (<tool_call>
    blocks) and Llama 3.1's (the turn one JSON object, the result an ipython turn); the transcript is the rewards'
    messages."""
    from transformers import AutoTokenizer

    from tests.tokenizer.test_chat_templates import DATE
    from tests.tokenizer.test_chat_tools import _hub_tokenizer
    from tokenizer import load_tokenizer
    if which == "ours":
        tok_dir = tiny_pretrain_data["tokenizer_dir"]
        ref, tok = AutoTokenizer.from_pretrained(tok_dir), load_tokenizer(tok_dir)
    else:
        ref = _qwen3_tokenizer() if which == "qwen3" else _hub_tokenizer(which, str(tmp_path / "hub"))
        tok = ref
    schemas = [weather_tools["get_weather"].schema]
    end = tok.convert_tokens_to_ids("<|eot_id|>" if which == "llama3.1" else "<|im_end|>")
    stops = [end, ref.eos_token_id]
    user = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = list(ref.apply_chat_template(user, tools=schemas, add_generation_prompt=True, tokenize=True,
                                          return_dict=False, date_string=DATE))
    written = '{"name": "get_weather", "parameters": {"city": "Paris"}}' if which == "llama3.1" else WEATHER_CALL
    turn = ref.encode(written, add_special_tokens=False) + [end]
    final = ("<think>\n\n</think>\n\n" if which == "qwen3" else "") + "It is 18 C and sunny."  # (Qwen3's last turn)
    answer = ref.encode(final, add_special_tokens=False) + [end]
    runner = ToolRunner(tok, weather_tools, [schemas], stops, max_rounds=0)
    fed = runner.turn_end(0, 0, turn, 200)
    said = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    convo = user + [said, {"role": "tool", "name": "get_weather", "content": "18 C, sunny"},
                    {"role": "assistant", "content": final}]
    want = list(ref.apply_chat_template(convo, tools=schemas, tokenize=True, return_dict=False, date_string=DATE))
    row = prompt + turn + fed + answer
    assert row == want[:len(row)] and len(want) - len(row) <= 1, ref.decode(row)
    last, messages, counts = runner.finish(0, 0, turn + fed + answer)
    assert last == final and messages == convo[1:] and (counts.calls, counts.failures) == (1, 0)
    # no room for the results and a token after them: the row ends at its call, nothing logged
    late = ToolRunner(tok, weather_tools, [schemas], stops)
    assert late.turn_end(0, 1, turn, len(fed)) is None and late.finish(0, 1, turn)[1] == [
        {"role": "assistant", "content": "", "tool_calls": said["tool_calls"]}]
    # --max_tool_calling_iterations=1: the second calling turn is not run
    once = ToolRunner(tok, weather_tools, [schemas], stops, max_rounds=1)
    assert once.turn_end(0, 0, turn, 200) == fed and once.turn_end(0, 0, turn, 200) is None
    # a failing call: the model reads the error
    bad = ref.encode(written.replace("Paris", "Oslo"), add_special_tokens=False) + [end]
    fails = ToolRunner(tok, weather_tools, [schemas], stops)
    got = fails.turn_end(0, 0, bad, 200)
    assert '{"error": "KeyError: \'Oslo\'"}' in ref.decode(got) and fails.rows[(0, 0)].failures == 1


def test_the_call_format_is_the_templates_and_one_without_calls_is_refused():
    from tests.tokenizer.test_chat_tools import FAMILIES
    from trainer.tasks.grpo_tools import call_format

    class Tok:
        chat_template = FAMILIES["qwen2.5"][0]
    assert call_format(Tok()) == "hermes"
    Tok.chat_template = FAMILIES["llama3.1"][0]
    assert call_format(Tok()) == "llama"
    Tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ToolsError, match="writes tool calls neither as <tool_call> JSON blocks"):
        call_format(Tok())
    # Llama 3.1's call is the whole turn: one JSON object with "parameters" (after an optional <|python_tag|>)
    want = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2}}}]
    assert parse_calls('{"name": "add", "parameters": {"a": 2}}', "llama") == ("", want, None)
    assert parse_calls('<|python_tag|>{"name": "add", "parameters": "{\\"a\\": 2}"}', "llama") == ("", want, None)
    assert parse_calls("The sum is 4.", "llama") == ("The sum is 4.", [], None)
    assert parse_calls('{"name": "add", "parameters": [2]}', "llama")[2] == (
        'a JSON call that is not {"name": str, "parameters": object}')
    assert parse_calls('{"name": "add", ', "llama")[2] == "a JSON call that does not parse"


def test_flag_checks():
    from trainer.tasks.grpo_flags import tool_problems
    assert tool_problems(_cfg(tools="a.b:c,d:e")) == []
    assert tool_problems(_cfg(tools="a.b:c", max_tool_calling_iterations=-1)) == [
        "--max_tool_calling_iterations=-1: must be >= 0 (0 = no limit)"]
    assert tool_problems(_cfg(tools="a.b")) == ["--tools: 'a.b' is not module:function"]


class _Scripted(torch.nn.Module):
    """A policy that writes scripts[b] from the completion's first position: logits 40 on the script's next id (the
    draw at temperature 1 is that id up to e^-40), whatever the row holds (fed positions are overwritten anyway)."""

    def __init__(self, vocab: int, prompt_len: int, scripts: list) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.vocab, self.p, self.scripts = vocab, prompt_len, scripts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(x.shape[0], x.shape[1], self.vocab)
        for b in range(x.shape[0]):
            script = self.scripts[b % len(self.scripts)]
            for t in range(self.p - 1, min(x.shape[1], self.p - 1 + len(script))):
                out[b, t, script[t - self.p + 1]] = 40.0
        return out + self.w * 0


def test_the_task_trains_the_models_turns_and_rewards_the_transcript(weather_tools, tiny_pretrain_data, tmp_path,
                                                                    monkeypatch):
    """GRPOTask's rollout with --tools from a scripted policy (ours ChatML): row 0 calls the tool and answers, row 1
    answers at once, row 2 calls a tool that fails and answers; a TRL reward gets each transcript, numeric_match the
    last turn; only the model's turns are trained on; the step's tool statistics."""
    from tokenizer import load_tokenizer, load_tokenizer_meta
    from trainer.tasks.grpo import GRPOTask
    _user_module(tmp_path, monkeypatch, "transcript_reward", '''
SEEN = []
def reward(completions, **kw):
    SEEN.extend(completions)
    return [float(sum(m["role"] == "tool" for m in c)) for c in completions]
''')
    tok_dir = tiny_pretrain_data["tokenizer_dir"]
    user = [{"role": "user", "content": "Weather in Paris?"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"messages": user, "answer": "18"},
        {"prompt": "Weather in Paris?", "answer": "18"},  # plain text: tools need a chat (a counted skip)
        {"messages": user, "answer": "18", "tools": [{"type": "function", "function": {"name": "get_time"}}]},
        {"messages": user, "answer": "18", "tools": [{"name": "get_weather"}]})), encoding="utf-8")
    cfg = _cfg(data_dir=str(tmp_path / "p.jsonl"), tokenizer_dir=tok_dir, tools="weather_tools:get_weather",
               reward_funcs="numeric_match,transcript_reward:reward", answer_marker="", num_generations=3,
               max_prompt_length=700, max_completion_length=300, max_seq_len=1000, generation_kv_cache=False,
               temperature=1.0)
    task = GRPOTask(cfg)
    lines = []
    data = task.datasets(load_tokenizer_meta(tok_dir), 0.0, True, lines.append)
    task._load_tools("cpu")
    tok = load_tokenizer(tok_dir)
    # a record's own tools choose among --tools' (the run's schema offered); one naming another tool is a skip
    assert any("4 records -> 2 prompts, skipped 2 (bad prompt 2)" in ln for ln in lines), lines
    prompt, chosen = data.train.prompts
    assert prompt.tools == chosen.tools == [weather_tools["get_weather"].schema] and prompt.ids == chosen.ids
    assert '"get_weather"' in tok.decode(prompt.ids)  # the tool offered in the prompt
    end = tok.convert_tokens_to_ids("<|im_end|>")
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    call = enc(WEATHER_CALL) + [end]
    fail = enc(WEATHER_CALL.replace("Paris", "Rome")) + [end]
    fed = ToolRunner(tok, weather_tools, [prompt.tools], [end]).turn_end(0, 0, call, 500)
    fed_fail = ToolRunner(tok, weather_tools, [prompt.tools], [end]).turn_end(0, 0, fail, 500)
    answer = enc("It is 18 C.") + [end]
    scripts = [call + fed + answer, enc("Sunny, 20") + [end], fail + fed_fail + answer]
    model = _Scripted(len(tok), len(prompt.ids), scripts)
    rows = task._roll(model, torch.device("cpu"), data.collate([0]), 0, samples := [])
    P = len(prompt.ids)
    for r, script in enumerate(scripts):
        assert rows["input_ids"][r, P:P + len(script)].tolist() == script
        trained = rows["completion_mask"][r, P - 1:P - 1 + len(script)].tolist()
        fed_here = fed if r == 0 else fed_fail if r == 2 else []
        head = len(script) - (len(fed_here) + len(answer) if fed_here else 0)
        assert trained == [1.0] * head + [0.0] * len(fed_here) + [1.0] * (len(script) - head - len(fed_here)), r
        assert rows["attention_mask"][r].sum() == P + len(script)
    assert rows["rewards"].tolist() == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]  # numeric_match on the last turn
    from transcript_reward import SEEN
    assert [m["role"] for m in SEEN[0]] == ["assistant", "tool", "assistant"] and SEEN[0][1]["content"] == \
        "18 C, sunny" and SEEN[2][1]["content"] == '{"error": "KeyError: \'Rome\'"}' and len(SEEN[1]) == 1
    assert rows["tool_calls"].tolist() == [1.0, 0.0, 1.0] and rows["tool_failures"].tolist() == [0.0, 0.0, 1.0]
    assert "<tool_response>" in samples[0]["completion"]
    assert task.step_metrics({**{k: 0.0 for k in task.stat_keys}, "completions": 3.0, "tool_calls": 2.0,
                              "tool_failures": 1.0})["tool_failure_frequency"] == 0.5
    # held out (--eval_data_dir): the greedy answer is decoded with the calls run, scored as the rollouts are; at 2
    # ranks rank 1 decodes a filler batch (the full length, uncounted) and the sums are rank 0's
    from trainer.tasks.grpo_eval import held_out_sums
    kw = dict(rows=3, max_new_tokens=cfg.max_completion_length, stop_ids=[end], device=torch.device("cpu"),
              tools=task._runner, use_cache=False)
    one = held_out_sums(model, [prompt], task._rewards, tok.decode, **kw)
    assert one == [1.0, 2.0, 1.0, 1.0, 1.0, 1.0, float(len(scripts[0])), 2.0]
    two = [held_out_sums(model, [prompt], task._rewards, tok.decode, rank=r, world=2, **kw) for r in (0, 1)]
    assert [a + b for a, b in zip(*two)] == one
