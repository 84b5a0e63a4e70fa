"""Requests refused whole (#34 items 2 and 3): every sampling number has a range, and a value
outside it, a `logit_bias` key that is not a plain token id, an empty prompt or a malformed
Responses item is an OpenAI-shaped 400 naming the field, before anything reaches the engine
or the session. One session's bad request never fails another session's."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

MSGS = [{"role": "user", "content": "What is 6 * 7?"}]
CHAT = {"model": "agentrl", "messages": MSGS}
COMPLETION = {"model": "agentrl", "prompt": "What is 6 * 7?"}
RESPONSE = {"model": "agentrl", "input": "What is 6 * 7?"}
NAN, INF = float("nan"), float("inf")


def _post(url: str, body: dict) -> httpx.Response:
    """`body` as Python's json writes it: NaN and Infinity as the bare words (not JSON, but
    what a careless client sends)."""
    return httpx.post(url, content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"})


def _refused(proxy, r: httpx.Response, param: str, *says: str) -> None:
    """A 400 naming `param`, saying each of `says`; nothing sampled, nothing recorded."""
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for text in says:
        assert text in error["message"], error["message"]
    assert proxy.engine.requests == []
    assert all(not s.calls for s in proxy.store.list())


OUT_OF_RANGE = [
    # (where, field, value, the range the message names)
    ("chat", "top_k", 2**63, "[0, 2147483647]"),
    ("chat", "top_k", -1, "[0, 2147483647]"),
    ("chat", "seed", 2**64, "[-9223372036854775808, 9223372036854775807]"),
    ("chat", "max_tokens", 2**63, "[1, 2147483647]"),
    ("chat", "max_completion_tokens", 0, "[1, 2147483647]"),
    ("chat", "temperature", NAN, "[0, 2]"),
    ("chat", "top_p", INF, "(0, 1]"),
    ("chat", "n", 65, "[1, 64]"),
    ("chat", "frequency_penalty", -INF, "[-2, 2]"),
    ("completions", "top_k", 2**63, "[0, 2147483647]"),
    ("completions", "logprobs", 21, "[0, 20]"),
    ("responses", "max_output_tokens", 2**63, "[1, 2147483647]"),
    ("responses", "temperature", 1e400, "[0, 2]"),
]
ROUTES = {"chat": ("/v1/chat/completions", CHAT), "completions": ("/v1/completions", COMPLETION),
          "responses": ("/v1/responses", RESPONSE)}


@pytest.mark.parametrize(("where", "field", "value", "bounds"), OUT_OF_RANGE,
                         ids=[f"{c[0]}-{c[1]}={c[2]!r:.12}" for c in OUT_OF_RANGE])
def test_a_sampling_number_out_of_its_range_is_a_400_naming_field_and_range(
        proxy, where, field, value, bounds):
    path, body = ROUTES[where]
    r = _post(f"{proxy.url}/sessions/s{path}", {**body, field: value})
    _refused(proxy, r, field, f"'{field}'", bounds)


def test_one_sessions_bad_top_k_never_fails_another_sessions_request(real_proxy):
    """#34 item 2: top_k = 2**63 was a 500 that also failed the request batched with it."""
    good = {**CHAT, "temperature": 0, "max_tokens": 12}
    alone = httpx.post(f"{real_proxy.url}/sessions/ref/v1/chat/completions", json=good)
    assert alone.status_code == 200

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=real_proxy.url, timeout=60) as c:
            return await asyncio.gather(
                c.post("/sessions/bad/v1/chat/completions", json={**good, "top_k": 2**63}),
                c.post("/sessions/good/v1/chat/completions", json=good))

    bad, ok = asyncio.run(both())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_k", bad.text
    assert ok.status_code == 200, ok.text
    assert (ok.json()["choices"][0]["message"]["content"]
            == alone.json()["choices"][0]["message"]["content"])
    assert not real_proxy.store.get("bad") or not real_proxy.store.get("bad").calls


@pytest.mark.parametrize("key", ["²", "⑴", "١٢", "𝟙", "9" * 4301, "-1", " 1", "+1", "1.0", ""])
def test_logit_bias_keys_must_be_plain_ascii_token_ids(proxy, tok, key):
    """#34 item 3: "²", "⑴" and a 4,301-digit key were 500s; "١٢" and "𝟙" became ids 12, 1."""
    says = f"[0, {len(tok)})" if key.isascii() and key.isdigit() else "ASCII digits"
    for path, body in (ROUTES["chat"], ROUTES["completions"]):
        r = _post(f"{proxy.url}/sessions/s{path}", {**body, "logit_bias": {key: 5}})
        _refused(proxy, r, "logit_bias", says)
        assert len(r.json()["error"]["message"]) < 300  # a long key is not echoed whole


def test_logit_bias_out_of_the_vocabulary_or_range_is_a_400(proxy, tok):
    r = _post(f"{proxy.url}/sessions/s/v1/chat/completions",
              {**CHAT, "logit_bias": {str(len(tok)): 5}})
    _refused(proxy, r, "logit_bias", f"[0, {len(tok)})")
    r = _post(f"{proxy.url}/sessions/s/v1/chat/completions", {**CHAT, "logit_bias": {"5": NAN}})
    _refused(proxy, r, "logit_bias", "[-100, 100]")
    r = _post(f"{proxy.url}/sessions/s/v1/chat/completions", {**CHAT, "logit_bias": {"5": 7}})
    assert r.status_code == 200 and proxy.engine.requests[0][1].logit_bias == ((5, 7.0),)


@pytest.mark.parametrize("prompt", [[""], "", []])
def test_an_empty_text_prompt_is_a_400(proxy, prompt):
    """#34 item 3: {"prompt": [""]} reached the engine: 500 "prompt_ids is empty"."""
    r = _post(f"{proxy.url}/sessions/s/v1/completions", {**COMPLETION, "prompt": prompt})
    _refused(proxy, r, "prompt", "empty")


def test_a_nan_in_a_responses_tool_is_a_400_and_records_nothing(proxy):
    """#34 item 3: answered 500 after the turn was recorded (the answer echoes the tools)."""
    tool = {"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number", "maximum": NAN}}}}
    r = _post(f"{proxy.url}/sessions/s/v1/responses", {**RESPONSE, "tools": [tool]})
    _refused(proxy, r, "tools.0.parameters", "properties.x.maximum", "finite number")
    chat_tool = {"type": "function", "function": {"name": "f", "parameters": {"default": INF}}}
    r = _post(f"{proxy.url}/sessions/s/v1/chat/completions", {**CHAT, "tools": [chat_tool]})
    _refused(proxy, r, "tools.0.function.parameters", "default", "finite number")


@pytest.mark.parametrize("kind", [["function_call"], {"x": 1}, 7, None])
def test_a_responses_item_type_that_is_not_a_string_is_a_400(proxy, kind):
    """#34 item 3: a list type was a 500 (unhashable list)."""
    item = {"type": kind, "call_id": "c", "name": "f", "arguments": "{}"}
    r = _post(f"{proxy.url}/sessions/s/v1/responses", {**RESPONSE, "input": [item]})
    _refused(proxy, r, "input.0", "`type` must be a string", "'function_call'", "'message'")
