"""`/v1/messages` with the real `anthropic` SDK: answers and streamed events validated against
the SDK's own types, sampled and recorded as chat completions are (a tool round trip is one
trajectory), Anthropic-shaped errors, count_tokens, and sessions by base URL and `x-api-key`."""

from __future__ import annotations

import json

import anthropic
import httpx
import numpy as np
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from agentrl.engine.fakes import FakeEngine, StreamingFakeEngine
from agentrl.models import load_tokenizer
from tests.servers.test_images import _data_url, _img, _png
from tests.servers.test_tool_calls import CALL_TEXT, _tool_reply, one_trajectory_for_the_round_trip

TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
    "additionalProperties": False}}]
EVENTS = TypeAdapter(RawMessageStreamEvent)


def _client(p, session: str | None = None, **kw: object) -> anthropic.Anthropic:
    base = f"{p.url}/sessions/{session}" if session else p.url
    kw.setdefault("api_key", "test")
    return anthropic.Anthropic(base_url=base, max_retries=0, **kw)  # type: ignore[arg-type]


def _events(raw: httpx.Response) -> list:
    """Each SSE event validated against the SDK's union; its `event:` name is its type."""
    out = []
    for block in raw.text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = EVENTS.validate_python(json.loads(data[len("data: "):]), strict=True) if \
            name != "event: ping" else json.loads(data[len("data: "):])
        kind = event["type"] if isinstance(event, dict) else event.type
        assert name == f"event: {kind}"
        out.append(event)
    return out


def _validated(raw: httpx.Response) -> Message:
    return Message.model_validate(raw.json(), strict=True)


def test_a_text_answer_is_a_valid_message_recorded_in_the_session(make_proxy, tok):
    p = make_proxy()
    raw = _client(p, "plain").messages.with_raw_response.create(
        model="agentrl", max_tokens=50, system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hi.",
                                                 "cache_control": {"type": "ephemeral"}}]}],
        metadata={"user_id": "u1"},
        # This SDK's create() no longer names them; older SDKs and harnesses send them.
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 7})
    m = Message.model_validate(raw.http_response.json(), strict=True)
    assert m.id.startswith("msg_") and m.role == "assistant" and m.stop_reason == "end_turn"
    [block] = m.content
    assert block.type == "text" and block.text == "Hello! The answer is 42."
    [traj] = p.store.get("plain").trajectories()
    turn = traj.turns[0]
    assert m.usage.output_tokens == turn.end - turn.start and m.usage.input_tokens == turn.start
    prompt_ids, params, _ = p.engine.requests[0]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (
        0.5, 0.9, 7, 50)
    prompt = tok.decode(prompt_ids)
    assert "Be brief." in prompt and "Say hi." in prompt


@pytest.mark.parametrize("stream_second", [False, True])
def test_a_tool_round_trip_is_one_trajectory(make_proxy, tok, stream_second):
    """The second call continues from the tokens sampled for the tool_use, as chat
    completions do: one trajectory, no drift, whether the answer is streamed or not."""
    p = make_proxy(FakeEngine(tok, reply=_tool_reply(CALL_TEXT)))
    client = _client(p, "tools")
    msgs: list = [{"role": "user", "content": "Weather in Paris?"}]
    kw = {"model": "agentrl", "max_tokens": 200, "tools": TOOLS, "system": "Use tools."}
    r1 = client.messages.create(messages=msgs, **kw)
    [use] = r1.content
    assert r1.stop_reason == "tool_use" and use.type == "tool_use"
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    msgs += [r1.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}]
    if stream_second:
        with client.messages.stream(messages=msgs, **kw) as stream:
            r2 = stream.get_final_message()
    else:
        r2 = client.messages.create(messages=msgs, **kw)
    assert [b.text for b in r2.content if b.type == "text"] == ["It is sunny."]
    second_prompt = one_trajectory_for_the_round_trip(p, tok, "tools")
    assert r2.usage.input_tokens == len(second_prompt)


