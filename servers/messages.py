"""`POST /v1/messages`: the Anthropic Messages API (what Claude-Code-style harnesses speak),
streaming (typed SSE events) and not, and `POST /v1/messages/count_tokens`.

A Messages request is translated into a chat request (`system` -> a system message, text and
image blocks -> message content, `tool_use` blocks -> the assistant's tool calls, `tool_result`
blocks -> tool messages, `tools` -> function tools, `tool_choice`, `stop_sequences`,
`output_config.format` -> `response_format`) and then
goes through exactly the chat path (servers/chat_completions.py): the same rendering,
constraints, sampling, recording and continuation from the tokens sampled for a reply the
client sends back, so a tool round trip is one trajectory. Only the shape differs: content
blocks and a `stop_reason` in the answer, the `message_start` ... `message_stop` events when
streamed, and Anthropic-shaped errors (`{"type": "error", "error": {"type", "message"}}`).

Not served: a final assistant message to continue (prefill), thinking and document blocks,
server tools, images inside `tool_result`; each is refused with a 400. `is_error` on a tool
result is accepted; the result's text is rendered as any other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import ValidationError

from agentrl.completion import Completion
from servers.anthropic_schemas import (
    CountTokensRequest,
    ImageBlock,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlock,
    ToolUseBlock,
)
from servers.chat_completions import ChatCall, prepare, respond
from servers.config import ProxyState
from servers.errors import (
    APIError,
    anthropic_error_body,
    anthropic_error_response,
    validation_message,
)
from servers.generation import (
    Accumulator,
    check_model,
    engine_stream,
    off_loop,
    parse_request,
    refused_unsampled,
    render_cost_us,
    stored,
)
from servers.images import load_images
from servers.openai_schemas import ChatCompletionRequest
from servers.render import message_chars
from servers.streaming import ChoiceText
from servers.tools import ParseEvent, ToolCall

log = logging.getLogger(__name__)


class AnthropicRoute(APIRoute):
    """A route whose errors take Anthropic's shape (the app's handlers answer OpenAI's)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except APIError as e:
                return anthropic_error_response(e)
            except Exception as e:
                log.exception("unhandled error in the proxy")
                return anthropic_error_response(APIError(
                    500, f"internal error in the proxy: {type(e).__name__}: {e}"))

        return route


router = APIRouter(route_class=AnthropicRoute)
_warned: set[str] = set()


def _bad(message: str) -> APIError:
    return APIError(400, message, param="messages")


def _assistant(k: int, m: MessageParam) -> tuple[dict, list[str]]:
    """An assistant message as a chat message, and its tool_use ids. Its text blocks are
    joined as they were split: around the tool calls of one reply."""
    blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
    texts: list[str] = []
    calls: list[dict] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        else:
            raise _bad(f"messages.{k}.content.{j}: {b.type} blocks may only be in user "
                       f"messages, not in an assistant one")
    text = "".join(texts)
    out: dict = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        out["tool_calls"] = calls
    return out, [c["id"] for c in calls]


def _user(k: int, m: MessageParam, expected: list[str]) -> list[dict]:
    """A user message as chat messages: its tool results (which come first, one for each
    tool_use of the assistant message before it) as tool messages, then the rest."""
    if isinstance(m.content, str):
        if expected:
            raise _missing_results(k - 1, expected)
        return [{"role": "user", "content": m.content}]
    if not m.content:
        raise _bad(f"messages.{k}: a user message needs non-empty content")
    out: list[dict] = []
    answered: list[str] = []
    rest: list[TextBlock | ImageBlock] = []
    for j, b in enumerate(m.content):
        where = f"messages.{k}.content.{j}"
        if isinstance(b, ToolResultBlock):
            if rest:
                raise _bad(f"{where}: tool_result blocks must come first in a user message, "
                           f"before any text or image block")
            if b.tool_use_id not in expected:
                raise _bad(f"{where}: unexpected `tool_use_id` found in `tool_result` blocks: "
                           f"{b.tool_use_id}. Each `tool_result` block must have a "
                           f"corresponding `tool_use` block in the previous message.")
            if b.tool_use_id in answered:
                raise _bad(f"{where}: a second `tool_result` for tool_use id "
                           f"{b.tool_use_id}; send one result per `tool_use`")
            if not isinstance(b.content, str) and any(
                    isinstance(c, ImageBlock) for c in b.content):
                raise _bad(f"{where}: images inside a tool_result are not supported by this "
                           f"server; send the image in a user image block after the results")
            answered.append(b.tool_use_id)
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()})
        elif isinstance(b, ToolUseBlock):
            raise _bad(f"{where}: tool_use blocks may only be in assistant messages")
        elif isinstance(b, TextBlock | ImageBlock):
            rest.append(b)
    missing = [i for i in expected if i not in answered]
    if missing:
        raise _missing_results(k - 1, missing)
    if rest and all(isinstance(b, TextBlock) for b in rest):
        out.append({"role": "user", "content": "\n\n".join(
            b.text for b in rest if isinstance(b, TextBlock))})
    elif rest:
        out.append({"role": "user", "content": [
            {"type": "text", "text": b.text} if isinstance(b, TextBlock)
            else {"type": "image_url", "image_url": {"url": b.url()}} for b in rest]})
    return out


