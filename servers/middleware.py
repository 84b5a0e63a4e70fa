"""A pure-ASGI guard in front of the app: header and body size, request ids, auth, global
concurrency.

Pure ASGI (not `BaseHTTPMiddleware`) because it runs on every request and must not add a
task hop or buffer streaming responses.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servers.errors import ANTHROPIC_PATHS, APIError, error_bytes, error_headers

_GENERATION_SUFFIXES = ("/chat/completions", "/completions", "/responses", "/v1/messages")
_OPEN_PATHS = ("/health", "/v1/models")

MAX_HEADER_BYTES = 32 * 1024
"""Largest request head (URL and headers) the proxy accepts by default: OpenAI clients send
well under 1 KB; nginx buffers at most 32 KB, Node.js 16 KB."""


def head_bytes(scope: Scope) -> int:
    """Bytes of a request's URL and headers as sent (each header line with its `: ` and CRLF)."""
    url = len(scope.get("raw_path") or scope["path"].encode()) + len(scope.get("query_string", b""))
    return url + sum(len(k) + len(v) + 4 for k, v in scope["headers"])


def head_too_large(limit: int, size: int | None = None) -> str:
    """The 400's message for a request head over `limit` bytes (`size`, when it is known)."""
    are = f"are {size} bytes, more than" if size is not None else "are more than"
    return (f"the request's URL and headers {are} this server's limit of {limit} bytes; send "
            f"fewer or shorter headers (a large cookie or custom header?) and a shorter URL")


class BodyTooLarge(APIError):
    """Raised from `receive` once a body streams past the limit; answered 413 by the app."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            413,
            f"the request body is larger than this server's limit of {limit} bytes; send "
            f"fewer or smaller images/messages",
            code="request_too_large",
        )


class ProxyGuard:
    def __init__(
        self,
        app: ASGIApp,
        *,
        api_keys: tuple[str, ...],
        max_body_bytes: int,
        max_concurrency: int,
        max_header_bytes: int = MAX_HEADER_BYTES,
    ) -> None:
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.max_body_bytes = max_body_bytes
        self.max_header_bytes = max_header_bytes
        self.max_concurrency = max_concurrency
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = head_bytes(scope)
        if head > self.max_header_bytes:  # first: not even its x-request-id is read (#34 item 6)
            await _reject(send, 400, head_too_large(self.max_header_bytes, head),
                          "request_headers_too_large")
            return
        headers = dict(scope["headers"])
        if b"x-api-key" in headers and b"authorization" not in headers:
            # Anthropic clients send their key as `x-api-key`: from here on it is the bearer
            # token, for auth and for a `session-<id>` key alike.
            headers[b"authorization"] = b"Bearer " + headers[b"x-api-key"]
            scope = {**scope, "headers": [*scope["headers"],
                                          (b"authorization", headers[b"authorization"])]}
        request_id = headers.get(b"x-request-id") or f"req-{secrets.token_hex(8)}".encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id)]
            await send(message)

        path: str = scope["path"]
        anthropic = path.endswith(ANTHROPIC_PATHS)

        async def reject(status: int, message: str, code: str,
                         retry_after: float | None = None) -> None:
            await _reject(send_with_id, status, message, code, retry_after, anthropic=anthropic)

        if self.api_keys and not path.startswith(_OPEN_PATHS) and not self._authorized(headers):
            await reject(401, "invalid or missing API key; send `Authorization: Bearer <key>` "
                         "(or `x-api-key: <key>`) with a key this server accepts",
                         "invalid_api_key")
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(reject)
            return
        generating = scope["method"] == "POST" and path.endswith(_GENERATION_SUFFIXES)
        if generating and self.in_flight >= self.max_concurrency:
            await reject(503, f"the server is at its limit of {self.max_concurrency} "
                         f"concurrent generation requests; retry after a moment", "overloaded",
                         retry_after=1)
            return
        received = 0
        response_started = False

        async def guarded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if message["type"] == "http.response.start":
                response_started = True
            await send_with_id(message)

        if generating:
            self.in_flight += 1
        try:
            await self.app(scope, guarded_receive, tracking_send)
        except BodyTooLarge:
            if not response_started:
                await self._too_large(reject)
        finally:
            if generating:
                self.in_flight -= 1

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        return any(hmac.compare_digest(token, k) for k in self.api_keys)

    async def _too_large(self, reject: Callable[[int, str, str], Awaitable[None]]) -> None:
        await reject(413, f"the request body is larger than this server's limit of "
                     f"{self.max_body_bytes} bytes; send fewer or smaller images/messages",
                     "request_too_large")


async def _reject(
    send: Send, status: int, message: str, code: str, retry_after: float | None = None, *,
    anthropic: bool = False,
) -> None:
    body = error_bytes(status, message, code, anthropic=anthropic)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error_headers(status, retry_after).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
