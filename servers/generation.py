"""What every generation endpoint shares: model check, session binding, sampling params, running
the engine so a client disconnect aborts it, and recording the call into its session."""

from __future__ import annotations

import asyncio
import difflib
import logging
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from agentrl.completion import Completion, CompletionDelta, FinishReason, SamplingParams
from agentrl.engine.affinity import affinity_key
from agentrl.engine.base import PromptTooLongError
from agentrl.engine.grammar import GrammarError, GrammarTooComplexError
from agentrl.types import Image
from servers.config import ProxyState
from servers.errors import APIError, error_body, validation_message
from servers.sessions import CallRecord, Session, StoreError, check_session_id
from servers.streaming import SSE_DONE, sse

log = logging.getLogger(__name__)
_warned: set[str] = set()
M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")


OFF_LOOP_US = 2_000
"""Work estimated to take more microseconds than this runs in a worker thread: on the event
loop every other request would wait for it. What it costs is estimated by what takes the time,
JSON values and messages as well as bytes and characters (#34 item 5: a 400 KB body of 10^4
tiny messages, under the byte and character thresholds this replaces, stalled /health for
1.2-1.95 s). The rates below are measured on the 2-core development machine; a thread hop costs
about 0.2 ms."""


def parse_cost_us(raw: bytes) -> float:
    """Estimated cost of parsing and validating the JSON body `raw`. It is in the values, not
    the bytes: 10^4 messages in 400 KB take ~50 ms, one 1 MB string 0.4 ms, 10^5 token ids
    ~20 ms. A body over 64 KiB is not counted (that would take time of its own): it goes off
    the loop whatever it holds."""
    if len(raw) > 1 << 16:
        return math.inf
    return len(raw) / 2_000 + 2.5 * (raw.count(b",") + raw.count(b"{"))


def render_cost_us(messages: int, chars: int = 0) -> float:
    """Estimated cost of rendering and tokenizing `messages` messages (or items) holding
    `chars` characters of content: ~80 us a message and ~2 us a character."""
    return 80.0 * messages + 2.0 * chars


def grammar_cost_us(schema_chars: int) -> float:
    """Estimated cost of turning JSON schemas of `schema_chars` characters into a grammar:
    ~0.4 us a character (1.5 MB took 0.6 s; `agentrl.engine.grammar` caps a schema at 256 KiB
    and caches what it built)."""
    return 0.5 * schema_chars


def parse_body(model: type[M], raw: bytes) -> M:
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        message, param = validation_message(e)
        raise APIError(400, message, param=param) from None


NON_PROMPT_BYTES = 1 << 20
"""Room in a body for what is not prompt text (stop strings, logit_bias, schemas, keys)."""


async def parse_request(model: type[M], request: Request, state: ProxyState | None = None,
                        param: str = "messages") -> M:
    """The request's body as `model`; a costly one is parsed off the event loop. With `state`,
    a text-only model's body too big to fit its context is refused unparsed (parsing holds
    the GIL: a client sending 5 MB bodies back to back stalled everyone else)."""
    length = request.headers.get("content-length", "")
    size = int(length) if length.isdigit() else 0
    if state is not None and size > NON_PROMPT_BYTES and state.renderer.processor is None:
        # Each prompt character is at least 1 and at most 6 bytes of JSON (\uXXXX).
        refuse_if_too_long(state, (size - NON_PROMPT_BYTES) // 6, param, body_bytes=size)
    raw = await request.body()
    return await off_loop(parse_cost_us(raw), parse_body, model, raw)


def refuse_if_too_long(state: ProxyState, chars: int, param: str,
                       body_bytes: int | None = None) -> None:
    """A 400 before any tokenization when `chars` of content cannot fit the context."""
    least = chars // state.renderer.max_token_bytes
    max_context = state.engine.max_context
    if least >= max_context:
        size = (f"a {body_bytes}-byte request body" if body_bytes is not None
                else f"{chars} characters")
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens, but the {param} "
            f"take at least {least} tokens ({size}). Shorten them.",
            code="context_length_exceeded",
            param=param,
        )


