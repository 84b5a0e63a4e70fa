"""Prompts and the python tool's schema for the math envs.

The default TIR system prompt teaches the fenced ```python protocol with one worked exchange:
measured with the embedded SmolLM2-135M (reference/platform-facts.md), that is what makes a
135M model write a correct `print(...)` block, read "Output: ..." and box it. The Hermes
`<tool_call>` format is accepted as well, for models trained on it; `PYTHON_TOOL` is the
schema rendered by templates that support tools.
"""

from __future__ import annotations

TIR_SYSTEM_PROMPT = """\
You are a math assistant that can run Python. To calculate, write a Python code block:
```python
print(2 + 3)
```
You will then see its output. When you know the answer, write it as \\boxed{ANSWER}."""

TIR_EXAMPLE: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "What is 4 * 6?"},
    {"role": "assistant", "content": "```python\nprint(4 * 6)\n```"},
    {"role": "user", "content": "Output: 24"},
    {"role": "assistant", "content": "The answer is \\boxed{24}."},
)
"""The worked exchange shown before every problem, as real chat turns: a 135M model copies
turn structure far more reliably than an example described inside the system prompt."""

TIR_SYSTEM_PROMPT_INLINE_EXAMPLE = TIR_SYSTEM_PROMPT + """

Example:
User: What is 4 * 6?
Assistant: ```python
print(4 * 6)
```
User: Output: 24
Assistant: The answer is \\boxed{24}."""

MATH_SYSTEM_PROMPT = """\
You are a math assistant. Solve the problem step by step, then write the final answer as \
\\boxed{ANSWER}.

Example:
User: What is 4 * 6?
Assistant: 4 * 6 = 24. The answer is \\boxed{24}."""

PYTHON_TOOL: dict = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run Python code in a persistent session (variables persist across calls in the "
            "episode) and return what it prints. The value of a trailing expression is printed."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source to run."}},
            "required": ["code"],
        },
    },
}

NO_ACTION_HINT = (
    "Write a ```python code block to calculate, or give the final answer as \\boxed{ANSWER}."
)
EMPTY_OUTPUT = "(no output: use print() to show values)"
