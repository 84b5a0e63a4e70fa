"""Run an app with uvicorn on a loopback port in a background thread (tests, helpers), the
HTTP protocol every agentrl server runs (`http_protocol`), and prepare a serving process's
memory (`freeze_startup_objects`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from servers.errors import error_bytes, error_headers
from servers.middleware import MAX_HEADER_BYTES, head_too_large

LOOPBACK = "127.0.0.1"


class _BoundedHead(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request whose head (URL and headers) grows past
    `max_head_bytes` before it ends. httptools buffers a head of any size, and a client could
    make the server hold gigabytes; a head that does end is measured exactly by the app
    (`servers.middleware.ProxyGuard`), so this only needs to be a lower bound that stops it."""

    max_head_bytes = MAX_HEADER_BYTES
    _in_head = False  # between the first byte of a request and the end of its headers
    _head_bytes = 0  # of the open head, counted from the chunk after the one that began it
    _heads = 0  # requests begun on this connection

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes, self._heads = True, 0, self._heads + 1

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def data_received(self, data: bytes) -> None:
        # Only a chunk that arrives inside a head and leaves the same head open is all head: the
        # one that begins a request may hold the end of the one before it.
        inside, heads = self._in_head, self._heads
        super().data_received(data)
        if not (inside and self._in_head and heads == self._heads):
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            body = error_bytes(400, head_too_large(self.max_head_bytes),
                               "request_headers_too_large")
            headers = {**error_headers(400), "content-type": "application/json",
                       "content-length": str(len(body)), "connection": "close"}
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\n" + b"".join(
                f"{k}: {v}\r\n".encode() for k, v in headers.items()) + b"\r\n" + body)
            self.transport.close()


@functools.cache
def http_protocol(max_header_bytes: int = MAX_HEADER_BYTES) -> type[asyncio.Protocol]:
    """uvicorn's `http=` for agentrl's servers: its httptools protocol, refusing a request head
    that grows past `max_header_bytes` before it ends (#34 item 6)."""
    return type("BoundedHeadProtocol", (_BoundedHead,), {"max_head_bytes": max_header_bytes})


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, *, host: str = LOOPBACK, port: int = 0,
                    max_header_bytes: int = MAX_HEADER_BYTES) -> Iterator[str]:
    """Serve `app` until the block exits; yields the base URL (`http://127.0.0.1:PORT`).

    Port 0 picks a free port. The server shuts down (and its thread ends) on exit.
    """
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
        timeout_keep_alive=30, http=http_protocol(max_header_bytes),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="agentrl-proxy", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the proxy did not start on {host}:{port}")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{bound}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def freeze_startup_objects() -> int:
    """Move every object alive now (the model, the tokenizer, imported modules: millions) out
    of the garbage collector's sight, so its full collections scan only what requests create.
    Without it a full collection in `agentrl serve` paused the event loop for ~200 ms now and
    then, which every in-flight request waited out. Call once, after loading, before serving;
    returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