def test_the_same_conversation_renders_as_its_chat_completion(make_proxy, tok):
    """Same rendering: the Messages request and its chat-completions twin reach the engine as
    the same prompt ids."""
    p = make_proxy(FakeEngine(tok, reply=_tool_reply(CALL_TEXT)))
    _client(p).messages.create(
        model="agentrl", max_tokens=20, system="Use tools.", tools=TOOLS, messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "And tomorrow?"}]}])
    openai_tools = [{"type": "function", "function": {
        "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
        for t in TOOLS]
    _openai = httpx.post(f"{p.url}/v1/chat/completions", json={
        "model": "agentrl", "max_tokens": 20, "tools": openai_tools, "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "t1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
            {"role": "user", "content": "And tomorrow?"}]})
    assert _openai.status_code == 200
    assert p.engine.requests[0][0] == p.engine.requests[1][0]


def test_streamed_events_are_the_sdks_types_and_add_up_to_the_answer(make_proxy):
    p = make_proxy(streaming=True)
    kw = {"model": "agentrl", "max_tokens": 40,
          "messages": [{"role": "user", "content": "Say hi."}]}
    plain = _client(p, "streamed").messages.create(**kw)
    raw = httpx.post(f"{p.url}/sessions/streamed/v1/messages", json={**kw, "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = _events(raw)
    kinds = [e["type"] if isinstance(e, dict) else e.type for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-4:] == ["content_block_delta", "content_block_stop", "message_delta",
                          "message_stop"]
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.stop_reason is None
    text = "".join(e.delta.text for e in events
                   if not isinstance(e, dict) and e.type == "content_block_delta")
    assert text == plain.content[0].text
    delta = events[-2]
    assert delta.delta.stop_reason == "end_turn" and delta.usage.output_tokens == (
        plain.usage.output_tokens)
    with _client(p, "streamed").messages.stream(**kw) as stream:
        assert stream.get_final_message().content[0].text == plain.content[0].text
    trajs = p.store.get("streamed").trajectories()
    assert len({tuple(t.token_ids[t.turns[0].start:]) for t in trajs}) == 1


def test_streamed_tool_use_is_an_input_json_delta(make_proxy, tok):
    reply = "Checking. " + CALL_TEXT
    p = make_proxy(StreamingFakeEngine(tok, reply=reply))
    raw = httpx.post(f"{p.url}/v1/messages", json={
        "model": "agentrl", "max_tokens": 200, "tools": TOOLS, "stream": True,
        "messages": [{"role": "user", "content": "Weather?"}]})
    events = [e for e in _events(raw) if not isinstance(e, dict)]
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use"] and starts[1].input == {}
    [args] = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert json.loads(args) == {"city": "Paris"}
    assert [e.index for e in events if e.type == "content_block_stop"] == [0, 1]
    with _client(p).messages.stream(model="agentrl", max_tokens=200, tools=TOOLS, messages=[
            {"role": "user", "content": "Weather?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"}


def test_stop_sequences_and_max_tokens_set_the_stop_reason(make_proxy):
    p = make_proxy()
    client = _client(p)
    msgs = [{"role": "user", "content": "hi"}]
    r = client.messages.create(model="agentrl", max_tokens=50, messages=msgs,
                               stop_sequences=["zzz", "answer"])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "answer")
    assert r.content[0].text == "Hello! The "
    r = client.messages.create(model="agentrl", max_tokens=2, messages=msgs)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2
    with client.messages.stream(model="agentrl", max_tokens=50, messages=msgs,
                                stop_sequences=["answer"]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "answer")


@pytest.mark.parametrize(("choice", "grammar", "parallel_off"), [
    ({"type": "auto"}, False, False),
    ({"type": "any"}, True, False),
    ({"type": "tool", "name": "get_weather"}, True, False),
    ({"type": "auto", "disable_parallel_tool_use": True}, True, True),
])
def test_tool_choice_constrains_sampling_as_chat_does(make_proxy, tok, choice, grammar,
                                                      parallel_off):
    p = make_proxy(FakeEngine(tok, reply=CALL_TEXT))
    r = _client(p).messages.create(model="agentrl", max_tokens=200, tools=TOOLS,
                                   tool_choice=choice,  # type: ignore[arg-type]
                                   messages=[{"role": "user", "content": "Weather?"}])
    assert r.stop_reason == "tool_use"
    params = p.engine.requests[0][1]
    assert (params.grammar is not None) == grammar
    if parallel_off:
        assert "<tool_call>" in params.grammar


def test_tool_choice_none_leaves_tools_out(make_proxy, tok):
    p = make_proxy(FakeEngine(tok, reply=CALL_TEXT))
    r = _client(p).messages.create(model="agentrl", max_tokens=200, tools=TOOLS,
                                   tool_choice={"type": "none"},
                                   messages=[{"role": "user", "content": "Weather?"}])
    assert r.stop_reason == "end_turn" and r.content[0].text == CALL_TEXT
    assert "get_weather" not in tok.decode(p.engine.requests[0][0])


def test_image_blocks_reach_the_models_processor(make_proxy):
    vlm_tok = load_tokenizer("tiny-llava")
    p = make_proxy(tokenizer=vlm_tok)
    a = _img(0)
    url = _data_url(_png(a))
    _client(p, "vlm").messages.create(model="agentrl", max_tokens=20, messages=[{
        "role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": url.split(",", 1)[1]}}]}])
    assert p.engine.requests[-1][2] == 1
    [traj] = p.store.get("vlm").trajectories()
    [im] = traj.images
    assert np.array_equal(im.pixels, a) and im.end - im.start == 16
    # A text-only model refuses images, in Anthropic's shape.
    q = make_proxy()
    with pytest.raises(anthropic.BadRequestError, match="no image processor") as e:
        _client(q).messages.create(model="agentrl", max_tokens=20, messages=[{
            "role": "user", "content": [{"type": "image", "source": {
                "type": "url", "url": url}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"


BAD = [
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     400, "blocks of type 'document' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "txt", "text": "hi"}]}]},
     400, "did you mean 'text'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
     400, "unexpected `tool_use_id` found in `tool_result` blocks: nope"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": "and?"}]},
     400, "messages.1: `tool_use` ids were found without `tool_result` blocks"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "text", "text": "x"}, {
            "type": "tool_result", "tool_use_id": "t1"}]}]},
     400, "tool_result blocks must come first"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}]},
     400, "tool_use blocks may only be in assistant messages"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "The answer is"}]},
     400, "prefill"),
    ({"max_tokens": None}, 400, "missing required field 'max_tokens'"),
    ({"max_tokens": "10"}, 400, "max_tokens"),
    ({"temperature": 3.0}, 400, "temperature"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400,
     "only client tools"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, 400,
     "not among the tools"),
    ({"model": "claude-sonnet-4-5"}, 404, "does not exist"),
]


