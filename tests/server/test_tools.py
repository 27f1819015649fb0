"""Tool calls out of model text (hermes tags, Llama 3 JSON), streamed in pieces of any size; forced-call schemas;
the messages a chat template receives."""
import json

import pytest

from mimw.server import protocol as P
from mimw.server.tools import (ParsedCall, ToolCallParser, forced_schema, parse_hermes, parse_llama3_json, template_messages,
                               tool_format)

QWEN_LIKE = "{%- if tools %}<tools>{{ tools }}</tools> reply with <tool_call>{...}</tool_call>{%- endif %}"
LLAMA_LIKE = ('{%- if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument '
              'name and its value}.{%- endif %}<|python_tag|>')
SMOL = "{% for message in messages %}<|im_start|>{{ message['role'] }}{% endfor %}"


def test_format_follows_the_template():
    assert tool_format(QWEN_LIKE) == "hermes"
    assert tool_format(LLAMA_LIKE) == "llama3_json"
    assert tool_format(SMOL) == "hermes"  # mimw writes the hermes prompt itself


def test_hermes_calls_with_leading_text_and_a_missing_close_tag():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}')
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_time", {"zone": "CET"})]
    assert parse_hermes("no calls here") == ("no calls here", [])
    bad = "<tool_call>{not json}</tool_call>"
    assert parse_hermes(bad) == (bad, [])


def test_llama3_json_calls_separated_by_semicolons():
    content, calls = parse_llama3_json(' {"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert parse_llama3_json("The answer is 4.")[1] == []
    assert parse_llama3_json('{"city": "Paris"}')[1] == []  # JSON but not a call: it stays text


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_hermes_text_is_sent_up_to_the_call(piece):
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": "<b>"}}\n</tool_call>'
    p = ToolCallParser("hermes", "auto")
    sent = "".join(p.feed(text[i:i + piece]) for i in range(0, len(text), piece))
    rest, calls = p.finish()
    assert sent + rest == "Sure. " and [c.name for c in calls] == ["f"]
    assert json.loads(calls[0].arguments) == {"a": "<b>"}


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_streamed_text_without_calls_comes_out_whole(piece):
    text = "a < b and <tool is not a tag"
    for fmt in ("hermes", "llama3_json"):
        p = ToolCallParser(fmt, "auto")
        sent = "".join(p.feed(text[i:i + piece]) for i in range(0, len(text), piece))
        rest, calls = p.finish()
        assert sent + rest == text and calls == []


def test_streamed_llama3_json_is_held_until_it_parses():
    p = ToolCallParser("llama3_json", "auto", parallel=False)
    sent = "".join(p.feed(x) for x in ["  ", '{"name": "f", ', '"parameters": {"q": 2}}; ', '{"name": "g"}'])
    rest, calls = p.finish()
    assert sent == "" and rest == "" and [c.name for c in calls] == ["f"]  # parallel_tool_calls false: one


def test_forced_outputs_parse_or_stay_text():
    p = ToolCallParser("hermes", "get_weather")
    assert p.feed('{"city": "Oslo"}') == ""
    assert p.finish() == ("", [ParsedCall("get_weather", '{"city": "Oslo"}')])
    p = ToolCallParser("hermes", "required")
    p.feed('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"k": 1}}]')
    assert [c.name for c in p.finish()[1]] == ["a", "b"]
    p = ToolCallParser("hermes", "required")
    p.feed('[{"name": "a", "param')  # cut by max_tokens
    assert p.finish() == ('[{"name": "a", "param', [])


def test_forced_schema_shapes():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "b"}}]
    assert forced_schema(tools, "b", True) == {"type": "object"}
    s = forced_schema(tools, "required", False)
    assert s["type"] == "array" and s["minItems"] == 1 and s["maxItems"] == 1
    assert [i["properties"]["name"]["const"] for i in s["items"]["anyOf"]] == ["a", "b"]


def test_template_messages_native_and_written_by_mimw():
    msgs = [P.ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12C"}]]
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    native, t = template_messages(msgs, tools, QWEN_LIKE)
    assert t == tools and native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    assert native[2] == {"role": "tool", "content": "12C", "tool_call_id": "c1"}
    written, t = template_messages(msgs, tools, SMOL)
    assert t is None and written[0]["role"] == "system" and '"name": "w"' in written[0]["content"]
    assert "<tool_call>" in written[2]["content"] and '"city": "Oslo"' in written[2]["content"]
    assert written[3]["content"] == "<tool_response>\n12C\n</tool_response>"
