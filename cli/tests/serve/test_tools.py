"""Tool calls over HTTP on SmolLM2 with the openai client: `required` and a named function give
a call of a listed tool whose arguments validate, streamed calls reassemble to the non-streamed
call, a conversation with tool results renders, bad tool requests are 400s naming the field."""

import json
import re

import httpx
import jsonschema
import pytest

from test_serve import client

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000}},
            "required": ["a", "b"]}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call):
    assert call.type == "function"
    params = PARAMS[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), params)


def test_required_and_named_tool_choice_give_valid_calls(smol):
    c = client(smol)
    for seed in range(6):
        r = c.chat.completions.create(model="smollm2.maxc", messages=ASK, tools=TOOLS,
                                      tool_choice="required", temperature=1.0, seed=seed,
                                      max_tokens=120)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        # Parallel calls (OpenAI's default): one or more, each valid.
        assert ch.message.content is None and len(ch.message.tool_calls) >= 1
        for call in ch.message.tool_calls:
            check_call(call)
        one = c.chat.completions.create(model="smollm2.maxc", messages=ASK, tools=TOOLS,
                                        tool_choice="required", temperature=1.0, seed=seed,
                                        max_tokens=120, parallel_tool_calls=False)
        assert len(one.choices[0].message.tool_calls) == 1
        check_call(one.choices[0].message.tool_calls[0])
        named = c.chat.completions.create(
            model="smollm2.maxc", messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
            max_tokens=120, tool_choice={"type": "function", "function": {"name": "add"}})
        call = named.choices[0].message.tool_calls[0]
        assert call.function.name == "add"
        check_call(call)


def test_streamed_calls_reassemble_to_the_same_call(smol):
    c = client(smol)
    for seed in range(3):
        args = dict(model="smollm2.maxc", messages=ASK, tools=TOOLS, tool_choice="required",
                    temperature=1.0, seed=seed, max_tokens=120)
        plain = c.chat.completions.create(**args).choices[0].message.tool_calls[0]
        with c.chat.completions.stream(**args) as s:
            for _ in s:
                pass
            final = s.get_final_completion()
        streamed = final.choices[0].message.tool_calls[0]
        assert streamed.function.name == plain.function.name
        assert json.loads(streamed.function.arguments) == json.loads(plain.function.arguments)
        assert final.choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_tool_results_and_auto(smol):
    c = client(smol)
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "abc123xyz", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "abc123xyz", "content": "{\"temperature\": 21}"},
    ]
    r = c.chat.completions.create(model="smollm2.maxc", messages=messages, tools=TOOLS,
                                  temperature=0, max_tokens=24)
    ch = r.choices[0]
    # Auto: SmolLM2 answers in text; nothing is held back for good.
    if ch.message.tool_calls:
        check_call(ch.message.tool_calls[0])
    else:
        assert ch.message.content and ch.finish_reason in ("stop", "length"), ch
    toks = httpx.post(smol.base + "/tokenize", json={"messages": messages}).json()
    assert toks["count"] > 0


@pytest.mark.parametrize("body,param,why", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in `tools`"),
    ({"tool_choice": "sometimes"}, "tool_choice", "expected none"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools", "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools",
     "parameters"),
])
def test_bad_tool_requests_name_the_field(smol, body, param, why):
    full = {"messages": ASK, "max_tokens": 8, "tools": TOOLS, **body}
    r = httpx.post(smol.v1 + "/chat/completions", json=full)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and why in err["message"], err
    ok = httpx.post(smol.v1 + "/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert ok.status_code == 200


def test_reasoning_content_apart_from_content(artifacts):
    """A thinking section goes to reasoning_content (streamed as its own deltas); a regex makes
    SmolLM2 write one, on a server that reads every answer for it."""
    from conftest import Server
    s = Server(artifacts["smol"], "--reasoning-parser", "think")
    try:
        body = {"messages": [{"role": "user", "content": "Think, then answer."}],
                "max_tokens": 80, "temperature": 1.0, "seed": 4,
                "structured_outputs": {"regex": "<think>[a-z ]{5,30}</think>\\n[A-Z][a-z ]{5,30}\\."}}
        r = httpx.post(s.v1 + "/chat/completions", json=body, timeout=120).json()
        m = r["choices"][0]["message"]
        assert re.fullmatch(r"[a-z ]{5,30}", m["reasoning_content"]), m
        assert re.fullmatch(r"[A-Z][a-z ]{5,30}\.", m["content"]), m
        reasoning, content = "", ""
        with httpx.stream("POST", s.v1 + "/chat/completions", json={**body, "stream": True},
                          timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])["choices"][0]["delta"]
                    reasoning += d.get("reasoning_content") or ""
                    content += d.get("content") or ""
        assert (reasoning, content) == (m["reasoning_content"], m["content"])
    finally:
        s.stop()


@pytest.mark.parametrize("answer,outcome", [
    ('{"name": "add", "arguments": {"a": 1, "b": 2}}', None),
    ('{"name": "add", "arguments": {"a": 1}}', "schema_mismatch"),
    ('{"name": "add", "arguments": {"a": 1, "b": 1e9}}', "schema_mismatch"),
    ('{"name": "nope", "arguments": {}}', "unknown_tool"),
    ('{"name": "add", "argu', "invalid_json"),
])
def test_tool_call_conformance_errors_count_each_outcome(smol, answer, outcome):
    """The answer is forced (a structured-outputs choice) and read for calls in `auto` mode."""
    key = "maxserve_tool_call_conformance_errors_total"
    before = {k: v for k, v in smol.metrics().items() if k.startswith(key)}
    r = httpx.post(smol.v1 + "/chat/completions", json={
        "messages": ASK, "tools": TOOLS, "max_tokens": 60, "temperature": 0,
        "structured_outputs": {"choice": [answer]}}, timeout=60)
    assert r.status_code == 200, r.text
    after = {k: v for k, v in smol.metrics().items() if k.startswith(key)}
    grew = {k for k in after if after[k] != before.get(k, 0.0)}
    assert grew == ({f'{key}{{outcome="{outcome}"}}'} if outcome else set())
    calls = r.json()["choices"][0]["message"].get("tool_calls") or []
    assert len(calls) == (0 if outcome == "invalid_json" else 1)
