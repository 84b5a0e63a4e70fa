"""The recording OpenAI-compatible proxy: `create_app(engine, tokenizer, store)`.

It also speaks the Anthropic Messages API (`/v1/messages`, servers/messages.py). Every route is
served twice: at `/v1/...` and at `/sessions/{session_id}/v1/...`, so a
framework that only lets you set `base_url` can still bind its calls to a session.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.engine.base import Engine
from agentrl.models.vision import VisionProcessor
from servers import chat_completions, completions, messages, responses, session_routes
from servers.config import ProxyConfig, ProxyState
from servers.deps import Tokenizer
from servers.errors import APIError, install_error_handlers
from servers.generation import (
    check_model,
    off_loop,
    parse_body,
    parse_request,
    render_cost_us,
    requested_session_id,
)
from servers.images import load_images
from servers.middleware import ProxyGuard
from servers.openai_schemas import DetokenizeRequest, TokenizeRequest
from servers.render import message_chars
from servers.sessions import InMemorySessionStore, SessionStore

misc = APIRouter()


def create_app(
    engine: Engine,
    tokenizer: Tokenizer,
    store: SessionStore | None = None,
    *,
    processor: VisionProcessor | None = None,
    config: ProxyConfig | None = None,
) -> FastAPI:
    """Build the proxy app.

    engine: an `agentrl.engine.Engine` (the proxy uses `max_context`, `generate` and
        `generate_stream`; an engine object without `generate_stream` is streamed in chunks
        of its whole completions). tokenizer: a Hugging Face tokenizer with a chat template.
    store: where sessions live (in memory by default). processor: a vision-language model's
    (default: found from the tokenizer's model).
    """
    config = config or ProxyConfig()
    store = store if store is not None else InMemorySessionStore()
    app = FastAPI(title="agentrl proxy", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(_session_id_checked)])
    app.state.proxy = ProxyState.build(engine, tokenizer, store, config, processor)
    install_error_handlers(app)
    for router in (chat_completions.router, completions.router, responses.router,
                   messages.router, misc):
        app.include_router(router)
        app.include_router(router, prefix="/sessions/{session_id}")
    app.include_router(session_routes.router)
    app.add_middleware(
        ProxyGuard,
        api_keys=config.api_keys,
        max_body_bytes=config.max_body_bytes,
        max_concurrency=config.max_concurrency,
        max_header_bytes=config.max_header_bytes,
    )
    return app


async def _session_id_checked(request: Request) -> None:
    """Every route checks the session id its path or header carries, whether or not it uses
    it. A coroutine: FastAPI runs a plain function dependency in its thread pool, which cost
    ~0.25 ms a request."""
    requested_session_id(request)


def _state(request: Request) -> ProxyState:
    return request.app.state.proxy


def _model_card(state: ProxyState, name: str) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "agentrl",
        "max_model_len": state.engine.max_context,
    }


@misc.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse(
        {"object": "list", "data": [_model_card(state, n) for n in state.model_names]}
    )


@misc.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    state = _state(request)
    check_model(state, model)
    return JSONResponse(_model_card(state, model))


@misc.get("/health")
async def health(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse({"status": "ok", "model": state.config.model_name})


@misc.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = _state(request)
    req = await parse_request(TokenizeRequest, request)
    if req.model is not None:
        check_model(state, req.model)
    if req.messages is not None:
        chars = message_chars(req.messages, req.tools)
        images = await load_images(req.messages, state.config,
                                   vision=state.renderer.processor is not None)
        cost = render_cost_us(len(req.messages) + len(req.tools or ()), chars)
        rendered = await off_loop(
            cost, state.renderer.render_chat, req.messages, req.tools,
            add_generation_prompt=req.add_generation_prompt, images=images,
        )
    else:
        prompt = req.prompt or ""
        rendered = await off_loop(render_cost_us(1, len(prompt)), state.renderer.render_text,
                                  prompt)
    return JSONResponse(
        {
            "tokens": rendered.ids,
            "count": len(rendered.ids),
            "max_model_len": state.engine.max_context,
        }
    )


@misc.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = _state(request)
    req = parse_body(DetokenizeRequest, await request.body())
    if req.model is not None:
        check_model(state, req.model)
    vocab = len(state.tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(
            400, f"token ids {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens"
        )
    text = state.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})
