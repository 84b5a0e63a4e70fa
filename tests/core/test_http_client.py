"""agentrl.http_client: one TLS context for every client, connection retries as asked."""

from __future__ import annotations

import socket

import httpx
import pytest

from agentrl.http_client import async_http_client, http_client


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("retries", [0, 3])
def test_a_refused_connection_is_tried_again_as_asked(retries, monkeypatch):
    """httpx's transport retries a connection that could not be made (with backoff), so a
    client with retries spends measurably longer before it gives up on a closed port."""
    attempts = []
    real = socket.create_connection

    def counted(*args, **kwargs):
        attempts.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    with http_client(timeout_s=2.0, retries=retries) as client, pytest.raises(httpx.ConnectError):
        client.get(f"http://127.0.0.1:{_closed_port()}/")
    assert len(attempts) == retries + 1


async def test_clients_share_one_tls_context():
    a, b = http_client(timeout_s=1.0), async_http_client(timeout_s=1.0)
    try:
        # Building a TLS context reads the CA bundle; every client reuses the one built.
        assert a._transport._pool._ssl_context is b._transport._pool._ssl_context
    finally:
        a.close()
        await b.aclose()
