"""A scripted policy for some MiniWoB++ tasks, reading the `dom` observation as the model does.

    oracle_action("click-button", 'Click on the "yes" button.', lines)  # -> "click(6)"

It answers in `actions.py`'s grammar from the task's words and the page listing (`dom.py`'s
`[ref] tag "text"` lines), so it needs no access to the page that the policy lacks. It plays
the `click-basics` suite and the `warm-up` suite (other tasks whose skills are the same:
finding the element a task names, clicking, typing into fields, submitting), and is used to
play scripted episodes (`agentrl.rollout.scripted`, for a supervised warm-up before RL) and by
benchmarks/miniwob_overhead.py. Tasks it cannot play raise `KeyError` naming those it can.

The plan is a function of the current page, not of the turn: a form is filled field by field
(the first field whose value is not yet right is typed into), then its button clicked. So an
episode that is replayed or resumed gets the same answers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

_LINE = re.compile(r'^\[(-?\d+)\] (\S+)(?: ("(?:[^"\\]|\\.)*"))?(.*)$')
_VALUE = re.compile(r'value=("(?:[^"\\]|\\.)*")')
"""The listing's strings and the grammar's are JSON string literals (`dom.py`, `actions.py`)."""
_QUOTED = re.compile(r'"([^"]*)"')
_ORDINAL = re.compile(r"(\d+)(?:st|nd|rd|th)")


@dataclass(frozen=True)
class Element:
    """One line of the page listing."""

    ref: int
    tag: str
    text: str
    value: str | None
    """A field's value (None: not a field)."""


def parse_listing(lines: Sequence[str]) -> list[Element]:
    """The listing's lines as elements (lines that are not elements are skipped)."""
    out = []
    for line in lines:
        m = _LINE.match(line.strip())
        if m is None:
            continue
        value = _VALUE.search(m.group(4) or "")
        out.append(Element(int(m.group(1)), m.group(2), json.loads(m.group(3) or '""'),
                           None if value is None else json.loads(value.group(1))))
    return out


def _quote(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _first(page: list[Element], pred: Callable[[Element], bool], what: str) -> Element:
    for el in page:
        if pred(el):
            return el
    raise ValueError(f"the page has no {what}: {[f'[{e.ref}] {e.tag} {e.text!r}' for e in page]}")


def _fill(page: list[Element], values: Sequence[str], button: str | None) -> str:
    """Type `values` into the page's text fields in order, then click the button named
    `button` (any button when None)."""
    fields = [e for e in page if e.tag in ("input_text", "input_password", "textarea")]
    if len(fields) < len(values):
        raise ValueError(f"the page has {len(fields)} text fields, the task fills {len(values)}")
    for el, want in zip(fields, values, strict=False):
        if el.value != want:
            return f"type({el.ref}, {_quote(want)})"
    target = _first(page, lambda e: e.tag == "button" and (
        button is None or e.text.lower() == button.lower()), f"button {button!r}")
    return f"click({target.ref})"


def _click_text(page: list[Element], tag: str | None, text: str) -> str:
    """Click the first element (with this tag, if one is given) whose text is `text`."""
    found = _first(page, lambda e: (tag is None or e.tag == tag) and e.text == text, repr(text))
    return f"click({found.ref})"


def _named(tag: str) -> Callable[[str, list[Element]], str]:
    """Click the element with this tag whose text is the task's first quoted word."""
    return lambda task, page: _click_text(page, tag, _QUOTED.findall(task)[0])


def _click_tag(page: list[Element], tag: str) -> str:
    return f"click({_first(page, lambda e: e.tag == tag, tag).ref})"


def _click_tab(task: str, page: list[Element]) -> str:
    number = re.search(r"Tab #(\d+)", task)
    assert number is not None, task
    return _click_text(page, None, f"Tab #{number.group(1)}")


def _click_button_text(task: str, page: list[Element]) -> str:
    """click-test-2: "Click button ONE." """
    return _click_text(page, "button", re.findall(r"button (\w+)", task)[0])


def _click_dialog_button(task: str, page: list[Element]) -> str:
    """click-dialog-2: the dialog's button labeled as the task says ("x" is its Close)."""
    word = _QUOTED.findall(task)[0]
    return _click_text(page, "button", "Close" if word == "x" else word)


_WIDGETS = {"button": ("button",), "text": ("input_text",), "textarea": ("textarea",),
            "checkbox": ("input_checkbox",), "radio": ("input_radio",)}


def _click_widget(task: str, page: list[Element]) -> str:
    kind = _QUOTED.findall(task)[0]
    tags = _WIDGETS.get(kind, (kind,))
    return f"click({_first(page, lambda e: e.tag in tags, kind).ref})"


def _focus_nth(task: str, page: list[Element]) -> str:
    n = _ORDINAL.search(task)
    fields = [e for e in page if e.tag == "input_text"]
    i = int(n.group(1)) - 1 if n else 0
    if i >= len(fields):
        raise ValueError(f"{task!r}: the page has {len(fields)} text fields")
    return f"click({fields[i].ref})"


PLANS: dict[str, Callable[[str, list[Element]], str]] = {
    # click-basics
    "click-button": _named("button"),
    "click-link": _named("span"),
    "click-dialog": lambda task, page: _click_tag(page, "button"),  # its one button: close
    "click-tab": _click_tab,
    "focus-text": lambda task, page: _click_tag(page, "input_text"),
    "enter-text": lambda task, page: _fill(page, _QUOTED.findall(task)[:1], "Submit"),
    # warm-up
    "click-test-2": _click_button_text,
    "click-widget": _click_widget,
    "focus-text-2": _focus_nth,
    "click-dialog-2": _click_dialog_button,
    "click-tab-2-easy": _named("span"),
    "enter-password": lambda task, page: _fill(page, [_QUOTED.findall(task)[0]] * 2, "Submit"),
    "login-user": lambda task, page: _fill(page, _QUOTED.findall(task)[:2], "Login"),
}
"""The tasks the oracle plays, each a function of (task words, page) to an action."""


def oracle_action(task: str, words: str, lines: Sequence[str]) -> str:
    """The scripted action for `task` (a MiniWoB++ task name) whose instruction is `words`,
    on a page listed as `lines`."""
    plan = PLANS.get(task)
    if plan is None:
        raise KeyError(f"no scripted policy for MiniWoB++ task {task!r}; it plays: "
                       f"{', '.join(sorted(PLANS))}")
    return plan(words, parse_listing(lines))