@pytest.mark.parametrize(("extra", "status", "says"), BAD)
def test_bad_input_gets_anthropic_shaped_errors(make_proxy, extra, status, says):
    p = make_proxy()
    body = {"model": "agentrl", "max_tokens": 20,
            "messages": [{"role": "user", "content": "hi"}], **extra}
    body = {k: v for k, v in body.items() if v is not None}
    raw = httpx.post(f"{p.url}/v1/messages", json=body)
    assert raw.status_code == status, raw.text
    err = ErrorResponse.model_validate(raw.json(), strict=True)
    assert says in err.error.message
    assert err.error.type == ("not_found_error" if status == 404 else "invalid_request_error")
    assert raw.headers["x-should-retry"] == "false"


def test_errors_through_the_sdk_and_elsewhere_keep_their_shapes(make_proxy):
    p = make_proxy(max_tokens_default=None)
    client = _client(p)
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):
        client.messages.create(model="agentrl", max_tokens=10, messages=[
            {"role": "user", "content": "word " * 5000}])
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=10,
                               messages=[{"role": "user", "content": "hi"}])
    # Only this route answers in Anthropic's shape: chat completions keep OpenAI's.
    raw = httpx.post(f"{p.url}/v1/chat/completions", json={"model": "nope", "messages": []})
    assert raw.status_code in (400, 404) and "type" not in raw.json()
    # The streamed error event is the SDK's APIStatusError.
    p.engine.fail_with = RuntimeError("boom")
    with pytest.raises(anthropic.APIStatusError, match="boom"), client.messages.stream(
            model="agentrl", max_tokens=10, messages=[{"role": "user", "content": "hi"}]) as s:
        s.get_final_message()


