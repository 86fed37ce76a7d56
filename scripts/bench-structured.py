"""Tokens/s of 8 concurrent requests with a JSON Schema against the same requests unconstrained,
on a running `maxc serve` (scripts/bench-structured.sh starts one); interleaved rounds, medians
and their ratio."""

import concurrent.futures as cf
import json
import statistics
import sys
import time
import urllib.request

BASE = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
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
for _ in range(ROUNDS):
    free.append(run(False))
    constrained.append(run(True))
f, c = statistics.median(free), statistics.median(constrained)
print(f"{N} concurrent requests of up to {MAX} tokens, {ROUNDS} interleaved rounds")
print(f"unconstrained  tokens/s {[round(x, 1) for x in free]} median {f:.1f}")
print(f"json_schema    tokens/s {[round(x, 1) for x in constrained]} median {c:.1f}")
print(f"tokens per round: unconstrained {counts[False]}, json_schema {counts[True]}")
print(f"ratio json_schema / unconstrained: {c / f:.3f}")
