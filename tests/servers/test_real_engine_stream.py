"""The proxy over a real TransformersEngine (tiny model): native token streaming end to end."""

from __future__ import annotations

import pytest

from agentrl.engine.hf import TransformersEngine
from servers.deps import StreamingEngine
from tests.engine._models import sharp_tiny_model

MSGS = [{"role": "user", "content": "What is 6 * 7?"}]


@pytest.fixture
def real_proxy(make_proxy, tok):
    engine = TransformersEngine(sharp_tiny_model(tok), tok, max_batch_size=4)
    try:
        yield make_proxy(engine)
    finally:
        engine.close()


def test_streamed_greedy_equals_non_streamed(real_proxy):
    assert isinstance(real_proxy.engine, StreamingEngine)
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
