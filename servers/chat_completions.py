"""`POST /v1/chat/completions`, streaming (SSE) and not, with tools and logprobs."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentrl.completion import Completion
from agentrl.engine.grammar import (
    GrammarError,
    json_object_grammar,
    json_schema_grammar,
    union_grammar,
)
from servers.config import ProxyState
from servers.errors import APIError, error_body
from servers.generation import (
    Accumulator,
    ClientDisconnected,
    bind_session,
    check_model,
    engine_generate,
    engine_stream,
    grammar_cost_us,
    grammar_refused,
    new_id,
    off_loop,
    parse_request,
    record_call,
    refuse_if_too_long,
    refused_unsampled,
    render_cost_us,
    retry_count,
    run_unless_disconnected,
    sampling_params,
    stored,
    stored_stream_end,
)
from servers.images import load_images
from servers.openai_schemas import (
    ChatCompletionRequest,
    ChatMessage,
    JSONObjectFormat,
    JSONSchemaFormat,
    NamedToolChoice,
    TextPart,
)
from servers.render import Rendered, message_chars
from servers.sessions import context_key, reply_key
from servers.streaming import ChoiceText, sse, token_logprob_entries
from servers.tools import ParseEvent, tool_call_grammar

log = logging.getLogger(__name__)
router = APIRouter()


def _state(request: Request) -> ProxyState:
    return request.app.state.proxy


class ChatCall:
    """One chat request, validated and rendered."""

    def __init__(self, state: ProxyState, request: Request, req: ChatCompletionRequest) -> None:
        check_model(state, req.model)
        self.state, self.req = state, req
        self.session = bind_session(state, request)
        self.retries = retry_count(request)
        self.id = new_id("chatcmpl")
        self.created = int(time.time())
        use_tools = bool(req.tools) and req.tool_choice != "none"
        self.tool_names = [t.function.name for t in req.tools or ()] if use_tools else []
        if isinstance(req.tool_choice, NamedToolChoice):
            self.tool_names = [req.tool_choice.function.name]
        self.tools = req.tools if use_tools else None
        self.context: str | None = None
        self.rewritten = False
        """The request carried back a reply of this session unchanged, but the chat template
        rewrites the conversation before it: rendered whole, the call starts a new segment."""
        self.grammar_param: str | None = None
        """Where the grammar came from (`response_format` or `tools`), for its 400s."""

    async def render(self, images: list[np.ndarray], chars: int) -> None:
        """The prompt's ids (off the event loop when that costs) and the sampling params."""
        state, req = self.state, self.req
        cost = render_cost_us(len(req.messages) + len(self.tools or ()), chars)
        self.rendered: Rendered = await off_loop(cost, self._render, images)
        self.params = sampling_params(
            state,
            prompt_len=len(self.rendered.ids),
            max_tokens=req.max_new_tokens(),
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            n=req.n,
            stop=req.stop_tuple(),
            seed=req.seed,
            session=self.session,
            top_logprobs=req.top_logprobs or 0,
            penalties={
                "frequency_penalty": req.frequency_penalty,
                "presence_penalty": req.presence_penalty,
            },
            logit_bias=req.logit_bias,
            grammar=await off_loop(grammar_cost_us(self._schema_chars()), self._grammar),
        )

    def _render(self, images: list[np.ndarray]) -> Rendered:
        """A request that carries back a reply this session's proxy gave continues from the
        tokens sampled for that reply; anything else is rendered whole."""
        req = self.req
        if self.session is not None:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            tools = [t.model_dump(exclude_none=True) for t in self.tools or ()]
            self.context = context_key(messages, tools)
            if not images:
                rendered = self._continue_sampled(messages, tools)
                if rendered is not None:
                    return rendered
        return self.state.renderer.render_chat(req.messages, self.tools, images=images)

    def _schema_chars(self) -> int:
        fmt = self.req.response_format
        size = len(json.dumps(fmt.json_schema.schema_)) if isinstance(fmt, JSONSchemaFormat) else 0
        return size + sum(len(json.dumps(t.function.parameters or {})) for t in self.tools or ())

    def _grammar(self) -> str | None:
        """What the output must match: calls to the allowed tools where `tool_choice` requires
        one or `parallel_tool_calls` is false, JSON where `response_format` asks for it (or,
        with tools, a call instead of the JSON), or None."""
        req = self.req
        fmt = req.response_format
        json_grammar = None
        try:
            if isinstance(fmt, JSONObjectFormat):
                json_grammar = json_object_grammar()
            elif isinstance(fmt, JSONSchemaFormat):
                json_grammar = json_schema_grammar(
                    fmt.json_schema.schema_,
                    what=f"response_format.json_schema {fmt.json_schema.name!r}")
        except GrammarError as e:
            raise grammar_refused(e, "response_format", "invalid_json_schema") from None
        self.grammar_param = None if json_grammar is None else "response_format"
        if not self.tools:
            return json_grammar
        required = req.tool_choice == "required" or isinstance(req.tool_choice, NamedToolChoice)
        parallel = req.parallel_tool_calls is not False
        if not required and parallel and json_grammar is None:
            return None  # calls are parsed from free text; nothing to constrain
        allowed = [(t.function.name, t.function.parameters) for t in self.tools
                   if t.function.name in self.tool_names]
        try:
            calls = tool_call_grammar(self.state.tool_parser, allowed,
                                      only_calls=required or json_grammar is not None,
                                      parallel=parallel)
        except GrammarError as e:
            raise grammar_refused(e, "tools", "invalid_function_parameters") from None
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from None
        if json_grammar is None or required:
            self.grammar_param = "tools"
            return calls
        self.grammar_param = "response_format"  # or tools: the 400's message says which failed
        return union_grammar(json_grammar, calls)

    def _continue_sampled(self, dumped: list[dict], tools: list[dict]) -> Rendered | None:
        """The earlier call and choice whose reply is this request's last assistant message,
        asked exactly the messages before it: its prompt, its sampled ids, then the rest.
        None (render it whole) where there is none, or where the chat template rewrites the
        conversation once the rest follows (`rewritten`: the model is shown what the template
        renders, and the call starts a new segment). `dumped`, `tools`: the request's messages
        and tools as `context_key` takes them."""
        assert self.session is not None
        messages = self.req.messages
        last = max((k for k, m in enumerate(messages) if m.role == "assistant"), default=None)
        if last is None or last == len(messages) - 1:
            return None
        asked = context_key(dumped[:last], tools)
        found = self.session.find_reply(asked, _reply_of(messages[last]))
        if found is None:
            return None
        call, choice = found
        if self.state.renderer.rewrites(messages, last + 1, self.tools):
            self.rewritten = True
            return None
        return self.state.renderer.render_after(
            call.prompt_ids, call.images, call.choices[choice].token_ids, messages[last + 1:],
            self.tools)

    def choice_text(self) -> ChoiceText:
        parser = self.state.tool_parser(frozenset(self.tool_names)) if self.tool_names else None
        return ChoiceText(
            self.state.tokenizer, skip_ids=self.state.skip_ids, stops=self.params.stop,
            parser=parser,
        )

    def logprobs(
        self,
        token_ids: list[int],
        lps: list[float] | None,
        top: Sequence[Sequence[tuple[int, float]]] | None,
    ) -> dict | None:
        if not self.req.logprobs:
            return None
        entries = token_logprob_entries(self.state.tokenizer, token_ids, lps, top,
                                        self.state.skip_ids)
        return {"content": entries, "refusal": None}

    def record(self, completions: list[Completion], *, aborted: bool,
               texts: Sequence[ChoiceText] = ()) -> None:
        """`texts`: each choice's text as the client got it (for `Session.find_reply`)."""
        record_call(
            self.session,
            call_id=self.id,
            prompt_ids=self.rendered.ids,
            completions=completions,
            images=self.rendered.images,
            aborted=aborted,
            retries=self.retries,
            context_key=self.context,
            reply_keys=[reply_key(t.content, [(c.name, c.arguments) for c in t.calls])
                        for t in texts],
            rewritten=self.rewritten,
        )

    def usage(self, completions: list[Completion]) -> dict:
        prompt = len(self.rendered.ids)
        done = sum(len(c.token_ids) for c in completions)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _reply_of(m: ChatMessage) -> str:
    """`reply_key` of an assistant message a client sent back."""
    content = m.content if isinstance(m.content, str) or m.content is None else "".join(
        p.text for p in m.content if isinstance(p, TextPart))
    return reply_key(content, [(c.function.name, c.function.arguments)
                               for c in m.tool_calls or ()])


