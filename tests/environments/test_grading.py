"""Answer extraction, math-verify equivalence, and the time bounds on grading."""

from __future__ import annotations

import threading
import time

import pytest

from environments.math_tir.grading import extract_boxed, grade, parse_gold
from environments.math_tir.protocol import find_calls, strip_code


@pytest.mark.parametrize(("text", "boxed"), [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last one is final
    ("\\boxed{\\sqrt{x^{2}}}", "\\sqrt{x^{2}}"),
    ("\\boxed{12", None),  # cut off before closing: not an answer
    ("no answer", None),
])
def test_extract_boxed(text, boxed):
    assert extract_boxed(text) == boxed


@pytest.mark.parametrize(("gold", "said", "ok"), [
    ("0.5", "\\frac{1}{2}", True), ("1/2", "0.5", True), ("288", "288.0", True),
    ("-4", "-4", True), ("$244/607$", "\\frac{244}{607}", True), ("288", "289", False),
    ("3", "x", False),
])
def test_equivalence(gold, said, ok):
    assert grade(f"\\boxed{{{said}}}", parse_gold(gold)).correct is ok


@pytest.mark.parametrize("bomb", ["9^{9^{9^{9}}}", "100000!", "2^{10^{6}}", "1" * 400])
def test_explosive_answers_are_refused_quickly(bomb):
    threads = threading.active_count()
    start = time.perf_counter()
    result = grade(f"\\boxed{{{bomb}}}", parse_gold("5"))
    assert time.perf_counter() - start < 1.0
    assert result.correct is False and result.error is not None
    assert threading.active_count() <= threads  # no verify thread left running


def test_grading_works_off_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(grade("\\boxed{0.5}", parse_gold("1/2"))))
    t.start()
    t.join()
    assert out[0].correct


def test_find_calls_forms():
    fenced = find_calls("a\n```python\nx = 1\n```\nb\n```py\nprint(x)\n```")
    assert [c.code for c in fenced] == ["x = 1\n", "print(x)\n"]
    unclosed = find_calls("```python\nprint(3)")
    assert [c.code for c in unclosed] == ["print(3)"]
    hermes = find_calls('<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}'
                        '</tool_call>')
    assert [(c.kind, c.code) for c in hermes] == [("tool_call", "1")]
    other = find_calls('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert other[0].code is None and "unknown tool 'search'" in other[0].error
    assert find_calls("```\nnot python\n```") == []
    assert "boxed" not in strip_code('```python\nprint("\\boxed{1}")\n```')
