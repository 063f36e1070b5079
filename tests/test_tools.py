"""Tool calls (draftwise.tools; the server's tools, tool_choice, parallel_tool_calls).

What must hold: a reply reads as its text and its calls, and the streamed reader gives exactly
that for any way the reply arrives; the real Qwen2.5-Coder-0.5B, served, calls the tool a
question needs through the unchanged openai client, streamed or not; "required" and a named
function always give well-formed calls of the given tools; speculation changes no token of a
reply with tools; a conversation's earlier calls and tool results reach the model through its
chat template; bad tool requests get a 400 that names the problem.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import given, settings, strategies as st

import draftwise
from draftwise.engine import Engine
from draftwise.errors import ConfigError
from draftwise.server import ServerThread
from draftwise.tools import ToolUse

QWEN = "qwen2.5-coder-0.5b"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def use(qwen_tokenizer):
    return ToolUse(qwen_tokenizer, TOOLS)


@pytest.mark.parametrize("text, content, calls", [
    ("No tool needed: it is 4.", "No tool needed: it is 4.", []),
    (f"<tool_call>\n{CALL}\n</tool_call>", "", [("get_weather", {"city": "Paris"})]),
    (f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>\n',
     "Let me check.\n", [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Oslo"})]),
    (f"<tool_call>\n{CALL}", "", [("get_weather", {"city": "Paris"})]),  # a stop string cut the closing tag
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),  # kept as text
    (f"<tool_call>\n{CALL}\n</tool_call>\nDone.", "\nDone.", [("get_weather", {"city": "Paris"})]),
    (f"  {CALL}\n", "", [("get_weather", {"city": "Paris"})]),  # a bare call, as small Qwen models write one
    (f"```json\n{CALL}\n```", "", [("get_weather", {"city": "Paris"})]),
    ('{"name": "launch_rocket", "arguments": {}}', '{"name": "launch_rocket", "arguments": {}}', []),  # not a tool
])
def test_a_reply_reads_as_its_text_and_its_calls(use, text, content, calls):
    read_content, read_calls = use.parse(text)
    assert read_content == content
    assert [(call.name, json.loads(call.arguments)) for call in read_calls] == calls
    assert all(call.id.startswith("call_") for call in read_calls)


PIECES = ["<tool_call>", "</tool_call>", "<tool", "_call>", "\n", " ", "Sure.", "{", "}", "```json", "```",
          CALL, '{"name": "get_time", "arguments": {"city": "Rome"}}', "{oops", "text <tool"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(PIECES), max_size=12), st.data())
def test_the_streamed_reader_gives_what_parse_gives_however_the_reply_arrives(use, pieces, data):
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    reader, streamed, calls = use.reader(), [], []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        delta, new_calls = reader.feed(text[start:end])
        streamed.append(delta)
        calls += new_calls
    delta, new_calls = reader.finish()
    streamed.append(delta)
    calls += new_calls
    content, expected = use.parse(text)
    assert "".join(streamed) == content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in expected]


def test_tools_a_model_cannot_take_and_malformed_tools_are_refused(qwen_tokenizer):
    from transformers import AutoTokenizer

    from tests.conftest import _fetched_folder

    smollm2 = AutoTokenizer.from_pretrained(_fetched_folder("smollm2-135m"))
    with pytest.raises(ConfigError, match="has no place for tools"):
        ToolUse(smollm2, TOOLS)
    ToolUse(smollm2, TOOLS, "none")  # the tools are not shown: nothing to refuse
    cases = [
        ([WEATHER, WEATHER], "auto", "given twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "auto", "an object"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}],
         "required", r"tools\[0\].function.parameters is not a JSON schema"),
        (TOOLS, {"type": "function", "function": {"name": "launch_rocket"}}, "not among the tools"),
        (TOOLS, "always", "is not one of"),
        ([], "auto", "non-empty list"),
    ]
    for tools, choice, message in cases:
        with pytest.raises(ConfigError, match=message):
            ToolUse(qwen_tokenizer, tools, choice)


@pytest.fixture(scope="module")
def qwen(qwen_tokenizer):  # (the tokenizer's fixture fetches the model on a fresh machine)
    return draftwise.load(QWEN, drafter="ngram", progress=False)


@pytest.fixture(scope="module")
def served(qwen):
    with ServerThread(qwen, max_batch=4) as live:
        yield live


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="-", max_retries=0, timeout=120)


def _ask(client, question: str, stream: bool = False, **fields):
    return client.chat.completions.create(model=QWEN, messages=[{"role": "user", "content": question}], tools=TOOLS,
                                          max_tokens=48, temperature=0, stream=stream, **fields)


def _streamed(chunks) -> tuple[str, list, str]:
    content, calls, finish = "", [], None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


def test_the_model_calls_the_tool_a_question_needs_through_the_openai_client(client):
    answer = _ask(client, "What's the weather like in Paris right now?").choices[0]
    assert answer.finish_reason == "tool_calls"
    assert answer.message.content is None
    [call] = answer.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"
    content, calls, finish = _streamed(_ask(client, "What's the weather like in Paris right now?", stream=True))
    assert (content, finish) == ("", "tool_calls")
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [(0, "get_weather", call.function.arguments)]


def test_a_question_no_tool_answers_is_answered_in_text(client):
    answer = _ask(client, "Write a haiku about autumn.").choices[0]
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert answer.message.content and "<tool_call>" not in answer.message.content
    content, calls, _ = _streamed(_ask(client, "Write a haiku about autumn.", stream=True))
    assert (content, calls) == (answer.message.content, [])


def test_required_and_named_choices_always_give_calls_of_the_tools(client):
    """On a question no tool answers: the grammar still makes every reply calls whose names and
    arguments the tools' schemas allow."""
    answer = _ask(client, "Write a haiku about autumn.", tool_choice="required", parallel_tool_calls=False)
    assert answer.usage.model_extra["speculative"]["forced_tokens"] > 0  # the tags, the keys: drafted as forced
    one = answer.choices[0]
    [call] = one.message.tool_calls
    assert one.finish_reason == "tool_calls" and call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments)["city"], str)
    named = _ask(client, "Write a haiku about autumn.",
                 tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
    [call] = named.message.tool_calls
    assert call.function.name == "get_time"
    assert set(json.loads(call.function.arguments)) == {"city"}  # additionalProperties: false
    content, calls, finish = _streamed(_ask(client, "Write a haiku about autumn.", stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert (content, finish) == ("", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_time", call.function.arguments)]


def test_speculation_changes_no_token_of_a_reply_with_tools(qwen, qwen_tokenizer):
    plain = Engine(qwen.target)
    question = [{"role": "user", "content": "What time is it in Tokyo, and the weather in Oslo?"}]
    for choice in ("auto", "required"):
        use = ToolUse(qwen_tokenizer, TOOLS, choice)
        ids = qwen.encode(question, use.tools)
        outputs = [engine.generate(ids, max_new_tokens=40, grammar=use.grammar).token_ids for engine in (plain, qwen)]
        assert outputs[0] == outputs[1], choice
        assert use.parse(qwen_tokenizer.decode(outputs[0]))[1], choice  # it did call


def test_earlier_calls_and_tool_results_reach_the_model_through_its_template(qwen, client):
    conversation = [
        {"role": "user", "content": "What's the weather like in Paris right now?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "cloudy"}'},
    ]
    from draftwise.server.protocol import ChatCompletionRequest

    messages = ChatCompletionRequest(messages=conversation, tools=TOOLS).chat()
    rendered = qwen.tokenizer.decode(qwen.encode(messages, TOOLS))
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in rendered
    assert '<tool_response>\n{"temperature_c": 18, "sky": "cloudy"}\n</tool_response>' in rendered
    answer = client.chat.completions.create(model=QWEN, messages=conversation, tools=TOOLS, max_tokens=24,
                                            temperature=0).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}}}, "not among the tools"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format with tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "an object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"functions": [WEATHER["function"]]}, "send tools instead"),
    ({"tools": TOOLS, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{city"}}]}]}, "not a JSON object"),
])
def test_bad_tool_requests_get_a_400_naming_the_problem(served, fields, message):
    body = {"model": QWEN, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]
