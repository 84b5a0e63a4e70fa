"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with the right status
(and, for the Anthropic Messages API's routes only, Anthropic's shape: `anthropic_error_body`).

FastAPI answers validation failures with 422 and a list of pydantic errors; OpenAI clients
expect 400 and one message, so the handlers here translate. Deterministic failures (4xx other
than 408/409/429) carry `x-should-retry: false` so the SDK does not retry them three times.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "server_error",
}
_RETRYABLE = {408, 409, 429, 500, 502, 503, 504}


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after = retry_after


def error_body(status: int, message: str, code: str | None, param: str | None) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error"),
            "param": param,
            "code": code,
        }
    }


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
"""Path ends (at `/v1/...` and under `/sessions/<id>/`) whose errors take Anthropic's shape."""


def anthropic_error_body(status: int, message: str, code: str | None = None) -> dict:
    """`{"type": "error", "error": {"type", "message"}}`, as the Anthropic API answers. A
    context overflow's message starts as Anthropic's does ("prompt is too long: "), which
    Claude-Code-style harnesses look for to compact their history."""
    if code == "context_length_exceeded":
        message = f"prompt is too long: {message}"
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        anthropic_error_body(err.status, err.message, err.code),
        status_code=err.status,
        headers=error_headers(err.status, err.retry_after),
    )


def error_headers(status: int, retry_after: float | None = None) -> dict[str, str]:
    headers = {"x-should-retry": "true" if status in _RETRYABLE else "false"}
    if retry_after is not None:
        headers["retry-after"] = str(max(1, round(retry_after)))
    return headers


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(err.status, err.message, err.code, err.param),
        status_code=err.status,
        headers=error_headers(err.status, err.retry_after),
    )


def error_bytes(status: int, message: str, code: str | None = None, *,
                anthropic: bool = False) -> bytes:
    body = (anthropic_error_body(status, message, code) if anthropic
            else error_body(status, message, code, None))
    return json.dumps(body).encode()


def _loc(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    # Drop pydantic's union/discriminator tags (e.g. "str", "list[...]", "function-after[...]")
    parts = [p for p in parts if not ("[" in p or p in {"str", "int", "list", "dict", "float"})]
    return ".".join(parts)


def validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """One readable sentence out of pydantic's error list: where, what, and what was sent."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") in ("json_invalid", "json_type"):
        ctx = first.get("ctx", {}).get("error", "")
        return (
            (f"the request body is not valid JSON ({ctx}); send a JSON object with "
            f"Content-Type: application/json"),
            None,
        )
    loc = _loc(tuple(first.get("loc", ())))
    if first.get("type") == "model_attributes_type" or (not loc and first["type"].endswith("type")):
        return "the request body must be a JSON object", None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    got = first.get("input")
    if first.get("type") == "missing":
        text = f"missing required field {loc!r}"
    elif loc:
        shown = repr(got)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        text = f"invalid value for {loc!r}: {msg} (got {shown})"
    else:
        text = msg
    more = len(errors) - 1
    if more:
        text += f" (and {more} more error{'s' if more > 1 else ''})"
    return text, loc or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"{message}: no such endpoint; see /v1/models, /v1/chat/completions"
        elif exc.status_code == 405:
            message = f"{message}: this endpoint does not accept this HTTP method"
        return error_response(APIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in the proxy")
        return error_response(
            APIError(500, f"internal error in the proxy: {type(exc).__name__}: {exc}")
        )