def _finish(engine_reason: str | None, text: ChoiceText) -> str:
    if text.calls:
        return "tool_calls"
    if text.stopped:
        return "stop"
    return "length" if engine_reason == "length" else "stop"


async def prepare(state: ProxyState, request: Request, req: ChatCompletionRequest) -> ChatCall:
    """A validated request's call, its images loaded and its prompt rendered (shared with the
    Responses API, whose requests become chat requests)."""
    check_model(state, req.model)
    chars = message_chars(req.messages, req.tools)
    refuse_if_too_long(state, chars, "messages")
    images = await load_images(req.messages, state.config,
                               vision=state.renderer.processor is not None)
    call = ChatCall(state, request, req)
    await call.render(images, chars)
    return call


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    req = await parse_request(ChatCompletionRequest, request, state)
    call = await prepare(state, request, req)
    stream = _stream(call, request) if req.stream else None
    return await respond(call, request, stream, functools.partial(_complete, call))


async def respond(
    call: ChatCall,
    request: Request,
    stream: AsyncIterator[bytes] | None,
    answer: Callable[[list[Completion], list[ChoiceText]], Awaitable[Response]],
) -> Response:
    """Answer a prepared call, counted in its session's in-flight requests until it is answered:
    `stream` (whose generator ends the count when it ends) as server-sent events, or else every
    choice sampled whole and handed to `answer`; 499 when the client went first. Every route
    that samples through `sample` answers this way."""
    if call.session is not None:
        call.session.in_flight += 1
    if stream is not None:
        return StreamingResponse(stream, media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
    try:
        completions, texts = await sample(call, request)
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        if call.session is not None:
            call.session.in_flight -= 1
    return await answer(completions, texts)


async def sample(call: ChatCall, request: Request) -> tuple[list[Completion], list[ChoiceText]]:
    """Every choice sampled and parsed, recorded and stored; ClientDisconnected (recorded as
    aborted) when the client goes away first."""
    rendered = call.rendered
    try:
        completions = await run_unless_disconnected(
            request, engine_generate(call.state, rendered.ids, call.params, rendered.images,
                                     grammar_param=call.grammar_param)
        )
    except ClientDisconnected:
        call.record([], aborted=True)
        raise
    texts = []
    for c in completions:
        text = call.choice_text()
        text.push(c.token_ids)
        text.finish()
        texts.append(text)
    call.record(completions, aborted=False, texts=texts)
    await stored(call.state)
    return completions, texts


async def _complete(
    call: ChatCall, completions: list[Completion], texts: list[ChoiceText]
) -> Response:
    choices = []
    for i, (c, text) in enumerate(zip(completions, texts, strict=True)):
        message: dict = {"role": "assistant", "content": text.content, "refusal": None}
        if text.calls:
            message["content"] = text.content or None
            message["tool_calls"] = [tc.as_message_dict() for tc in text.calls]
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": _finish(c.finish_reason, text),
                "logprobs": call.logprobs(c.token_ids, c.logprobs, c.top_logprobs),
            }
        )
    return JSONResponse(
        {
            "id": call.id,
            "object": "chat.completion",
            "created": call.created,
            "model": call.req.model,
            "choices": choices,
            "usage": call.usage(completions),
        }
    )


