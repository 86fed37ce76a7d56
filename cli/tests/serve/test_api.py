"""The application API around generation: logit_bias, /tokenize and /detokenize."""

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
