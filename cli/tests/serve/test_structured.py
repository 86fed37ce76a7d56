"""Structured outputs over HTTP on SmolLM2: JSON Schema, JSON objects, regex, choice and Lark
grammars through `response_format` and vLLM's `structured_outputs`, sampled at temperature 1,
streamed and not, 16 at once; every output parses and validates."""

import concurrent.futures as cf
import json
import re

import httpx
import jsonschema
import pytest

from test_serve import client

SCHEMAS = [
    {"type": "object",
     "properties": {
         "name": {"type": "string", "maxLength": 20},
         "age": {"type": "integer", "minimum": 0, "maximum": 120},
         "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}},
     "required": ["name", "age", "email"], "additionalProperties": False},
    {"type": "object",
     "properties": {
         "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                  "minItems": 1, "maxItems": 3},
         "location": {"type": "object",
                      "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90},
                                     "lon": {"type": "integer", "minimum": -180,
                                             "maximum": 180}},
                      "required": ["lat", "lon"], "additionalProperties": False}},
     "required": ["city", "tags", "location"], "additionalProperties": False},
    {"type": "object",
     "properties": {
         "answer": {"type": "boolean"},
         "confidence": {"type": "string", "enum": ["low", "medium", "high"]},
         "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
     "required": ["answer", "confidence", "code"], "additionalProperties": False},
    {"type": "object",
     "properties": {
         "items": {"type": "array", "maxItems": 3,
                   "items": {"type": "object",
                             "properties": {"id": {"type": "integer", "minimum": 1,
                                                   "maximum": 99},
                                            "done": {"type": "boolean"}},
                             "required": ["id", "done"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"$defs": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
     "type": "object",
     "properties": {"primary": {"$ref": "#/$defs/color"},
                    "others": {"type": "array", "items": {"$ref": "#/$defs/color"},
                               "maxItems": 2}},
     "required": ["primary", "others"], "additionalProperties": False},
]

PROMPT = "Reply with a JSON object describing something you like."


def ask(s, schema, i, stream):
    body = {"max_tokens": 160, "temperature": 1.0, "seed": i,
            "messages": [{"role": "user", "content": PROMPT}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": f"s{i}", "schema": schema,
                                                "strict": True}}}
    if not stream:
        r = httpx.post(s.v1 + "/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    body["stream"] = True
    text, finish = "", None
    with httpx.stream("POST", s.v1 + "/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk["choices"]:
                text += c["delta"].get("content") or ""
                finish = c.get("finish_reason") or finish
    return text, finish


def test_fifty_json_schema_requests_all_validate(smol):
    jobs = [(SCHEMAS[i % len(SCHEMAS)], i, i % 2 == 1) for i in range(50)]
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda j: ask(smol, *j), jobs))
    distinct = set()
    for (schema, i, stream), (text, finish) in zip(jobs, outs):
        assert finish == "stop", (i, text)
        value = json.loads(text)
        jsonschema.validate(value, schema)
        distinct.add(text)
    assert len(distinct) > 25, "sampling at temperature 1 varies the outputs"


def test_json_object_regex_choice_and_grammar(smol):
    c = client(smol)
    # A free-form object may run past max_tokens at temperature 1 (a string can go on): every
    # one that finishes is an object, and most finish.
    finished = 0
    for seed in range(6):
        r = c.completions.create(model="smollm2.maxc", prompt="A JSON object:",
                                 max_tokens=200, temperature=1.0, seed=seed,
                                 extra_body={"response_format": {"type": "json_object"}})
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].text), dict)
            finished += 1
    assert finished >= 3, finished
    for seed in range(4):
        r = c.completions.create(model="smollm2.maxc", prompt="Call me at", max_tokens=40,
                                 temperature=1.0, seed=seed,
                                 extra_body={"structured_outputs": {
                                     "regex": "\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}"}})
        assert re.fullmatch(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}", r.choices[0].text), r
        assert r.choices[0].finish_reason == "stop"
        choices = ["positive", "negative", "neutral"]
        r = c.chat.completions.create(
            model="smollm2.maxc", temperature=1.0, seed=seed, max_tokens=10,
            messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
            extra_body={"structured_outputs": {"choice": choices}})
        assert r.choices[0].message.content in choices
    grammar = 'start: "SELECT " COL " FROM " TABLE\nCOL: "name" | "age"\nTABLE: "users" | "pets"'
    r = c.completions.create(model="smollm2.maxc", prompt="SQL:", max_tokens=20,
                             temperature=1.0, seed=5,
                             extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"SELECT (name|age) FROM (users|pets)", r.choices[0].text), r


@pytest.mark.parametrize("body,param,why", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "foo"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/nowhere"}}}},
     "response_format", "nowhere"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty"),
    ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs", "nope"),
])
def test_a_grammar_that_cannot_compile_is_a_400_naming_the_field(smol, body, param, why):
    before = sum(v for k, v in smol.metrics().items()
                 if k.startswith("maxserve_structured_output_grammar_rejections_total"))
    r = httpx.post(smol.v1 + "/completions",
                   json={"prompt": "hi", "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and why in err["message"], err
    after = sum(v for k, v in smol.metrics().items()
                if k.startswith("maxserve_structured_output_grammar_rejections_total"))
    compiled = "cannot be compiled" in err["message"]
    assert after == before + (1 if compiled else 0), (before, after, err)
    ok = httpx.post(smol.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_constraints_with_speculation_and_preemption(tmp_path, smol):
    """A decoder that verifies 3 drafts from a differently quantized draft, with a KV cache
    small enough to preempt: sampled outputs still validate, and greedy ones equal the plain
    server's."""
    from conftest import SMOLLM2, Server, compile_artifact
    common = ("--max-seq-len", "512", "--page-size", "16", "--max-batch-size", "8")
    dec = compile_artifact(SMOLLM2, str(tmp_path / "dec.maxc"), *common,
                           "--num-speculative-tokens", "3", "--kv-cache-pages", "16")
    draft = compile_artifact(SMOLLM2, str(tmp_path / "draft.maxc"), *common,
                             "--weights", "q4_0")
    s = Server(dec, "--draft", draft)
    try:
        jobs = [(SCHEMAS[i % len(SCHEMAS)], 100 + i, i % 2 == 0) for i in range(16)]
        with cf.ThreadPoolExecutor(16) as pool:
            outs = list(pool.map(lambda j: ask(s, *j), jobs))
        for (schema, i, _), (text, finish) in zip(jobs, outs):
            assert finish == "stop", (i, text)
            jsonschema.validate(json.loads(text), schema)
        assert s.metric("maxserve_cache_preemption_count_total") > 0, "no preemption"
        accepted = s.metric("maxserve_spec_decode_avg_acceptance_length_tokens_sum")
        assert accepted > 0, "no draft accepted"

        def greedy(server, schema):
            r = httpx.post(server.v1 + "/chat/completions", json={
                "max_tokens": 160, "temperature": 0,
                "messages": [{"role": "user", "content": PROMPT}],
                "response_format": {"type": "json_schema",
                                    "json_schema": {"name": "g", "schema": schema}}},
                timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]
        for schema in SCHEMAS[:3]:
            got = greedy(s, schema)
            jsonschema.validate(json.loads(got), schema)
            assert got == greedy(smol, schema)
    finally:
        s.stop()


def test_instructor_with_a_pydantic_model(smol):
    """`instructor` (a structured-output library from PyPI) asks for a Pydantic model in its
    JSON-schema mode; every answer parses into the model (instructor validates it)."""
    import os
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    py = subprocess.run(["bash", "scripts/install-py-instructor.sh"], cwd=root,
                        capture_output=True, text=True, timeout=600)
    assert py.returncode == 0, "scripts/install-py-instructor.sh (pip from PyPI): " + py.stderr
    r = subprocess.run(
        ["python3", os.path.join(os.path.dirname(__file__), "instructor_client.py"), smol.v1,
         "6", "smollm2.maxc"],
        env={**os.environ, "PYTHONPATH": py.stdout.strip()}, capture_output=True, text=True,
        timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    people = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(people) == 6
    assert all(p["address"]["city"] in ("Paris", "Tokyo", "Lima") for p in people)


def test_n_choices_each_follow_the_schema(smol):
    schema = SCHEMAS[2]
    r = httpx.post(smol.v1 + "/chat/completions", json={
        "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 120,
        "temperature": 1.0, "seed": 9, "n": 3,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": schema}}}, timeout=300)
    assert r.status_code == 200, r.text
    texts = [c["message"]["content"] for c in r.json()["choices"]]
    assert len(texts) == 3
    for t in texts:
        jsonschema.validate(json.loads(t), schema)
    assert len(set(texts)) > 1, texts


def test_an_answer_cut_before_its_json_completes_counts_as_truncated(smol):
    key = 'maxserve_response_format_conformance_errors_total{outcome="truncated"}'
    before = smol.metric(key)
    r = httpx.post(smol.v1 + "/completions", json={
        "prompt": "A JSON object:", "max_tokens": 3, "temperature": 0,
        "response_format": {"type": "json_object"}}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "length"
    assert smol.metric(key) == before + 1
    # A complete answer counts nothing.
    total = sum(v for k, v in smol.metrics().items()
                if k.startswith("maxserve_response_format_conformance_errors_total"))
    r = httpx.post(smol.v1 + "/completions", json={
        "prompt": "Call me at", "max_tokens": 40, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "c", "schema": {"type": "object", "properties": {
                "ok": {"type": "boolean"}}, "required": ["ok"]}}}}, timeout=60).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert sum(v for k, v in smol.metrics().items()
               if k.startswith("maxserve_response_format_conformance_errors_total")) == total


def test_mask_time_and_its_exposed_part_are_measured(smol):
    m = "maxc_structured_output_mask_time_milliseconds"
    e = "maxc_structured_output_mask_exposed_time_milliseconds"
    steps = smol.metric(m + "_count")
    r = httpx.post(smol.v1 + "/completions", json={
        "prompt": "A JSON object:", "max_tokens": 12, "temperature": 0,
        "response_format": {"type": "json_object"}}, timeout=60).json()
    n = r["usage"]["completion_tokens"]
    # One mask per step that samples a constrained token; the exposed part is within it.
    assert smol.metric(m + "_count") - steps >= n
    assert smol.metric(e + "_count") == smol.metric(m + "_count")
    assert 0 < smol.metric(m + "_sum")
    assert 0 <= smol.metric(e + "_sum")