def _chunk(call: ChatCall, choices: list[dict], usage: bool) -> dict:
    out = {
        "id": call.id,
        "object": "chat.completion.chunk",
        "created": call.created,
        "model": call.req.model,
        "choices": choices,
    }
    if usage:
        out["usage"] = None
    return out


def _event_deltas(text: ChoiceText, events: list[ParseEvent]) -> list[dict]:
    deltas: list[dict] = []
    for e in events:
        if e.call is None:
            deltas.append({"content": e.content})
            continue
        k = text.calls.index(e.call)
        first = {"index": k, "id": e.call.id, "type": "function",
                 "function": {"name": e.call.name, "arguments": ""}}
        deltas.append({"tool_calls": [first]})
        deltas.append({"tool_calls": [{"index": k, "function": {"arguments": e.call.arguments}}]})
    return deltas


async def _stream(call: ChatCall, request: Request) -> AsyncIterator[bytes]:
    req = call.req
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    texts = [call.choice_text() for _ in range(req.n)]
    accs = [Accumulator() for _ in range(req.n)]
    finished = 0
    status = "aborted"
    try:
        for i in range(req.n):
            role = {"index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}
            yield sse(_chunk(call, [role], include_usage))
        rendered = call.rendered
        async for d in engine_stream(call.state, rendered.ids, call.params, rendered.images,
                                     grammar_param=call.grammar_param):
            i = d.index
            accs[i].add(d)
            text = texts[i]
            deltas = _event_deltas(text, text.push(d.token_ids))
            lp = call.logprobs(d.token_ids, d.logprobs, d.top_logprobs)
            if lp is not None and not deltas and d.token_ids:
                deltas = [{"content": ""}]
            for j, delta in enumerate(deltas):
                choice = {"index": i, "delta": delta, "logprobs": lp if j == 0 else None,
                          "finish_reason": None}
                yield sse(_chunk(call, [choice], include_usage))
            if d.finish_reason is not None:
                finished += 1
                for delta in _event_deltas(text, text.finish()):
                    choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                    yield sse(_chunk(call, [choice], include_usage))
                final = {"index": i, "delta": {}, "logprobs": None,
                         "finish_reason": _finish(d.finish_reason, text)}
                yield sse(_chunk(call, [final], include_usage))
        if finished < req.n or any(a.finish_reason == "abort" for a in accs):
            raise APIError(503, "the engine ended the stream early (aborted); retry",
                           retry_after=1)
        status = "done"
        if include_usage:
            usage = call.usage([a.completion() for a in accs])
            yield sse({**_chunk(call, [], False), "usage": usage})
    except asyncio.CancelledError:
        raise  # client disconnected: the engine stream is closed, the call recorded aborted
    except APIError as e:
        status = "refused" if refused_unsampled(e, accs) else "error"
        yield sse(error_body(e.status, e.message, e.code, e.param))
    except Exception as e:
        log.exception("engine failed mid-stream")
        status = "error"
        yield sse(error_body(500, f"the engine failed mid-stream: {type(e).__name__}: {e}",
                             None, None))
    finally:
        if call.session is not None:
            call.session.in_flight -= 1
        if status != "refused":
            call.record([a.completion() for a in accs], aborted=status != "done", texts=texts)
    yield await stored_stream_end(call.state)
