"""`agentrl reward-serve rewards.py:score`: any reward function as an HTTP reward service.

    POST /score {"items": [{"prompt": ..., "response": "...", "label": ...}, ...]}
      -> {"rewards": [float | null, ...], "infos": [{...}, ...], "errors": [null | str, ...]}

Training runs reach it with `agentrl train --dataset data.jsonl --reward.url
http://HOST:PORT/score` (batched, with timeouts and retries: `agentrl.rewards.RemoteReward`).
The function runs in worker threads, never on the event loop. An item whose function call
raises or returns no number gets a null reward and its error (the others are scored); the
training run discards that episode and counts it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from tyro.conf import Positional

from agentrl.rewards import RewardFn, RewardFunctionError, call_reward_fn
from servers.errors import install_error_handlers

log = logging.getLogger(__name__)


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: Any
    response: str
    label: Any = None


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[ScoreItem] = Field(min_length=1, max_length=4096)


def create_reward_app(reward_fn: RewardFn) -> FastAPI:
    app = FastAPI(title="agentrl reward service", docs_url=None, redoc_url=None,
                  openapi_url=None)
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok"})

    @app.post("/score")
    async def score(request: Request) -> JSONResponse:
        from servers.generation import parse_body

        req = parse_body(ScoreRequest, await request.body())

        def run() -> list[tuple[float | None, dict[str, Any], str | None]]:
            out: list[tuple[float | None, dict[str, Any], str | None]] = []
            for i, it in enumerate(req.items):
                try:
                    reward, info = call_reward_fn(reward_fn, it.prompt, it.response, it.label,
                                                  sample=i)
                    out.append((reward, info, None))
                except RewardFunctionError as e:
                    out.append((None, {}, str(e)))
            return out

        scored = await asyncio.to_thread(run)
        return JSONResponse({"rewards": [r for r, _, _ in scored],
                             "infos": [info for _, info, _ in scored],
                             "errors": [e for _, _, e in scored]})

    return app


@dataclass(frozen=True, kw_only=True)
class RewardServeArgs:
    """Serve a reward function over HTTP for `agentrl train --reward.url`."""

    reward_fn: Positional[str]
    """`file.py:fn` or `package.module:fn` scoring fn(prompt, response, label), or a bare
    `file.py` defining OpenRLHF's batched reward_func(queries, prompts, labels)."""
    host: str = "127.0.0.1"
    port: int = 8001


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from agentrl.command_line import parse_flags
    from agentrl.rewards import reward_fn_from_spec

    args = parse_flags(RewardServeArgs, sys.argv[1:] if argv is None else argv,
                       prog="agentrl reward-serve")
    try:
        fn = reward_fn_from_spec(args.reward_fn)
    except ValueError as e:
        print(f"agentrl reward-serve: {e}", file=sys.stderr)
        return 2
    from servers.serving import http_protocol

    config = uvicorn.Config(create_reward_app(fn), host=args.host, port=args.port,
                            log_level="warning", http=http_protocol())
    print(f"agentrl reward service for {args.reward_fn}: "
          f"--reward.url http://{args.host}:{args.port}/score", flush=True)
    uvicorn.Server(config).run()
    return 0