async def off_loop(cost_us: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)`, in a worker thread when its estimated cost is over `OFF_LOOP_US`
    (rendering and tokenizing a long prompt takes seconds, and every other session would
    wait), else in place."""
    if cost_us > OFF_LOOP_US:
        return await asyncio.to_thread(fn, *args, **kwargs)
    return fn(*args, **kwargs)


def check_model(state: ProxyState, name: str) -> None:
    if name in state.model_names:
        return
    hint = difflib.get_close_matches(name, state.model_names, n=1)
    did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
    raise APIError(
        404,
        f"the model {name!r} does not exist.{did_you_mean} This server serves "
        f"{list(state.model_names)} (see GET /v1/models)",
        code="model_not_found",
        param="model",
    )


def valid_session_id(sid: str) -> str:
    """`sid`, or a 400 saying what a session id may be (length, characters)."""
    try:
        return check_session_id(sid)
    except ValueError as e:
        raise APIError(400, str(e), code="invalid_session_id", param="session_id") from None


def requested_session_id(request: Request) -> str | None:
    """The session id the request names by its path or `X-Session-Id` header, or None; a 400
    when it is not a valid id. The app checks it on every route, those that never bind a
    session included (#34 item 6: `/sessions/<3000 characters>/v1/models` answered 200)."""
    sid = request.path_params.get("session_id") or request.headers.get("x-session-id")
    return None if sid is None else valid_session_id(sid)


def bind_session(state: ProxyState, request: Request) -> Session | None:
    """The session named by the path, the `X-Session-Id` header or a `session-<id>` api key."""
    sid = requested_session_id(request)
    if sid is None and not state.config.api_keys:
        auth = request.headers.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip()
        prefix = state.config.session_api_key_prefix
        if prefix and key.startswith(prefix) and len(key) > len(prefix):
            sid = valid_session_id(key[len(prefix) :])
    if sid is None:
        return None
    session = state.store.get(sid)
    if session is None:
        if not state.config.auto_create_sessions:
            raise APIError(
                404, f"unknown session {sid!r}; create it with POST /sessions first",
                code="session_not_found",
            )
        try:
            session = state.store.create(sid)
        except KeyError:  # created concurrently
            session = state.store.get(sid)
            assert session is not None
    if session.closed:
        raise APIError(
            400, f"session {sid!r} is closed; start a new session for a new episode",
            code="session_closed",
        )
    # Engine calls of this request (its task) belong to the session: a router over several
    # engines sends them to the engine holding the session's conversation.
    affinity_key.set(session.id)
    if session.in_flight >= state.config.max_session_concurrency:
        raise APIError(
            429,
            f"session {sid!r} already has {session.in_flight} requests in flight (limit "
            f"{state.config.max_session_concurrency}); retry later",
            code="rate_limit_exceeded",
            retry_after=1,
        )
    return session


def sampling_params(
    state: ProxyState,
    *,
    prompt_len: int,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    n: int,
    stop: tuple[str, ...],
    seed: int | None,
    session: Session | None,
    top_logprobs: int,
    penalties: dict[str, float | None],
    logit_bias: dict[str, float] | None = None,
    grammar: str | None = None,
) -> SamplingParams:
    max_context = state.engine.max_context
    remaining = max_context - prompt_len
    if remaining < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens, but the messages "
            f"take {prompt_len} tokens. Shorten the messages to at most {max_context - 1} "
            f"tokens.",
            code="context_length_exceeded",
            param="messages",
        )
    if max_tokens is None:
        max_tokens = state.config.max_tokens_default or remaining
    if session is not None:  # drawn whether used or not: call k's seed is the k-th draw
        session_seed = session.call_seed()
        seed = session_seed if seed is None else seed
    for name, value in penalties.items():
        if value and name not in _warned:
            _warned.add(name)
            log.warning("%s=%s is accepted but ignored by this engine", name, value)
    return SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        max_tokens=min(max_tokens, remaining),
        stop=stop,
        n=n,
        seed=seed,
        logprobs=True,
        top_logprobs=top_logprobs,
        logit_bias=_logit_bias(state, logit_bias),
        grammar=grammar,
    )


def _logit_bias(state: ProxyState, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` as (id, bias) pairs, or a 400 for an id outside the vocabulary
    (`servers.openai_schemas.LogitBias` has checked that keys are ASCII digits, biases in range)."""
    pairs = []
    vocab = len(state.tokenizer)
    for key, value in (bias or {}).items():
        digits = key.lstrip("0") or "0"
        # Compared by length first: int() of a 4,301-digit string raises (Python's limit).
        if len(digits) > len(str(vocab)) or int(digits) >= vocab:
            shown = key if len(key) <= 20 else key[:17] + "..."
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab}) of this "
                                f"model's vocabulary, got {shown!r}", param="logit_bias")
        pairs.append((int(digits), float(value)))
    return tuple(pairs)


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def retry_count(request: Request) -> int:
    try:
        return int(request.headers.get("x-stainless-retry-count", "0"))
    except ValueError:
        return 0


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class ClientDisconnected(Exception):
    pass


async def run_unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes away first, cancel it (which aborts the engine)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        raise ClientDisconnected
    return task.result()


def grammar_refused(e: GrammarError, param: str | None, code: str) -> APIError:
    """The 400 for a grammar (from the request's `param`) that cannot be built or compiled:
    `code`, or `grammar_too_complex` past a limit or its compile timeout (#34 item 4)."""
    too_complex = isinstance(e, GrammarTooComplexError)
    return APIError(400, str(e), code="grammar_too_complex" if too_complex else code,
                    param=param)


async def engine_generate(
    state: ProxyState, prompt_ids: list[int], params: SamplingParams, images: list[Image],
    *, grammar_param: str | None = None,
) -> list[Completion]:
    """The engine's completions; `grammar_param` names where the request's grammar came from,
    for the 400 when the engine cannot compile it."""
    try:
        completions = await state.engine.generate(
            prompt_ids, params, [im.pixels for im in images] or None
        )
    except PromptTooLongError as e:
        raise APIError(400, str(e), code="context_length_exceeded", param="messages") from e
    except GrammarError as e:
        raise grammar_refused(e, grammar_param, "invalid_grammar") from None
    if any(c.finish_reason == "abort" for c in completions):
        raise APIError(503, "the engine aborted the request (e.g. a weight update); retry",
                       retry_after=1)
    return completions


async def engine_stream(
    state: ProxyState, prompt_ids: list[int], params: SamplingParams, images: list[Image],
    *, grammar_param: str | None = None,
) -> AsyncIterator[CompletionDelta]:
    """Token deltas from the engine: native streaming, or generate-then-chunk for an engine
    object that implements only `generate` (a remote engine's stub, a test's fake)."""
    pixels = [im.pixels for im in images] or None
    engine = state.engine
    if hasattr(engine, "generate_stream"):
        try:
            async for d in engine.generate_stream(prompt_ids, params, pixels):
                yield d
        except PromptTooLongError as e:
            raise APIError(400, str(e), code="context_length_exceeded") from e
        except GrammarError as e:
            raise grammar_refused(e, grammar_param, "invalid_grammar") from None
        return
    completions = await engine_generate(state, prompt_ids, params, images,
                                        grammar_param=grammar_param)
    longest = max((len(c.token_ids) for c in completions), default=0)
    for j in range(max(longest, 1)):
        for i, c in enumerate(completions):
            if j >= len(c.token_ids) and not (j == 0 and not c.token_ids):
                continue
            yield c.delta(i, j, j + 1, last=j >= len(c.token_ids) - 1)


def refused_unsampled(e: APIError, accs: Sequence[Accumulator]) -> bool:
    """Whether a stream's error refused the request before anything was sampled (a grammar
    the engine cannot compile, a prompt over its context): then, as for a refusal before the
    stream began, nothing is recorded."""
    return e.status < 500 and not any(a.token_ids for a in accs)


@dataclass
class Accumulator:
    """Collects one choice's streamed deltas back into a Completion for the session."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    policy_version: int = 0
    version_changes: list[tuple[int, int]] = field(default_factory=list)

    def add(self, d: CompletionDelta) -> None:
        at = len(self.token_ids)
        for i, v in [(0, d.policy_version), *d.version_changes]:
            if i >= len(d.token_ids):
                continue  # no token of this delta was sampled by it (an empty last delta)
            current = self.version_changes[-1][1] if self.version_changes else self.policy_version
            if at + i == 0:
                self.policy_version = v  # the first token's version
            elif v != current:
                self.version_changes.append((at + i, v))
        self.token_ids.extend(d.token_ids)
        lps = d.logprobs if d.logprobs is not None else [0.0] * len(d.token_ids)
        self.logprobs.extend(float(x) for x in lps)
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason

    def completion(self) -> Completion:
        fr = self.finish_reason
        reason: FinishReason = "stop" if fr == "stop" else "length" if fr == "length" else "abort"
        return Completion(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=reason,
            policy_version=self.policy_version,
            version_changes=list(self.version_changes),
        )


async def stored(state: ProxyState) -> None:
    """Wait until every change so far is in the session store: answer a client only then."""
    try:
        await state.store.sync()
    except StoreError as e:
        raise APIError(500, str(e), code="session_store_failed") from None


async def stored_stream_end(state: ProxyState) -> bytes:
    """The last event of a stream: [DONE] once the turn is stored, else an error event."""
    try:
        await stored(state)
    except APIError as e:
        return sse(error_body(e.status, e.message, e.code, e.param)) + SSE_DONE
    return SSE_DONE


def record_call(
    session: Session | None,
    *,
    call_id: str,
    prompt_ids: Sequence[int],
    completions: list[Completion],
    images: list[Image],
    aborted: bool,
    retries: int,
    context_key: str | None = None,
    reply_keys: Sequence[str] = (),
    rewritten: bool = False,
) -> None:
    if session is None:
        return
    session.record(
        CallRecord(
            call_id=call_id,
            prompt_ids=list(prompt_ids),
            choices=completions,
            images=images,
            aborted=aborted,
            retry_count=retries,
            context_key=context_key,
            reply_keys=list(reply_keys),
            rewritten=rewritten,
        )
    )
