"""`agentrl serve --engines N`: the proxy behind the engine router keeps a session on one
engine (#16 item 1)."""

from __future__ import annotations

import pytest

from agentrl.engine.router import EngineRouter


@pytest.mark.slow
def test_the_proxy_keeps_a_session_on_one_engine(make_proxy, tok):
    from agentrl.engine.fakes import FakeEngine

    engines = [FakeEngine(tok), FakeEngine(tok)]
    router = EngineRouter(engines)
    p = make_proxy(router)
    msgs = [{"role": "user", "content": "hi"}]
    for session in ("a", "b", "a", "b", "a"):
        p.client(session).chat.completions.create(model="agentrl", messages=msgs, max_tokens=3)
    assert sorted(len(e.requests) for e in engines) == [2, 3]
    stream = p.client("a").chat.completions.create(model="agentrl", messages=msgs, max_tokens=3,
                                                   stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert sorted(len(e.requests) for e in engines) == [2, 4]  # session a's engine again
