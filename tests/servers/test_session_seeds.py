"""Seeded sessions: a session created with a seed samples each call that sets no seed of its own
with derive_seed(seed, k) for its k-th call, so an agent run through the proxy samples the same
tokens on every run of the same seed, whatever other sessions' calls the engine batches it with
(the CI failure of stop 43: an 8-step agent run drew from one generator shared in arrival
order)."""

from __future__ import annotations

import asyncio

import httpx

from agentrl.engine.fakes import FakeEngine
from agentrl.seeding import derive_seed
from servers.agents import run_agents
from servers.app import create_app
from servers.cli import vocabulary_id
from servers.durable import SqliteSessionStore

MSGS = [{"role": "user", "content": "hi"}]


def _seeds(engine: FakeEngine, n: int) -> list[int | None]:
    return [params.seed for _, params, _ in engine.requests[-n:]]


def test_each_call_of_a_seeded_session_gets_its_own_derived_seed(proxy):
    created = httpx.post(f"{proxy.url}/sessions", json={"id": "s7", "seed": 7})
    assert created.status_code == 201 and created.json()["seed"] == 7
    client = proxy.client("s7")
    for _ in range(2):
        client.chat.completions.create(model="agentrl", messages=MSGS)
    client.chat.completions.create(model="agentrl", messages=MSGS, seed=5)  # its own seed wins
    httpx.post(f"{proxy.url}/sessions/s7/v1/completions",
               json={"model": "agentrl", "prompt": "a", "max_tokens": 2}).raise_for_status()
    # A retry is a new call with a new seed (the same seed would resample the failed answer).
    httpx.post(f"{proxy.url}/sessions/s7/v1/chat/completions",
               json={"model": "agentrl", "messages": MSGS},
               headers={"x-stainless-retry-count": "1"}).raise_for_status()
    assert _seeds(proxy.engine, 5) == [derive_seed(7, 0), derive_seed(7, 1), 5,
                                       derive_seed(7, 3), derive_seed(7, 4)]
    assert len(set(_seeds(proxy.engine, 5))) == 5
    proxy.client("plain").chat.completions.create(model="agentrl", messages=MSGS)
    assert _seeds(proxy.engine, 1) == [None]  # a session without a seed leaves it to the engine
    assert httpx.get(f"{proxy.url}/sessions/plain").json()["seed"] is None


def test_a_seed_that_is_not_a_64_bit_integer_is_refused(proxy):
    for bad in ("7", 2**64, 1.5):
        r = httpx.post(f"{proxy.url}/sessions", json={"id": "bad", "seed": bad})
        assert r.status_code == 400 and "seed" in r.text, r.text
    assert proxy.store.get("bad") is None


def test_a_reopened_store_goes_on_with_the_seeds_after_its_recorded_calls(make_proxy, tok,
                                                                          tmp_path):
    path = tmp_path / "sessions.sqlite"
    store = SqliteSessionStore(path, tokenizer_id=vocabulary_id(tok))
    p = make_proxy(FakeEngine(tok), store=store)
    httpx.post(f"{p.url}/sessions", json={"id": "s", "seed": 3}).raise_for_status()
    for _ in range(2):
        p.client("s").chat.completions.create(model="agentrl", messages=MSGS)
    store.close()
    again = SqliteSessionStore(path, tokenizer_id=vocabulary_id(tok))
    q = make_proxy(FakeEngine(tok), store=again)
    q.client("s").chat.completions.create(model="agentrl", messages=MSGS)
    assert _seeds(q.engine, 1) == [derive_seed(3, 2)]
    again.close()


def _two_calls(prompt: str, base_url: str, api_key: str) -> None:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    msgs = [{"role": "user", "content": prompt}]
    for _ in range(2):
        reply = client.chat.completions.create(model="agentrl", messages=msgs, max_tokens=6)
        msgs += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "go on"}]


def test_a_seeded_agent_run_samples_alike_alone_or_batched(tok):
    """The real engine over the plain tiny model (near-uniform: every token is a draw): the
    same seed gives the same tokens whether the 6 sessions run one at a time or batched 6
    wide; another seed gives others."""
    from agentrl.engine.transformers_engine import TransformersEngine
    from agentrl.models.tiny import tiny_model

    engine = TransformersEngine(tiny_model(tok, seed=0), tok, max_batch_size=8)
    app = create_app(engine, tok)

    def run(seed: int, concurrency: int) -> list[list[int]]:
        trajs = asyncio.run(run_agents(_two_calls, ["a", "b", "c"], app=app, seed=seed,
                                       n_samples_per_task=2, concurrency=concurrency))
        assert len(trajs) == 6 and all(len(t.turns) == 2 for t in trajs)
        return [t.token_ids for t in trajs]

    try:
        alone, batched = run(11, 1), run(11, 6)
        assert alone == batched
        assert alone[0] != alone[1]  # two samples of one task draw differently
        assert run(12, 6) != alone
    finally:
        engine.close()
