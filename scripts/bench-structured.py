"""Tokens/s of 8 concurrent requests with a JSON Schema against the same requests unconstrained,
on a running `maxc serve` (scripts/bench-structured.sh starts one); interleaved rounds, medians
and their ratio; with the server's metrics URL, the structured outputs' per-step mask time, the
part of it the steps waited for after their forward pass, and the forward pass's time."""

import concurrent.futures as cf
import json
import statistics
import sys
import time
import urllib.request

BASE = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
METRICS = sys.argv[3] if len(sys.argv) > 3 else None


def scrape():
    """Sums and counts of the mask and batch-execution histograms (milliseconds)."""
    out = {}
    text = urllib.request.urlopen(METRICS, timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        for key in ("maxc_structured_output_mask_time_milliseconds",
                    "maxc_structured_output_mask_exposed_time_milliseconds",
                    "maxserve_batch_execution_time_milliseconds"):
            for part in ("_sum", "_count"):
                if name.startswith(key + part):
                    out[key + part] = out.get(key + part, 0.0) + float(value)
    return out
N, MAX = 8, 96
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"word": {"type": "string", "maxLength": 12},
                                     "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["word", "n"]}, "minItems": 40}}, "required": ["items"]}


def one(i, constrained):
    body = {"prompt": f"List {i}: words and numbers as JSON.", "max_tokens": MAX,
            "temperature": 1.0, "seed": i, "ignore_eos": True}
    if constrained:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "b", "schema": SCHEMA}}
    req = urllib.request.Request(BASE + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))["usage"]["completion_tokens"]


counts = {False: [], True: []}


def run(constrained):
    t = time.perf_counter()
    with cf.ThreadPoolExecutor(N) as pool:
        tokens = sum(pool.map(lambda i: one(i, constrained), range(N)))
    counts[constrained].append(tokens)
    return tokens / (time.perf_counter() - t)


one(0, True)  # builds the token trie once
free, constrained = [], []
masked = {}
for _ in range(ROUNDS):
    free.append(run(False))
    before = scrape() if METRICS else {}
    constrained.append(run(True))
    if METRICS:
        for k, v in scrape().items():
            masked[k] = masked.get(k, 0.0) + v - before.get(k, 0.0)
f, c = statistics.median(free), statistics.median(constrained)
print(f"{N} concurrent requests of up to {MAX} tokens, {ROUNDS} interleaved rounds")
print(f"unconstrained  tokens/s {[round(x, 1) for x in free]} median {f:.1f}")
print(f"json_schema    tokens/s {[round(x, 1) for x in constrained]} median {c:.1f}")
print(f"tokens per round: unconstrained {counts[False]}, json_schema {counts[True]}")
print(f"ratio json_schema / unconstrained: {c / f:.3f}")
if masked:
    m = "maxc_structured_output_mask_time_milliseconds"
    e = "maxc_structured_output_mask_exposed_time_milliseconds"
    b = "maxserve_batch_execution_time_milliseconds"
    steps = masked[m + "_count"]
    mask, exposed = masked[m + "_sum"], masked[e + "_sum"]
    print(f"json_schema steps {steps:.0f}: mask {mask / steps:.3f} ms/step, forward pass and "
          f"masks {masked[b + '_sum'] / masked[b + '_count']:.2f} ms/step, waited for masks "
          f"{exposed / steps:.3f} ms/step: the overlap hid {100 * (1 - exposed / mask):.1f}% of "
          f"the mask time")
