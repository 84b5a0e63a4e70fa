"""Proxy settings and the state shared by its routes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from agentrl.engine.base import Engine
from agentrl.models.vision import VisionProcessor, vision_processor
from servers.deps import Tokenizer
from servers.middleware import MAX_HEADER_BYTES
from servers.render import ChatRenderer
from servers.sessions import ResponseHistory, SessionStore
from servers.tools import ToolParserFactory, get_tool_parser


@dataclass(frozen=True, kw_only=True)
class ProxyConfig:
    """How the proxy serves and guards itself."""

    model_name: str = "agentrl"
    """Name reported by /v1/models; requests must name it (or one of `aliases`)."""
    aliases: tuple[str, ...] = ()
    """Other model names accepted as the same model."""
    api_keys: tuple[str, ...] = ()
    """If non-empty, every /v1 and /sessions request needs `Authorization: Bearer <key>`."""
    max_body_bytes: int = 32 * 2**20
    """Largest request body accepted (413 beyond); images as data URLs count."""
    max_header_bytes: int = MAX_HEADER_BYTES
    """Largest request URL and headers accepted, in bytes (400 beyond)."""
    max_concurrency: int = 1024
    """Most generation requests in flight at once; more get 503 + Retry-After."""
    max_session_concurrency: int = 64
    """Most generation requests in flight per session; more get 429 + Retry-After."""
    max_tokens_default: int | None = None
    """Cap on new tokens when the request sets none (None: up to the context length)."""
    tool_parser: str = "hermes"
    """Name in `servers.tools.TOOL_PARSERS`."""
    auto_create_sessions: bool = True
    """Create a session on first use of its id; if false, unknown ids get 404."""
    session_api_key_prefix: str = "session-"
    """An api key `session-<id>` binds the call to session `<id>` (when auth is off)."""
    max_images_per_request: int = 16
    """Most `image_url` parts one request may carry (400 beyond)."""
    allow_image_urls: bool = False
    """Fetch `http(s)` image URLs; off by default: only base64 `data:` URLs are accepted."""
    image_url_max_bytes: int = 16 * 2**20
    """Largest image fetched from a URL."""
    image_url_timeout_s: float = 10.0
    """Longest wait for an image URL's server."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ValueError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_concurrency < 1 or self.max_session_concurrency < 1:
            raise ValueError(
                f"max_concurrency and max_session_concurrency must be >= 1, got "
                f"{self.max_concurrency} and {self.max_session_concurrency}"
            )
        get_tool_parser(self.tool_parser)
        if self.max_images_per_request < 0 or self.image_url_max_bytes < 1 or not (
            self.image_url_timeout_s > 0
        ):
            raise ValueError(
                "max_images_per_request must be >= 0, image_url_max_bytes >= 1 and "
                "image_url_timeout_s > 0"
            )


@dataclass
class ProxyState:
    engine: Engine
    tokenizer: Tokenizer
    store: SessionStore
    config: ProxyConfig
    renderer: ChatRenderer
    tool_parser: ToolParserFactory
    skip_ids: frozenset[int]
    created: int = field(default_factory=lambda: int(time.time()))
    in_flight: int = 0
    responses: ResponseHistory = field(default_factory=ResponseHistory)

    @classmethod
    def build(
        cls,
        engine: Engine,
        tokenizer: Tokenizer,
        store: SessionStore,
        config: ProxyConfig,
        processor: VisionProcessor | None,
    ) -> ProxyState:
        """`processor`: the vision-language model's; default: the one the tokenizer's model
        has (none for a text-only model)."""
        if processor is None:
            processor = vision_processor(tokenizer)
        special = set(getattr(tokenizer, "all_special_ids", ()) or ())
        return cls(
            engine=engine,
            tokenizer=tokenizer,
            store=store,
            config=config,
            renderer=ChatRenderer(tokenizer, processor),
            tool_parser=get_tool_parser(config.tool_parser),
            skip_ids=frozenset(special),
        )

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.config.model_name, *self.config.aliases)