def test_count_tokens_is_the_rendered_prompt(make_proxy, tok):
    p = make_proxy()
    kw = {"model": "agentrl", "system": "Use tools.", "tools": TOOLS,
          "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    raw = _client(p, "counted").messages.with_raw_response.count_tokens(**kw)
    count = MessageTokensCount.model_validate(raw.http_response.json(), strict=True)
    assert not p.store.list()  # counting opens no session and samples nothing
    r = _client(p).messages.create(max_tokens=5, **kw)
    assert count.input_tokens == r.usage.input_tokens == len(p.engine.requests[0][0])
    assert "Weather in Paris?" in tok.decode(p.engine.requests[0][0])


def test_anthropic_base_url_and_x_api_key_bind_the_session(make_proxy, monkeypatch):
    """With ANTHROPIC_BASE_URL set to the session's URL the unmodified SDK's calls land in
    that session; an `x-api-key` is taken as the bearer token (for auth, and for a
    `session-<id>` key)."""
    p = make_proxy()
    monkeypatch.setenv("ANTHROPIC_BASE_URL", f"{p.url}/sessions/env-bound")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "anything")
    anthropic.Anthropic(max_retries=0).messages.create(
        model="agentrl", max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert len(p.store.get("env-bound").trajectories()) == 1
    body = {"model": "agentrl", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}
    raw = httpx.post(f"{p.url}/v1/messages", json=body, headers={"x-api-key": "session-k1"})
    assert raw.status_code == 200 and len(p.store.get("k1").trajectories()) == 1

    guarded = make_proxy(api_keys=("secret",))
    ok = httpx.post(f"{guarded.url}/v1/messages", json=body, headers={"x-api-key": "secret"})
    assert ok.status_code == 200
    bad = httpx.post(f"{guarded.url}/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert bad.status_code == 401
    err = ErrorResponse.model_validate(bad.json(), strict=True)
    assert err.error.type == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        _client(guarded, api_key="wrong").messages.create(**body)  # type: ignore[arg-type]
    assert _client(guarded, api_key="secret").messages.create(**body).content  # type: ignore[arg-type]


def test_greedy_stream_and_not_sample_the_same_tokens_on_the_real_engine(real_proxy):
    client = _client(real_proxy, "real")
    kw = {"model": "agentrl", "max_tokens": 12, "extra_body": {"temperature": 0.0},
          "messages": [{"role": "user", "content": "Count: one two"}]}
    plain = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in plain.content]
    assert streamed.usage == plain.usage
    trajs = real_proxy.store.get("real").trajectories()
    sampled = {tuple(t.token_ids[t.turns[0].start:t.turns[0].end]) for t in trajs}
    assert len(sampled) == 1


def test_output_format_constrains_the_text_to_its_schema(make_proxy, tok):
    """Structured outputs (`output_config.format`) are chat's `response_format`: a grammar."""
    p = make_proxy(FakeEngine(tok, reply='{"city": "Paris"}'))
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    r = _client(p).messages.create(
        model="agentrl", max_tokens=50, messages=[{"role": "user", "content": "Where?"}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    assert json.loads(r.content[0].text) == {"city": "Paris"}
    assert p.engine.requests[0][1].grammar is not None
    bad = httpx.post(f"{p.url}/v1/messages", json={
        "model": "agentrl", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "strang"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
