"""A pure-ASGI guard in front of the app: request ids, auth, body size, global concurrency.

Pure ASGI (not `BaseHTTPMiddleware`) because it runs on every request and must not add a
task hop or buffer streaming responses.
"""

from __future__ import annotations

import hmac
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servers.errors import APIError, error_bytes, error_headers

_GENERATION_SUFFIXES = ("/chat/completions", "/completions", "/responses")
_OPEN_PATHS = ("/health", "/v1/models")


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
    ) -> None:
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.max_body_bytes = max_body_bytes
        self.max_concurrency = max_concurrency
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id") or f"req-{secrets.token_hex(8)}".encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id)]
            await send(message)

        path: str = scope["path"]
        if self.api_keys and not path.startswith(_OPEN_PATHS) and not self._authorized(headers):
            await _reject(send_with_id, 401, "invalid or missing API key; send "
                          "`Authorization: Bearer <key>` with a key this server accepts",
                          "invalid_api_key")
            return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await self._too_large(send_with_id)
            return
        generating = scope["method"] == "POST" and path.endswith(_GENERATION_SUFFIXES)
        if generating and self.in_flight >= self.max_concurrency:
            await _reject(send_with_id, 503, f"the server is at its limit of "
                          f"{self.max_concurrency} concurrent generation requests; retry "
                          f"after a moment", "overloaded", retry_after=1)
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
                await self._too_large(send_with_id)
        finally:
            if generating:
                self.in_flight -= 1

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        return any(hmac.compare_digest(token, k) for k in self.api_keys)

    async def _too_large(self, send: Send) -> None:
        await _reject(send, 413, f"the request body is larger than this server's limit of "
                      f"{self.max_body_bytes} bytes; send fewer or smaller images/messages",
                      "request_too_large")


async def _reject(
    send: Send, status: int, message: str, code: str, retry_after: float | None = None
) -> None:
    body = error_bytes(status, message, code)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error_headers(status, retry_after).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
