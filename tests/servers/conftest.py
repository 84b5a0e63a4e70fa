"""Fixtures: the real proxy app built from fakes, served by uvicorn on loopback."""

from __future__ import annotations

import contextlib
import ssl
import threading
from collections.abc import Callable, Iterator

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from agentrl.engine.fakes import FakeEngine, StreamingFakeEngine
from agentrl.models import load_tokenizer
from servers.app import create_app
from servers.config import ProxyConfig
from servers.serving import serve_in_thread
from servers.sessions import InMemorySessionStore, SessionStore


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer("tiny")


TLS = ssl.create_default_context()
"""One TLS context for every test's clients: a client builds its own otherwise, reading the CA
bundle (~20 ms), though the proxy is plain http on loopback."""


class Proxy:
    def __init__(self, url: str, engine: FakeEngine, store: SessionStore) -> None:
        self.url = url
        self.engine = engine
        self.store = store

    def client(self, session: str | None = None, **kw: object) -> openai.OpenAI:
        base = f"{self.url}/sessions/{session}/v1" if session else f"{self.url}/v1"
        kw.setdefault("max_retries", 0)
        kw.setdefault("api_key", "test")
        kw.setdefault("http_client", openai.DefaultHttpxClient(verify=TLS))
        return openai.OpenAI(base_url=base, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="package")
def stopping_proxies() -> Iterator[list[threading.Thread]]:
    """The threads stopping the proxies of finished tests; all joined when the package ends."""
    threads: list[threading.Thread] = []
    yield threads
    for t in threads:
        t.join()


@pytest.fixture
def make_proxy(tok, stopping_proxies) -> Iterator[Callable[..., Proxy]]:
    stack = contextlib.ExitStack()

    def make(engine: FakeEngine | None = None, *, streaming: bool = False,
             tokenizer: object = None, store: SessionStore | None = None,
             **config: object) -> Proxy:
        t = tokenizer or tok
        if engine is None:
            engine = StreamingFakeEngine(t) if streaming else FakeEngine(t)
        store = store if store is not None else InMemorySessionStore()
        app = create_app(engine, t, store, config=ProxyConfig(**config))  # type: ignore[arg-type]
        url = stack.enter_context(serve_in_thread(app))
        return Proxy(url, engine, store)

    try:
        yield make
    finally:
        # uvicorn takes ~0.2 s to stop a server (up to a 0.1 s tick, then a fixed 0.1 s grace),
        # at the end of each of ~100 tests: a test's proxies stop while the next test runs.
        stopper = threading.Thread(target=stack.close, name="agentrl-proxy-stop")
        stopper.start()
        stopping_proxies.append(stopper)


@pytest.fixture
def real_proxy(make_proxy, tok):
    """The proxy on the real transformers engine over a tiny model with sharp distributions."""
    from agentrl.engine.transformers_engine import TransformersEngine
    from tests.engine._models import sharp_tiny_model

    engine = TransformersEngine(sharp_tiny_model(tok), tok, max_batch_size=4)
    try:
        yield make_proxy(engine)
    finally:
        engine.close()


@pytest.fixture
def proxy(make_proxy) -> Proxy:
    return make_proxy()


def validate_completion(body: dict) -> ChatCompletion:
    return ChatCompletion.model_validate(body, strict=True)


def validate_chunk(body: dict) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(body, strict=True)
