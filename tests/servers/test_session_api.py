"""Sessions over HTTP: binding by path/header/api key, multi-turn merge, rewards, export."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agentrl.engine.fakes import FakeEngine
from agentrl.types import Trajectory


def _chat(client: openai.OpenAI, msgs: list[dict]) -> str:
    return client.chat.completions.create(model="agentrl", messages=msgs).choices[0].message.content


def _three_turns(client: openai.OpenAI, edit=lambda s: s) -> None:
    msgs = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "hi"}]
    for turn in range(3):
        msgs.append({"role": "assistant", "content": edit(_chat(client, msgs))})
        msgs.append({"role": "user", "content": f"and now {turn}?"})


def test_multi_turn_chat_merges_into_one_trajectory(proxy, tok):
    _three_turns(proxy.client("mt"))
    body = httpx.get(f"{proxy.url}/sessions/mt").json()
    assert body["drift_events"] == 0 and body["num_calls"] == 3
    (traj,) = [Trajectory.from_dict(t) for t in body["trajectories"]]
    assert len(traj.turns) == 3
    last_prompt = proxy.engine.requests[-1][0]
    assert traj.token_ids[: len(last_prompt)] == last_prompt
    for t in traj.turns:
        assert tok.decode(traj.token_ids[t.start:t.end]) == "Hello! The answer is 42.<|im_end|>"
    assert traj.logprobs[traj.turns[0].start] < 0 and traj.logprobs[0] == 0


def test_edited_history_is_drift(proxy):
    _three_turns(proxy.client("d"), edit=lambda s: s.upper())
    s = proxy.store.get("d").summary()
    assert s["drift_events"] == 2 and s["num_trajectories"] == 3


def test_replies_sent_back_continue_from_the_sampled_tokens(make_proxy, tok):
    """#17 item 3: the model "samples" one token per character, which re-tokenizing its text
    would merge (two drift events before); the proxy reuses what it sampled instead."""
    per_char = lambda text: [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]
    p = make_proxy(FakeEngine(tok, token_ids_for=per_char))
    _three_turns(p.client("nc"))
    session = p.store.get("nc")
    assert session.drift_events == 0
    (traj,) = session.trajectories()
    sampled = per_char("Hello! The answer is 42.")
    for turn in traj.turns:
        assert traj.token_ids[turn.start:turn.end][: len(sampled)] == sampled


def test_session_bound_by_header_and_api_key(proxy):
    msgs = [{"role": "user", "content": "hi"}]
    proxy.client(default_headers={"X-Session-Id": "hdr"}).chat.completions.create(
        model="agentrl", messages=msgs)
    proxy.client(api_key="session-key1").chat.completions.create(model="agentrl", messages=msgs)
    proxy.client().chat.completions.create(model="agentrl", messages=msgs)  # unbound
    ids = {s["id"] for s in httpx.get(f"{proxy.url}/sessions").json()["data"]}
    assert ids == {"hdr", "key1"}


def test_reward_close_export_delete(proxy):
    r = httpx.post(f"{proxy.url}/sessions", json={"id": "ep1", "group": "task-7"})
    assert r.status_code == 201 and r.json()["base_url"].endswith("/sessions/ep1/v1")
    c = proxy.client("ep1")
    first = c.chat.completions.create(model="agentrl", messages=[{"role": "user", "content": "a"}])
    httpx.post(f"{proxy.url}/sessions/ep1/reward", json={"reward": 0.5, "call_id": first.id})
    httpx.post(f"{proxy.url}/sessions/ep1/reward", json={"reward": 1.0}).raise_for_status()
    assert httpx.post(f"{proxy.url}/sessions/ep1/close").json()["closed"]
    with pytest.raises(openai.BadRequestError, match="is closed"):
        c.chat.completions.create(model="agentrl", messages=[{"role": "user", "content": "b"}])
    lines = httpx.get(f"{proxy.url}/sessions/ep1/export").text.splitlines()
    (traj,) = [Trajectory.from_json(line) for line in lines]
    assert traj.rewards == [1.5] and traj.group == "task-7" and traj.terminated
    assert len(httpx.get(f"{proxy.url}/export?closed_only=true").text.splitlines()) == 1
    assert httpx.delete(f"{proxy.url}/sessions/ep1").json()["deleted"]
    assert httpx.get(f"{proxy.url}/sessions/ep1").status_code == 404


def test_session_errors_are_openai_shaped(proxy):
    r = httpx.get(f"{proxy.url}/sessions/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    httpx.post(f"{proxy.url}/sessions", json={"id": "e"})
    r = httpx.post(f"{proxy.url}/sessions/e/reward", json={"reward": 1.0})
    assert r.status_code == 400 and "no completed call" in r.json()["error"]["message"]
    r = httpx.post(f"{proxy.url}/sessions/e/reward", json={"reward": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reward"
    assert httpx.post(f"{proxy.url}/sessions", json={"id": "e"}).status_code == 409


def test_unknown_session_rejected_without_auto_create(make_proxy):
    p = make_proxy(auto_create_sessions=False)
    with pytest.raises(openai.NotFoundError, match="unknown session"):
        p.client("ghost").chat.completions.create(
            model="agentrl", messages=[{"role": "user", "content": "a"}])


def test_tokenize_agrees_with_generation_and_detokenize_round_trips(proxy, tok):
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = httpx.post(f"{proxy.url}/tokenize", json={"model": "agentrl", "messages": msgs}).json()
    proxy.client().chat.completions.create(model="agentrl", messages=msgs)
    assert ids["tokens"] == proxy.engine.requests[-1][0]
    text = httpx.post(f"{proxy.url}/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    again = httpx.post(f"{proxy.url}/tokenize", json={"prompt": text}).json()["tokens"]
    assert again == ids["tokens"]
    r = httpx.post(f"{proxy.url}/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def test_text_completions(proxy):
    c = proxy.client("tc")
    r = c.completions.create(model="agentrl", prompt="The answer", max_tokens=4, logprobs=2)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert "".join(r.choices[0].logprobs.tokens) == r.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="agentrl", prompt="x", stream=True))
    assert streamed == "Hello! The answer is 42."
    r = c.completions.create(model="agentrl", prompt=[1, 2, 3])
    assert r.choices[0].text == "Hello! The answer is 42."
    assert proxy.store.get("tc").summary()["num_calls"] == 3


def test_auth_required_when_configured(make_proxy):
    p = make_proxy(api_keys=("sekret",))
    with pytest.raises(openai.AuthenticationError) as e:
        p.client(api_key="wrong").chat.completions.create(
            model="agentrl", messages=[{"role": "user", "content": "a"}])
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = p.client(api_key="sekret").chat.completions.create(
        model="agentrl", messages=[{"role": "user", "content": "a"}])
    assert r.choices[0].message.content
    assert httpx.get(f"{p.url}/health").json()["status"] == "ok"
    assert json.loads(httpx.get(f"{p.url}/sessions").text)["error"]["code"] == "invalid_api_key"
