"""The Hermes tool-call format, in one place: how tool schemas reach a prompt and how calls are
read back from the policy's text.

Hermes 2 Pro, Qwen 2.5/3 and the templates trained like them write a call as

    <tool_call>{"name": "get", "arguments": {"key": "x"}}</tool_call>

and show the tools as JSON schemas inside `<tools></tools>` in the system message. Chat
templates that take `tools` (Qwen's) render that themselves; for the ones that ignore them
(SmolLM2's), `fold_tools` writes the same block into the system message, so the policy sees its
tools whatever its template does (`ChatTemplateBridge` and the proxy's renderer both do).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
"""One call block; a block left unclosed at the end counts (the policy stopped right after it)."""

CALL_FORMAT = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'

TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)

_PROBE = "agentrl_probe_fn"


@dataclasses.dataclass(frozen=True)
class ToolCallText:
    """One call read from the policy's text: a name and arguments, or an error saying what is
    wrong with it (written for the policy to read as an observation)."""

    name: str = ""
    arguments: Mapping[str, object] = dataclasses.field(default_factory=dict)
    error: str | None = None


def parse_tool_call(body: str) -> ToolCallText:
    """The JSON inside one `<tool_call>` block. Arguments may also be a JSON string, as in
    OpenAI's wire format, or be named "parameters" (as Llama 3's format names them)."""
    try:
        obj = json.loads(body)
        args = obj.get("arguments", obj.get("parameters", {})) if isinstance(obj, dict) else None
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError as e:
        return ToolCallText(error=f"Error: the tool call is not valid JSON ({e}). "
                                  f"Write {CALL_FORMAT}")
    name = obj.get("name") if isinstance(obj, dict) else None
    if not isinstance(name, str) or not isinstance(args, dict):
        return ToolCallText(error=f"Error: a tool call needs a string \"name\" and an object of "
                                  f"\"arguments\". Write {CALL_FORMAT}")
    return ToolCallText(name=name, arguments=args)


def find_tool_calls(text: str) -> list[ToolCallText]:
    """The `<tool_call>{json}</tool_call>` blocks in `text`, in order."""
    return [parse_tool_call(m.group(1)) for m in TOOL_CALL_BLOCK.finditer(text)]


def fold_tools(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`messages` with the tool schemas in the system message (appended to a text one, else a
    new one first), in the wording Qwen's template uses."""
    block = TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    block += TOOLS_POSTAMBLE
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
        return out
    return [{"role": "system", "content": block}, *out]


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether `tokenizer`'s chat template shows the `tools` it is given (a probe tool's name
    appears in the rendering); a template that fails on them does not."""
    tools = [{"type": "function", "function": {"name": _PROBE, "parameters": {}}}]
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=tools, add_generation_prompt=True,
            tokenize=False,
        )
    except Exception:  # noqa: BLE001 - any template failure means "not supported"
        return False
    return _PROBE in str(text)
