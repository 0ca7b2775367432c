"""The official `openai` Python client against a running `graft serve`.

Usage: openai_client.py BASE_URL MODEL_ID

Each comparison of two answers sends the request once before: the prefix cache then
holds the prompt for both, so both compute the same way (a quantized model's CPU dot
products round differently for prompts cut into different chunks).

Non-streamed and streamed chat and text completions (equal texts and usage), usage
counts against /tokenize, stop strings, seeds, log-probabilities, and the client's
error classes for a 400 and a 404. Prints one line per check and a closing
"N passed, N failed" line; exits 1 when a check failed.
"""

import json
import sys
import urllib.request

import openai

BASE, MODEL = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=BASE + "/v1", api_key="unused", max_retries=0, timeout=300)
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
CHAT = [{"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Name a colour and a fruit."}]
passed, failed = 0, 0


def check(name):
    def run(fn):
        global passed, failed
        try:
            fn()
            passed += 1
            print(f"ok: {name}")
        except Exception as e:  # noqa: BLE001 - every failure is reported the same way
            failed += 1
            print(f"FAILED: {name}: {type(e).__name__}: {e}")
        return fn
    return run


def tokenize(text):
    req = urllib.request.Request(BASE + "/tokenize", method="POST",
                                 data=json.dumps({"content": text, "add_special": True}).encode())
    with urllib.request.urlopen(req) as r:
        return json.load(r)["tokens"]


def stream_chat(**kw):
    chunks = list(client.chat.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert all(c.usage is None for c in chunks[:-1]), "usage only on the last chunk"
    return text, finish, usage


def stream_completion(**kw):
    chunks = list(client.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, finish, chunks[-1].usage


@check("models.list names the served model")
def _():
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL], ids


@check("chat: whole and streamed answers and usage are equal")
def _():
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, **GREEDY)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, **GREEDY)
    c = r.choices[0]
    assert r.object == "chat.completion" and c.message.role == "assistant"
    assert c.finish_reason == "length", c.finish_reason
    u = r.usage
    assert u.completion_tokens == 16 and u.total_tokens == u.prompt_tokens + 16, u
    text, finish, usage = stream_chat(messages=CHAT, max_tokens=16, **GREEDY)
    assert text == c.message.content, (text, c.message.content)
    assert finish == ["length"], finish
    assert (usage.prompt_tokens, usage.completion_tokens) == (u.prompt_tokens, 16), usage


@check("completions: whole and streamed answers equal, usage against /tokenize")
def _():
    prompt = "The lighthouse keeper"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(tokenize(prompt)), r.usage
    assert r.usage.completion_tokens == 12
    text, finish, usage = stream_completion(prompt=prompt, max_tokens=12, **GREEDY)
    assert text == r.choices[0].text, (text, r.choices[0].text)
    assert finish == ["length"] and usage.completion_tokens == 12


@check("stop strings end the text and are never emitted")
def _():
    prompt = "Once upon a time"
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, **GREEDY)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, **GREEDY).choices[0].text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 1) if full[i:i + 2].strip() == full[i:i + 2])
    expected = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, stop=[stop], **GREEDY)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop", (r.choices[0].text, expected, stop)
    text, finish, _ = stream_completion(prompt=prompt, max_tokens=32, stop=[stop], **GREEDY)
    assert text == expected and finish == ["stop"], (text, expected)


@check("the same seed gives the same text")
def _():
    ask = lambda seed: client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0, seed=seed).choices[0].message.content
    ask(1234)
    first = ask(1234)
    assert ask(1234) == first
    assert any(ask(s) != first for s in range(1, 5)), "other seeds give other texts"


@check("log-probabilities: chat top_logprobs and completions logprobs")
def _():
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, logprobs=True,
                                       top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for t in content:
        assert len(t.top_logprobs) == 2 and t.logprob <= 0
        assert abs(t.logprob - t.top_logprobs[0].logprob) < 1e-5, "greedy picks the most likely"
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5


@check("errors: 400 and 404 as the client's exceptions")
def _():
    try:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=5)
        raise AssertionError("temperature 5 was accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["param"] == "temperature", e.body
    try:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
        raise AssertionError("an unknown model was accepted")
    except openai.NotFoundError as e:
        assert e.body["code"] == "model_not_found", e.body


print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
