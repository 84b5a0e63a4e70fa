"""The action grammar of `agentrl/MiniWoB-v0`: what the policy writes, parsed strictly.

    click(ref)            click the element listed as [ref] (refs are shown in dom/both modes;
                          a negative ref is a run of text, clicked at its centre)
    click(x, y)           click at pixel (x, y) of the screenshot, from its top-left corner
    type(ref, "text")     click the element [ref], then type the text (a select [ref]: pick
                          its option "text")
    type("text")          type the text into the focused element
    key("Enter")          press a key: a name (Enter, Tab, Backspace, Escape, Space, Delete,
                          ArrowUp/Down/Left/Right, Home, End, PageUp, PageDown) or one
                          character, with optional modifiers: key("Control+a"), key("Shift+Tab")
    scroll(dx, dy)        turn the mouse wheel by (dx, dy) pixels where the pointer last was
                          (positive dy scrolls down)
    done()                end the episode (a task that has not ended scores -1, as a time-out)

The action is the answer's last non-empty line (what comes before it is the policy's own
reasoning), stripped of surrounding spaces and of one pair of backticks; that line must be
exactly one action. Strings are double-quoted with JSON escapes (\\" and \\\\). Anything else is
not an action: `parse_action` returns the reason, which the env shows the policy as feedback.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

MAX_TEXT_CHARS = 200
"""The longest string `type` accepts."""
MAX_SCROLL_PX = 2000
"""The largest |dx| or |dy| `scroll` accepts."""

KEY_NAMES = (
    "Enter", "Tab", "Backspace", "Escape", "Space", "Delete", "Insert", "ArrowUp", "ArrowDown",
    "ArrowLeft", "ArrowRight", "Home", "End", "PageUp", "PageDown",
)
MODIFIERS = {"Control": "C-", "Shift": "S-", "Alt": "A-", "Meta": "M-"}
"""Modifier names and their prefix in MiniWoB's key syntax (`miniwob.selenium_actions`)."""

GRAMMAR = ('click(ref), click(x, y), type(ref, "text"), type("text"), key("Enter"), '
           'scroll(dx, dy) or done()')

_INT = r"-?\d+"
_STR = r'"(?:[^"\\\n]|\\.)*"'
_FORMS = [
    ("click_ref", re.compile(rf"click\(\s*(?P<ref>{_INT})\s*\)")),
    ("click_at", re.compile(rf"click\(\s*(?P<x>{_INT})\s*,\s*(?P<y>{_INT})\s*\)")),
    ("type_ref", re.compile(rf"type\(\s*(?P<ref>{_INT})\s*,\s*(?P<text>{_STR})\s*\)")),
    ("type", re.compile(rf"type\(\s*(?P<text>{_STR})\s*\)")),
    ("key", re.compile(rf"key\(\s*(?P<key>{_STR})\s*\)")),
    ("scroll", re.compile(rf"scroll\(\s*(?P<dx>{_INT})\s*,\s*(?P<dy>{_INT})\s*\)")),
    ("done", re.compile(r"done\(\s*\)")),
]
_NAME = re.compile(r"^(\w+)\s*\(")


@dataclass(frozen=True)
class ClickRef:
    ref: int


@dataclass(frozen=True)
class ClickAt:
    x: int
    y: int


@dataclass(frozen=True)
class Type:
    text: str
    ref: int | None = None
    """The element to click first; None types into the focused one."""


@dataclass(frozen=True)
class Key:
    key: str
    """In MiniWoB's syntax: modifier prefixes ("C-", "S-", ...) and "<Enter>" or a character."""


@dataclass(frozen=True)
class Scroll:
    dx: int
    dy: int


@dataclass(frozen=True)
class Done:
    pass


Action = ClickRef | ClickAt | Type | Key | Scroll | Done


def action_line(text: str) -> str:
    """The line of an answer that holds its action: the last non-empty one, stripped of spaces
    and of one pair of enclosing backticks."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else ""
    if len(line) >= 2 and line[0] == line[-1] == "`":
        line = line[1:-1].strip()
    return line


def parse_action(text: str) -> Action | str:
    """The action the answer writes, or why it is not one (a sentence for the policy)."""
    line = action_line(text)
    if not line:
        return f"Your answer was empty. End it with one action: {GRAMMAR}."
    for kind, pattern in _FORMS:
        m = pattern.fullmatch(line)
        if m is not None:
            return _build(kind, m)
    name = _NAME.match(line)
    if name is None or name.group(1) not in {"click", "type", "key", "scroll", "done"}:
        shown = line if len(line) <= 60 else line[:57] + "..."
        return (f"No action in your answer's last line ({shown!r}). End your answer with one "
                f"action: {GRAMMAR}.")
    return (f"{line!r} is not a valid {name.group(1)} action; the forms are: {GRAMMAR} "
            f"(whole numbers, strings in double quotes, one action on the last line).")


def _build(kind: str, m: re.Match[str]) -> Action | str:
    if kind == "click_ref":
        return ClickRef(int(m.group("ref")))
    if kind == "click_at":
        return ClickAt(int(m.group("x")), int(m.group("y")))
    if kind == "scroll":
        dx, dy = int(m.group("dx")), int(m.group("dy"))
        if max(abs(dx), abs(dy)) > MAX_SCROLL_PX:
            return f"scroll({dx}, {dy}) is too far: at most {MAX_SCROLL_PX} pixels each way."
        return Scroll(dx, dy)
    if kind == "done":
        return Done()
    literal = m.group("text") if kind != "key" else m.group("key")
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return f"{literal} is not a valid string (use JSON escapes: \\\" and \\\\)."
    if kind == "key":
        return _key(value)
    if len(value) > MAX_TEXT_CHARS:
        return f"That text is {len(value)} characters long; type at most {MAX_TEXT_CHARS}."
    ref = m.group("ref") if kind == "type_ref" else None
    return Type(value, None if ref is None else int(ref))


def _key(spec: str) -> Key | str:
    """`Control+Shift+a` -> Key("C-S-a"); an unknown key name -> the reason."""
    mods, name = ([], "+") if spec == "+" else (spec.split("+")[:-1], spec.split("+")[-1])
    prefix = ""
    for mod in mods:
        if mod not in MODIFIERS:
            return (f"key({json.dumps(spec)}): unknown modifier {mod!r}; modifiers are "
                    f"{', '.join(MODIFIERS)}, joined with '+' (key(\"Control+a\")).")
        prefix += MODIFIERS[mod]
    if name in KEY_NAMES:
        return Key(f"{prefix}<{name}>")
    if len(name) == 1 and name.isprintable():
        return Key(prefix + name)
    return (f"key({json.dumps(spec)}): unknown key {name!r}; name one of {', '.join(KEY_NAMES)} "
            f"or a single character.")
