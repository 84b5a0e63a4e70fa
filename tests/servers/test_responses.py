"""`/v1/responses` with the real openai SDK: answers and streamed events validated against the
SDK's own types, tool round trips merged into one trajectory, and bad input refused."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from agentrl.engine.fakes import FakeEngine
from tests.servers.test_tool_calls import CALL_TEXT, _tool_reply, one_trajectory_for_the_round_trip

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "strict": True, "parameters": {
              "type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}}]
EVENTS = TypeAdapter(ResponseStreamEvent)


def _proxy(make_proxy, tok):
    return make_proxy(FakeEngine(tok, reply=_tool_reply(CALL_TEXT)))


def test_a_text_answer_is_a_valid_response_recorded_in_the_session(make_proxy, tok):
    p = make_proxy()
    client = p.client("plain")
    raw = client.responses.with_raw_response.create(
        model="agentrl", input="Say hi.", instructions="Be brief.", max_output_tokens=50,
        include=["message.output_text.logprobs"], top_logprobs=2)
    r = Response.model_validate(raw.http_response.json(), strict=True)
    [message] = r.output
    assert message.type == "message" and r.status == "completed" and r.output_text
    [traj] = p.store.get("plain").trajectories()
    turn = traj.turns[0]
    sampled = traj.token_ids[turn.start:turn.end]
    assert r.usage.output_tokens == len(sampled) and r.usage.input_tokens == turn.start
    logprobs = message.content[0].logprobs
    assert [lp.logprob for lp in logprobs] == pytest.approx(
        [traj.logprobs[i] for i in range(turn.start, turn.end)
         if traj.token_ids[i] not in p.engine.tokenizer.all_special_ids])
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)
    prompt = tok.decode(p.engine.requests[0][0])
    assert "Be brief." in prompt and "Say hi." in prompt


@pytest.mark.parametrize("how", ["previous_response_id", "items sent back"])
def test_a_tool_round_trip_is_one_trajectory(make_proxy, tok, how):
    """#17 item 5: the second turn continues from the tokens sampled for the call, whether the
    client names the previous response or sends its output items back (the Agents SDK)."""
    p = _proxy(make_proxy, tok)
    client = p.client("tools")
    items: list = [{"role": "user", "content": "Weather in Paris?"}]
    r1 = client.responses.create(model="agentrl", input=items, tools=TOOLS,
                                 instructions="Use tools.")
    [call] = r1.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    if how == "previous_response_id":
        r2 = client.responses.create(model="agentrl", previous_response_id=r1.id,
                                     input=[result], tools=TOOLS, instructions="Use tools.")
    else:
        items += [o.model_dump(exclude_none=True) for o in r1.output] + [result]
        r2 = client.responses.create(model="agentrl", input=items, tools=TOOLS,
                                     instructions="Use tools.")
    assert r2.output_text == "It is sunny." and r2.previous_response_id == (
        r1.id if how == "previous_response_id" else None)
    one_trajectory_for_the_round_trip(p, tok, "tools")


def test_streamed_events_are_the_sdks_and_add_up_to_the_answer(make_proxy, tok):
    p = make_proxy()
    client = p.client("streamed")
    kw = {"model": "agentrl", "input": "Say hi.", "max_output_tokens": 40}
    plain = client.responses.create(**kw)
    raw = httpx.post(f"{p.url}/sessions/streamed/v1/responses", json={**kw, "stream": True})
    events = [EVENTS.validate_python(json.loads(line[len("data: "):]), strict=True)
              for line in raw.text.splitlines() if line.startswith("data: ")]
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text == events[-1].response.output_text
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert final.output_text == plain.output_text
    trajs = p.store.get("streamed").trajectories()
    assert len({tuple(t.token_ids[t.turns[0].start:]) for t in trajs}) == 1


def test_streamed_tool_calls(make_proxy, tok):
    p = _proxy(make_proxy, tok)
    stream = p.client().responses.create(model="agentrl", input="Weather?", tools=TOOLS,
                                         stream=True)
    events = list(stream)
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert final.status == "completed" and final.output[0].type == "function_call"


def test_bad_input_gets_openai_shaped_400s(make_proxy, tok):
    p = _proxy(make_proxy, tok)
    client = p.client("a")
    first = client.responses.create(model="agentrl", input="hi")
    cases = [
        ({"previous_response_id": "resp_nope"}, "not found in this session"),
        ({"tools": [{"type": "web_search"}]}, "only function tools are supported"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "not supported"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
         "not among the tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
            "type": "strang"}}}}, "cannot be compiled"),
    ]
    for extra, says in cases:
        kw = {"model": "agentrl", "input": "hi", **extra}
        with pytest.raises(openai.BadRequestError, match=says):
            client.responses.create(**kw)
    # A response is continued only from the session that answered it.
    with pytest.raises(openai.BadRequestError, match="not found in this session"):
        p.client("b").responses.create(model="agentrl", input="hi",
                                       previous_response_id=first.id)
    assert client.responses.create(model="agentrl", input="still alive").output_text


@pytest.mark.slow
async def test_the_agents_sdks_default_model_runs_unmodified(make_proxy, tok):
    """The Agents SDK's default model is its Responses model: a tool-using agent runs against
    the proxy and its episode is one trajectory."""
    agents = pytest.importorskip("agents")
    p = _proxy(make_proxy, tok)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=f"{p.url}/sessions/agent/v1", api_key="x",
                                max_retries=0)
    model = agents.OpenAIResponsesModel(model="agentrl", openai_client=client)
    bot = agents.Agent(name="w", instructions="Use tools.", tools=[get_weather], model=model)
    result = await agents.Runner.run(bot, "Weather in Paris?", max_turns=3,
                                     run_config=agents.RunConfig(tracing_disabled=True))
    assert calls == ["Paris"] and result.final_output == "It is sunny."
    session = p.store.get("agent")
    assert session.drift_events == 0 and [len(t.turns) for t in session.trajectories()] == [2]
