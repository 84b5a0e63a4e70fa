"""agentrl.terminal_safe.visible: which characters it escapes, how, and that the result reads
back exactly (#34 item 10)."""

from __future__ import annotations

import random
import re

import pytest

from agentrl.terminal_safe import visible

BIDI = [0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)]
ESCAPED = {*range(0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0), *BIDI}
"""C0 but \\t and \\n, DEL, C1, and the bidi controls of Trojan Source (CVE-2021-42574)."""


def _read_back(shown: str) -> str:
    """The inverse the module docstring describes, written as a plain loop."""
    out, i = [], 0
    while i < len(shown):
        if shown[i] != "\\":
            out.append(shown[i])
            i += 1
            continue
        j = i
        while j < len(shown) and shown[j] == "\\":
            j += 1
        n = j - i
        escape = re.match(r"x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}", shown[j:])
        if escape is None:
            out.append("\\" * n)
        elif n % 2:
            out.append("\\" * (n // 2) + chr(int(escape.group()[1:], 16)))
        else:
            out.append("\\" * (n // 2) + escape.group())
        i = j + (len(escape.group()) if escape else 0)
    return "".join(out)


def test_exactly_the_controls_and_bidi_characters_are_escaped():
    changed = {c for c in range(0x110000) if visible(chr(c)) != chr(c)}
    assert changed == ESCAPED


@pytest.mark.parametrize(("raw", "shown"), [
    ("\x1b]52;c;cHduZWQ=\x07", r"\x1b]52;c;cHduZWQ=\x07"),  # OSC 52: set the clipboard
    ("\x1b]0;title\x07", r"\x1b]0;title\x07"),  # set the window title
    ("\x1b[2J", r"\x1b[2J"),  # clear the screen
    ("ok\rno", r"ok\x0dno"),  # overwrite the line
    ("ab\bc\x00\x7f", r"ab\x08c\x00\x7f"),
    ("\x9b31m", r"\x9b31m"),  # C1 CSI
    ("\u202eevil\u2066x\u2069", r"\u202eevil\u2066x\u2069"),
])
def test_escapes_read_as_what_they_stand_for(raw, shown):
    assert visible(raw) == shown


@pytest.mark.parametrize("text", [
    "line 1\n\tline 2\n", "\\frac{1}{2} = 0.5", "C:\\Users\\new", "\\\\ ends with \\",
    "\\xyz \\u12 \\U0001f600", "café 数学 مرحبا 👩\u200d💻", "",
])
def test_text_without_controls_is_unchanged(text):
    assert visible(text) == text


@pytest.mark.parametrize(("raw", "shown"), [
    ("\\x41", "\\\\x41"),  # would read as "A"
    ("\\u00e9", "\\\\u00e9"),
    ("\\\\x41", "\\\\\\\\x41"),  # a run: every backslash doubled
    ("\\\x1b", "\\\\\\x1b"),  # a backslash before an escaped character
])
def test_backslashes_are_doubled_only_where_they_would_be_misread(raw, shown):
    assert visible(raw) == shown


def test_the_result_reads_back_exactly_and_holds_no_control():
    rng = random.Random(0)
    alphabet = ["\\", "x", "u", "1", "b", "F", "e", "z", "\n", "\x1b", "\x85", "\u202e", "é"]
    for _ in range(3000):
        raw = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        shown = visible(raw)
        assert not ESCAPED & {ord(c) for c in shown}
        assert _read_back(shown) == raw, (raw, shown)
