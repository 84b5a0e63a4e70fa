"""`agentrl serve [--model NAME] [--engine transformers|vllm]`: the recording proxy on a real
engine, with uvicorn. With no flag it serves the embedded default model, as `train` trains it."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from agentrl.command_line import EngineOptions, parse_flags, validation_deferred
from servers.durable import SqliteSessionStore, default_store_path
from servers.sessions import InMemorySessionStore, SessionStore, StoreError

if TYPE_CHECKING:
    import uvicorn

    from servers.deps import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServeArgs(EngineOptions):
    """Serve a model through the recording OpenAI-compatible proxy."""

    model: str = "smollm2-135m-instruct"
    """Model name (smollm2-135m-instruct, the embedded default; `tiny`, `tiny-qwen2-vl`) or a
    local Hugging Face model directory (a vision-language model takes image_url parts)."""
    device: str = "auto"
    """Where the transformers engine runs: auto (cuda when a GPU is visible, else cpu), cpu,
    cuda or cuda:N."""
    num_engines: int = 1
    """Engines behind one router (agentrl/engine/router.py): each call goes to the least loaded,
    every call of a session to the same one. On GPUs each engine gets its own GPU."""
    host: str = "127.0.0.1"
    """Address to bind. Loopback by default; anything else exposes the proxy on the network."""
    port: int = 8000
    """TCP port (0 picks a free one)."""
    served_model_name: str | None = None
    """Name clients put in `model` (default: the --model value)."""
    api_key: tuple[str, ...] = ()
    """Require one of these keys as `Authorization: Bearer <key>` (default: no auth)."""
    max_concurrency: int = 1024
    """Most generation requests in flight; more get 503 + Retry-After."""
    max_body_bytes: int = 32 * 2**20
    """Largest request body accepted (413 beyond); images as data URLs count."""
    max_header_bytes: int = 32 * 2**10
    """Largest request URL and headers accepted (400 beyond)."""
    max_tokens_default: int | None = None
    """Most tokens sampled per choice when a request sets neither max_tokens nor
    max_completion_tokens (default: the rest of the context)."""
    tool_parser: str = "hermes"
    """How tool calls are read from model text (see servers.tools.TOOL_PARSERS)."""
    max_images_per_request: int = 16
    """Most image_url parts one request may carry."""
    allow_image_urls: bool = False
    """Fetch http(s) image URLs (otherwise only base64 data: URLs are accepted)."""
    image_url_max_bytes: int = 16 * 2**20
    """Largest image fetched from a URL."""
    image_url_timeout_s: float = 10.0
    """Longest wait for an image URL's server."""
    store: str | None = None
    """Where sessions are kept across restarts: a SQLite file (default: one per model under
    $XDG_DATA_HOME/agentrl/sessions/, printed at start), or `memory` (lost when it stops)."""

    def __post_init__(self) -> None:
        if validation_deferred():
            return
        if self.max_tokens_default is not None and self.max_tokens_default < 1:
            raise ValueError(f"--max_tokens_default must be >= 1, got {self.max_tokens_default}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"--max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        from agentrl.backends.device import check_device_name

        EngineOptions.__post_init__(self)
        check_device_name(self.device, "--device")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    try:
        args = parse_flags(ServeArgs, sys.argv[1:] if argv is None else argv,
                           prog="agentrl serve", renamed={"--engines": "--num_engines"})
    except ValueError as e:
        print(f"agentrl serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not _is_loopback(args.host) and not args.api_key:
        log.warning("binding %s without --api-key: anyone who can reach it can use it", args.host)
    from agentrl.engine import open_engine
    from agentrl.models import load_tokenizer
    from servers.app import create_app
    from servers.config import ProxyConfig

    try:
        import torch

        from agentrl.engine.router import EngineRouter, engine_devices

        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        places = engine_devices(args.num_engines, args.device, gpus=torch.cuda.device_count(),
                                engine=args.engine,
                                tensor_parallel_size=args.tensor_parallel_size,
                                visible=visible.split(",") if visible else None)
        tokenizer = load_tokenizer(args.model)
        engines = [open_engine(
            args.model, engine=args.engine,
            device=place.device if args.num_engines > 1 else args.device,
            tokenizer=tokenizer, tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization,
            cuda_visible_devices=place.cuda_visible_devices,
        ) for place in places]
        engine = engines[0] if len(engines) == 1 else EngineRouter(engines)
    except ValueError as e:
        print(f"agentrl serve: {e}", file=sys.stderr)
        return 2
    name = args.served_model_name or args.model
    try:
        store = open_store(args.store, args.model, tokenizer)
    except StoreError as e:
        engine.close()
        print(f"agentrl serve: {e}", file=sys.stderr)
        return 2
    app = create_app(
        engine,
        # Hugging Face's stubs type the general case (batches in, lists out); the proxy calls
        # decode on one id list and apply_chat_template without tokenizing, which give strings.
        cast("Tokenizer", tokenizer),
        store,
        config=ProxyConfig(model_name=name, api_keys=args.api_key,
                           max_concurrency=args.max_concurrency, tool_parser=args.tool_parser,
                           max_body_bytes=args.max_body_bytes,
                           max_header_bytes=args.max_header_bytes,
                           max_tokens_default=args.max_tokens_default,
                           max_images_per_request=args.max_images_per_request,
                           allow_image_urls=args.allow_image_urls,
                           image_url_max_bytes=args.image_url_max_bytes,
                           image_url_timeout_s=args.image_url_timeout_s),
    )
    from servers.serving import freeze_startup_objects, http_protocol

    freeze_startup_objects()
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            http=http_protocol(args.max_header_bytes))
    server = uvicorn.Server(config)

    async def announce() -> None:
        port = server.servers[0].sockets[0].getsockname()[1] if server.servers else args.port
        base = f"http://{args.host}:{port}"
        print(f"agentrl proxy serving {name!r}\n  OpenAI base_url: {base}/v1\n"
              f"  per-session base_url: {base}/sessions/<session-id>/v1\n"
              f"  trajectories: GET {base}/sessions/<session-id>\n"
              f"  sessions stored in: {_where(store)}", flush=True)

    try:
        _run_with_announce(server, announce)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn has shut down gracefully, then re-raised it
        print("agentrl serve: stopped", file=sys.stderr)
    finally:
        engine.close()  # vLLM's engine runs in processes of its own: stop them with the server
        if isinstance(store, SqliteSessionStore):
            store.close()
    return 0


def open_store(where: str | None, model: str, tokenizer: object) -> SessionStore:
    """`--store`: `memory`, a SQLite path, or (None) the model's default path."""
    if where == "memory":
        return InMemorySessionStore()
    path = Path(where) if where else default_store_path(model)
    return SqliteSessionStore(path, tokenizer_id=vocabulary_id(tokenizer))


def vocabulary_id(tokenizer: object) -> str:
    """What a store's token ids mean: the vocabulary's size and a hash of it."""
    vocab = sorted(cast("Any", tokenizer).get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]
    return f"a vocabulary of {len(vocab)} tokens (sha256 {digest})"


def _where(store: SessionStore) -> str:
    if isinstance(store, SqliteSessionStore):
        return f"{store.path} ({store.restored} sessions restored)"
    return "memory only (lost when the server stops; --store PATH keeps them)"


def _run_with_announce(server: uvicorn.Server, announce: Callable[[], Awaitable[None]]) -> None:
    import asyncio

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if not task.done():
            await announce()
        await task

    asyncio.run(run())
