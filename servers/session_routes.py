"""Session management: create, list (paged), inspect, reward, close, delete, and export as JSON
lines, streamed a session at a time. Every change is stored before it is answered. A session
that cannot be exported is a `discard` line saying why, never a body cut off mid-stream."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from agentrl.types import Trajectory
from servers.config import ProxyState
from servers.errors import APIError
from servers.generation import parse_body, stored, valid_session_id
from servers.openai_schemas import RewardRequest, SessionCreate
from servers.sessions import Session

log = logging.getLogger(__name__)
MAX_PAGE = 1000

router = APIRouter()


def _state(request: Request) -> ProxyState:
    return request.app.state.proxy


def _get(state: ProxyState, session_id: str) -> Session:
    session = state.store.get(valid_session_id(session_id))
    if session is None:
        raise APIError(
            404,
            f"unknown session {session_id!r}; list sessions with GET /sessions or create one "
            f"with POST /sessions",
            code="session_not_found",
            param="session_id",
        )
    return session


def _base_url(request: Request, session_id: str) -> str:
    return f"{str(request.base_url).rstrip('/')}/sessions/{session_id}/v1"


@router.post("/sessions")
async def create_session(request: Request) -> JSONResponse:
    state = _state(request)
    raw = await request.body()
    req = parse_body(SessionCreate, raw) if raw.strip() else SessionCreate()
    if req.id is not None:
        valid_session_id(req.id)
    try:
        session = state.store.create(req.id, group=req.group, info=req.info, seed=req.seed)
    except KeyError as e:
        raise APIError(409, f"{e.args[0]}; pick another id or omit it", code="session_exists",
                       param="id") from None
    await stored(state)
    return JSONResponse(
        {**session.summary(), "base_url": _base_url(request, session.id)}, status_code=201
    )


@router.get("/sessions")
async def list_sessions(request: Request, limit: int = 100, after: str | None = None
                        ) -> JSONResponse:
    """Sessions in creation order, `limit` at a time; `after` is the last id of the page before
    (OpenAI's list paging: `has_more`, `first_id`, `last_id`)."""
    state = _state(request)
    if not 1 <= limit <= MAX_PAGE:
        raise APIError(400, f"limit must be between 1 and {MAX_PAGE}, got {limit}",
                       param="limit")
    sessions = state.store.list()
    start = 0
    if after is not None:
        ids = [s.id for s in sessions]
        if valid_session_id(after) not in ids:
            raise APIError(400, f"after={after!r} is not a session id of this server (use the "
                                f"last_id of the previous page)", param="after")
        start = ids.index(after) + 1
    page = sessions[start : start + limit]
    return JSONResponse({
        "object": "list",
        "data": [_summary(s) for s in page],
        "has_more": start + limit < len(sessions),
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
    })


def _ndjson(sessions: Iterable[Session]) -> StreamingResponse:
    """Trajectories as JSON lines, built one session at a time (off the event loop: Starlette
    iterates a plain generator in its thread pool), never as one big body."""
    def lines() -> Iterator[str]:
        for s in sessions:
            yield _session_lines(s)

    return StreamingResponse(lines(), media_type="application/x-ndjson")


def _session_lines(session: Session) -> str:
    """A session's trajectories as JSON lines; if they cannot be built or written, one empty
    `discard` trajectory saying why. Once an export's 200 is sent, an exception would end the
    body mid-stream for every session after this one (#34)."""
    try:
        return "".join(t.to_json() + "\n" for t in session.trajectories())
    except Exception as e:  # one session's failure must not end the export
        log.exception("session %r cannot be exported", session.id)
        placeholder = Trajectory(
            token_ids=[], loss_mask=[], logprobs=[], turns=[], discard=True,
            uid=f"{session.id}-unexportable", group=session.group,
            info={"session_id": session.id,
                  "export_error": f"{type(e).__name__}: {e}"[:1000]})
        return placeholder.to_json() + "\n"


def _summary(session: Session) -> dict:
    """`session.summary()`, or its id and why not: one session must not fail the whole list."""
    try:
        return session.summary()
    except Exception as e:  # logged, and said in the entry
        log.exception("session %r cannot be summarised", session.id)
        return {"id": session.id, "object": "session",
                "error": f"{type(e).__name__}: {e}"[:1000]}


@router.get("/export")
async def export_all(request: Request, closed_only: bool = False) -> StreamingResponse:
    state = _state(request)
    return _ndjson(s for s in state.store.list() if s.closed or not closed_only)


@router.get("/sessions/{session_id}")
async def get_session(request: Request, session_id: str) -> JSONResponse:
    session = _get(_state(request), session_id)
    return JSONResponse(
        {**session.summary(), "trajectories": [t.to_dict() for t in session.trajectories()]}
    )


@router.get("/sessions/{session_id}/export")
async def export_session(request: Request, session_id: str) -> StreamingResponse:
    return _ndjson([_get(_state(request), session_id)])


@router.post("/sessions/{session_id}/reward")
async def reward(request: Request, session_id: str) -> JSONResponse:
    session = _get(_state(request), session_id)
    req = parse_body(RewardRequest, await request.body())
    try:
        session.add_reward(
            req.reward,
            call_id=req.call_id,
            choice=req.choice,
            terminated=req.terminated,
            truncated=req.truncated,
            info=req.info,
        )
    except KeyError as e:
        raise APIError(400, e.args[0], code="call_not_found", param="call_id") from None
    except ValueError as e:  # not finite, or the session's sums would not be
        raise APIError(400, str(e), code="invalid_reward", param="reward") from None
    await stored(_state(request))
    return JSONResponse(session.summary())


@router.post("/sessions/{session_id}/close")
async def close(request: Request, session_id: str) -> JSONResponse:
    session = _get(_state(request), session_id)
    session.close()
    await stored(_state(request))
    return JSONResponse(session.summary())


@router.delete("/sessions/{session_id}")
async def delete(request: Request, session_id: str) -> JSONResponse:
    state = _state(request)
    _get(state, session_id)
    state.store.delete(session_id)
    await stored(state)
    return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})