def _missing_results(k: int, ids: list[str]) -> APIError:
    return _bad(f"messages.{k}: `tool_use` ids were found without `tool_result` blocks "
                f"immediately after: {', '.join(ids)}. Each `tool_use` block must have a "
                f"corresponding `tool_result` block in the next message.")


def chat_messages(req: CountTokensRequest) -> list[dict]:
    """The request's conversation as chat messages, its tool_use/tool_result pairing checked."""
    system = req.system_text()
    out: list[dict] = [{"role": "system", "content": system}] if system else []
    expected: list[str] = []
    seen: set[str] = set()
    for k, m in enumerate(req.messages):
        if m.role == "assistant":
            if expected:
                raise _missing_results(k - 1, expected)
            message, expected = _assistant(k, m)
            if again := [i for i in expected if i in seen]:
                raise _bad(f"messages.{k}: tool_use ids must be unique in a conversation; "
                           f"{', '.join(again)} came before")
            seen.update(expected)
            out.append(message)
        else:
            out += _user(k, m, expected)
            expected = []
    if req.messages[-1].role == "assistant":
        raise _bad(f"messages.{len(req.messages) - 1}: the last message must be a user "
                   f"message; continuing a final assistant message (prefill) is not supported "
                   f"by this server")
    return out


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that `req` is answered as."""
    if req.thinking is not None and "thinking" not in _warned:
        _warned.add("thinking")
        log.warning("thinking=%s is accepted but ignored: this server writes no thinking "
                    "blocks", req.thinking)
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in req.tools]
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceNone):
        body["tool_choice"] = "none"
    elif isinstance(choice, ToolChoiceAuto):
        body["tool_choice"] = "auto" if req.tools else None
    elif isinstance(choice, ToolChoiceAny):
        body["tool_choice"] = "required"
    elif choice is not None:
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    if choice is not None and not isinstance(choice, ToolChoiceNone) and \
            choice.disable_parallel_tool_use:
        body["parallel_tool_calls"] = False
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output_format", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(400, message, param=param) from None


async def _chat(req: CountTokensRequest) -> ChatCompletionRequest:
    # Blocks are converted and validated again as chat messages: off the loop when many.
    return await off_loop(render_cost_us(len(req.messages)), chat_request, req)


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    req = await parse_request(MessagesRequest, request, state)
    call = await prepare(state, request, await _chat(req))
    call.id = "msg_" + secrets.token_hex(12)  # the session records the call under this id
    stream = _stream(call, req) if req.stream else None
    return await respond(call, request, stream, functools.partial(_respond, call, req))


async def _respond(call: ChatCall, req: MessagesRequest, completions: list[Completion],
                   texts: list[ChoiceText]) -> Response:
    [completion], [text] = completions, texts
    content: list[dict] = [{"type": "text", "text": text.content}] if text.content else []
    content += [_tool_use(c) for c in text.calls]
    return JSONResponse(_message(call, req, content, completion, text))


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    """The prompt's tokens as `/v1/messages` renders it afresh (a session's call that continues
    from sampled tokens may differ by the few tokens a re-render would change)."""
    state: ProxyState = request.app.state.proxy
    req = await parse_request(CountTokensRequest, request, state)
    check_model(state, req.model)
    chat = await _chat(req)
    tools = chat.tools if chat.tool_choice != "none" else None
    images = await load_images(chat.messages, state.config,
                               vision=state.renderer.processor is not None)
    cost = render_cost_us(len(chat.messages) + len(tools or ()),
                          message_chars(chat.messages, tools))
    rendered = await off_loop(cost, state.renderer.render_chat, chat.messages, tools,
                              images=images)
    return JSONResponse({"input_tokens": len(rendered.ids)})


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": json.loads(call.arguments)}


def _stop(completion: Completion | None, text: ChoiceText) -> tuple[str | None, str | None]:
    """`stop_reason` and `stop_sequence`. A stop sequence is found by the engine (its
    `stop_reason`, the text left out) or in the decoded text (the earliest, as `ChoiceText`
    cuts there)."""
    if completion is None:
        return None, None
    if text.calls:
        return "tool_use", None
    if text.stopped:
        hits = [(at, s) for s in text.stops if (at := text.text.find(s)) >= 0]
        return "stop_sequence", min(hits)[1] if hits else None
    if isinstance(completion.stop_reason, str) and completion.stop_reason in text.stops:
        return "stop_sequence", completion.stop_reason
    return ("max_tokens" if completion.finish_reason == "length" else "end_turn"), None


def _usage(call: ChatCall, completion: Completion | None) -> dict:
    return {"input_tokens": len(call.rendered.ids),
            "output_tokens": len(completion.token_ids) if completion is not None else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _message(call: ChatCall, req: MessagesRequest, content: list[dict],
             completion: Completion | None, text: ChoiceText) -> dict:
    reason, sequence = _stop(completion, text)
    return {"id": call.id, "type": "message", "role": "assistant", "model": req.model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": _usage(call, completion)}


def _event(kind: str, **fields: Any) -> bytes:
    data = json.dumps({"type": kind, **fields}, separators=(",", ":"), ensure_ascii=False)
    return f"event: {kind}\ndata: {data}\n\n".encode()


class _Blocks:
    """The content blocks of a streamed answer, as events: text deltas go to the open text
    block, each tool call is a block of its own (its input in one `input_json_delta`)."""

    def __init__(self) -> None:
        self.index = -1
        self.open_text = False

    def close(self) -> list[bytes]:
        if not self.open_text:
            return []
        self.open_text = False
        return [_event("content_block_stop", index=self.index)]

    def __call__(self, events: list[ParseEvent]) -> list[bytes]:
        out: list[bytes] = []
        for e in events:
            if e.call is None:
                if not e.content:
                    continue
                if not self.open_text:
                    self.index += 1
                    self.open_text = True
                    out.append(_event("content_block_start", index=self.index,
                                      content_block={"type": "text", "text": ""}))
                out.append(_event("content_block_delta", index=self.index,
                                  delta={"type": "text_delta", "text": e.content}))
                continue
            out += self.close()
            self.index += 1
            block = _tool_use(e.call)
            out += [_event("content_block_start", index=self.index,
                           content_block={**block, "input": {}}),
                    _event("content_block_delta", index=self.index, delta={
                        "type": "input_json_delta", "partial_json": e.call.arguments}),
                    _event("content_block_stop", index=self.index)]
        return out


async def _stream(call: ChatCall, req: MessagesRequest) -> AsyncIterator[bytes]:
    text = call.choice_text()
    acc = Accumulator()
    blocks = _Blocks()
    status = "aborted"
    stop_reason: str | int | None = None  # the engine's, on its last delta
    try:
        yield _event("message_start", message=_message(call, req, [], None, text))
        yield _event("ping")
        rendered = call.rendered
        async for d in engine_stream(call.state, rendered.ids, call.params, rendered.images,
                                     grammar_param=call.grammar_param):
            acc.add(d)
            for chunk in blocks(text.push(d.token_ids)):
                yield chunk
            if d.finish_reason is not None:
                stop_reason = d.stop_reason
                for chunk in blocks(text.finish()):
                    yield chunk
        if acc.finish_reason in (None, "abort"):
            raise APIError(503, "the engine ended the stream early (aborted); retry",
                           retry_after=1)
        for chunk in blocks.close():
            yield chunk
        completion = dataclasses.replace(acc.completion(), stop_reason=stop_reason)
        status = "done"
        call.record([completion], aborted=False, texts=[text])
        await stored(call.state)
        reason, sequence = _stop(completion, text)
        yield _event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                     usage={"output_tokens": len(completion.token_ids)})
        yield _event("message_stop")
    except asyncio.CancelledError:
        raise  # client disconnected: the engine stream is closed, the call recorded aborted
    except APIError as e:
        if status != "done":  # (once recorded, a store failure leaves the call as it is)
            status = "refused" if refused_unsampled(e, [acc]) else "error"
        yield _event("error", **_error_fields(e.status, e.message, e.code))
    except Exception as e:
        log.exception("engine failed mid-stream")
        status = "error"
        yield _event("error", **_error_fields(
            500, f"the engine failed mid-stream: {type(e).__name__}: {e}", None))
    finally:
        if call.session is not None:
            call.session.in_flight -= 1
        if status not in ("done", "refused"):
            call.record([acc.completion()], aborted=True, texts=[text])


def _error_fields(status: int, message: str, code: str | None) -> dict:
    return {"error": anthropic_error_body(status, message, code)["error"]}
