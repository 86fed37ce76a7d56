"""The application API around generation: logit_bias, /tokenize and /detokenize."""

import json

import httpx
import openai
import pytest

from test_serve import PROMPTS, client, ids

TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  leading spaces and\ttabs\nand newlines\n\n",
    "Unicode: café, naïve, 東京, emoji 🙂",
    "def f(x):\n    return x ** 2",
]


def greedy_first(s, prompt, **extra):
    r = httpx.post(s.v1 + "/completions", json={
        "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 0,
        "return_tokens_as_token_ids": True, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return ids(r.json()["choices"][0])[0]


def test_logit_bias_bans_the_greedy_token_and_forces_another(smol):
    for prompt in PROMPTS[:4]:
        t = greedy_first(smol, prompt)
        banned = greedy_first(smol, prompt, logit_bias={str(t): -100})
        assert banned != t, prompt
        forced = 1234 if t != 1234 else 4321
        assert greedy_first(smol, prompt, logit_bias={str(forced): 100}) == forced
    # Sampling honours it too, and so does chat, through the openai client.
    c = client(smol)
    r = c.chat.completions.create(
        model="smollm2.maxc", messages=[{"role": "user", "content": "Say something."}],
        max_tokens=3, temperature=1.0, seed=7, logit_bias={"1234": 100})
    assert r.choices[0].message.content == smol_text(smol, [1234, 1234, 1234])


def smol_text(s, tokens):
    r = httpx.post(s.base + "/detokenize", json={"tokens": tokens})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.mark.parametrize("bias,why", [
    ({"1": 101}, "[-100, 100]"),
    ({"1": -100.5}, "[-100, 100]"),
    ({"99999999": 1}, "vocabulary"),
    ({"x": 1}, "vocabulary"),
    ({"-3": 1}, "vocabulary"),
])
def test_bad_logit_bias_names_the_field(smol, bias, why):
    r = httpx.post(smol.v1 + "/completions",
                   json={"prompt": "hi", "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and why in err["message"], err
    assert httpx.post(smol.v1 + "/completions",
                      json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_tokenize_and_detokenize_round_trip(smol):
    for text in TEXTS:
        r = httpx.post(smol.base + "/tokenize",
                       json={"prompt": text, "add_special_tokens": False,
                             "return_token_strs": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 0
        assert body["max_model_len"] == 512
        assert smol_text(smol, body["tokens"]) == text
    # The ids a completion sees: usage counts the same prompt tokens.
    r = httpx.post(smol.base + "/tokenize", json={"prompt": PROMPTS[0]}).json()
    c = httpx.post(smol.v1 + "/completions",
                   json={"prompt": PROMPTS[0], "max_tokens": 1}).json()
    assert c["usage"]["prompt_tokens"] == r["count"]
    # A conversation: the chat template's rendering, as chat completions count it.
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2 + 2?"}]
    r = httpx.post(smol.base + "/tokenize", json={"messages": messages}).json()
    chat = client(smol).chat.completions.create(model="smollm2.maxc", messages=messages,
                                                max_tokens=1)
    assert chat.usage.prompt_tokens == r["count"]
    assert "What is 2 + 2?" in smol_text(smol, r["tokens"])


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
    ("/tokenize", {"prompt": "a", "foo": 1}, "body"),
    ("/detokenize", {"tokens": [1, -2]}, "tokens"),
    ("/detokenize", {"tokens": [99999999]}, "tokens"),
    ("/detokenize", {}, "body"),
])
def test_bad_tokenize_requests(smol, path, body, param):
    r = httpx.post(smol.base + path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


WORDS = ("river stone garden music winter bread lantern forest morning silver window "
         "harbor paper thunder orange village candle mountain letter summer").split()
# A 400-token prompt that does not repeat itself (a repeated one makes every sample the same).
LONG = " ".join(WORDS[(i * 7 + i * i) % len(WORDS)] for i in range(400)) + ". Then"


def test_n_choices_share_the_prompt_and_fork(artifacts, smol):
    """n = 4 on a 400-token prompt: one prefill, the choices start from its pages (without a
    prefix cache), greedy choices are identical, sampled ones differ, the prompt counts once."""
    from conftest import Server
    tok = httpx.post(smol.base + "/tokenize", json={"prompt": LONG}).json()
    assert 380 <= tok["count"] <= 450, tok["count"]
    s = Server(artifacts["smol"], "--no-prefix-caching")
    try:
        # Greedy: four identical choices, usage counting the prompt once.
        r = httpx.post(s.v1 + "/completions", json={
            "prompt": LONG, "max_tokens": 12, "temperature": 0, "n": 4}, timeout=300).json()
        assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
        assert len({c["text"] for c in r["choices"]}) == 1, r
        assert r["usage"]["prompt_tokens"] == tok["count"]
        assert r["usage"]["completion_tokens"] == 4 * 12
        # Sampled and streamed: while the four choices run, the cache holds one prompt's pages
        # (16 tokens each) plus four tails, far below four prompts.
        body = {"prompt": LONG, "max_tokens": 48, "temperature": 1.0, "seed": 11, "n": 4,
                "stream": True, "ignore_eos": True}
        texts, used = ["", "", "", ""], []
        with httpx.stream("POST", s.v1 + "/completions", json=body, timeout=300) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for c in json.loads(line[6:])["choices"]:
                    texts[c["index"]] += c["text"]
                used.append(s.metric("maxserve_cache_num_used_blocks"))
        prompt_pages = tok["count"] // 16
        print(f"n=4 over a {tok['count']}-token prompt: at most {max(used):.0f} pages in use "
              f"({prompt_pages} full prompt pages)")
        assert max(used) <= prompt_pages + 4 * 5, (prompt_pages, max(used))
        assert max(used) > prompt_pages, used
        assert len(set(texts)) > 1, texts
        # The same seed gives the same four choices.
        again = httpx.post(s.v1 + "/completions", json={**body, "stream": False},
                           timeout=300).json()
        assert [c["text"] for c in again["choices"]] == texts
    finally:
        s.stop()
    # Chat, through the openai client.
    r = client(smol).chat.completions.create(
        model="smollm2.maxc", messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=8, temperature=1.0, seed=3, n=3)
    assert len(r.choices) == 3 and [c.index for c in r.choices] == [0, 1, 2]


@pytest.mark.parametrize("n,why", [(0, "at least 1"), (1000, "sequences a step")])
def test_bad_n_names_the_field(smol, n, why):
    r = httpx.post(smol.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2, "n": n})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and why in err["message"], err


def test_best_of_keeps_the_most_likely_candidates(smol):
    """best_of 4, n 2: the two of the four candidates (the same seeds as n 4's choices) whose
    tokens have the highest mean log-probability; usage counts every candidate's tokens."""
    body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "seed": 5}
    four = httpx.post(smol.v1 + "/completions", json={**body, "n": 4, "logprobs": 0},
                      timeout=120).json()
    mean = [sum(c["logprobs"]["token_logprobs"]) / len(c["logprobs"]["token_logprobs"])
            for c in four["choices"]]
    texts = [c["text"] for c in four["choices"]]
    assert len(set(texts)) > 1, texts
    want = [texts[i] for i in sorted(range(4), key=lambda i: -mean[i])[:2]]
    best = httpx.post(smol.v1 + "/completions", json={**body, "n": 2, "best_of": 4},
                      timeout=120).json()
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert [c["text"] for c in best["choices"]] == want
    assert all(c["logprobs"] is None for c in best["choices"])
    assert best["usage"]["completion_tokens"] == four["usage"]["completion_tokens"]


@pytest.mark.parametrize("body,why", [
    ({"n": 3, "best_of": 2}, "below `n`"),
    ({"best_of": 2, "stream": True}, "cannot be streamed"),
    ({"best_of": 0}, "at least 1"),
])
def test_bad_best_of_names_the_field(smol, body, why):
    r = httpx.post(smol.v1 + "/completions", json={"prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "best_of" and why in err["message"], err


def bf16_tensor(path, name):
    """A bf16 tensor of a safetensors file as float32 (numpy has no bf16)."""
    import numpy as np
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        meta = header[name]
        assert meta["dtype"] == "BF16", meta
        start, end = meta["data_offsets"]
        f.seek(8 + n + start)
        raw = np.frombuffer(f.read(end - start), dtype=np.uint16)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(meta["shape"])


def test_embeddings_are_the_final_hidden_states_transformers_computes(artifacts):
    """tiny-llama: transformers' final hidden state, recovered from its logits (logits = h W^T,
    W the 1024 × 256 untied head: least squares gives h exactly), pooled and normalized."""
    import base64
    import os

    import numpy as np
    from safetensors.numpy import load_file

    from conftest import FIXTURES, Server
    fixture = os.path.join(FIXTURES, "tiny-llama")
    ref = load_file(os.path.join(fixture, "reference.safetensors"))
    w = bf16_tensor(os.path.join(fixture, "model.safetensors"), "lm_head.weight")
    prompts = [ref[f"p{i}.tokens"].tolist() for i in range(4)]

    def unit(v):
        return v / np.linalg.norm(v)

    want_last = [unit(np.linalg.lstsq(w, ref[f"p{i}.last"], rcond=None)[0]) for i in range(4)]
    want_mean = [unit(np.linalg.lstsq(w, ref[f"p{i}.logits"].T, rcond=None)[0].mean(axis=1))
                 for i in range(4)]
    s = Server(artifacts["tiny"])
    try:
        for pooling, want in [("last", want_last), ("mean", want_mean)]:
            r = httpx.post(s.v1 + "/embeddings",
                           json={"input": prompts, "pooling": pooling}, timeout=120)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
            for d, w_ in zip(body["data"], want):
                got = np.array(d["embedding"], dtype=np.float64)
                cos = float(got @ w_)
                print(f"{pooling} pooling, prompt {d['index']}: cosine {cos:.8f}, "
                      f"max |diff| {np.abs(got - w_).max():.2e}")
                assert cos > 0.99999 and np.abs(got - w_).max() < 1e-4, (pooling, d["index"], cos)
        # base64 holds the same little-endian floats.
        f = httpx.post(s.v1 + "/embeddings", json={"input": prompts[2]}).json()
        b = httpx.post(s.v1 + "/embeddings",
                       json={"input": prompts[2], "encoding_format": "base64"}).json()
        raw = np.frombuffer(base64.b64decode(b["data"][0]["embedding"]), dtype="<f4")
        assert np.array_equal(raw, np.array(f["data"][0]["embedding"], dtype=np.float32))
        for body, param in [({"input": []}, "input"), ({"input": [[]]}, "input"),
                            ({"input": [5], "encoding_format": "hex"}, "encoding_format"),
                            ({"input": [99999]}, "input"), ({}, "input")]:
            r = httpx.post(s.v1 + "/embeddings", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    finally:
        s.stop()
