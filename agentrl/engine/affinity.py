"""Which conversation a generate call belongs to, for routers over several engines.

The rollout collector sets it to the episode for all of the episode's turns, and the proxy to
the session; a router (`agentrl.engine.router.EngineRouter`) sends every call of one key to the same
engine, whose prefix cache then holds the conversation so far. A context variable, so it needs
no argument in the engine protocol: it follows the awaiting task into the engine call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

affinity_key: ContextVar[str | None] = ContextVar("agentrl_affinity_key", default=None)


@contextlib.contextmanager
def conversation(key: str | None) -> Iterator[None]:
    """Calls made inside belong to conversation `key`."""
    token = affinity_key.set(key)
    try:
        yield
    finally:
        affinity_key.reset(token)
