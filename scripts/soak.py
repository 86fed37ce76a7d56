#!/usr/bin/env python3
"""Soak driver for `maxc serve` (run by scripts/soak.sh): CLIENTS concurrent clients send mixed
completions for MINUTES (streamed and not, greedy and sampled, some sharing a prompt prefix,
random lengths), and drop some streams midway on purpose. Samples the server's resident memory
and KV pages in use; at the end checks that no request failed (the dropped ones aside), that
resident memory stayed flat after warm-up (at most GROWTH above its value when warm-up ended,
and the number is printed), and that once idle the KV pages in use are exactly those the
prefix cache holds alone. Prints a JSON summary; exits 1 if a check fails. Needs aiohttp."""
import argparse
import asyncio
import json
import random
import time

import aiohttp


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


async def metrics(session, url):
    out = {}
    async with session.get(url) as r:
        for line in (await r.text()).splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                out[k] = float(v)
    return out


PREFIX = [(i * 37) % 997 + 3 for i in range(64)]


def request_body(rng, model):
    n = rng.randint(1, 150)
    prompt = [rng.randint(3, 1000) for _ in range(n)]
    if rng.random() < 0.3:
        prompt = PREFIX + prompt[: rng.randint(1, 40)]
    body = {"model": model, "prompt": prompt, "max_tokens": rng.randint(1, 64),
            "ignore_eos": rng.random() < 0.5}
    if rng.random() < 0.4:
        body.update(temperature=0.8, top_p=0.95, seed=rng.randint(0, 1 << 30))
    else:
        body["temperature"] = 0
    return body


async def client(i, a, session, deadline, stats):
    rng = random.Random(a.seed * 1000 + i)
    while time.monotonic() < deadline:
        body = request_body(rng, a.model)
        stream = rng.random() < 0.7
        drop_after = rng.randint(1, 8) if stream and rng.random() < a.drop else None
        body["stream"] = stream
        stats["sent"] += 1
        try:
            async with session.post(a.url + "/v1/completions", json=body) as r:
                if r.status != 200:
                    stats["failed"] += 1
                    stats["errors"].append(f"HTTP {r.status}: {(await r.text())[:120]}")
                    continue
                if not stream:
                    j = await r.json()
                    if j["usage"]["completion_tokens"] < 1:
                        raise RuntimeError(f"no tokens: {j}")
                    stats["ok"] += 1
                    continue
                chunks, done = 0, False
                async for raw in r.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    msg = json.loads(data)
                    if "error" in msg:
                        raise RuntimeError(f"stream error: {msg['error']}")
                    chunks += 1
                    if drop_after is not None and chunks >= drop_after:
                        break
                if drop_after is not None and not done:
                    stats["dropped"] += 1
                    r.close()
                elif done:
                    stats["ok"] += 1
                else:
                    raise RuntimeError("stream ended without [DONE]")
        except Exception as e:  # noqa: BLE001 - every failure is counted and shown
            stats["failed"] += 1
            stats["errors"].append(repr(e)[:160])


async def sampler(a, session, deadline, samples):
    start = time.monotonic()
    while time.monotonic() < deadline:
        m = await metrics(session, a.metrics)
        samples.append({"t": round(time.monotonic() - start, 1), "rss_mib": rss_mib(a.pid),
                        "kv_used": m.get("maxserve_cache_num_used_blocks"),
                        "running": m.get("maxserve_num_requests_running")})
        await asyncio.sleep(a.sample_s)


async def main(a):
    stats = {"sent": 0, "ok": 0, "dropped": 0, "failed": 0, "errors": []}
    samples = []
    deadline = time.monotonic() + a.minutes * 60
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(sampler(a, session, deadline, samples),
                             *(client(i, a, session, deadline, stats) for i in range(a.clients)))
        # Idle: every request done (dropped streams are cancelled at the next step).
        for _ in range(100):
            m = await metrics(session, a.metrics)
            if m.get("maxserve_num_requests_running") == 0 and \
                    m.get("maxserve_num_requests_queued") == 0:
                break
            await asyncio.sleep(0.1)
    warmup = a.warmup_s if a.warmup_s is not None else min(60.0, a.minutes * 12)
    warm = [s for s in samples if s["t"] >= warmup]
    base = warm[0]["rss_mib"] if warm else None
    peak = max((s["rss_mib"] for s in warm), default=None)
    used = m.get("maxserve_cache_num_used_blocks")
    prefix_only = m.get("maxc_cache_prefix_only_blocks")
    checks = {
        "no_failed_request": stats["failed"] == 0,
        "rss_flat_after_warmup": base is not None and peak <= base * (1 + a.growth) + 8,
        "kv_back_to_prefix_cache_only": used == prefix_only and m.get(
            "maxserve_num_requests_running") == 0,
    }
    summary = {
        "minutes": a.minutes, "clients": a.clients,
        "requests": stats["sent"], "ok": stats["ok"], "dropped_on_purpose": stats["dropped"],
        "failed": stats["failed"], "errors": stats["errors"][:10],
        "warmup_s": warmup, "rss_mib_at_warmup_end": base, "rss_mib_peak_after_warmup": peak,
        "rss_bound_mib": None if base is None else round(base * (1 + a.growth) + 8, 1),
        "kv_blocks_in_use_at_end": used, "kv_blocks_prefix_cache_only": prefix_only,
        "kv_blocks_total": m.get("maxserve_cache_num_total_blocks"),
        "preemptions": m.get("maxserve_cache_preemption_count_total"),
        "checks": checks, "samples": samples,
    }
    print(json.dumps(summary))
    return all(checks.values())


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--drop", type=float, default=0.1, help="share of streams dropped midway")
    ap.add_argument("--warmup-s", type=float, default=None,
                    help="warm-up [default: a fifth of the run, at most 60 s]")
    ap.add_argument("--growth", type=float, default=0.05, help="allowed RSS growth after warm-up")
    ap.add_argument("--sample-s", type=float, default=5)
    ap.add_argument("--seed", type=int, default=1)
    raise SystemExit(0 if asyncio.run(main(ap.parse_args())) else 1)
