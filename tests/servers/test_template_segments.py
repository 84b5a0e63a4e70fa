"""#32 item 5 through the proxy: a chat template that drops earlier reasoning (tiny-think, as
Qwen3's). A reply the client sends back unchanged is rewritten by the template once a new
question follows: the call is rendered whole, as the template shows it, and starts a segment
of the same episode; that is not drift. A client that changes the text is drift."""

from __future__ import annotations

import pytest

from agentrl.engine.fakes import FakeEngine
from servers.cli import vocabulary_id
from servers.durable import SqliteSessionStore

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def think_tok():
    from agentrl.models import load_tokenizer

    return load_tokenizer("tiny-think")


def _reply(prompt: str, choice: int) -> str:
    n = prompt.count("<|im_start|>user")
    return f"<think>plan {n}</think>ok {n}"


def _sampled(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def _chat(client, questions: list[str], edit=None) -> list[dict]:
    msgs: list[dict] = []
    for q in questions:
        msgs.append({"role": "user", "content": q})
        out = client.chat.completions.create(model="agentrl", messages=msgs, max_tokens=64)
        reply = out.choices[0].message.model_dump(exclude_none=True)
        msgs.append(edit(reply) if edit else reply)
    return msgs


@pytest.mark.parametrize("durable", [False, True])
def test_each_call_after_rewritten_reasoning_is_a_segment_of_the_episode(
        make_proxy, think_tok, tmp_path, durable):
    tok = think_tok
    path, tok_id = tmp_path / "s.db", vocabulary_id(tok)
    store = SqliteSessionStore(path, tokenizer_id=tok_id) if durable else None
    p = make_proxy(FakeEngine(tok, reply=_reply), tokenizer=tok, store=store)
    msgs = _chat(p.client("s"), ["One?", "Two?", "Three?"])
    assert msgs[1]["content"] == "<think>plan 1</think>ok 1"  # the client got it all
    if store is not None:  # what the proxy knew survives a restart
        store.close()
        store = SqliteSessionStore(path, tokenizer_id=tok_id)
        session = store.get("s")
        store.close()
    else:
        session = p.store.get("s")
    trajs = session.trajectories()
    assert len(trajs) == 3 and session.drift_events == 0
    summary = session.summary()
    assert (summary["drift_events"], summary["template_segments"]) == (0, 2)
    asked = [r[0] for r in p.engine.requests]
    for k, t in enumerate(trajs):
        assert t.info["episode"] == "s" and t.info["segment"] == k and not t.info["drift"]
        assert t.info["segment_cause"] == ("template" if k else "start")
        [turn] = t.turns
        # The prompt is exactly what the engine was asked, which is what the template shows:
        # no earlier reasoning. The policy tokens are exactly what was sampled.
        assert t.token_ids[: turn.start] == asked[k]
        shown = tok.decode(asked[k])
        assert "plan" not in shown and all(f"ok {j}" in shown for j in range(1, k + 1))
        assert t.token_ids[turn.start:] == _sampled(tok, f"<think>plan {k + 1}</think>ok {k + 1}")


def test_a_tool_loop_keeps_its_reasoning_and_continues(make_proxy, think_tok):
    """After the last question the template keeps reasoning (as Qwen3's does in a tool loop):
    the tool result continues the sampled tokens, one segment; the next question starts one."""
    tok = think_tok

    def reply(prompt: str, _i: int) -> str:
        return "It is sunny." if "<tool_response>" in prompt else f"<think>look it up</think>{CALL}"

    p = make_proxy(FakeEngine(tok, reply=reply), tokenizer=tok)
    client = p.client("t")
    msgs: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
    r1 = client.chat.completions.create(model="agentrl", messages=msgs, tools=TOOLS)
    msgs.append(r1.choices[0].message.model_dump(exclude_none=True))
    msgs.append({"role": "tool", "tool_call_id": r1.choices[0].message.tool_calls[0].id,
                 "content": "sunny, 21C"})
    r2 = client.chat.completions.create(model="agentrl", messages=msgs, tools=TOOLS)
    msgs += [r2.choices[0].message.model_dump(exclude_none=True),
             {"role": "user", "content": "And tomorrow?"}]
    client.chat.completions.create(model="agentrl", messages=msgs, tools=TOOLS)
    session = p.store.get("t")
    first, second = session.trajectories()
    assert [len(first.turns), len(second.turns)] == [2, 1] and session.drift_events == 0
    assert second.info["segment_cause"] == "template"
    turn = first.turns[0]
    assert first.token_ids[turn.start:turn.end] == _sampled(tok, f"<think>look it up</think>{CALL}")
    assert "look it up" not in tok.decode(second.token_ids[: second.turns[0].start])


def test_a_client_that_drops_the_reasoning_itself_is_drift(make_proxy, think_tok):
    def strip(reply: dict) -> dict:
        return {**reply, "content": reply["content"].split("</think>")[-1]}

    p = make_proxy(FakeEngine(think_tok, reply=_reply), tokenizer=think_tok)
    _chat(p.client("c"), ["One?", "Two?"], edit=strip)
    session = p.store.get("c")
    assert [t.info["segment_cause"] for t in session.trajectories()] == ["start", "drift"]
    assert session.drift_events == 1 and session.summary()["template_segments"] == 0


def test_only_a_template_that_drops_reasoning_is_probed_as_rewriting(tok, think_tok):
    from servers.render import ChatRenderer

    assert ChatRenderer(think_tok).rewrites_history
    assert not ChatRenderer(tok).rewrites_history
