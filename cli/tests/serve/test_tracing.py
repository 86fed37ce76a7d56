"""Traces of `maxc serve` over real HTTP: the config file, `max.batch` spans linked to the
requests of each pass, a kernel capture armed by a request header, OTLP export to a collector
on loopback (OTLP/JSON over HTTP)."""

import concurrent.futures as cf
import http.server
import json
import subprocess
import threading
import time

import httpx
import pytest

from conftest import MAXC, Server


def read_spans(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def wait_for(pred, what, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError("timed out waiting for " + what)


@pytest.mark.parametrize("text,names", [
    ("prot: 8000\n", ["prot", "line 1"]),
    ("profiling:\n  kernel_trace_max_pases: 3\n", ["profiling.kernel_trace_max_pases", "line 2"]),
    ("profiling:\n  kernel_trace_max_passes: -1\n", ["profiling.kernel_trace_max_passes", "-1"]),
    ("profiling:\n  kernel_trace_max_spans: lots\n", ["profiling.kernel_trace_max_spans", "lots"]),
    ("profiling:\n  gpu_profiling: loud\n", ["profiling.gpu_profiling", "loud"]),
    ("max_queue_size: -3\n", ["max_queue_size", "-3"]),
    ("kernel_trace_level: everything\n", ["kernel_trace_level", "everything"]),
])
def test_a_bad_config_file_stops_serve_naming_the_key_and_the_file(artifacts, tmp_path, text, names):
    f = tmp_path / "serve.yaml"
    f.write_text(text)
    r = subprocess.run([MAXC, "serve", artifacts["tiny"], "--config-file", str(f), "--port", "0",
                        "--metrics-port", "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "serve.yaml" in r.stderr, r.stderr
    for n in names:
        assert n in r.stderr, r.stderr


def test_the_config_file_sets_what_flags_do_not(artifacts, tmp_path):
    f = tmp_path / "serve.yaml"
    f.write_text("prod:\n  served_model_name: from-file\n  max_queue_size: 3\n"
                 "dev:\n  served_model_name: dev\n")
    s = Server(artifacts["tiny"], "--config-file", str(f), "--section-name", "prod")
    try:
        assert [m["id"] for m in httpx.get(s.v1 + "/models").json()["data"]] == ["from-file"]
    finally:
        s.stop()
    s = Server(artifacts["tiny"], "--config-file", str(f), "--section-name", "prod",
               "--served-model-name", "from-flag")
    try:
        assert [m["id"] for m in httpx.get(s.v1 + "/models").json()["data"]] == ["from-flag"]
    finally:
        s.stop()


def test_batch_level_spans_link_exactly_the_requests_of_each_pass(artifacts, tmp_path):
    trace = tmp_path / "spans.jsonl"
    s = Server(artifacts["tiny"], "--trace-file", str(trace),
               env={"MAX_SERVE_KERNEL_TRACE_LEVEL": "batch"})
    n, max_tokens = 6, 5
    try:
        def one(i):
            r = httpx.post(s.v1 + "/completions", headers={"x-request-id": f"req-{i}"}, json={
                "prompt": [1 + i, 2, 3, 4 + i], "max_tokens": max_tokens, "ignore_eos": True},
                timeout=60)
            assert r.status_code == 200, r.text
        with cf.ThreadPoolExecutor(n) as pool:
            list(pool.map(one, range(n)))
    finally:
        assert s.stop() == 0
    spans = read_spans(trace)
    requests = {sp["attributes"]["max.request_id"]: sp for sp in spans
                if sp["name"] == "max.request" and sp["attributes"]["url.path"] == "/v1/completions"}
    assert sorted(requests) == [f"req-{i}" for i in range(n)]
    by_span = {sp["span_id"]: rid for rid, sp in requests.items()}
    batches = [sp for sp in spans if sp["name"] == "max.batch"]
    passes_of = {rid: 0 for rid in requests}
    for b in batches:
        linked = [by_span[link["span_id"]] for link in b["links"]]
        assert len(linked) == len(set(linked))
        assert len(linked) == b["attributes"]["max.batch.size"], b
        for rid in linked:
            passes_of[rid] += 1
            r = requests[rid]
            # The pass ran within the request's lifetime.
            assert r["start_unix_nano"] <= b["start_unix_nano"] <= r["end_unix_nano"]
    # Each request ran its prefill (giving the first token) and max_tokens - 1 decode steps.
    assert passes_of == {rid: max_tokens for rid in requests}


class Collector(http.server.BaseHTTPRequestHandler):
    """An OTLP/HTTP JSON collector: keeps every span posted to /v1/traces."""
    spans = []

    def do_POST(self):
        body = self.rfile.read(int(self.headers["content-length"]))
        ok = self.path == "/v1/traces" and "json" in self.headers.get("content-type", "")
        if ok:
            for rs in json.loads(body)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    Collector.spans.extend(ss["spans"])
        self.send_response(200 if ok else 400)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_a_kernel_header_captures_the_request_and_otlp_receives_its_trace(artifacts, tmp_path):
    Collector.spans = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("profiling:\n  kernel_trace_max_passes: 2\n  kernel_trace_max_spans: 40\n")
    s = Server(artifacts["tiny"], "--config-file", str(cfg),
               "--kernel-trace-dir", str(tmp_path / "captures"),
               env={"MAX_SERVE_KERNEL_TRACE_HEADERS": "1",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{srv.server_port}",
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    try:
        # Untraced (level none, no header): no spans at all.
        r = httpx.post(s.v1 + "/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert r.status_code == 200
        r = httpx.post(s.v1 + "/completions", json={
            "prompt": [1, 2, 3], "max_tokens": 6, "ignore_eos": True},
            headers={"x-max-trace-level": "kernel",
                     "traceparent": f"00-{trace_id}-{parent}-01"})
        assert r.status_code == 200

        def mine():
            spans = [sp for sp in Collector.spans if sp["traceId"] == trace_id]
            return spans if any(sp["name"] == "max.request" for sp in spans) and any(
                sp["name"] == "max.pass" for sp in spans) else None
        spans = wait_for(mine, "the traced request's spans over OTLP")
    finally:
        s.stop()
        srv.shutdown()
    request = [sp for sp in spans if sp["name"] == "max.request"]
    assert len(request) == 1 and request[0]["parentSpanId"] == parent
    passes = [sp for sp in spans if sp["name"] == "max.pass"]
    assert len(passes) == 2, "the capture stops at kernel_trace_max_passes"
    assert all(p["parentSpanId"] == request[0]["spanId"] for p in passes)
    kernels = [sp for sp in spans if sp["name"] not in ("max.request", "max.pass")]
    assert kernels and len(passes) + len(kernels) <= 40
    pass_ids = {p["spanId"] for p in passes}
    assert all(k["parentSpanId"] in pass_ids for k in kernels)
    # Its six passes each got a max.batch span (their own traces), linked to it.
    batches = [sp for sp in Collector.spans if sp["name"] == "max.batch"]
    assert len(batches) == 6
    for b in batches:
        assert [(link["traceId"], link["spanId"]) for link in b["links"]] == [
            (trace_id, request[0]["spanId"])]
    # The capture file was replayed and removed.
    assert list((tmp_path / "captures").iterdir()) == []
