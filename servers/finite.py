"""Numbers the proxy accepts: finite, within the float range, and in each field's range.

Python's JSON (and pydantic's parser) read `NaN`, `Infinity` and `1e400` (as inf), and JSON
answers refuse them (`allow_nan=False`): a value that got in was stored, then failed every
read of it (#34). So numbers are checked where they come in, by these functions only:
`finite` for one number, `check_finite_json` for a JSON tree (schemas, tool parameters),
`in_range` for a request field with bounds.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def _shown(value: object, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def finite(value: float, what: str) -> float:
    """`value` as a float; a ValueError naming `what` when it is not a finite number in the
    float range (NaN, ±inf, or an integer too large for a float)."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{what} must be a finite number within the float range (±1.8e308; "
                         f"JSON has no NaN or Infinity), got {_shown(value)}")
    return number


def check_finite_json(value: object, what: str) -> None:
    """A ValueError naming the path (`what.key.0.key`; `key.0.key` when `what` is "") of the
    first number in the JSON tree `value` that `finite` refuses. Walked with a stack: a deeply
    nested tree cannot exhaust the recursion limit."""
    stack: list[tuple[str, object]] = [(what, value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, dict | list):
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((f"{path}.{k}" if path else str(k), v)
                         for k, v in reversed(list(items)))
        elif isinstance(node, int | float) and not isinstance(node, bool):
            finite(node, path)


def in_range(lo: N, hi: N, *, lo_open: bool = False, note: str = "") -> Callable[[N], N]:
    """A pydantic after-validator: the value if it is in [lo, hi] ((lo, hi] with `lo_open`),
    else a ValueError naming the range (NaN and infinities are outside every range). `note`
    says what the ends mean, e.g. "; 0 turns top-k off"."""
    integers = isinstance(lo, int) and isinstance(hi, int)
    ends = f"{lo}, {hi}" if integers else f"{lo:g}, {hi:g}"
    shown = f"{'(' if lo_open else '['}{ends}]"
    kind = "an integer" if integers else "a number"

    def check(value: N) -> N:
        inside = (lo < value if lo_open else lo <= value) and value <= hi
        if not inside:
            raise ValueError(f"must be {kind} in {shown}{note}")
        return value

    return check
