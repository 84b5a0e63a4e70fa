"""The page as text for `dom` mode: one line per visible element, `[ref] tag "text"`.

    [6] button "Ok"
    [4] input_text value="" (focused)
    [-2] text "Facilisis aliquam nisl"
    [9] select value="Angola" options: "American Samoa", "Angola", "Aruba"
    [15] span icon "trash"
    [21] span background="#ff0000"

Listed, in document order: elements with text (a button or link once, with the text of all it
holds), form fields (input_*, textarea, select; their value, checked state and focus; a
select's options, which `type(ref, "option")` picks), runs of text inside mixed content
(MiniWoB's `t` nodes, shown as `text`, with negative refs that change every step), and
controls without text (icons, colour swatches, a link or button holding only an icon), named
by their label (aria-label, title or alt), else (if a click does something: a handler or a
pointer cursor) their id or classes, and shown with their background colour where it is not
white. Not listed: containers, elements with nothing to name them by, and elements wholly
outside the screen. Every listed ref can be clicked:
`click(ref)`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miniwob.dom import DOMElement  # type: ignore[import-untyped, import-not-found, unused-ignore]

MAX_TEXT_CHARS = 80
"""Longer text is cut, with "..." at the end."""

_WHOLE = frozenset({"button", "a"})
"""Tags listed once, with the text of everything they hold (a dialog's close button holds an
icon and an off-screen "Close")."""
_FIELDS = ("input", "textarea", "select", "option")
MAX_OPTIONS = 30
"""A select shows at most this many options, then how many more it has."""


@dataclass(frozen=True)
class Notes:
    """What the listing adds to MiniWoB++'s DOM, by ref: labels (aria-label, title, alt), each
    select's options in order, and the elements without text that react to a click."""

    labels: Mapping[int, str]
    options: Mapping[int, Sequence[str]]
    clickable: frozenset[int] = frozenset()

    @staticmethod
    def of(raw: Mapping[str, Any]) -> Notes:
        """Read from the raw DOM of `TaskPage.look` (its elements' `label` and `options`)."""
        labels: dict[int, str] = {}
        options: dict[int, list[str]] = {}
        clickable: set[int] = set()
        stack = [raw]
        while stack:
            node = stack.pop()
            if node.get("label"):
                labels[int(node["ref"])] = str(node["label"])
            if node.get("options") is not None:
                options[int(node["ref"])] = [str(o) for o in node["options"]]
            if node.get("clickable"):
                clickable.add(int(node["ref"]))
            stack.extend(node.get("children", ()))
        return Notes(labels, options, frozenset(clickable))


NO_NOTES = Notes({}, {})


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


def render_page(root: DOMElement, width: int, height: int,
                notes: Notes = NO_NOTES) -> tuple[list[str], dict[int, Box]]:
    """The listing's lines, and the box of every listed ref."""
    lines: list[str] = []
    boxes: dict[int, Box] = {}
    for child in root.children:
        _walk(child, width, height, notes, lines, boxes)
    return lines, boxes


def _walk(el: DOMElement, width: int, height: int, notes: Notes, lines: list[str],
          boxes: dict[int, Box]) -> None:
    box = Box(el.left, el.top, el.width, el.height)
    tag = "text" if el.tag == "t" else el.tag
    field = tag.startswith(_FIELDS)
    whole = tag in _WHOLE
    text = _all_text(el) if whole else el.text
    # A control without text: a leaf (an icon, a swatch) or a link or button holding only one.
    name = None if field or text or (el.children and not whole) else _name(el, notes)
    colour = _background(el) if name is not None or (not field and not text
                                                    and not el.children) else None
    if box.meets(width, height) and (field or whole or text or name or colour):
        line = _line(el, tag, text, notes)
        if name:
            line += f" icon {_quote(name)}"
        if colour:
            line += f' background="{colour}"'
        lines.append(line)
        boxes[el.ref] = box
    if not whole:
        for child in el.children:
            _walk(child, width, height, notes, lines, boxes)


def _line(el: DOMElement, tag: str, text: str | None, notes: Notes) -> str:
    parts = [f"[{el.ref}] {tag}"]
    if text:
        parts.append(_quote(text))
    if isinstance(el.value, bool):
        parts.append("(checked)" if el.value else "(not checked)")
    elif el.value is not None:
        parts.append(f"value={_quote(str(el.value))}")
    options = notes.options.get(el.ref)
    if options is not None:
        shown = ", ".join(_quote(o) for o in options[:MAX_OPTIONS])
        more = len(options) - MAX_OPTIONS
        parts.append(f"options: {shown}" + (f" (and {more} more)" if more > 0 else ""))
    if el.focused:
        parts.append("(focused)")
    return " ".join(parts)


def _name(el: DOMElement, notes: Notes) -> str | None:
    """What names a control without text: its label, else (a link or button, or an element
    that reacts to a click) its id, else its classes. None for the rest (a resize handle, an
    empty container)."""
    label = notes.labels.get(el.ref)
    if label or not (el.tag in _WHOLE or el.ref in notes.clickable):
        return label or None
    return el.id or " ".join(el.classes.split()) or None


def _background(el: DOMElement) -> str | None:
    """An element's own background colour as #rrggbb, or None: transparent, or white (the
    page's own, and what miniwob reads a missing colour as)."""
    rgba = el.bg_color
    if rgba is None or len(rgba) < 4 or rgba[3] < 0.5:
        return None
    colour = "#" + "".join(f"{round(c * 255):02x}" for c in rgba[:3])
    return None if colour == "#ffffff" else colour


def _all_text(el: DOMElement) -> str:
    if el.text is not None:
        return el.text
    return " ".join(t for t in (_all_text(c) for c in el.children) if t)


def _quote(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > MAX_TEXT_CHARS:
        text = text[: MAX_TEXT_CHARS - 3] + "..."
    return json.dumps(text, ensure_ascii=False)
