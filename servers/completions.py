"""`POST /v1/completions`: raw text (or token id) prompts, streaming and not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agentrl.completion import Completion, SamplingParams
from servers.config import ProxyState
from servers.errors import APIError, error_body
from servers.generation import (
    Accumulator,
    ClientDisconnected,
    bind_session,
    check_model,
    engine_generate,
    engine_stream,
    new_id,
    off_loop,
    parse_request,
    record_call,
    refuse_if_too_long,
    render_cost_us,
    retry_count,
    run_unless_disconnected,
    sampling_params,
    stored,
    stored_stream_end,
)
from servers.openai_schemas import CompletionRequest
from servers.streaming import ChoiceText, sse

if TYPE_CHECKING:
    from typing_extensions import TypeIs  # typing's own from Python 3.13

router = APIRouter()


def _legacy_logprobs(state: ProxyState, c: Completion, k: int) -> dict:
    ids = [t for t in c.token_ids if t not in state.skip_ids]
    lps = [lp for t, lp in zip(c.token_ids, c.logprobs or [0.0] * len(c.token_ids), strict=True)
           if t not in state.skip_ids]
    tokens = [state.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    offsets, at = [], 0
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    top = None
    if k and c.top_logprobs:
        top = [
            {state.tokenizer.decode([a], skip_special_tokens=False): min(0.0, lp) for a, lp in alts}
            for t, alts in zip(c.token_ids, c.top_logprobs, strict=False)
            if t not in state.skip_ids
        ]
    return {"tokens": tokens, "token_logprobs": [min(0.0, x) for x in lps],
            "top_logprobs": top, "text_offset": offsets}


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state: ProxyState = request.app.state.proxy
    req = await parse_request(CompletionRequest, request, state, "prompt")
    check_model(state, req.model)
    if req.echo:
        raise APIError(400, "echo=true is not supported by this server; drop it", param="echo")
    prompt = req.prompt
    if isinstance(prompt, list) and _is_text_list(prompt):
        if len(prompt) != 1:
            raise APIError(400, "batched prompts are not supported; send one prompt per request",
                           param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        refuse_if_too_long(state, len(prompt), "prompt")
        ids = (await off_loop(render_cost_us(1, len(prompt)), state.renderer.render_text,
                              prompt)).ids
    else:
        vocab = len(state.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        ids = list(prompt)
    if not ids:  # "", [] or [""]: the engine needs a token to condition on
        raise APIError(400, "the prompt is empty (it has no tokens); send at least one "
                            "character of text or one token id", param="prompt")
    session = bind_session(state, request)
    params = sampling_params(
        state, prompt_len=len(ids), max_tokens=req.max_new_tokens(), temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, n=req.n, stop=req.stop_tuple(), seed=req.seed,
        session=session, top_logprobs=req.logprobs or 0,
        penalties={"frequency_penalty": req.frequency_penalty,
                   "presence_penalty": req.presence_penalty},
        logit_bias=req.logit_bias,
    )
    call_id, created = new_id("cmpl"), int(time.time())
    retries = retry_count(request)

    def record(comps: list[Completion], aborted: bool) -> None:
        record_call(session, call_id=call_id, prompt_ids=ids, completions=comps, images=[],
                    aborted=aborted, retries=retries)

    def text_of(c: Completion) -> tuple[str, str]:
        text = ChoiceText(state.tokenizer, skip_ids=state.skip_ids, stops=params.stop)
        text.push(c.token_ids)
        text.finish()
        reason = "stop" if text.stopped or c.finish_reason != "length" else "length"
        return text.content, reason

    head = {"id": call_id, "object": "text_completion", "created": created, "model": req.model}
    if req.stream:
        return StreamingResponse(_stream(state, req, ids, params, head, record),
                                 media_type="text/event-stream")
    try:
        comps = await run_unless_disconnected(request, engine_generate(state, ids, params, []))
    except ClientDisconnected:
        record([], True)
        return Response(status_code=499)
    record(comps, False)
    await stored(state)
    choices = []
    for i, c in enumerate(comps):
        text, reason = text_of(c)
        lp = _legacy_logprobs(state, c, req.logprobs or 0) if req.logprobs is not None else None
        choices.append({"index": i, "text": text, "finish_reason": reason, "logprobs": lp})
    done = sum(len(c.token_ids) for c in comps)
    usage = {"prompt_tokens": len(ids), "completion_tokens": done, "total_tokens": len(ids) + done}
    return JSONResponse({**head, "choices": choices, "usage": usage})


def _is_text_list(prompt: list[int] | list[str]) -> TypeIs[list[str]]:
    """Whether a list prompt is texts (validation keeps a list to one kind)."""
    return bool(prompt) and isinstance(prompt[0], str)


async def _stream(
    state: ProxyState,
    req: CompletionRequest,
    ids: list[int],
    params: SamplingParams,
    head: dict[str, object],
    record: Callable[[list[Completion], bool], None],
) -> AsyncIterator[bytes]:
    texts = [ChoiceText(state.tokenizer, skip_ids=state.skip_ids, stops=params.stop)
             for _ in range(req.n)]
    accs = [Accumulator() for _ in range(req.n)]
    ok = False
    try:
        async for d in engine_stream(state, ids, params, []):
            accs[d.index].add(d)
            t = texts[d.index]
            out = "".join(e.content for e in t.push(d.token_ids))
            reason = None
            if d.finish_reason is not None:
                out += "".join(e.content for e in t.finish())
                reason = "stop" if t.stopped or d.finish_reason != "length" else "length"
            if out or reason:
                choice = {"index": d.index, "text": out, "finish_reason": reason, "logprobs": None}
                yield sse({**head, "choices": [choice]})
        ok = True
    except asyncio.CancelledError:
        raise
    except APIError as e:
        yield sse(error_body(e.status, e.message, e.code, e.param))
    except Exception as e:  # noqa: BLE001 - engine failure mid-stream becomes an error chunk
        yield sse(error_body(500, f"the engine failed mid-stream: {e}", None, None))
    finally:
        record([a.completion() for a in accs], not ok)
    yield await stored_stream_end(state)
