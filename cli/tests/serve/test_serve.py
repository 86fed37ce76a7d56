"""`maxc serve` over real HTTP on loopback, with the `openai` client and raw requests (httpx)."""

import concurrent.futures as cf
import json
import math
import os
import signal
import socket
import threading
import time

import httpx
import numpy as np
import openai
import pytest
from safetensors.numpy import load_file

from conftest import FIXTURES, Server, generate

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at",
    "My favourite fruit is",
    "In 1969, astronauts",
    "The quick brown fox",
]


def ids(choice):
    """The generated token ids of a choice asked with return_tokens_as_token_ids."""
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0)


def test_models_health_version(smol):
    models = client(smol).models.list()
    assert [m.id for m in models.data] == ["smollm2.maxc"]
    raw = httpx.get(smol.v1 + "/models").json()
    assert raw["data"][0]["max_model_len"] == 512
    for path in ["/health", "/v1/health"]:
        r = httpx.get(smol.base + path)
        assert r.status_code == 200 and r.headers["x-request-id"]
    assert httpx.get(smol.base + "/version").json()["version"]
    r = httpx.get(smol.base + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_completion_and_chat_match_generate_streaming_or_not(smol, artifacts):
    c = client(smol)
    want = generate_text(artifacts["smol"], PROMPTS[0], 16)
    r = c.completions.create(model="smollm2.maxc", prompt=PROMPTS[0], max_tokens=16,
                             temperature=0)
    assert r.choices[0].text == want
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 16
    pieces = []
    usage = None
    for chunk in c.completions.create(model="smollm2.maxc", prompt=PROMPTS[0], max_tokens=16,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == want
    assert usage.completion_tokens == 16 and usage.total_tokens == 21
    assert usage.prompt_tokens_details.cached_tokens >= 0

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = c.chat.completions.create(model="smollm2.maxc", messages=msgs, max_tokens=24,
                                     temperature=0)
    assert full.choices[0].message.role == "assistant"
    text = full.choices[0].message.content
    assert "Paris" in text
    streamed, usage = [], None
    for chunk in c.chat.completions.create(model="smollm2.maxc", messages=msgs, max_tokens=24,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            streamed.append(chunk.choices[0].delta.content)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(streamed) == text
    # The second identical chat prompt finds its full pages in the prefix cache.
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def generate_text(artifact, prompt, n):
    import subprocess
    from conftest import MAXC
    r = subprocess.run([MAXC, "generate", artifact, "--prompt", prompt, "--max-new-tokens",
                        str(n), "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])["text"]


def test_stop_strings_are_never_emitted(smol, artifacts):
    c = client(smol)
    free = c.completions.create(model="smollm2.maxc", prompt=PROMPTS[0], max_tokens=24,
                                temperature=0).choices[0].text
    assert "\n" in free, free
    cut = free[:free.index("\n")]
    for stream in [False, True]:
        if stream:
            text = "".join(ch.choices[0].text for ch in c.completions.create(
                model="smollm2.maxc", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                stop=["\n"], stream=True) if ch.choices)
        else:
            r = c.completions.create(model="smollm2.maxc", prompt=PROMPTS[0], max_tokens=24,
                                     temperature=0, stop="\n")
            assert r.choices[0].finish_reason == "stop"
            text = r.choices[0].text
        assert text == cut and "\n" not in text


def test_concurrent_greedy_requests_equal_generate_alone(smol, artifacts):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    lengths = [4 + (i * 5) % 20 for i in range(32)]
    c = client(smol)

    def one(i):
        r = c.completions.create(model="smollm2.maxc", prompt=prompts[i], max_tokens=lengths[i],
                                 temperature=0)
        return r.choices[0].text

    with cf.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(one, range(32)))
    with cf.ThreadPoolExecutor(4) as pool:
        want = list(pool.map(lambda i: generate_text(artifacts["smol"], prompts[i], lengths[i]),
                             range(32)))
    for i in range(32):
        assert got[i] == want[i], (i, prompts[i], got[i], want[i])


@pytest.mark.parametrize("artifact", ["tiny_all", "tiny", "tiny_rows8"])
def test_logprobs_with_echo_score_the_prompt_like_transformers(artifacts, artifact):
    """Every artifact scores prompts: compiled with --all-logits (a whole step's rows), with no
    flag (64 rows a step) and with --max-logit-rows 8 (the prompt in chunks of 8)."""
    s = Server(artifacts[artifact])
    try:
        ref = load_file(os.path.join(FIXTURES, "tiny-llama", "reference.safetensors"))
        tokens = ref["p1.tokens"].tolist()
        logits = ref["p1.logits"].astype(np.float64)
        lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
        want = [float(logits[j, tokens[j + 1]] - lse[j]) for j in range(len(tokens) - 1)]
        r = httpx.post(s.v1 + "/completions", json={
            "prompt": tokens, "max_tokens": 0, "echo": True, "logprobs": 1}, timeout=60)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None
        got = lp["token_logprobs"][1:]
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:])
        # vLLM's prompt_logprobs: the same values, with each token's rank and alternatives.
        r = httpx.post(s.v1 + "/completions", json={
            "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 2}, timeout=60)
        assert r.status_code == 200, r.text
        plp = r.json()["choices"][0]["prompt_logprobs"]
        assert plp[0] is None and len(plp) == len(tokens)
        for j, entry in enumerate(plp[1:]):
            e = entry[str(tokens[j + 1])]
            assert abs(e["logprob"] - want[j]) < 1e-3
            rank = 1 + int((logits[j] > logits[j, tokens[j + 1]]).sum())
            assert e["rank"] == rank
            # The two most likely, the token among them where it is one.
            assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2] or rank > 2
            assert len(entry) == 2 + (rank > 2)
        # Generated tokens' logprobs too, for chat-less completions with echo off.
        # Generated tokens: transformers' greedy continuation, each the top-1 alternative.
        r = httpx.post(s.v1 + "/completions", json={
            "prompt": tokens, "max_tokens": 3, "logprobs": 2, "temperature": 0,
            "return_tokens_as_token_ids": True}, timeout=60)
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert ids(choice) == ref["p1.greedy"].tolist()[:3]
        assert all(v <= 0 for v in lp["token_logprobs"])
        top1 = [max(t.values()) for t in lp["top_logprobs"]]
        assert all(abs(a - b) < 1e-6 for a, b in zip(top1, lp["token_logprobs"]))
    finally:
        s.stop()


def test_chat_logprobs(smol):
    r = client(smol).chat.completions.create(
        model="smollm2.maxc", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert math.isclose(e.top_logprobs[0].logprob, e.logprob, abs_tol=1e-6)


def test_a_small_kv_cache_preempts_and_completes_every_request(artifacts):
    s = Server(artifacts["tiny_small_kv"])
    try:
        prompts = [[(i * 53 + j * 11) % 1000 + 1 for j in range(30 + i)] for i in range(8)]

        def one(p):
            r = httpx.post(s.v1 + "/completions", json={
                "prompt": p, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        with cf.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, prompts))
        assert s.metric("maxserve_cache_preemption_count_total") > 0
        for p, choice in zip(prompts, got):
            want = generate(artifacts["tiny_small_kv"], p, 24)["generated"]
            assert choice["finish_reason"] == "length"
            assert ids(choice) == want
    finally:
        s.stop()


def test_shared_prefix_hits_the_cache_and_gives_the_same_tokens(artifacts):
    prefix = [(j * 37) % 900 + 5 for j in range(40)]
    outs = {}
    for caching in [True, False]:
        s = Server(artifacts["tiny"], *([] if caching else ["--no-prefix-caching"]))
        try:
            texts = []
            for tail in ([7, 8, 9], [11, 12]):
                r = httpx.post(s.v1 + "/completions", json={
                    "prompt": prefix + tail, "max_tokens": 10, "temperature": 0,
                    "logprobs": 0, "return_tokens_as_token_ids": True}, timeout=60).json()
                texts.append(ids(r["choices"][0]))
                last = r
            outs[caching] = texts
            hits = s.metric('maxserve_cache_hits_tokens_total{tier="g0"}')
            if caching:
                assert hits == 32, hits
                assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
            else:
                assert hits == 0
        finally:
            s.stop()
    assert outs[True] == outs[False]


def test_a_disconnected_stream_frees_its_pages(artifacts):
    # Without prefix caching the pages in use go back to zero (with it, to the cached ones).
    s = Server(artifacts["smol"], "--no-prefix-caching")
    try:
        with httpx.stream("POST", s.v1 + "/completions", json={
                "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}, timeout=60) as r:
            seen = 0
            held = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    seen += 1
                if seen >= 3:
                    # Read while the stream is live: leaving the loop closes the connection.
                    held = s.metric("maxserve_cache_num_used_blocks")
                    break
            assert held > 0
        deadline = time.time() + 10
        while time.time() < deadline and s.metric("maxserve_cache_num_used_blocks") != 0:
            time.sleep(0.05)
        assert s.metric("maxserve_cache_num_used_blocks") == 0
        assert s.metric("maxserve_num_requests_running") == 0
        assert s.metric("maxserve_num_output_tokens_total") == 0, "cancelled, not finished"
        # The server goes on serving.
        r = httpx.post(s.v1 + "/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert r.status_code == 200
    finally:
        s.stop()


METRICS = """maxserve_request_time_milliseconds maxserve_input_processing_time_milliseconds
maxserve_output_processing_time_milliseconds maxserve_time_to_first_token_milliseconds
maxserve_time_per_output_token_milliseconds maxserve_itl_milliseconds
maxserve_num_input_tokens_total maxserve_num_output_tokens_total
maxserve_num_input_characters_total maxserve_input_tokens_per_request_tokens
maxserve_output_tokens_per_request_tokens maxserve_request_count_total
maxserve_num_requests_running maxserve_num_requests_queued
maxserve_num_requests_awaiting_admission maxserve_requests_awaiting_admission
maxserve_num_responses_buffered maxserve_responses_buffered
maxserve_response_queue_time_milliseconds maxserve_batch_size
maxserve_batch_execution_time_milliseconds maxserve_batch_creation_time_milliseconds
maxserve_batch_input_tokens maxserve_batch_context_tokens
maxserve_batch_prompt_throughput_tokens_per_second
maxserve_batch_generation_throughput_tokens_per_second maxserve_batch_terminated_reqs
maxserve_batch_pending_reqs maxserve_cache_num_used_blocks maxserve_cache_num_total_blocks
maxserve_cache_request_prefix_coverage_percent maxserve_cache_preemption_count_total
maxserve_cache_hits_tokens_total maxserve_cache_misses_tokens_total
maxserve_cache_used_kv_pct_percent maxserve_cache_device_blocks_served_blocks_total
maxserve_dp_active_token_occupancy_percent maxserve_dp_context_token_occupancy_percent
maxserve_dp_active_tokens_total maxserve_dp_step_capacity_tokens_total
maxserve_model_load_time_milliseconds maxserve_pipeline_load_total
maxserve_spec_decode_acceptance_rate_per_position_percent
maxserve_spec_decode_avg_acceptance_length_tokens maxc_cache_prefix_only_blocks
maxc_cpu_threads maxc_cpu_threads_max""".split()


def test_every_metric_is_served_and_counts_are_exact(artifacts):
    s = Server(artifacts["tiny"])
    try:
        text = httpx.get(s.metrics_url).text
        for name in METRICS:
            assert ("# TYPE " + name) in text or ("# TYPE " + name.removesuffix("_total")) in text, name
        sent = [([1, 2, 3, 4, 5], 7), ([9, 8, 7], 3), (list(range(1, 40)), 11)]
        for prompt, n in sent:
            r = httpx.post(s.v1 + "/completions", json={
                "prompt": prompt, "max_tokens": n, "ignore_eos": True})
            assert r.status_code == 200
        httpx.post(s.v1 + "/completions", json={"prompt": [], "max_tokens": 1})
        m = s.metrics()
        assert m["maxserve_num_input_tokens_total"] == sum(len(p) for p, _ in sent)
        assert m["maxserve_num_output_tokens_total"] == sum(n for _, n in sent)
        assert m['maxserve_request_count_total{code="200",path="/v1/completions"}'] == 3
        assert m['maxserve_request_count_total{code="400",path="/v1/completions"}'] == 1
        assert m["maxserve_input_tokens_per_request_tokens_count"] == 3
        assert m["maxserve_output_tokens_per_request_tokens_sum"] == 21
        assert m["maxserve_time_to_first_token_milliseconds_count"] == 3
        assert m["maxserve_cache_num_total_blocks"] == 64
        assert m["maxserve_pipeline_load_total"] == 1
        assert m['maxserve_cache_misses_tokens_total'] + m['maxserve_cache_hits_tokens_total{tier="g0"}'] == 47
        assert m['maxserve_batch_size_count{batch_type="CE"}'] >= 3
        assert m['maxserve_model_load_time_milliseconds{component="engine"}'] > 0
        # Four generation requests arrived (one refused); none waits or is buffered now.
        assert m["maxserve_requests_awaiting_admission_count"] == 4
        assert m["maxserve_num_requests_awaiting_admission"] == 0
        assert m["maxserve_num_responses_buffered"] == 0
        assert m["maxserve_response_queue_time_milliseconds_count"] >= 3
        assert m["maxserve_num_requests_running"] == 0 and m["maxserve_num_requests_queued"] == 0
        # Idle: the pages in use are exactly those the prefix cache holds (the finished
        # requests' full pages).
        assert m["maxc_cache_prefix_only_blocks"] == m["maxserve_cache_num_used_blocks"] > 0
        # The kernels' width is at most their thread count, which the startup log named.
        assert 1 <= m["maxc_cpu_threads"] <= m["maxc_cpu_threads_max"]
    finally:
        s.stop()


def test_request_count_labels_come_from_a_fixed_set(artifacts):
    """Random paths land in one `other` series: a client cannot grow the metrics."""
    import random
    s = Server(artifacts["tiny"])
    try:
        def series():
            return {k for k in s.metrics() if k.startswith("maxserve_request_count_total")}
        with httpx.Client() as c:
            c.get(s.base + "/warm-up-path")
            c.post(s.base + "/another-one", json={})
            before = series()
            rng = random.Random(7)
            for i in range(2000):
                path = "/" + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789/")
                                     for _ in range(rng.randint(1, 24)))
                r = (c.get if i % 2 else c.post)(s.base + path)
                assert r.status_code in (404, 405), (path, r.status_code)
            after = series()
        assert after == before, sorted(after - before)[:10]
        m = s.metrics()
        others = sum(v for k, v in m.items()
                     if k.startswith("maxserve_request_count_total") and 'path="other"' in k)
        assert others >= 2002, m
        assert all('path="other"' in k or 'path="/' in k for k in after), after
    finally:
        s.stop()


@pytest.mark.parametrize("body,param,status", [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens", 400),
    ({"prompt": "hi", "temperature": 3}, "temperature", 400),
    ({"prompt": [1, 99999999], "max_tokens": 2}, "prompt", 400),
    ({"prompt": "hi", "max_tokens": 100000}, "max_tokens", 400),
    ({"prompt": "", "max_tokens": 2}, "prompt", 400),
    ({"prompt": [], "max_tokens": 2}, "prompt", 400),
    ({"prompt": "hi", "n": 0}, "n", 400),
    ({"prompt": "hi", "best_of": 0}, "best_of", 400),
    ({"prompt": "hi", "best_of": 2, "stream": True}, "best_of", 400),
    ({"prompt": "hi", "top_p": 0}, "top_p", 400),
    ({"prompt": "hi", "model": "gpt-4"}, "model", 404),
    ({"max_tokens": 2}, "prompt", 400),
    ({"prompt": "hi", "max_tokens": 1e30}, "max_tokens", 400),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens", 400),
    ({"prompt": "hi", "temperature": "hot"}, "temperature", 400),
    ({"prompt": "hi", "stream": "yes"}, "stream", 400),
    ({"prompt": {"text": "hi"}}, "prompt", 400),
])
def test_bad_requests_name_the_field_and_the_server_goes_on(smol, body, param, status):
    r = httpx.post(smol.v1 + "/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] and err["code"] == status
    ok = httpx.post(smol.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


def test_bad_chat_requests(smol):
    for body, param in [({"messages": []}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
                         "top_logprobs"),
                        ({"messages": [{"role": "user", "content": "x", "foo": 1}]},
                         "foo")]:
        r = httpx.post(smol.v1 + "/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert param in r.json()["error"]["message"], r.text
    r = httpx.post(smol.v1 + "/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"


def test_body_limit_and_queue_limit(artifacts):
    s = Server(artifacts["tiny"], env={"MAX_SERVE_MAX_REQUEST_BYTES": "200",
                                       "MAX_SERVE_MAX_QUEUE_SIZE": "0"})
    try:
        r = httpx.post(s.v1 + "/completions", json={"prompt": list(range(1, 200))})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413

        def one(_):
            return httpx.post(s.v1 + "/completions", json={
                "prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True}, timeout=60)

        with cf.ThreadPoolExecutor(24) as pool:
            rs = list(pool.map(one, range(24)))
        codes = sorted(r.status_code for r in rs)
        assert codes.count(429) > 0 and codes.count(200) >= 8, codes
        limited = next(r for r in rs if r.status_code == 429)
        assert limited.headers["retry-after"] and limited.json()["error"]["code"] == 429
        assert httpx.post(s.v1 + "/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 200
    finally:
        s.stop()


def test_sigterm_drains_in_flight_requests_then_exits(artifacts):
    s = Server(artifacts["tiny"], env={"MAX_SERVE_GRACEFUL_SHUTDOWN_TIMEOUT_S": "20"})
    result = {}

    def long_request():
        result["r"] = httpx.post(s.v1 + "/completions", json={
            "prompt": [1, 2, 3], "max_tokens": 100, "ignore_eos": True}, timeout=60)

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.3)
    # mpirun passes the signal on to its ranks and exits 1 however they end; rank 0 (the
    # server) drains and says so.
    from conftest import MPIRUN
    assert s.stop(signal.SIGTERM) == (1 if MPIRUN else 0)
    assert any("maxc serve: stopped" in line for line in s.lines), "".join(s.lines)
    t.join()
    assert result["r"].status_code == 200
    assert result["r"].json()["usage"]["completion_tokens"] == 100


def test_a_port_in_use_is_a_clear_error(artifacts):
    import subprocess
    from conftest import MAXC
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    try:
        r = subprocess.run([MAXC, "serve", artifacts["tiny"], "--host", "127.0.0.1",
                            "--port", str(port), "--metrics-port", "0"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode != 0
        assert f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr, r.stderr
    finally:
        sock.close()


def test_an_artifact_that_fails_to_load_is_a_clear_error(artifacts, tmp_path):
    import shutil
    import subprocess
    from conftest import MAXC
    bad = tmp_path / "bad.maxc"
    shutil.copytree(artifacts["tiny"], bad)
    w = bad / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0x40
    w.write_bytes(bytes(data))
    r = subprocess.run([MAXC, "serve", str(bad), "--host", "127.0.0.1", "--port", "0",
                        "--metrics-port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "weights.safetensors" in r.stderr and "sha256" in r.stderr, r.stderr


def test_speculative_serving_gives_the_plain_greedy_tokens(artifacts):
    ref = load_file(os.path.join(FIXTURES, "tiny-roles", "reference.safetensors"))
    prompts = [ref[f"target.p{i}.tokens"].tolist() for i in range(4)]
    reqs = [(i % 4, 6 + (i * 7) % 19) for i in range(16)]
    s = Server(artifacts["roles"], "--speculative")
    try:
        c = client(s)

        def one(r):
            p, n = r
            out = c.completions.create(model="roles.maxc", prompt=prompts[p], max_tokens=n,
                                       temperature=0, logprobs=0,
                                       extra_body={"return_tokens_as_token_ids": True})
            return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]

        alone = [one(r) for r in reqs[:4]]
        with cf.ThreadPoolExecutor(16) as pool:
            together = list(pool.map(one, reqs))
        m = s.metrics()
    finally:
        s.stop()
    want = [generate(artifacts["roles"], prompts[p], n)["generated"] for p, n in reqs]
    assert alone == want[:4]
    for i in range(16):
        assert together[i] == want[i], (i, together[i], want[i])
    # Every step verified the draft's proposals at three positions.
    for pos in range(3):
        key = f'maxserve_spec_decode_acceptance_rate_per_position_percent_count{{position="{pos}"}}'
        assert m.get(key, 0) > 0, key
    assert m.get("maxserve_spec_decode_avg_acceptance_length_tokens_count", 0) > 0


def test_slow_clients_cannot_hold_the_server(artifacts):
    # Two connections at most; a client gets 1 s for its headers and 1 s for its body.
    s = Server(artifacts["tiny"], "--max-connections", "2", "--header-read-timeout-s", "1",
               "--body-read-timeout-s", "1")
    port = int(s.base.rsplit(":", 1)[1])
    try:
        def connect():
            c = socket.create_connection(("127.0.0.1", port))
            c.settimeout(10)
            return c

        # Headers that never finish: the connection is closed after the timeout.
        c = connect()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t = time.time()
        assert c.recv(1000) == b""
        assert 0.8 < time.time() - t < 5
        # A body that never finishes: 408 in OpenAI's envelope.
        c = connect()
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\"")
        t = time.time()
        reply = c.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        body = json.loads(reply.split("\r\n\r\n", 1)[1])
        assert body["error"]["code"] == 408 and "did not arrive" in body["error"]["message"]
        assert 0.8 < time.time() - t < 5
        # Two idle connections fill the server: a third client waits until the header timeout
        # frees a slot, then is served.
        held = [connect(), connect()]
        time.sleep(0.2)
        t = time.time()
        r = httpx.get(s.base + "/health", timeout=10)
        assert r.status_code == 200
        assert 0.5 < time.time() - t < 5
        for h in held:
            assert h.recv(10) == b""
        # And the server goes on as before.
        r = httpx.post(s.v1 + "/completions", json={"prompt": [1, 2, 3], "max_tokens": 4,
                                                    "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        s.stop()
