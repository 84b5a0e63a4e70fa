"""What a request's grammar may cost (#34 item 4): an enum of 10^5 strings took ~42 s to
compile and went on after its client had gone. A schema past the limits is a 400 before any
work; a grammar that does not compile within the engine's timeout is a 400 and its compile is
stopped; a client that hangs up stops it too. Nothing is recorded for a refused request."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

MSGS = [{"role": "user", "content": "What is 6 * 7?"}]
CHAT = {"model": "agentrl", "messages": MSGS, "max_tokens": 8}


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _slow_schema(prefix: str) -> dict:
    """3000 optional properties: 86 KB, under every limit, and seconds to compile for the
    tiny vocabulary (2000 took 2-12 s; the prefix makes each test's grammar its own)."""
    return {"type": "object", "properties": {f"{prefix}{i}": {"type": "string"}
                                             for i in range(3000)},
            "additionalProperties": False}


def _wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def _refused(proxy, r: httpx.Response, param: str, *says: str) -> None:
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["param"]) == ("grammar_too_complex", param), error
    for text in says:
        assert text in error["message"], error["message"]
    assert r.headers["x-should-retry"] == "false"
    assert all(not s.calls for s in proxy.store.list())


def test_schemas_past_the_limits_are_a_400_before_any_work(make_proxy, tok):
    from agentrl.engine.fakes import FakeEngine

    # A context big enough that a 1.4 MB body is not refused unparsed as too long a prompt.
    proxy = make_proxy(FakeEngine(tok, max_context=1_000_000))
    enum = [f"value{i:06d}" for i in range(100_000)]  # the 1.4 MB enum
    cases = [
        (_format({"enum": enum}), None, "response_format", "over the limit of 262144"),
        (_format({"type": "object", "properties": {"x": {"enum": enum[:5000]}}}), None,
         "response_format", "5000 enum and const values, over the limit of 1000"),
        (_format(_nested(100)), None, "response_format", "nested deeper than 64 levels"),
        (None, [{"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"x": {"enum": enum[:2000]}}}}}],
         "tools", "the parameters of the tools (pick): 2000 enum"),
    ]
    for fmt, tools, param, *says in cases:
        body = {**CHAT, **({"response_format": fmt} if fmt else {}),
                **({"tools": tools, "tool_choice": "required"} if tools else {})}
        start = time.monotonic()
        r = httpx.post(f"{proxy.url}/sessions/limits/v1/chat/completions", json=body,
                       timeout=60)
        _refused(proxy, r, param, *says)
        assert time.monotonic() - start < 5
    assert proxy.engine.requests == []


def test_a_grammar_past_its_compile_timeout_is_a_400_and_is_stopped(real_proxy):
    grammars = real_proxy.engine.grammars
    grammars.compile_timeout_s = 0.5
    small = _format({"type": "object", "properties": {"n": {"type": "integer"}},
                     "required": ["n"]})
    warm = httpx.post(f"{real_proxy.url}/v1/chat/completions", timeout=120,
                      json={**CHAT, "max_tokens": 12, "response_format": small})
    assert warm.status_code == 200, warm.text[:300]  # the compile worker is up
    killed = grammars.killed
    url = f"{real_proxy.url}/sessions/slow/v1/chat/completions"
    r = httpx.post(url, json={**CHAT, "response_format": _format(_slow_schema("t"))}, timeout=60)
    _refused(real_proxy, r, "response_format", "did not compile within 0.5 s", "simplify")
    assert grammars.killed == killed + 1
    with httpx.stream("POST", url, timeout=60, json={
            **CHAT, "stream": True, "response_format": _format(_slow_schema("s"))}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "grammar_too_complex", events[-1]
    assert grammars.killed == killed + 2
    # The Anthropic route's stream refuses it the same way, and records nothing either.
    with httpx.stream("POST", f"{real_proxy.url}/sessions/slow/v1/messages", timeout=60, json={
            **CHAT, "stream": True,
            "output_config": {"format": {"type": "json_schema", "schema": _slow_schema("m")}}},
            ) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert events[-1]["type"] == "error", events[-1]
    assert grammars.killed == killed + 3
    assert all(not s.calls and not s.summary()["aborted_calls"]
               for s in real_proxy.store.list())
    again = httpx.post(url, json={**CHAT, "response_format": small}, timeout=60)
    assert again.status_code == 200


def test_a_client_that_hangs_up_stops_its_grammar_compile(real_proxy):
    """The compile went on after the client had gone; now its worker is killed."""
    grammars = real_proxy.engine.grammars
    warm = httpx.post(f"{real_proxy.url}/v1/chat/completions", timeout=120, json={
        **CHAT, "response_format": {"type": "json_object"}})
    assert warm.status_code == 200, warm.text[:300]
    killed = grammars.killed
    body = json.dumps({**CHAT, "response_format": _format(_slow_schema("h"))}).encode()
    host, port = real_proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /sessions/gone/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  b"Content-Type: application/json\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n" + body)
        assert _wait_for(lambda: grammars.trials_running == 1)  # compiling, for seconds
    # (within the compile's own 6-12 s: a hang-up seen late, on a loaded machine, still counts)
    assert _wait_for(lambda: grammars.killed == killed + 1, 15.0)
    assert grammars.trials_running == 0
    assert httpx.get(f"{real_proxy.url}/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_sent_again_is_not_converted_again(proxy, monkeypatch, stream):
    import xgrammar as xgr

    calls = []
    real = xgr.Grammar.from_json_schema
    monkeypatch.setattr(xgr.Grammar, "from_json_schema",
                        staticmethod(lambda *a, **k: calls.append(1) or real(*a, **k)))
    fmt = _format({"type": "object", "properties": {f"again_{stream}": {"type": "integer"}}})
    for _ in range(3):
        r = httpx.post(f"{proxy.url}/v1/chat/completions",
                       json={**CHAT, "stream": stream, "response_format": fmt})
        assert r.status_code == 200
    assert calls == [1]
