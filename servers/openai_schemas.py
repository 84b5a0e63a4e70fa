"""Request bodies of the OpenAI-compatible endpoints, as strict pydantic models.

Strict: a string where a number belongs is a 400, not a silent coercion. Every number that
reaches the engine has a range (the types below), so no value can fail inside the engine's
batch, where it would fail the requests batched with it (#34). Unknown but harmless
fields that real clients send (`user`, `metadata`, `store`, `service_tier`,
`reasoning_effort`, ...) are accepted and ignored (`extra="allow"`).
Responses are plain dicts shaped like the OpenAI types; tests validate them with the `openai`
package's own models.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from servers.finite import check_finite_json, in_range
from servers.sessions import SESSION_ID_PATTERN

_STRICT = ConfigDict(strict=True, extra="allow")
_CLOSED = ConfigDict(strict=True, extra="forbid")

MAX_INT32 = 2**31 - 1
"""Token counts and top-k: engines hold them in 32-bit integers."""

Temperature = Annotated[float, AfterValidator(in_range(0.0, 2.0, note="; 0 is greedy"))]
TopP = Annotated[float, AfterValidator(in_range(0.0, 1.0, lo_open=True))]
TopK = Annotated[int, AfterValidator(in_range(0, MAX_INT32, note="; 0 turns top-k off"))]
MaxTokens = Annotated[int, AfterValidator(in_range(1, MAX_INT32))]
NumChoices = Annotated[int, AfterValidator(in_range(1, 64))]
TopLogprobs = Annotated[int, AfterValidator(in_range(0, 20))]
Penalty = Annotated[float, AfterValidator(in_range(-2.0, 2.0))]
Seed = Annotated[int, AfterValidator(in_range(-(2**63), 2**63 - 1, note=" (a 64-bit integer)"))]
_bias = in_range(-100.0, 100.0)


def _finite_tree(value: dict) -> dict:
    check_finite_json(value, "")
    return value


def _token_biases(bias: dict[str, float]) -> dict[str, float]:
    """OpenAI's `logit_bias`: token ids, as strings of ASCII digits, to biases in [-100, 100]
    (whether an id is in the vocabulary is the server's to check, `sampling_params`)."""
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()):
            shown = key if len(key) <= 20 else key[:17] + "..."
            raise ValueError(f'keys must be token ids in plain ASCII digits (0-9), like '
                             f'{{"50256": -100}}; {shown!r} is not one')
        try:
            _bias(value)
        except ValueError as e:
            raise ValueError(f"the bias of token {key[:20]} {e}") from None
    return bias


JSONObject = Annotated[dict, AfterValidator(_finite_tree)]
"""A JSON object read as data (a JSON schema, tool parameters): its numbers must be finite."""
LogitBias = Annotated[dict[str, float], AfterValidator(_token_biases)]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = _STRICT
    url: str
    detail: str | None = None


class ImagePart(BaseModel):
    model_config = _STRICT
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str | dict = "{}"

    @model_validator(mode="after")
    def _arguments_are_an_object(self) -> FunctionCall:
        """A tool call sent back must carry what a call carries: a JSON object (the proxy
        never answers with anything else), or nothing."""
        if isinstance(self.arguments, str) and self.arguments.strip():
            try:
                value = json.loads(self.arguments)
            except ValueError as e:
                raise ValueError(f"the arguments of tool call {self.name!r} are not valid "
                                 f"JSON ({e}); send the arguments string the call came "
                                 f"with") from None
            if not isinstance(value, dict):
                raise ValueError(f"the arguments of tool call {self.name!r} must be a JSON "
                                 f"object, got {type(value).__name__}")
        return self


class ToolCallIn(BaseModel):
    model_config = _STRICT
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(
                f"a {self.role!r} message needs `content` (only assistant messages with "
                f"`tool_calls` may have content null)"
            )
        return self


