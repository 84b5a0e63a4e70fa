"""The actions screenshot environments understand, parsed from the text the model writes.

    click(x, y)      x, y in pixels from the screen's top-left corner
    type("text")     types into the focused field
    submit()         presses the form's submit button

The first action in the text counts; anything else is ignored. Text with no action is a
malformed action: the env answers with feedback, never an exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_ACTION = re.compile(
    r"click\(\s*(?P<x>-?\d+)\s*,\s*(?P<y>-?\d+)\s*\)"
    r"|type\(\s*\"(?P<text>[^\"\n]{0,64})\"\s*\)"
    r"|(?P<submit>submit\(\s*\))"
)


@dataclass(frozen=True)
class Click:
    x: int
    y: int


@dataclass(frozen=True)
class Type:
    text: str


@dataclass(frozen=True)
class Submit:
    pass


Action = Click | Type | Submit


def parse_action(text: str) -> Action | None:
    """The first action written in `text`, or None."""
    m = _ACTION.search(text)
    if m is None:
        return None
    if m.group("x") is not None:
        return Click(int(m.group("x")), int(m.group("y")))
    if m.group("text") is not None:
        return Type(m.group("text"))
    return Submit()
