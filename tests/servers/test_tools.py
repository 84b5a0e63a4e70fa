"""Tool-call parsing: streamed in any split it agrees with the whole-text parse."""

from __future__ import annotations

import json

import pytest

from servers.tools import HermesToolParser, get_tool_parser, parse_tool_calls

TEXT = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def test_parses_calls_and_content():
    content, calls = parse_tool_calls(HermesToolParser, TEXT, ["get_weather", "get_time"])
    assert content == "Let me look."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streamed_in_pieces_equals_whole(step):
    parser = HermesToolParser(frozenset({"get_weather", "get_time"}))
    events = []
    for i in range(0, len(TEXT), step):
        events += parser.feed(TEXT[i : i + step])
    events += parser.finish()
    assert "".join(e.content for e in events) == "Let me look."
    assert [e.call.name for e in events if e.call] == ["get_weather", "get_time"]


def test_unknown_tool_or_bad_json_stays_content():
    text = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(HermesToolParser, text, ["get_time"])
    assert calls == [] and content == text
    content, calls = parse_tool_calls(HermesToolParser, "<tool_call>{oops</tool_call>", ["x"])
    assert calls == [] and content == "<tool_call>{oops</tool_call>"


def test_unclosed_call_at_end_is_parsed():
    _, calls = parse_tool_calls(HermesToolParser, '<tool_call>{"name": "f", "arguments": {"a": 1}}',
                                ["f"])
    assert [c.name for c in calls] == ["f"]


def test_text_like_the_tag_is_not_swallowed():
    content, calls = parse_tool_calls(HermesToolParser, "a <tool and <tool_cal", ["f"])
    assert content == "a <tool and <tool_cal" and calls == []


def test_unknown_parser_name_suggests():
    with pytest.raises(ValueError, match="Did you mean 'hermes'"):
        get_tool_parser("hermez")
