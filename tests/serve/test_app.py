"""The OpenAI-compatible server on a FakeBatchEngine, over real loopback HTTP (uvicorn in a thread)."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")


def client(srv: Any, api_key: str = "none") -> Any:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=api_key, max_retries=0, timeout=30)


def metric(srv: Any, name: str, labels: str = "") -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def wait_for(cond: Any, timeout: float = 30.0) -> bool:  # generous: CI machines are loaded
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def stream_text(c: Any, prompt: str, max_tokens: int = 16) -> str:
    out = c.completions.create(model="fake-model", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(ch.choices[0].text for ch in out)


# -- happy paths -------------------------------------------------------------------------------------


def test_models_health_and_completion(serve: Any) -> None:
    srv = serve()
    c = client(srv)
    assert [m.id for m in c.models.list().data] == ["fake-model"]
    assert httpx.get(f"{srv.url}/health").json() == {"status": "ok"}
    r = c.completions.create(model="fake-model", prompt="Hello", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert len(r.choices[0].text) > 0
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8  # BOS + "He"+"l"+"l"+"o" merges: 4
    again = c.completions.create(model="fake-model", prompt="Hello", max_tokens=8, temperature=0)
    assert again.choices[0].text == r.choices[0].text


def test_streaming_completion_equals_non_streaming(serve: Any) -> None:
    srv = serve()
    c = client(srv)
    full = c.completions.create(model="fake-model", prompt="The sky", max_tokens=20, temperature=0)
    chunks = list(
        c.completions.create(
            model="fake-model",
            prompt="The sky",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_chat_uses_manifest_template_and_streams(serve: Any) -> None:
    srv = serve()
    c = client(srv)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = c.chat.completions.create(model="fake-model", messages=msgs, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    # The same prompt as a completion: the manifest's template rendered by runtime/chat.py
    prompt = "<system>Be brief.\n<user>Hi\n<assistant>"
    same = c.completions.create(model="fake-model", prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == same.choices[0].text
    assert r.usage.prompt_tokens == same.usage.prompt_tokens
    chunks = list(
        c.chat.completions.create(model="fake-model", messages=msgs, max_tokens=12, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing(serve: Any) -> None:
    srv = serve()
    body = {"prompt": "Hi", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for e in events[:-2]:
        assert e.startswith("data: ") and json.loads(e[6:])["object"] == "text_completion"


def test_sampling_params_n_stop_seed_and_logprobs(serve: Any) -> None:
    srv = serve(engine_kw={"eos_after": 6})
    c = client(srv)
    r = c.completions.create(model="fake-model", prompt="Hi", max_tokens=30, temperature=0)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 7  # EOS after 6 tokens
    text = r.choices[0].text
    r2 = c.completions.create(model="fake-model", prompt="Hi", max_tokens=30, temperature=0, stop=[text[3:5]])
    assert r2.choices[0].text == text[:3] and r2.choices[0].finish_reason == "stop"
    r3 = c.completions.create(
        model="fake-model", prompt="Hi", max_tokens=30, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r3.choices[0].finish_reason == "length" and r3.usage.completion_tokens == 30
    kw = dict(model="fake-model", prompt="Hi", max_tokens=5, temperature=1.0, top_p=0.9, n=3, seed=5)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    lp = c.completions.create(model="fake-model", prompt="Hi", max_tokens=4, temperature=0, logprobs=2).choices[0]
    assert len(lp.logprobs.tokens) == 4 and all(len(t) <= 2 for t in lp.logprobs.top_logprobs)
    assert "".join(lp.logprobs.tokens) == lp.text
    ch = c.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "x"}], max_tokens=3, logprobs=True, top_logprobs=2
    )
    assert len(ch.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in ch.choices[0].logprobs.content)


def test_batch_of_prompts(serve: Any) -> None:
    srv = serve()
    c = client(srv)
    r = c.completions.create(model="fake-model", prompt=["Hello", "World"], max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    one = c.completions.create(model="fake-model", prompt="World", max_tokens=6, temperature=0)
    assert r.choices[2].text == r.choices[3].text == one.choices[0].text


def greedy_alone(engine: Any, prompt: str, max_tokens: int = 16) -> str:
    """The greedy text of ``prompt`` straight from ``engine``: one sequence, no server, no scheduler."""
    from perfx_compiler.runtime.api import Tokenizer
    from perfx_compiler.runtime.generate import model_info, prepare_prompt

    tok = Tokenizer.from_file(engine.tokenizer_path, model_info(engine))
    sid = engine.add_sequence()
    logits = engine.prefill(sid, prepare_prompt(engine, tok.encode(prompt)))
    out: list[int] = []
    for _ in range(max_tokens):
        out.append(int(np.argmax(logits)))
        if out[-1] == engine.eos:
            break
        logits = engine.decode([sid], [out[-1]])[0]
    engine.remove_sequence(sid)
    return tok.decode(out)


def test_32_concurrent_streams_match_alone(serve: Any, make_engine: Any) -> None:
    srv = serve(engine_kw={"max_batch": 16})
    c = client(srv)
    prompts = [f"Prompt {i} says {chr(65 + i)}" for i in range(32)]
    # Each stream's expectation comes from its own engine (same weights as the server's, seed 0), run
    # alone: independent of the server, the scheduler and the other 31 streams.
    expected = [greedy_alone(make_engine(), p) for p in prompts]
    assert len(set(expected)) == 32  # distinct texts: a stream handed another's tokens cannot pass
    assert [stream_text(c, p) for p in prompts[:4]] == expected[:4]  # one at a time through the server
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda p: stream_text(c, p), prompts, timeout=120))
    for i, (t, e) in enumerate(zip(together, expected, strict=True)):
        assert t == e, f"stream {i} ({prompts[i]!r}): {t!r}, alone {e!r}"
    assert max(srv.engine.decode_batch_sizes) > 1
    assert metric(srv, "perfx_kv_pages_used") == 0


# -- cancellation, KV pool, queue ---------------------------------------------------------------------


def test_disconnect_mid_stream_frees_pages(serve: Any) -> None:
    srv = serve(engine_kw={"step_delay": 0.005, "max_context": 4096})
    body = {"prompt": "Hello", "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=10) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(x.startswith("data: ") for x in got)
        assert metric(srv, "perfx_running_sequences") == 1
        assert metric(srv, "perfx_kv_pages_used") > 0
    # the client closed the connection: the sequence is cancelled, its pages return at once
    assert wait_for(lambda: metric(srv, "perfx_kv_pages_used") == 0, 30)
    assert metric(srv, "perfx_running_sequences") == 0
    assert metric(srv, "perfx_sequences_finished_total", '{reason="abort"}') == 1
    assert srv.engine.free_pages() == srv.engine.num_pages


def test_disconnect_while_waiting_non_streaming_cancels(serve: Any) -> None:
    srv = serve(engine_kw={"step_delay": 0.005, "max_context": 4096})
    body = {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=0.5)  # gives up and closes the connection
    assert wait_for(lambda: metric(srv, "perfx_kv_pages_used") == 0, 30)
    assert metric(srv, "perfx_sequences_finished_total", '{reason="abort"}') == 1


def test_pool_exhausted_queues_and_queue_full_is_503(serve: Any) -> None:
    # 10 pages of 4 tokens: a request needs 6 to start (BOS + 20 prompt tokens + 1) and 9 at its end,
    # so one runs at a time and the others wait for pages (without the prefix cache: with it, the same
    # prompt shares its full pages, test_prefix_cache.py). Decode is held shut until the 503 is seen, so
    # the first request cannot finish early on a slow machine.
    gate = threading.Event()
    engine_kw = {"num_pages": 10, "decode_gate": gate, "prefix_cache": False}
    srv = serve(engine_kw=engine_kw, max_queue=2, retry_after=3)
    body = {"prompt": "abcdefghijklmnopqrst", "max_tokens": 15, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:
        # the first request is running before the other two are sent: sent together on a loaded machine,
        # the queue could hold all three at once and turn one away before the first was admitted
        futs = [pool.submit(httpx.post, f"{srv.url}/v1/completions", json=body, timeout=90)]
        try:
            assert wait_for(lambda: metric(srv, "perfx_running_sequences") == 1, 60), "the first request never ran"
            futs += [pool.submit(httpx.post, f"{srv.url}/v1/completions", json=body, timeout=90) for _ in range(2)]
            assert wait_for(lambda: metric(srv, "perfx_queue_depth") == 2, 60), (  # one runs, two wait for pages
                f"queue depth {metric(srv, 'perfx_queue_depth')}, running {metric(srv, 'perfx_running_sequences')}, "
                f"pages used {metric(srv, 'perfx_kv_pages_used')}, requests done {[f.done() for f in futs]}"
            )
            assert metric(srv, "perfx_running_sequences") == 1
            r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=10)
            assert r.status_code == 503 and r.headers["retry-after"] == "3"
            assert r.json()["error"]["code"] == "queue_full"
        finally:
            gate.set()
        results = [f.result() for f in futs]
    assert [x.status_code for x in results] == [200, 200, 200]
    assert len({x.json()["choices"][0]["text"] for x in results}) == 1
    assert metric(srv, "perfx_requests_total", '{endpoint="/v1/completions",status="503"}') == 1
    assert metric(srv, "perfx_kv_pages_total") == 10


def test_metrics_histograms_and_counters(serve: Any) -> None:
    srv = serve()
    c = client(srv)
    c.completions.create(model="fake-model", prompt="Hello", max_tokens=5, temperature=0)
    assert metric(srv, "perfx_time_to_first_token_seconds_count") == 1
    assert metric(srv, "perfx_inter_token_latency_seconds_count") == 4
    assert metric(srv, "perfx_generation_tokens_total") == 5
    assert metric(srv, "perfx_prompt_tokens_total") == 5
    assert metric(srv, "perfx_requests_total", '{endpoint="/v1/completions",status="200"}') == 1


# -- bad requests -------------------------------------------------------------------------------------

BAD = [
    ("malformed json", b'{"prompt": "x", ', 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("missing prompt", b'{"max_tokens": 4}', 400, "prompt"),
    ("prompt wrong type", b'{"prompt": 5}', 400, "prompt"),
    ("max_tokens string", b'{"prompt": "x", "max_tokens": "4"}', 400, "max_tokens"),
    ("max_tokens zero", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
    ("max_tokens negative", b'{"prompt": "x", "max_tokens": -3}', 400, "max_tokens"),
    ("max_tokens over context", b'{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),
    ("temperature string", b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
    ("temperature negative", b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
    ("top_p out of range", b'{"prompt": "x", "top_p": 1.5}', 400, "top_p"),
    ("stream not bool", b'{"prompt": "x", "stream": "yes"}', 400, "stream"),
    ("n zero", b'{"prompt": "x", "n": 0}', 400, "n"),
    ("stop wrong type", b'{"prompt": "x", "stop": 7}', 400, "stop"),
    ("unknown model", b'{"prompt": "x", "model": "gpt-9"}', 404, "model"),
    ("prompt over context", json.dumps({"prompt": "q" * 500}).encode(), 400, "prompt"),
    ("token id out of vocab", b'{"prompt": [1, 2, 999999]}', 400, "prompt"),
    ("empty prompt list", b'{"prompt": []}', 400, "prompt"),
    ("echo unsupported", b'{"prompt": "x", "echo": true}', 400, "echo"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_completion_requests(serve_shared: Any, name: str, body: bytes, status: int, param: str | None) -> None:
    srv = serve_shared
    r = httpx.post(f"{srv.url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    # the server still works for others
    ok = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_json_body_read_whatever_the_content_type(serve_shared: Any, content_type: str | None) -> None:
    # curl -d sends application/x-www-form-urlencoded; OpenAI's API (and vLLM) read the JSON anyway
    headers = {"content-type": content_type} if content_type else {}
    url = serve_shared.url
    body = b'{"model": "fake-model", "prompt": "Hello", "max_tokens": 3}'
    r = httpx.post(f"{url}/v1/completions", content=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3
    chat = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}'
    r = httpx.post(f"{url}/v1/chat/completions", content=chat, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{url}/v1/completions", content=b"prompt=Hello", headers=headers, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    typed = httpx.post(f"{url}/v1/completions", content=b'{"prompt": 5}', headers=headers, timeout=30)
    assert typed.status_code == 400 and typed.json()["error"]["param"] == "prompt"


BAD_CHAT = [
    ("messages missing", {}, "messages"),
    ("messages empty", {"messages": []}, "messages"),
    ("messages string", {"messages": "hi"}, "messages"),
    ("message without role", {"messages": [{"content": "hi"}]}, "messages.0.role"),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, None),
    ("chat over context", {"messages": [{"role": "user", "content": "w" * 500}]}, "messages"),
    ("top_logprobs without logprobs", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
]


@pytest.mark.parametrize("name,body,param", BAD_CHAT, ids=[b[0] for b in BAD_CHAT])
def test_bad_chat_requests(serve_shared: Any, name: str, body: dict, param: str | None) -> None:
    r = httpx.post(f"{serve_shared.url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param


def test_openai_client_sees_errors(serve_shared: Any) -> None:
    c = client(serve_shared)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="fake-model", prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="x")
    assert httpx.get(f"{serve_shared.url}/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_api_key(serve: Any) -> None:
    srv = serve(api_key="s3cret")
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{srv.url}/v1/models", headers=headers).status_code == 401
        assert httpx.get(f"{srv.url}/metrics", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client(srv, "wrong").models.list()
    good = client(srv, "s3cret")
    assert good.completions.create(model="fake-model", prompt="x", max_tokens=2).usage.completion_tokens == 2
    assert stream_text(good, "x", 3)
