"""Request bodies of the Anthropic Messages API (`POST /v1/messages`, servers/messages.py), as
strict pydantic models, and the Anthropic shape of its errors.

As strict as the OpenAI requests (servers/openai_schemas.py): a string where a number belongs
is a 400, every number has a range, and a content block or tool of a type this server does not
serve is refused by name (with a did-you-mean) instead of being dropped. Fields real clients
send that change nothing here (`metadata`, `cache_control`, `citations`, `service_tier`, ...)
are accepted and ignored; `thinking` is accepted with a warning (no thinking blocks are
written). Answers are plain dicts shaped like the `anthropic` package's types; tests validate
them with its own models.
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
)

from servers.openai_schemas import JSONObject, MaxTokens, Temperature, TopK, TopP

_STRICT = ConfigDict(strict=True, extra="allow")

BLOCK_KINDS = ("text", "image", "tool_use", "tool_result")
"""Content block types a request may carry (`thinking`, `document`, server tools: not served)."""


def _text_or(blocks: Any) -> Any:
    """`str | blocks`, validated as the one the value is (a list of blocks with one unknown
    type is then refused for that block, not for failing to be a string)."""
    return Annotated[
        Annotated[str, Tag("str")] | Annotated[blocks, Tag("list")],
        Discriminator(lambda v: "str" if isinstance(v, str) else "list"),
    ]


class TextBlock(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class Base64Source(BaseModel):
    model_config = _STRICT
    type: Literal["base64"]
    media_type: str
    data: str

    def url(self) -> str:
        return f"data:{self.media_type};base64,{self.data}"


class URLSource(BaseModel):
    model_config = _STRICT
    type: Literal["url"]
    url: str


class ImageBlock(BaseModel):
    model_config = _STRICT
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def url(self) -> str:
        return self.source.url() if isinstance(self.source, Base64Source) else self.source.url


class ToolUseBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: JSONObject


class ToolResultBlock(BaseModel):
    model_config = _STRICT
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: _text_or(list[Annotated[TextBlock | ImageBlock,  # type: ignore[valid-type]
                                     Field(discriminator="type")]]) = ""
    is_error: bool | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n\n".join(b.text for b in self.content if isinstance(b, TextBlock))


class UnsupportedBlock(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: str) -> str:
        shown = kind[:60]
        hint = difflib.get_close_matches(shown, BLOCK_KINDS, n=1)
        did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(f"content blocks of type {shown!r} are not supported by this server "
                         f"(only {', '.join(map(repr, BLOCK_KINDS))}){did_you_mean}")


def _block_kind(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):
        return None
    return kind if kind in BLOCK_KINDS else "other[block]"


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[UnsupportedBlock, Tag("other[block]")],  # (brackets: kept out of 400s)
    Discriminator(_block_kind, custom_error_type="invalid_block_type",
                  custom_error_message="a content block needs a string `type`, one of "
                                       + ", ".join(map(repr, BLOCK_KINDS))),
]


class MessageParam(BaseModel):
    model_config = _STRICT
    role: Literal["user", "assistant"]
    content: _text_or(list[ContentBlock])  # type: ignore[valid-type]


def _custom_tool(kind: str | None) -> str | None:
    if kind not in (None, "custom"):
        raise ValueError(f"only client tools (with `input_schema`, type 'custom' or no type) "
                         f"are supported, not {str(kind)[:60]!r} (this server has no "
                         f"server tools)")
    return kind


class Tool(BaseModel):
    model_config = _STRICT
    type: Annotated[str | None, AfterValidator(_custom_tool)] = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: JSONObject


class ToolChoiceAuto(BaseModel):
    model_config = _STRICT
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(BaseModel):
    model_config = _STRICT
    type: Literal["any"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(BaseModel):
    model_config = _STRICT
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(BaseModel):
    model_config = _STRICT
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone,
                       Field(discriminator="type")]


class OutputFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    schema_: JSONObject = Field(alias="schema")


class OutputConfig(BaseModel):
    """Structured outputs: `format` constrains the answer's text to a JSON schema (as chat's
    `response_format`); `effort` is accepted and ignored."""

    model_config = _STRICT
    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    """`POST /v1/messages/count_tokens`: the conversation without the sampling fields."""

    model_config = _STRICT
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: _text_or(list[TextBlock]) | None = None  # type: ignore[valid-type]
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict | None = None
    output_config: OutputConfig | None = None

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "\n\n".join(b.text for b in self.system)
        return self.system


class MessagesRequest(CountTokensRequest):
    model_config = _STRICT
    max_tokens: MaxTokens
    stop_sequences: list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False

