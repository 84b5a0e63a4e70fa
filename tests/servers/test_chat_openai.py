"""Chat completions through the real `openai` client, responses validated strictly."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agentrl.engine.fakes import FakeEngine, StreamingFakeEngine
from tests.servers.conftest import validate_chunk, validate_completion

MSGS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 6 * 7?"},
]


def _raw(client: openai.OpenAI, **kw):
    raw = client.chat.completions.with_raw_response.create(model="agentrl", **kw)
    return raw, raw.http_response.json()


def _sse(url: str, body: dict, headers: dict | None = None) -> list[dict | str]:
    with httpx.stream("POST", url, json=body, headers=headers, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    out: list[dict | str] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_list_retrieve_and_unknown(proxy):
    c = proxy.client()
    assert [m.id for m in c.models.list()] == ["agentrl"]
    assert c.models.retrieve("agentrl").id == "agentrl"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.code == "model_not_found"


def test_non_stream_shape_and_usage(proxy):
    raw, body = _raw(proxy.client(), messages=MSGS)
    cc = validate_completion(body)
    assert cc.id.startswith("chatcmpl-") and cc.object == "chat.completion"
    assert cc.choices[0].message.content == "Hello! The answer is 42."
    assert cc.choices[0].finish_reason == "stop"
    assert cc.usage.prompt_tokens == len(proxy.engine.requests[0][0])
    assert cc.usage.completion_tokens == cc.usage.total_tokens - cc.usage.prompt_tokens > 0
    assert raw.headers["x-request-id"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_both_names_give_length(proxy, field):
    _, body = _raw(proxy.client(), messages=MSGS, **{field: 3})
    cc = validate_completion(body)
    assert cc.choices[0].finish_reason == "length"
    assert cc.usage.completion_tokens == 3
    assert proxy.engine.requests[-1][1].max_tokens == 3


@pytest.mark.parametrize("stop", [" answer", [" is", "zzz"]])
def test_stop_string_or_list_not_in_content(proxy, stop):
    _, body = _raw(proxy.client(), messages=MSGS, stop=stop)
    content = validate_completion(body).choices[0].message.content
    assert content in ("Hello! The", "Hello! The answer")
    assert "answer is" not in content


def test_n_choices_recorded(proxy):
    _, body = _raw(proxy.client("s-n"), messages=MSGS, n=3, temperature=1.0, seed=7)
    cc = validate_completion(body)
    assert [c.index for c in cc.choices] == [0, 1, 2]
    assert cc.choices[1].message.content.endswith("(choice 1)")
    assert len(proxy.store.get("s-n").trajectories()) == 3


def test_harmless_fields_and_message_forms_accepted(proxy):
    msgs = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "name": "bob",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    _, body = _raw(
        proxy.client(),
        messages=msgs,
        temperature=0,
        top_p=0.9,
        seed=1,
        frequency_penalty=0.5,
        presence_penalty=0.1,
        user="u",
        metadata={"a": "b"},
        store=False,
        parallel_tool_calls=False,
        service_tier="auto",
        reasoning_effort="low",
    )
    validate_completion(body)
    prompt = proxy.engine.tokenizer.decode(proxy.engine.requests[-1][0])
    assert "<|im_start|>system\nBe brief.<|im_end|>" in prompt and "Hi there" in prompt


def test_logprobs_with_top_logprobs(proxy):
    _, body = _raw(proxy.client(), messages=MSGS, logprobs=True, top_logprobs=3)
    choice = validate_completion(body).choices[0]
    entries = choice.logprobs.content
    assert "".join(e.token for e in entries) == choice.message.content
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 3 for e in entries)
    assert all(bytes(e.bytes).decode() == e.token for e in entries)


def test_stream_shape_usage_and_done(make_proxy):
    p = make_proxy(streaming=True)
    events = _sse(
        f"{p.url}/v1/chat/completions",
        {
            "model": "agentrl",
            "messages": MSGS,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [validate_chunk(e) for e in events[:-1]]
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hello! The answer is 42."


@pytest.mark.parametrize("streaming_engine", [False, True])
def test_greedy_stream_equals_non_stream(make_proxy, tok, streaming_engine):
    p = make_proxy(streaming=streaming_engine)
    c = p.client("a")
    full = c.chat.completions.create(model="agentrl", messages=MSGS, temperature=0)
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in p.client("b").chat.completions.create(
            model="agentrl", messages=MSGS, temperature=0, stream=True
        )
        if ch.choices
    )
    assert streamed == full.choices[0].message.content
    assert (
        p.store.get("a").trajectories()[0].token_ids == p.store.get("b").trajectories()[0].token_ids
    )


def test_stream_n_interleaves_by_index(make_proxy):
    p = make_proxy(streaming=True)
    events = _sse(
        f"{p.url}/sessions/sn/v1/chat/completions",
        {"model": "agentrl", "messages": MSGS, "stream": True, "n": 2},
    )
    chunks = [validate_chunk(e) for e in events[:-1]]
    order = [c.choices[0].index for c in chunks]
    assert order[:4] == [0, 1, 0, 1]
    texts = [
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices[0].index == i)
        for i in (0, 1)
    ]
    assert texts == ["Hello! The answer is 42.", "Hello! The answer is 42. (choice 1)"]
    assert len(p.store.get("sn").trajectories()) == 2


def test_stream_stop_string_held_back(make_proxy):
    p = make_proxy(streaming=True)
    events = _sse(
        f"{p.url}/v1/chat/completions",
        {"model": "agentrl", "messages": MSGS, "stream": True, "stop": "42"},
    )
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == "Hello! The answer is "


def test_logprobs_in_stream_concatenate(make_proxy):
    p = make_proxy(streaming=True)
    events = _sse(
        f"{p.url}/v1/chat/completions",
        {"model": "agentrl", "messages": MSGS, "stream": True, "logprobs": True, "top_logprobs": 2},
    )
    chunks = [validate_chunk(e) for e in events[:-1]]
    toks = "".join(
        e.token for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content
    )
    assert toks == "Hello! The answer is 42."


def test_engine_failure_mid_stream_gives_error_chunk_then_done(make_proxy, tok):
    engine = StreamingFakeEngine(tok)
    engine.fail_after_tokens = 3
    p = make_proxy(engine)
    events = _sse(
        f"{p.url}/sessions/f/v1/chat/completions",
        {"model": "agentrl", "messages": MSGS, "stream": True},
    )
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "server_error"
    assert p.store.get("f").summary()["aborted_calls"] == 1
    # the server keeps serving
    assert p.client().models.list().data


def test_context_length_exceeded(make_proxy, tok):
    p = make_proxy(FakeEngine(tok, max_context=16))
    with pytest.raises(openai.BadRequestError) as e:
        p.client().chat.completions.create(model="agentrl", messages=MSGS)
    assert e.value.status_code == 400 and e.value.code == "context_length_exceeded"
    assert "maximum context length is 16" in str(e.value)


def test_context_hit_gives_length(make_proxy, tok):
    p = make_proxy(FakeEngine(tok, max_context=34))
    r = p.client().chat.completions.create(model="agentrl", messages=MSGS, max_tokens=100)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == 34


def test_sdk_retry_replaces_attempt(proxy):
    c = proxy.client("r")
    c.chat.completions.create(model="agentrl", messages=MSGS)
    c.chat.completions.create(
        model="agentrl", messages=MSGS, extra_headers={"x-stainless-retry-count": "1"}
    )
    s = proxy.store.get("r").summary()
    assert (s["num_calls"], s["replaced_calls"], s["drift_events"]) == (1, 1, 0)
