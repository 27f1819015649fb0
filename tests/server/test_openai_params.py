"""The OpenAI parameters clients rely on, through the real server and the official ``openai`` client: logprobs
(chat and completions, streamed and not), echo with prompt logprobs, penalties, logit_bias, min_p,
response_format, tools / tool_choice, and the fields every chunk carries."""
import json

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


# --- logprobs ---------------------------------------------------------------------------------------------------
def test_chat_logprobs_non_streamed_and_streamed_agree(client, model_name):
    kw = dict(model=model_name, messages=MSG, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens  # max_tokens reached: no stop token among them
    assert "".join(e.token for e in content) == c.message.content
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token  # greedy: the sampled token is the most likely one
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)
        assert bytes(e.bytes).decode() == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]


def test_logprobs_are_null_unless_asked(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=2, temperature=0, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


@pytest.fixture(scope="module")
def tok(built):
    """The server's own tokenizer (the server runs in this process)."""
    return built.app.state.server.tok


def test_completions_logprobs_and_echo_with_prompt_logprobs(client, model_name, tok):
    plain = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == 4 and "".join(lp.tokens) == plain.choices[0].text
    assert all(len(d) >= 2 and lp.tokens[i] in d for i, d in enumerate(lp.top_logprobs))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    echoed = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                       echo=True)
    e = echoed.choices[0]
    n_prompt = echoed.usage.prompt_tokens
    assert e.text == PROMPT + plain.choices[0].text
    assert len(e.logprobs.tokens) == n_prompt + 4 and "".join(e.logprobs.tokens) == e.text
    assert e.logprobs.token_logprobs[0] is None and e.logprobs.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in e.logprobs.token_logprobs[1:])
    assert e.logprobs.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-4)
    # a prompt token's logprob is the one the model gives it when generating it (raw: logit_bias does not move it)
    prompt_ids = tok.encode(PROMPT)
    assert len(prompt_ids) == n_prompt
    forced = client.completions.create(model=model_name, prompt=prompt_ids[:-1], max_tokens=1, temperature=0,
                                       logprobs=0, logit_bias={str(prompt_ids[-1]): 100})
    assert forced.choices[0].text == e.logprobs.tokens[n_prompt - 1]
    assert forced.choices[0].logprobs.token_logprobs[0] == pytest.approx(
        e.logprobs.token_logprobs[n_prompt - 1], abs=1e-4)


def test_echo_prompt_logprobs_survive_a_prefix_cache_hit(client, model_name):
    long = PROMPT + " " + " ".join(f"Item {i}." for i in range(30))
    a = client.completions.create(model=model_name, prompt=long, max_tokens=1, temperature=0, echo=True, logprobs=1)
    b = client.completions.create(model=model_name, prompt=long, max_tokens=1, temperature=0, echo=True, logprobs=1)
    assert a.usage.prompt_tokens > 48
    assert b.choices[0].logprobs.token_logprobs == pytest.approx(a.choices[0].logprobs.token_logprobs, abs=1e-4)
    # without prompt logprobs the same prompt is served from the prefix cache
    c = client.completions.create(model=model_name, prompt=long, max_tokens=1, temperature=0)
    assert c.usage.prompt_tokens_details.cached_tokens >= 32


def test_echo_with_max_tokens_zero_scores_the_prompt(client, model_name):
    # how evaluation harnesses score text: the prompt's logprobs, nothing generated
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == PROMPT and r.usage.completion_tokens == 0 and c.finish_reason == "length"
    assert len(c.logprobs.token_logprobs) == r.usage.prompt_tokens and c.logprobs.token_logprobs[0] is None
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=0)


def test_streamed_echo_starts_with_the_prompt(client, model_name):
    s = list(client.completions.create(model=model_name, prompt="Hello there", max_tokens=3, temperature=0,
                                       echo=True, stream=True))
    assert s[0].choices[0].text.startswith("Hello there")
    whole = client.completions.create(model=model_name, prompt="Hello there", max_tokens=3, temperature=0,
                                      echo=True)
    assert "".join(c.choices[0].text for c in s) == whole.choices[0].text


# --- sampling parameters ----------------------------------------------------------------------------------------
def test_logit_bias_forces_and_bans(client, model_name, tok):
    paris = tok.encode(" Paris")
    assert len(paris) == 1
    r = client.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0,
                                  logit_bias={str(paris[0]): 100})
    assert r.choices[0].text == " Paris" * 3
    base = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=0)
    first = tok.encode(base.choices[0].logprobs.tokens[0])[0]
    banned = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].text != base.choices[0].text


