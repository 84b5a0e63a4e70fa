"""Durable sessions (#17 item 1): every change goes to a SQLite log before it is answered, and a
restarted server replays it into the same sessions, merged and exported exactly as before."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from agentrl.engine.fakes import FakeEngine
from agentrl.types import Trajectory
from servers.app import create_app
from servers.cli import vocabulary_id
from servers.durable import SqliteSessionStore
from servers.serving import serve_in_thread
from servers.sessions import StoreError
from tests.servers.test_tool_calls import CALL_TEXT, _episode, _tool_reply


def _open(path, tok):
    return SqliteSessionStore(path, tokenizer_id=vocabulary_id(tok))


def _everything(p) -> tuple[str, list[dict]]:
    export = httpx.get(f"{p.url}/export").text
    pages = httpx.get(f"{p.url}/sessions", params={"limit": 1000}).json()["data"]
    return export, pages


def test_a_reopened_store_serves_the_same_sessions(make_proxy, tok, tmp_path):
    path = tmp_path / "sessions.sqlite"
    store = _open(path, tok)
    p = make_proxy(FakeEngine(tok, reply=_tool_reply(CALL_TEXT)), store=store)
    _episode(p.client("tools"))  # a tool call and its result, merged into one trajectory
    httpx.post(f"{p.url}/sessions/tools/reward", json={"reward": 0.5}).raise_for_status()
    httpx.post(f"{p.url}/sessions/tools/close").raise_for_status()
    forks = p.client("forks")
    msgs = [{"role": "user", "content": "Two answers?"}]
    r = forks.chat.completions.create(model="agentrl", messages=msgs, n=2, logprobs=True,
                                      top_logprobs=2)
    msgs.append({"role": "assistant", "content": r.choices[1].message.content})
    retried = {"model": "agentrl", "messages": msgs + [{"role": "user", "content": "More?"}]}
    httpx.post(f"{p.url}/sessions/forks/v1/chat/completions", json=retried).raise_for_status()
    replaced = httpx.post(f"{p.url}/sessions/forks/v1/chat/completions", json=retried,
                          headers={"x-stainless-retry-count": "1"})  # replaces the one before
    reply = replaced.json()["choices"][0]["message"]["content"]
    stream = p.client("streamed").chat.completions.create(
        model="agentrl", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert [c for c in stream]
    httpx.post(f"{p.url}/sessions", json={"id": "gone", "group": "g"}).raise_for_status()
    httpx.delete(f"{p.url}/sessions/gone").raise_for_status()
    before = _everything(p)
    assert before[0].count("\n") == 4  # tools; forks x2; streamed
    store.close()

    again = _open(path, tok)
    assert again.restored == 3
    q = make_proxy(FakeEngine(tok, reply=_tool_reply(CALL_TEXT)), store=again)
    assert _everything(q) == before
    # The session goes on where it was: the next call extends fork 1 without drift.
    summary = httpx.get(f"{q.url}/sessions/forks").json()
    assert (summary["drift_events"], summary["replaced_calls"]) == (0, 1)
    calls = summary["num_calls"]
    msgs = [*retried["messages"], {"role": "assistant", "content": reply},
            {"role": "user", "content": "Next?"}]
    q.client("forks").chat.completions.create(model="agentrl", messages=msgs)
    summary = httpx.get(f"{q.url}/sessions/forks").json()
    assert (summary["num_calls"], summary["drift_events"]) == (calls + 1, 0)
    again.close()


def test_one_server_per_store_and_one_vocabulary(tok, embedded_tokenizer, tmp_path):
    path = tmp_path / "s.sqlite"
    first = _open(path, tok)
    with pytest.raises(StoreError, match="another server is using the session store"):
        _open(path, tok)
    first.close()
    with pytest.raises(StoreError, match=r"holds token ids of a vocabulary of \d+ tokens"):
        _open(path, embedded_tokenizer)
    _open(path, tok).close()  # the right one still opens


def test_a_store_that_cannot_be_written_fails_the_call_not_silently(make_proxy, tok, tmp_path):
    store = _open(tmp_path / "s.sqlite", tok)
    p = make_proxy(store=store)
    store._db.execute("DROP TABLE events")  # the disk refuses from now on
    r = httpx.post(f"{p.url}/v1/chat/completions", headers={"x-session-id": "s"},
                   json={"model": "agentrl", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500 and r.json()["error"]["code"] == "session_store_failed"
    assert "could not be written" in r.json()["error"]["message"]
    assert httpx.get(f"{p.url}/health").status_code == 200
    store.close()


def _serve(store) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--model", "tiny", "--port", "0",
           "--store", str(store)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(r"OpenAI base_url: (http://\S+)/v1", line):
            proc.stdout.readline(), proc.stdout.readline()
            stored = proc.stdout.readline()
            assert str(store) in stored, stored
            return proc, m.group(1)
    proc.kill()
    pytest.fail("agentrl serve did not start:\n" + "".join(seen[-40:]))


@pytest.mark.slow
def test_kill_9_mid_load_loses_no_completed_turn(tmp_path):
    """A real server process, four clients running multi-turn sessions, SIGKILL while calls
    are in flight; after a restart on the same store every answered call is in its session
    and the sessions go on. (The tiny model is random: its text may not re-tokenize to what it
    sampled, so a session may hold several segments; #17 item 3 is about that.)"""
    store = tmp_path / "sessions.sqlite"
    proc, base = _serve(store)
    answered: dict[str, list[str]] = {}
    history: dict[str, list[dict]] = {}
    stop = threading.Event()

    def agent(k: int) -> None:
        with httpx.Client(timeout=30) as http:
            for episode in range(1000):
                sid, msgs = f"a{k}-{episode}", [{"role": "user", "content": f"Count to {k}."}]
                for _ in range(4):
                    if stop.is_set():
                        return
                    try:
                        r = http.post(f"{base}/sessions/{sid}/v1/chat/completions",
                                      json={"model": "tiny", "messages": msgs, "max_tokens": 4})
                    except httpx.HTTPError:
                        return  # the server is gone
                    body = r.json()
                    answered.setdefault(sid, []).append(body["id"])
                    msgs = [*msgs, {"role": "assistant",
                                    "content": body["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "And then?"}]
                    history[sid] = msgs

    agents = [threading.Thread(target=agent, args=(k,)) for k in range(4)]
    try:
        for t in agents:
            t.start()
        while sum(map(len, answered.values())) < 40:
            time.sleep(0.05)
        proc.kill()  # SIGKILL, calls in flight
        proc.wait()
        stop.set()
        for t in agents:
            t.join()
        proc, base = _serve(store)
        for sid, calls in answered.items():
            session = httpx.get(f"{base}/sessions/{sid}").json()
            stored = [c for t in session["trajectories"] for c in t["info"]["calls"]]
            assert set(calls) <= set(stored), (sid, calls, stored)
        # A session goes on after the restart: its next call is one more turn of it.
        sid = next(iter(answered))
        before = httpx.get(f"{base}/sessions/{sid}").json()["num_calls"]
        r = httpx.post(f"{base}/sessions/{sid}/v1/chat/completions",
                       json={"model": "tiny", "messages": history[sid], "max_tokens": 4})
        assert r.status_code == 200
        assert httpx.get(f"{base}/sessions/{sid}").json()["num_calls"] == before + 1
    finally:
        stop.set()
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


BAD_REWARDS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"1" + b"0" * 400]


def _chat(url: str, session: str) -> dict:
    r = httpx.post(f"{url}/sessions/{session}/v1/chat/completions",
                   json={"model": "agentrl", "messages": [{"role": "user", "content": "hi"}]})
    r.raise_for_status()
    return r.json()


def _reward(url: str, session: str, raw: bytes) -> httpx.Response:
    return httpx.post(f"{url}/sessions/{session}/reward", content=b'{"reward": ' + raw + b"}",
                      headers={"content-type": "application/json"})


def test_a_reward_that_is_not_a_finite_number_is_refused_before_it_is_stored(make_proxy, tok,
                                                                             tmp_path):
    """#34 item 1: NaN, infinities, 1e400 and a 400-digit integer were answered 500 after they
    were in the log, and from then on every list and export failed, across restarts. So was
    a second 1e308: each reward finite, their sum not."""
    path = tmp_path / "sessions.sqlite"
    store = _open(path, tok)
    p = make_proxy(store=store)
    _chat(p.url, "s")
    assert _reward(p.url, "s", b"0.5").status_code == 200
    for raw in BAD_REWARDS:
        r = _reward(p.url, "s", raw)
        assert r.status_code == 400, (raw[:12], r.text)
        error = r.json()["error"]
        assert (error["param"], error["code"]) == ("reward", "invalid_reward")
        assert "finite number" in error["message"] and "got" in error["message"], error
    assert _reward(p.url, "s", b"1e308").status_code == 200
    r = _reward(p.url, "s", b"1e308")
    assert r.status_code == 400 and "past the float range" in r.json()["error"]["message"]
    summary = httpx.get(f"{p.url}/sessions/s").json()
    assert summary["reward"] == 0.5 + 1e308 and summary["store_errors"] == []
    before = _everything(p)
    assert before[0].count("\n") == 1
    store.close()

    again = _open(path, tok)
    rewards = [json.loads(b)["value"] for (b,) in again._db.execute(
        "SELECT body FROM events WHERE kind = 'reward'")]
    assert rewards == [0.5, 1e308]  # the refused ones never reached the log
    q = make_proxy(store=again)
    assert _everything(q) == before
    again.close()


def test_a_store_holding_bad_values_still_serves_and_exports_everything_else(tok, tmp_path):
    """#34 item 1: a log written before rewards were checked (or damaged on disk) holds a NaN
    reward, two rewards whose sum overflows and a row that is not JSON, all of session "bad".
    After a restart every other session lists and exports in full; "bad" is listed and
    exported with its readable events, flagged (`store_errors`; its trajectories `discard`),
    and no body is cut off."""
    path = tmp_path / "sessions.sqlite"
    store = _open(path, tok)
    with serve_in_thread(create_app(FakeEngine(tok), tok, store)) as url:
        for sid in ("a", "bad", "c"):
            _chat(url, sid)
            assert _reward(url, sid, b"1.0").status_code == 200
        good_before = {sid: httpx.get(f"{url}/sessions/{sid}/export").text for sid in "ac"}
    store.close()  # the server has stopped; now the file goes bad behind its back
    with sqlite3.connect(path) as db:
        rows = [json.dumps({"value": v, "call_id": None, "choice": None, "terminated": True,
                            "truncated": False, "info": {}}) for v in (math.nan, 1e308, 1e308)]
        db.executemany("INSERT INTO events (session, kind, body) VALUES ('bad', 'reward', ?)",
                       [(r,) for r in rows])
        db.execute("INSERT INTO events (session, kind, body) VALUES ('bad', 'reward', '{oops')")

    again = _open(path, tok)
    with serve_in_thread(create_app(FakeEngine(tok), tok, again)) as url:
        listed = httpx.get(f"{url}/sessions")
        assert listed.status_code == 200, listed.text
        by_id = {s["id"]: s for s in listed.json()["data"]}
        assert sorted(by_id) == ["a", "bad", "c"]
        assert by_id["a"]["store_errors"] == by_id["c"]["store_errors"] == []
        errors = by_id["bad"]["store_errors"]
        assert len(errors) == 3 and by_id["bad"]["reward"] == 1.0 + 1e308, errors
        assert "finite number" in errors[0] and "past the float range" in errors[1]
        assert "not JSON" in errors[2]
        for sid in "ac":
            assert httpx.get(f"{url}/sessions/{sid}/export").text == good_before[sid]
            assert httpx.get(f"{url}/sessions/{sid}").status_code == 200
        shown = httpx.get(f"{url}/sessions/bad")
        assert shown.status_code == 200 and shown.json()["store_errors"] == errors
        lines = httpx.get(f"{url}/export").text.splitlines()
        trajs = {t.info["session_id"]: t for t in map(Trajectory.from_json, lines)}
        assert sorted(trajs) == ["a", "bad", "c"]
        assert trajs["bad"].discard and trajs["bad"].info["store_errors"] == errors
        assert not trajs["a"].discard and "store_errors" not in trajs["a"].info
        [one] = httpx.get(f"{url}/sessions/bad/export").text.splitlines()
        assert Trajectory.from_json(one).discard
        _chat(url, "bad")  # the session goes on, still flagged
        assert _reward(url, "bad", b"2.0").status_code == 200
    again.close()


def test_a_session_that_cannot_be_exported_does_not_cut_off_the_export(make_proxy, tok):
    """#34 item 1: one session failing mid-export used to end everyone's body mid-stream."""
    p = make_proxy()
    for sid in ("a", "b", "c"):
        _chat(p.url, sid)

    def broken() -> list:
        raise RuntimeError("cannot merge")

    p.store.get("b").trajectories = broken  # type: ignore[method-assign]
    r = httpx.get(f"{p.url}/export")
    assert r.status_code == 200
    trajs = [Trajectory.from_json(line) for line in r.text.splitlines()]
    assert [t.info["session_id"] for t in trajs] == ["a", "b", "c"]
    assert trajs[1].discard and "cannot merge" in trajs[1].info["export_error"]
    assert not trajs[0].discard and not trajs[2].discard
    assert httpx.get(f"{p.url}/sessions").status_code == 200
