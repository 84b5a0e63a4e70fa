"""The page as text for `dom` mode: one line per visible element, `[ref] tag "text"`.

    [6] button "Ok"
    [4] input_text value="" (focused)
    [-2] text "Facilisis aliquam nisl"

Listed, in document order: elements with text (a button or link once, with the text of all it
holds), form fields (input_*, textarea, select; their value, checked state and focus), and runs
of text inside mixed content (MiniWoB's `t` nodes, shown as `text`, with negative refs that
change every step). Not listed: containers without text of their own, empty elements, and
elements wholly outside the screen. Every listed ref can be clicked: `click(ref)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from miniwob.dom import DOMElement  # type: ignore[import-untyped, import-not-found, unused-ignore]

MAX_TEXT_CHARS = 80
"""Longer text is cut, with "..." at the end."""

_WHOLE = frozenset({"button", "a"})
"""Tags listed once, with the text of everything they hold (a dialog's close button holds an
icon and an off-screen "Close")."""
_FIELDS = ("input", "textarea", "select", "option")


@dataclass(frozen=True)
class Box:
    """An element's box in screen pixels, from the page's top-left corner."""

    left: float
    top: float
    width: float
    height: float

    @property
    def centre(self) -> tuple[int, int]:
        return round(self.left + self.width / 2), round(self.top + self.height / 2)

    def meets(self, width: int, height: int) -> bool:
        """Whether any of it is on a `width` x `height` screen."""
        return (self.left < width and self.top < height and self.left + self.width > 0
                and self.top + self.height > 0)


def render_page(root: DOMElement, width: int, height: int) -> tuple[list[str], dict[int, Box]]:
    """The listing's lines, and the box of every listed ref."""
    lines: list[str] = []
    boxes: dict[int, Box] = {}
    for child in root.children:
        _walk(child, width, height, lines, boxes)
    return lines, boxes


def _walk(el: DOMElement, width: int, height: int, lines: list[str],
          boxes: dict[int, Box]) -> None:
    box = Box(el.left, el.top, el.width, el.height)
    tag = "text" if el.tag == "t" else el.tag
    field = tag.startswith(_FIELDS)
    whole = tag in _WHOLE
    text = _all_text(el) if whole else el.text
    if box.meets(width, height) and (field or whole or text):
        lines.append(_line(el, tag, text))
        boxes[el.ref] = box
    if not whole:
        for child in el.children:
            _walk(child, width, height, lines, boxes)


def _line(el: DOMElement, tag: str, text: str | None) -> str:
    parts = [f"[{el.ref}] {tag}"]
    if text:
        parts.append(_quote(text))
    if isinstance(el.value, bool):
        parts.append("(checked)" if el.value else "(not checked)")
    elif el.value is not None:
        parts.append(f"value={_quote(str(el.value))}")
    if el.focused:
        parts.append("(focused)")
    return " ".join(parts)


def _all_text(el: DOMElement) -> str:
    if el.text is not None:
        return el.text
    return " ".join(t for t in (_all_text(c) for c in el.children) if t)


def _quote(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > MAX_TEXT_CHARS:
        text = text[: MAX_TEXT_CHARS - 3] + "..."
    return json.dumps(text, ensure_ascii=False)
