"""The proxy over a real TransformersEngine (tiny model): native token streaming end to end."""

from __future__ import annotations

import pytest

from agentrl.engine.base import Engine

MSGS = [{"role": "user", "content": "What is 6 * 7?"}]


def test_streamed_greedy_equals_non_streamed(real_proxy):
    assert isinstance(real_proxy.engine, Engine)
    kw = {"model": "agentrl", "messages": MSGS, "temperature": 0, "max_tokens": 16}
    full = real_proxy.client("plain").chat.completions.create(**kw)
    chunks = list(real_proxy.client("streamed").chat.completions.create(stream=True, **kw))
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(pieces) == full.choices[0].message.content
    assert len(pieces) > 1  # sent as it was sampled, not in one piece
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [full.choices[0].finish_reason]
    [plain] = real_proxy.store.get("plain").trajectories()
    [streamed] = real_proxy.store.get("streamed").trajectories()
    assert streamed.token_ids == plain.token_ids
    assert len(streamed.token_ids) > 0


def test_logit_bias_is_applied_not_ignored(real_proxy, tok):
    """#17 item 4: `logit_bias` was accepted and silently ignored."""
    import httpx
    import openai

    token = tok.encode("7", add_special_tokens=False)[0]
    r = real_proxy.client("biased").chat.completions.create(
        model="agentrl", messages=MSGS, max_tokens=5, logit_bias={str(token): 100})
    assert r.choices[0].message.content == "7" * 5
    [traj] = real_proxy.store.get("biased").trajectories()
    turn = traj.turns[0]
    assert traj.token_ids[turn.start:turn.end] == [token] * 5
    for bad, says in (({"x": 1}, "token ids in"), ({"999999": 1}, "token ids in"),
                      ({str(token): 101}, r"\[-100, 100\]")):
        with pytest.raises(openai.BadRequestError, match=says):
            real_proxy.client().chat.completions.create(
                model="agentrl", messages=MSGS, max_tokens=2, logit_bias=bad)
    done = httpx.post(f"{real_proxy.url}/v1/completions", json={
        "model": "agentrl", "prompt": "a", "max_tokens": 3, "logit_bias": {str(token): 100}})
    assert done.json()["choices"][0]["text"] == "777"


WEATHER = [{"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"], "additionalProperties": False}}}]
COLOR_FORMAT = {"type": "json_schema", "json_schema": {"name": "color", "strict": True, "schema": {
    "type": "object", "properties": {"color": {"enum": ["red", "blue"]}},
    "required": ["color"], "additionalProperties": False}}}


def test_constrained_outputs_are_what_the_options_ask_for(real_proxy, tok):
    """#17 item 4: `tool_choice` "required" and named, `parallel_tool_calls: false` and
    `response_format` constrain what the tiny random model samples (it writes none of these
    on its own), streamed or not, and the recorded tokens are the sampled ones."""
    import json

    client = real_proxy.client("constrained")
    kw = {"model": "agentrl", "messages": MSGS, "max_tokens": 120, "temperature": 1.0}
    free = client.chat.completions.create(n=4, seed=1, tools=WEATHER, **kw)
    assert not any(c.message.tool_calls for c in free.choices)
    required = client.chat.completions.create(n=4, seed=1, tools=WEATHER,
                                              tool_choice="required", **kw)
    for c in required.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c.message.content
        for call in c.message.tool_calls:
            args = json.loads(call.function.arguments)
            assert args in ({"city": "Paris"}, {"city": "Rome"}, {"zone": "UTC"},
                            {"zone": "CET"})
    named = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        r = client.chat.completions.create(n=3, seed=2, tools=WEATHER, tool_choice=named,
                                           parallel_tool_calls=False, stream=stream, **kw)
        if stream:
            calls = [[] for _ in range(3)]
            for chunk in r:
                for ch in chunk.choices:
                    for d in ch.delta.tool_calls or ():
                        if d.function and d.function.name:
                            calls[ch.index].append(d.function.name)
        else:
            calls = [[t.function.name for t in c.message.tool_calls] for c in r.choices]
        assert calls == [["get_time"]] * 3
    for fmt, check in ((COLOR_FORMAT, lambda v: v["color"] in ("red", "blue")),
                       ({"type": "json_object"}, lambda v: isinstance(v, dict))):
        r = client.chat.completions.create(n=3, seed=3, response_format=fmt, **kw)
        for c in r.choices:
            assert c.finish_reason == "stop" and check(json.loads(c.message.content))
    for traj in real_proxy.store.get("constrained").trajectories():
        for turn in traj.turns:  # the tokens recorded are the tokens the client saw
            text = tok.decode(traj.token_ids[turn.start:turn.end], skip_special_tokens=True)
            assert text.strip()


def test_a_schema_the_grammar_library_cannot_compile_is_a_400(real_proxy):
    import openai

    client = real_proxy.client()
    bad_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/missing"}}}}}
    with pytest.raises(openai.BadRequestError, match="cannot be compiled") as e:
        client.chat.completions.create(model="agentrl", messages=MSGS, max_tokens=4,
                                       response_format=bad_format)
    assert e.value.body["param"] == "response_format"
    bad_tool = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "strang"}}}]
    with pytest.raises(openai.BadRequestError, match=r"parameters of the tools \(f\)"):
        client.chat.completions.create(model="agentrl", messages=MSGS, max_tokens=4,
                                       tools=bad_tool, tool_choice="required")
    assert client.chat.completions.create(model="agentrl", messages=MSGS, max_tokens=2)
