"""The one way agentrl makes HTTP clients (reward services, agent sessions, image URLs).

Every client shares one TLS context (building one reads the CA bundle: ~20 ms each) and takes
`retries`: a connection that could not be made is tried again that many times, which is safe
for any method since nothing was sent. Retrying a request that was sent (a timeout, a 5xx) is
the caller's choice, made only where the call is idempotent (`RemoteReward`'s scoring)."""

from __future__ import annotations

import functools
import ssl
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def http_client(*, timeout_s: float | None, retries: int = 0, **options: Any) -> httpx.Client:
    """A client (`options`: httpx.Client's, e.g. base_url, headers, follow_redirects)."""
    import httpx

    return httpx.Client(timeout=timeout_s, verify=_tls(),
                        transport=httpx.HTTPTransport(retries=retries, verify=_tls()), **options)


def async_http_client(*, timeout_s: float | None, retries: int = 0,
                      **options: Any) -> httpx.AsyncClient:
    """An async client (`options`: httpx.AsyncClient's)."""
    import httpx

    return httpx.AsyncClient(
        timeout=timeout_s, verify=_tls(),
        transport=httpx.AsyncHTTPTransport(retries=retries, verify=_tls()), **options)
