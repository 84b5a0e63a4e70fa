"""MiniWoB++ task names, named suites, and `task=` specs resolved with a did-you-mean.

The tasks are the pages the `miniwob` package ships (its html/miniwob/ folder: 130 tasks, the
125 of its Gymnasium registry and five more). FlightWoB (`flight.*`: whole airline sites served
over HTTP, at another screen size) is not supported yet.
"""

from __future__ import annotations

import difflib
import importlib.util
from functools import cache
from pathlib import Path

SUITES: dict[str, tuple[str, ...]] = {
    # One to three actions each, solvable from the page text (#33's learning headline).
    "click-basics": ("click-button", "click-link", "click-dialog", "click-tab", "focus-text",
                     "enter-text"),
    # Other tasks of the same skills (find the element a task names, click it, type into
    # fields, submit), which the scripted policy plays (`oracle.py`): a supervised warm-up
    # before RL on click-basics that shows none of click-basics' pages.
    "warm-up": ("click-test-2", "click-widget", "click-dialog-2", "click-tab-2-easy",
                "focus-text-2", "enter-password", "login-user"),
}
"""Named suites: `task="click-basics"` samples one of its tasks per episode."""

INSTALL_HINT = "pip install 'agentrl[browser]' (miniwob==1.1.0, which brings selenium)"


def html_dir() -> Path:
    """The `miniwob` package's html/ folder, found without importing it (and selenium)."""
    spec = importlib.util.find_spec("miniwob")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(f"MiniWoB-v0 needs the miniwob package: {INSTALL_HINT}")
    return Path(spec.origin).parent / "html"


@cache
def task_names() -> tuple[str, ...]:
    """Every MiniWoB++ task name, sorted."""
    return tuple(sorted(p.stem for p in (html_dir() / "miniwob").glob("*.html")))


def resolve_tasks(spec: str) -> tuple[str, ...]:
    """The tasks a `task=` spec names: a task, a suite, or a comma-separated list of them."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"task={spec!r}: expected a MiniWoB++ task name (e.g. 'click-button'), "
                         f"a suite ({', '.join(SUITES)}) or a comma-separated list of them")
    names = task_names()
    out: list[str] = []
    for part in (p.strip() for p in spec.split(",")):
        if part in SUITES:
            out.extend(t for t in SUITES[part] if t not in out)
        elif part in names:
            if part not in out:
                out.append(part)
        else:
            raise ValueError(_unknown(part, names))
    return tuple(out)


def _unknown(name: str, names: tuple[str, ...]) -> str:
    if name.startswith("flight."):
        return (f"task {name!r}: FlightWoB tasks (flight.*) are not supported yet; pick one of "
                f"the {len(names)} MiniWoB++ tasks")
    hint = difflib.get_close_matches(name, [*SUITES, *names], n=3, cutoff=0.6)
    did_you_mean = f" Did you mean {' or '.join(repr(h) for h in hint)}?" if hint else ""
    return (f"unknown MiniWoB++ task {name!r}.{did_you_mean} Suites: {', '.join(SUITES)}. "
            f"Tasks ({len(names)}): {', '.join(names)}")
