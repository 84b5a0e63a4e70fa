"""Session management: create, list, inspect, reward, close, delete, export as JSON lines."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from servers.config import ProxyState
from servers.errors import APIError
from servers.generation import parse_body
from servers.protocol import RewardRequest, SessionCreate
from servers.sessions import Session

router = APIRouter()


def _state(request: Request) -> ProxyState:
    return request.app.state.proxy


def _get(state: ProxyState, session_id: str) -> Session:
    session = state.store.get(session_id)
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
    try:
        session = state.store.create(req.id, group=req.group, info=req.info)
    except KeyError as e:
        raise APIError(409, f"{e.args[0]}; pick another id or omit it", code="session_exists",
                       param="id") from None
    return JSONResponse(
        {**session.summary(), "base_url": _base_url(request, session.id)}, status_code=201
    )


@router.get("/sessions")
async def list_sessions(request: Request) -> JSONResponse:
    state = _state(request)
    return JSONResponse({"object": "list", "data": [s.summary() for s in state.store.list()]})


@router.get("/export")
async def export_all(request: Request, closed_only: bool = False) -> Response:
    state = _state(request)
    lines = [
        t.to_json()
        for s in state.store.list()
        if s.closed or not closed_only
        for t in s.trajectories()
    ]
    return Response("".join(line + "\n" for line in lines), media_type="application/x-ndjson")


@router.get("/sessions/{session_id}")
async def get_session(request: Request, session_id: str) -> JSONResponse:
    session = _get(_state(request), session_id)
    return JSONResponse(
        {**session.summary(), "trajectories": [t.to_dict() for t in session.trajectories()]}
    )


@router.get("/sessions/{session_id}/export")
async def export_session(request: Request, session_id: str) -> Response:
    session = _get(_state(request), session_id)
    body = "".join(t.to_json() + "\n" for t in session.trajectories())
    return Response(body, media_type="application/x-ndjson")


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
    return JSONResponse(session.summary())


@router.post("/sessions/{session_id}/close")
async def close(request: Request, session_id: str) -> JSONResponse:
    session = _get(_state(request), session_id)
    session.close()
    return JSONResponse(session.summary())


@router.delete("/sessions/{session_id}")
async def delete(request: Request, session_id: str) -> JSONResponse:
    state = _state(request)
    _get(state, session_id)
    state.store.delete(session_id)
    return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})