def test_penalties_and_extensions_change_repetitive_output(client, model_name):
    kw = dict(model=model_name, prompt="one one one one one one one one", max_tokens=12, temperature=0)
    plain = client.completions.create(**kw).choices[0].text
    for extra in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0},
                  {"extra_body": {"repetition_penalty": 2.0}}):
        assert client.completions.create(**kw, **extra).choices[0].text != plain, extra
    kw.update(temperature=1.0, seed=1, extra_body={"min_p": 0.5, "top_k": 5})
    r, again = client.completions.create(**kw), client.completions.create(**kw)
    assert r.choices[0].text == again.choices[0].text  # seeded sampling repeats


def test_default_valued_openai_fields_are_accepted(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_completion_tokens=2, temperature=0,
                                       store=False, modalities=["text"], service_tier="auto", user="u1",
                                       safety_identifier="s1", parallel_tool_calls=True)
    assert r.usage.completion_tokens == 2


# --- structured output -------------------------------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"capital_known": {"type": "boolean"},
                                           "digit": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["capital_known", "digit"], "additionalProperties": False}


def test_response_format_json_schema_streamed_and_not(client, model_name):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=40, temperature=0,
                                       response_format=rf)
    assert r.choices[0].finish_reason == "stop"
    doc = json.loads(r.choices[0].message.content)
    assert set(doc) == {"capital_known", "digit"} and isinstance(doc["capital_known"], bool)
    assert 0 <= doc["digit"] <= 9
    s = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=40, temperature=0.8, seed=3,
                                       response_format=rf, stream=True)
    doc = json.loads("".join(ch.choices[0].delta.content or "" for ch in s if ch.choices))
    assert set(doc) == {"capital_known", "digit"}


def test_response_format_json_object_and_length_cut(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=1, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")
    r = client.chat.completions.create(
        model=model_name, max_tokens=200, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}])
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 200


# --- tools --------------------------------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_named_tool_choice_forces_a_valid_call(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=[WEATHER, TIME], max_tokens=40,
                                       temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content is None
    (call,) = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    # the reply goes back as history (as the SDK serialises it), followed by the tool's result
    msgs = ASK + [c.message.model_dump(exclude_unset=True), {"role": "tool", "tool_call_id": call.id,
                                                             "content": '{"temperature": 21}'}]
    msgs[1]["annotations"] = []  # what other servers' replies may carry
    r = client.chat.completions.create(model=model_name, messages=msgs, tools=[WEATHER], max_tokens=2,
                                       temperature=0)
    assert r.usage.completion_tokens >= 1


def test_required_tool_choice_streams_tool_call_deltas(client, model_name):
    kw = dict(model=model_name, messages=[{"role": "user", "content": "What time is it?"}], tools=[TIME],
              max_tokens=40, temperature=0, tool_choice="required", parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw)
    c = whole.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
    assert c.message.tool_calls[0].function.name == "get_time"
    json.loads(c.message.tool_calls[0].function.arguments)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == \
        [(0, c.message.tool_calls[0].function.name, json.loads(c.message.tool_calls[0].function.arguments))]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        ["tool_calls"]


def test_tool_choice_none_and_auto_answer_in_the_openai_shape(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=[TIME], tool_choice="none",
                                       max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    r = client.chat.completions.create(model=model_name, messages=ASK, tools=[TIME], max_tokens=12,
                                       temperature=0)
    m = r.choices[0].message
    assert m.content or m.tool_calls
    if m.tool_calls:
        assert r.choices[0].finish_reason == "tool_calls"
        json.loads(m.tool_calls[0].function.arguments)


def test_a_conversation_with_tool_results_is_accepted(client, model_name):
    msgs = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    r = client.chat.completions.create(model=model_name, messages=msgs, tools=[WEATHER], max_tokens=6,
                                       temperature=0)
    assert r.usage.prompt_tokens > 40 and r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# --- chunk fields -------------------------------------------------------------------------------------------------
def test_stream_chunks_carry_the_spec_fields(base_url, model_name):
    body = {"model": model_name, "messages": MSG, "max_tokens": 3, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    for ch in lines[:-1]:
        assert ch["usage"] is None and ch["system_fingerprint"] and ch["object"] == "chat.completion.chunk"
        assert ch["choices"][0]["logprobs"] is None
    assert lines[-1]["choices"] == [] and lines[-1]["usage"]["completion_tokens"] == 3
    body["stream_options"] = {"include_usage": False}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
    assert all("usage" not in ch for ch in lines)
