"""Fixtures: the real proxy app built from fakes, served by uvicorn on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from agentrl.models import load_tokenizer
from servers.app import create_app
from servers.config import ProxyConfig
from servers.serving import serve_in_thread
from servers.sessions import InMemorySessionStore, SessionStore
from servers.testing import FakeEngine, StreamingFakeEngine


@pytest.fixture(scope="session")
def tok():
    return load_tokenizer("tiny")


class Proxy:
    def __init__(self, url: str, engine: FakeEngine, store: SessionStore) -> None:
        self.url = url
        self.engine = engine
        self.store = store

    def client(self, session: str | None = None, **kw: object) -> openai.OpenAI:
        base = f"{self.url}/sessions/{session}/v1" if session else f"{self.url}/v1"
        kw.setdefault("max_retries", 0)
        kw.setdefault("api_key", "test")
        return openai.OpenAI(base_url=base, **kw)  # type: ignore[arg-type]


@pytest.fixture
def make_proxy(tok) -> Iterator[Callable[..., Proxy]]:
    with contextlib.ExitStack() as stack:

        def make(engine: FakeEngine | None = None, *, streaming: bool = False,
                 tokenizer: object = None, store: SessionStore | None = None,
                 **config: object) -> Proxy:
            t = tokenizer or tok
            if engine is None:
                engine = StreamingFakeEngine(t) if streaming else FakeEngine(t)
            store = store if store is not None else InMemorySessionStore()
            app = create_app(engine, t, store,
                             config=ProxyConfig(**config))  # type: ignore[arg-type]
            url = stack.enter_context(serve_in_thread(app))
            return Proxy(url, engine, store)

        yield make


@pytest.fixture
def proxy(make_proxy) -> Proxy:
    return make_proxy()


def validate_completion(body: dict) -> ChatCompletion:
    return ChatCompletion.model_validate(body, strict=True)


def validate_chunk(body: dict) -> ChatCompletionChunk:
    return ChatCompletionChunk.model_validate(body, strict=True)
