"""`POST /v1/responses`: the OpenAI Responses API, streaming (typed SSE events) and not.

A Responses request is translated into a chat request (input items -> messages, `instructions`
-> a system message, function tools, `text.format` -> `response_format`, the conversation of
`previous_response_id` in front) and then goes through exactly the chat path: the same
rendering, constraints, sampling, recording and merging into the session's trajectories. Only
the shape of the answer differs: output items (a message, function calls) and, when streamed,
the `response.*` events.

Supported: text and image inputs, `instructions`, function tools with `tool_choice` (auto,
none, required, a named function) and `parallel_tool_calls`, function-call items and their
outputs sent back, `previous_response_id` (answered in the same session, kept in memory),
`text.format` (text, json_object, json_schema), `max_output_tokens`, `temperature`, `top_p`,
`top_logprobs` with `include: ["message.output_text.logprobs"]`. Built-in tools (web search,
file search, ...) and `item_reference` items are refused with a 400.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import secrets
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import (
    ValidationError,
)

from agentrl.completion import Completion
from servers.chat_completions import ChatCall, prepare, respond
from servers.config import ProxyState
from servers.errors import APIError, validation_message
from servers.generation import (
    Accumulator,
    bind_session,
    engine_stream,
    off_loop,
    parse_request,
    refused_unsampled,
    render_cost_us,
    stored,
)
from servers.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputImage,
    InputText,
    MessageItem,
    Refusal,
    ResponsesNamedFunction,
    ResponsesRequest,
)
from servers.streaming import ChoiceText
from servers.tools import ParseEvent, ToolCall

log = logging.getLogger(__name__)
router = APIRouter()

LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _text_of(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, InputText) else p.refusal if isinstance(p, Refusal)
                   else "" for p in content)


def _message(item: MessageItem) -> dict:
    if isinstance(item.content, str) or item.role != "user":
        if not isinstance(item.content, str) and any(
                isinstance(p, InputImage) for p in item.content):
            raise APIError(400, f"images are only accepted in user messages, not in a "
                                f"{item.role!r} one", param="input")
        return {"role": item.role, "content": _text_of(item.content)}
    parts: list[dict] = []
    for p in item.content:
        if isinstance(p, InputImage):
            if p.image_url is None:
                raise APIError(400, "input_image needs an image_url (a data: URL); this server "
                                    "has no file storage for file_id", param="input")
            parts.append({"type": "image_url", "image_url": {"url": p.image_url}})
        else:
            parts.append({"type": "text", "text": _text_of([p])})
    return {"role": "user", "content": parts}


def input_messages(items: list) -> list[dict]:
    """Responses input items as chat messages: a function call joins the assistant message
    just before it (the reply it was part of), its output becomes a tool message."""
    out: list[dict] = []
    for item in items:
        if isinstance(item, MessageItem):
            out.append(_message(item))
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
                if out[-1].get("content") == "":
                    out[-1]["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text_of(item.output)})
    return out


def _chat_request(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    messages = list(history)
    if req.instructions:
        messages.insert(0, {"role": "system", "content": req.instructions})
    messages += input_messages(req.input)
    if not messages:
        raise APIError(400, "the input has no messages; send at least one", param="input")
    body: dict[str, Any] = {
        "model": req.model, "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude={"type"}, exclude_none=True)} for t in req.tools]
    if isinstance(req.tool_choice, ResponsesNamedFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None or not fmt.name:
            raise APIError(400, "text.format json_schema needs `name` and `schema`",
                           param="text.format")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    elif fmt is not None:
        body["response_format"] = {"type": fmt.type}
    if LOGPROBS_INCLUDE in (req.include or ()):
        body["logprobs"] = True
        body["top_logprobs"] = req.top_logprobs or 0
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(400, message, param=param) from None


class _Answer:
    """One response being built: its id, the items it output, and its JSON shape."""

    def __init__(self, call: ChatCall, req: ResponsesRequest) -> None:
        self.call, self.req = call, req
        self.id = "resp_" + secrets.token_hex(16)
        call.id = self.id  # the session records the call under the response's id

    def message_item(self, text: str, logprobs: list[dict] | None, status: str) -> dict:
        part: dict = {"type": "output_text", "text": text, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        return {"type": "message", "id": "msg_" + secrets.token_hex(16), "role": "assistant",
                "status": status, "content": [part]}

    @staticmethod
    def call_item(call: ToolCall, status: str = "completed") -> dict:
        return {"type": "function_call", "id": "fc_" + secrets.token_hex(16),
                "call_id": call.id, "name": call.name, "arguments": call.arguments,
                "status": status}

    def body(self, output: list[dict], status: str, completion: Completion | None) -> dict:
        req, chat = self.req, self.call.req
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        fmt_out = (fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None
                   else {"type": "text"})
        usage = None
        if completion is not None:
            prompt, done = len(self.call.rendered.ids), len(completion.token_ids)
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0,
                                                              "cache_write_tokens": 0},
                     "output_tokens": done, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + done}
        tool_choice: Any = req.tool_choice if req.tool_choice is not None else "auto"
        if isinstance(tool_choice, ResponsesNamedFunction):
            tool_choice = tool_choice.model_dump()
        return {
            "id": self.id, "object": "response", "created_at": float(self.call.created),
            "status": status, "model": req.model, "output": output, "error": None,
            "incomplete_details": ({"reason": "max_output_tokens"} if status == "incomplete"
                                   else None),
            "instructions": req.instructions, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": chat.temperature if chat.temperature is not None else 1.0,
            "top_p": chat.top_p if chat.top_p is not None else 1.0,
            "tool_choice": tool_choice,
            "tools": [{"type": "function", "name": t.name, "description": t.description,
                       "parameters": t.parameters, "strict": t.strict} for t in req.tools or ()],
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "text": {"format": fmt_out}, "top_logprobs": req.top_logprobs,
            "truncation": "disabled", "usage": usage,
        }

    async def remember(self, text: ChoiceText) -> None:
        """Keep the conversation so that `previous_response_id` can continue it."""
        asked = self.call.req.messages
        messages = await off_loop(render_cost_us(len(asked)), _dumped, asked)
        if self.req.instructions:
            messages = messages[1:]  # instructions are not carried over (as OpenAI does)
        reply: dict = {"role": "assistant", "content": text.content}
        if text.calls:
            reply["content"] = text.content or None
            reply["tool_calls"] = [c.as_message_dict() for c in text.calls]
        session = self.call.session
        self.call.state.responses.put(self.id, session.id if session else None,
                                      [*messages, reply])

    def status(self, completion: Completion, text: ChoiceText) -> str:
        return ("incomplete" if completion.finish_reason == "length" and not text.stopped
                and not text.calls else "completed")


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    req = await parse_request(ResponsesRequest, request, state, param="input")
    history: list[dict] = []
    if req.previous_response_id is not None:
        sid = _session_id(request, state)
        found = state.responses.get(req.previous_response_id, sid)
        if found is None:
            raise APIError(400, f"previous response {req.previous_response_id!r} not found in "
                                f"this session (responses are kept in memory, in the session "
                                f"that answered them); send the conversation's items instead",
                           code="previous_response_not_found", param="previous_response_id")
        history = found
    # Each item is converted and validated again as a chat message: 10^4 items take ~0.1 s.
    chat = await off_loop(render_cost_us(len(history) + len(req.input)), _chat_request, req,
                          history)
    call = await prepare(state, request, chat)
    answer = _Answer(call, req)
    stream = _stream(answer, request) if req.stream else None
    return await respond(call, request, stream, functools.partial(_respond, answer))


async def _respond(answer: _Answer, completions: list[Completion],
                   texts: list[ChoiceText]) -> Response:
    [completion], [text] = completions, texts
    call = answer.call
    logprobs = call.logprobs(completion.token_ids, completion.logprobs,
                             completion.top_logprobs)
    status = answer.status(completion, text)
    output = []
    if text.content or not text.calls:
        output.append(answer.message_item(
            text.content, logprobs["content"] if logprobs is not None else None, status))
    output += [answer.call_item(c) for c in text.calls]
    await answer.remember(text)
    return JSONResponse(answer.body(output, status, completion))


def _dumped(messages: list[ChatMessage]) -> list[dict]:
    return [m.model_dump(exclude_none=True) for m in messages]


def _session_id(request: Request, state: ProxyState) -> str | None:
    session = bind_session(state, request)
    return session.id if session is not None else None


class _Events:
    """Responses SSE events, numbered in order."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        data = json.dumps(event, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()


