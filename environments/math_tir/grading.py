"""Answer extraction and grading with `math-verify`, safe to call from worker threads.

math-verify bounds its own time with `signal.alarm`, which raises outside the main thread,
and env steps run in the rollout's worker threads. So we call it with
`parsing_timeout=None, timeout_seconds=None` and bound time ourselves, in three layers:
1. a length cap on what is parsed (LaTeX parsing is linear in the input);
2. a screen of the parsed sympy expressions for constructs whose evaluation explodes
   (`9^{9^{9^9}}` hangs `verify` forever; so do huge factorials);
3. a wall-clock backstop: `verify` runs in a daemon thread that we stop waiting for. A
   runaway thread cannot be killed in Python, which is why layers 1 and 2 exist.
A prediction that fails any layer scores as wrong (the model wrote it), with a flag in info.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 256
"""Longest boxed answer (or gold answer) we parse; longer ones are not graded."""
VERIFY_TIMEOUT_S = 2.0
"""Wall-clock backstop for one `verify` call."""
_MAX_EXPONENT = 1000
_MAX_FACTORIAL = 1000

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced.

    The last one is the final answer by convention (models restate intermediate values).
    An unclosed box is not an answer: the policy was cut off before finishing it.
    """
    found = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1].strip()
    return found


def _is_safe(expr: object) -> bool:
    """False for sympy expressions whose evaluation can take unbounded time or memory."""
    import sympy

    if not isinstance(expr, sympy.Basic):
        return True
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow):
            exp = node.exp
            if exp.has(sympy.Pow, sympy.factorial) or (
                exp.is_Number and abs(exp) > _MAX_EXPONENT
            ):
                return False
        elif isinstance(node, sympy.factorial | sympy.gamma):
            arg = node.args[0]
            if not arg.is_Number or abs(arg) > _MAX_FACTORIAL:
                return False
    return True


def _silence_timeout_warning() -> None:
    """math-verify warns once that timeouts are disabled; we bound time ourselves (above)."""
    import math_verify.grader
    import math_verify.parser

    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True


def parse_answer(text: str) -> list[object]:
    """math-verify's parse of `text` (LaTeX or plain), or [] if it is unparseable or unsafe."""
    from math_verify import parse

    _silence_timeout_warning()

    text = text.strip()
    if not text or len(text) > MAX_ANSWER_CHARS:
        return []
    try:
        parsed = parse(text, parsing_timeout=None)
    except Exception as e:  # noqa: BLE001 - math-verify raises many types on odd LaTeX
        logger.debug("math-verify could not parse %r: %s", text, e)
        return []
    # A failed parse comes back as the raw string alone; that is not an answer we can compare.
    if all(isinstance(p, str) for p in parsed) or not all(_is_safe(p) for p in parsed):
        return []
    return parsed


def parse_gold(answer: str) -> list[object]:
    """Parse a reference answer. Bare strings are wrapped in `$...$` so that `0.5`, `1/2` and
    `-15.0 + 3.0i` parse as whole expressions (bare text would extract only the last number)."""
    text = answer.strip()
    if not (text.startswith("$") or "\\boxed" in text):
        text = f"${text}$"
    return parse_answer(text)


@dataclass(frozen=True)
class Grade:
    """Outcome of grading one final answer."""

    correct: bool
    answer: str | None
    """The extracted boxed answer, None if there was none."""
    error: str | None = None
    """Why the answer could not be compared (unparseable, unsafe, timeout); None if it was."""


def grade(text: str, gold: list[object]) -> Grade:
    """Grade the last boxed answer in `text` against a parsed gold answer (`parse_gold`)."""
    answer = extract_boxed(text)
    if answer is None:
        return Grade(False, None, "no \\boxed{} answer")
    pred = parse_answer(f"\\boxed{{{answer}}}")
    if not pred:
        return Grade(False, answer, "unparseable or unsafe answer")
    ok = verify_bounded(gold, pred)
    if ok is None:
        return Grade(False, answer, f"verification exceeded {VERIFY_TIMEOUT_S} s")
    return Grade(ok, answer)


def verify_bounded(gold: list[object], pred: list[object]) -> bool | None:
    """math-verify's `verify` with a wall-clock backstop; None if it did not finish."""
    from math_verify import verify

    result: list[bool] = []

    def work() -> None:
        try:
            result.append(bool(verify(gold, pred, timeout_seconds=None)))
        except Exception as e:  # noqa: BLE001 - a comparison sympy cannot do is no match
            logger.debug("math-verify failed comparing %r and %r: %s", gold, pred, e)
            result.append(False)

    thread = threading.Thread(target=work, name="math-verify", daemon=True)
    thread.start()
    thread.join(VERIFY_TIMEOUT_S)
    if thread.is_alive():
        logger.warning("math-verify did not finish within %.1f s; scoring 0", VERIFY_TIMEOUT_S)
        return None
    return result[0]
