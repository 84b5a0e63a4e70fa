"""Run an app with uvicorn on a loopback port in a background thread (tests, helpers), and
prepare a serving process's memory (`freeze_startup_objects`)."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

LOOPBACK = "127.0.0.1"


@contextlib.contextmanager
def serve_in_thread(app: FastAPI, *, host: str = LOOPBACK, port: int = 0) -> Iterator[str]:
    """Serve `app` until the block exits; yields the base URL (`http://127.0.0.1:PORT`).

    Port 0 picks a free port. The server shuts down (and its thread ends) on exit.
    """
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", access_log=False, lifespan="off",
        timeout_keep_alive=30,
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