async def _stream(answer: _Answer, request: Request) -> AsyncIterator[bytes]:
    call = answer.call
    emit = _Events()
    text = call.choice_text()
    acc = Accumulator()
    output: list[dict] = []
    message: dict | None = None  # the open message item, while text streams into it
    status = "aborted"

    def close_message() -> list[bytes]:
        nonlocal message
        if message is None:
            return []
        k = len(output) - 1
        part = message["content"][0]
        message["status"] = "completed"
        out = [emit("response.output_text.done", item_id=message["id"], output_index=k,
                    content_index=0, text=part["text"], logprobs=part.get("logprobs", [])),
               emit("response.content_part.done", item_id=message["id"], output_index=k,
                    content_index=0, part=part),
               emit("response.output_item.done", output_index=k, item=message)]
        message = None
        return out

    def on_events(events: list[ParseEvent], logprobs: list[dict] | None) -> list[bytes]:
        nonlocal message
        out: list[bytes] = []
        for e in events:
            if e.call is None:
                if message is None:
                    message = answer.message_item("", [] if logprobs is not None else None,
                                                  "in_progress")
                    output.append(message)
                    k = len(output) - 1
                    out.append(emit("response.output_item.added", output_index=k,
                                    item={**message, "content": []}))
                    out.append(emit("response.content_part.added", item_id=message["id"],
                                    output_index=k, content_index=0,
                                    part={"type": "output_text", "text": "",
                                          "annotations": []}))
                part = message["content"][0]
                part["text"] += e.content
                if logprobs is not None:
                    part["logprobs"] += logprobs
                out.append(emit("response.output_text.delta", item_id=message["id"],
                                output_index=len(output) - 1, content_index=0,
                                delta=e.content, logprobs=logprobs or []))
                logprobs = None  # one delta carries a step's logprobs
                continue
            out += close_message()
            item = answer.call_item(e.call)
            output.append(item)
            k = len(output) - 1
            out.append(emit("response.output_item.added", output_index=k,
                            item={**item, "arguments": "", "status": "in_progress"}))
            out.append(emit("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=k, delta=e.call.arguments))
            out.append(emit("response.function_call_arguments.done", item_id=item["id"],
                            output_index=k, arguments=e.call.arguments, name=e.call.name))
            out.append(emit("response.output_item.done", output_index=k, item=item))
        return out

    try:
        start = answer.body([], "in_progress", None)
        yield emit("response.created", response=start)
        yield emit("response.in_progress", response=start)
        rendered = call.rendered
        async for d in engine_stream(call.state, rendered.ids, call.params, rendered.images,
                                     grammar_param=call.grammar_param):
            acc.add(d)
            lp = call.logprobs(d.token_ids, d.logprobs, d.top_logprobs)
            entries = lp["content"] if lp is not None else None
            for chunk in on_events(text.push(d.token_ids), entries):
                yield chunk
            if d.finish_reason is not None:
                for chunk in on_events(text.finish(), None):
                    yield chunk
        if acc.finish_reason in (None, "abort"):
            raise APIError(503, "the engine ended the stream early (aborted); retry",
                           retry_after=1)
        for chunk in close_message():
            yield chunk
        completion = acc.completion()
        done = answer.status(completion, text)
        status = "done"
        call.record([completion], aborted=False, texts=[text])
        await stored(call.state)
        await answer.remember(text)
        yield emit(f"response.{done}", response=answer.body(output, done, completion))
    except asyncio.CancelledError:
        raise  # client disconnected: the engine stream is closed, the call recorded aborted
    except APIError as e:
        status = "refused" if refused_unsampled(e, [acc]) else "error"
        yield emit("error", code=e.code, message=e.message, param=e.param)
    except Exception as e:
        log.exception("engine failed mid-stream")
        status = "error"
        yield emit("error", code=None, message=f"the engine failed mid-stream: "
                                               f"{type(e).__name__}: {e}", param=None)
    finally:
        if call.session is not None:
            call.session.in_flight -= 1
        if status not in ("done", "refused"):
            call.record([acc.completion()], aborted=True, texts=[text])
