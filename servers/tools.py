"""Tool-call parsers: model text in, message content and OpenAI tool calls out.

Parsers are incremental (`feed` text as it is decoded, `finish` at the end) so streaming and
non-streaming share one code path and always agree. A parser only shapes the *response*: the
tokens the model sampled are recorded token-exact whatever the parser made of them.

Register more formats in `TOOL_PARSERS` (name -> factory taking the allowed tool names). A
factory that also has `call_tag(name, parameters)` (the xgrammar tag one call is written as)
and `trigger` can constrain sampling to calls: `tool_choice` "required" or a named function,
and `parallel_tool_calls: false`.
"""

from __future__ import annotations

import difflib
import json
import secrets
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from agentrl.engine.grammar import structural_tag_grammar
from agentrl.envs.tool_calls import parse_tool_call


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str
    """JSON text of the arguments object."""

    def as_message_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParseEvent:
    """Either content text or one complete tool call."""

    content: str = ""
    call: ToolCall | None = None


class ToolStreamParser(Protocol):
    def feed(self, text: str) -> list[ParseEvent]: ...
    def finish(self) -> list[ParseEvent]: ...


ToolParserFactory = Callable[[frozenset[str]], ToolStreamParser]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro, Qwen 2.5/3).

    Text that may be the start of `<tool_call>` is held back until it is known not to be.
    A call block that is not valid JSON naming a known tool is passed through as content,
    so nothing the model wrote disappears from the response.
    """

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    trigger = open_tag

    @classmethod
    def call_tag(cls, name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
        """One call as Hermes/Qwen chat templates render it, arguments valid for `parameters`."""
        schema = parameters if parameters else {"type": "object"}
        return {
            "type": "tag",
            "begin": f'{cls.open_tag}\n{{"name": {json.dumps(name)}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 2},
            "end": f"}}\n{cls.close_tag}",
        }

    def __init__(self, tool_names: frozenset[str]) -> None:
        self.tool_names = tool_names
        self._buf = ""
        self._in_call = False
        self._seen_call = False

    def feed(self, text: str) -> list[ParseEvent]:
        self._buf += text
        events: list[ParseEvent] = []
        while True:
            if not self._in_call:
                at = self._buf.find(self.open_tag)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.open_tag)
                    self._emit_content(events, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return events
                self._emit_content(events, self._buf[:at])
                self._buf = self._buf[at + len(self.open_tag) :]
                self._in_call = True
            at = self._buf.find(self.close_tag)
            if at < 0:
                return events
            body, self._buf = self._buf[:at], self._buf[at + len(self.close_tag) :]
            self._in_call = False
            events.append(self._call_or_text(body, closed=True))

    def finish(self) -> list[ParseEvent]:
        events: list[ParseEvent] = []
        if self._in_call:
            # Models often end with eos right after the JSON, without the closing tag.
            events.append(self._call_or_text(self._buf, closed=False))
        else:
            self._emit_content(events, self._buf)
        self._buf = ""
        self._in_call = False
        return events

    def _emit_content(self, events: list[ParseEvent], text: str) -> None:
        if self._seen_call and not text.strip():
            return  # whitespace between calls is formatting, not content
        if text:
            events.append(ParseEvent(content=text))

    def _call_or_text(self, body: str, *, closed: bool) -> ParseEvent:
        call = _parse_call_json(body, self.tool_names)
        if call is None:
            tail = self.close_tag if closed else ""
            return ParseEvent(content=f"{self.open_tag}{body}{tail}")
        self._seen_call = True
        return ParseEvent(call=call)


def _parse_call_json(body: str, tool_names: frozenset[str]) -> ToolCall | None:
    """The call in one block (agentrl.envs.tool_calls reads it); None if it is not one of the
    request's tools' calls, which then stays text."""
    call = parse_tool_call(body)
    if call.error is not None or (tool_names and call.name not in tool_names):
        return None
    arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
    return ToolCall(id=new_call_id(), name=call.name, arguments=arguments)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


TOOL_PARSERS: dict[str, ToolParserFactory] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
}


def get_tool_parser(name: str) -> ToolParserFactory:
    if name not in TOOL_PARSERS:
        hint = difflib.get_close_matches(name, TOOL_PARSERS, n=1)
        did_you_mean = f" Did you mean {hint[0]!r}?" if hint else ""
        raise ValueError(
            f"unknown tool parser {name!r}.{did_you_mean} Available: {sorted(TOOL_PARSERS)}; "
            f"add one to servers.tools.TOOL_PARSERS"
        )
    return TOOL_PARSERS[name]


def tool_call_grammar(
    factory: ToolParserFactory,
    tools: Sequence[tuple[str, dict[str, Any] | None]],
    *,
    only_calls: bool,
    parallel: bool,
) -> str:
    """A grammar for the completion given (name, parameters schema) of the tools it may call.

    only_calls: the completion is one or more calls (`tool_choice` "required" or a named tool)
    and nothing else; otherwise free text in which each call, once begun, must be well formed.
    parallel=False: at most one call, after which the completion ends.
    Raises GrammarError for a parameters schema the grammar library cannot compile, and
    ValueError for a tool format that cannot be constrained."""
    call_tag = getattr(factory, "call_tag", None)
    trigger = getattr(factory, "trigger", None)
    if call_tag is None or trigger is None:
        raise ValueError(f"the tool parser {getattr(factory, '__name__', factory)!r} does not "
                         f"describe its call format, so calls cannot be required or limited "
                         f"to one; use the hermes parser or give yours `call_tag` and `trigger`")
    tags = [call_tag(name, parameters) for name, parameters in tools]
    if only_calls:
        fmt: dict[str, Any] = {"type": "tags_with_separator", "tags": tags, "separator": "\n",
                               "at_least_one": True, "stop_after_first": not parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": [trigger], "tags": tags,
               "at_least_one": False, "stop_after_first": not parallel}
    names = ", ".join(name for name, _ in tools)
    return structural_tag_grammar(fmt, what=f"the parameters of the tools ({names})")


def parse_tool_calls(
    factory: ToolParserFactory, text: str, tool_names: Iterable[str]
) -> tuple[str | None, list[ToolCall]]:
    """Non-streaming parse of a whole completion."""
    parser = factory(frozenset(tool_names))
    events = [*parser.feed(text), *parser.finish()]
    content = "".join(e.content for e in events)
    calls = [e.call for e in events if e.call is not None]
    return (content or None) if calls else content, calls