class FunctionDef(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaSpec(BaseModel):
    model_config = _STRICT
    name: str = Field(min_length=1, max_length=64)
    schema_: JSONObject | bool = Field(default_factory=dict, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text"]


class JSONObjectFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]


class JSONSchemaFormat(BaseModel):
    model_config = _STRICT
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


ResponseFormat = Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat,
                           Field(discriminator="type")]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = _STRICT
    model: str
    max_tokens: MaxTokens | None = None
    n: NumChoices = 1
    stop: str | list[str] | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    seed: Seed | None = None
    logit_bias: LogitBias | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def stop_tuple(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return tuple(s for s in stops if s)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true; set logprobs=true or drop it")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ValueError("tool_choice is set but no tools are given; pass `tools` too")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or ()]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names function {self.tool_choice.function.name!r}, which is "
                    f"not among the tools {names}"
                )
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str]
    """Checked for emptiness once tokenized (`""`, `[]` and `[""]` alike)."""
    logprobs: TopLogprobs | None = None
    echo: bool = False

    def max_new_tokens(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` (text) or `messages` (chat)")
        return self


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class RewardRequest(BaseModel):
    model_config = _CLOSED
    reward: float
    call_id: str | None = None
    """Attach to the turn of this call (a `chatcmpl-…`/`cmpl-…` id); default: the last call."""
    choice: int | None = Field(default=None, ge=0)
    """With n > 1, only this choice's turn; default: every choice of the call."""
    terminated: bool = True
    truncated: bool = False
    info: dict = Field(default_factory=dict)


class SessionCreate(BaseModel):
    model_config = _CLOSED
    id: str | None = Field(default=None, pattern=SESSION_ID_PATTERN)
    group: str | None = None
    info: dict = Field(default_factory=dict)
    seed: Seed | None = None
    """Seeds the sampling of the session's calls that set no seed (`Session.call_seed`)."""


# The Responses API's request (`POST /v1/responses`, servers/responses.py): input items, tools
# and the text format, as strict as the chat request above.

class InputText(BaseModel):
    model_config = _STRICT
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(BaseModel):
    model_config = _STRICT
    type: Literal["refusal"]
    refusal: str


class InputImage(BaseModel):
    model_config = _STRICT
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: str | None = None


ContentIn = Annotated[InputText | Refusal | InputImage, Field(discriminator="type")]


class MessageItem(BaseModel):
    model_config = _STRICT
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentIn]


class FunctionCallItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningItem(BaseModel):
    """Sent back by clients that keep every output item; a model here never writes one."""

    model_config = _STRICT
    type: Literal["reasoning"]


def _item_kind(value: Any) -> str | None:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(
        value, "type", "message")
    if not isinstance(kind, str):  # e.g. ["function_call"]: no kind (and unhashable)
        return None
    return kind if kind in _ITEM_KINDS else "unsupported"


class UnsupportedItem(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str

    @field_validator("type")
    @classmethod
    def _refuse(cls, kind: str) -> str:
        raise ValueError(f"input items of type {kind[:60]!r} are not supported; send items "
                         f"of type {_KINDS_SHOWN} (and their content in full instead of an "
                         f"item_reference)")


_ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")
_KINDS_SHOWN = ", ".join(repr(k) for k in _ITEM_KINDS)
InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[UnsupportedItem, Tag("unsupported")],
    Discriminator(_item_kind, custom_error_type="invalid_item_type",
                  custom_error_message=f"an input item's `type` must be a string, one of "
                                       f"{_KINDS_SHOWN}"),
]


class FunctionTool(BaseModel):
    model_config = _STRICT
    type: str
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _functions_only(cls, kind: str) -> str:
        if kind != "function":
            raise ValueError(f"only function tools are supported, not {kind!r} (this server "
                             f"has no built-in tools)")
        return kind


class ResponsesNamedFunction(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    name: str


class TextFormatConfig(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: JSONObject | bool | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT
    format: TextFormatConfig | None = None


class ResponsesRequest(BaseModel):
    model_config = _STRICT
    model: str
    input: list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    stream: bool = False

    @field_validator("input", mode="before")
    @classmethod
    def _text_is_a_user_message(cls, value: Any) -> Any:
        return [{"role": "user", "content": value}] if isinstance(value, str) else value
