"""The python-tool protocol: finding code calls in the policy's text and rendering results.

Two call forms are accepted, because models are trained on either:
- Hermes: `<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`
  (arguments may also be a JSON string, as in OpenAI's wire format);
- a fenced block: ```python ... ``` (also `py`, `python3`).
A block left unclosed at the end of the turn still counts: the policy stopped right after it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentrl.envs.tool_calls import TOOL_CALL_BLOCK
from agentrl.terminal_safe import visible
from environments.math_tir.prompts import EMPTY_OUTPUT

if TYPE_CHECKING:
    from agentrl.sandbox import ExecResult

_FENCE = re.compile(r"```(?:python3?|py)[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)
_ANY_FENCE = re.compile(r"```.*?(?:```|\Z)", re.DOTALL)


@dataclass(frozen=True)
class Call:
    """One code call found in the policy's text."""

    kind: str
    """"tool_call" (Hermes) or "fenced"."""
    code: str | None
    """The code to run; None when the call was malformed (see `error`)."""
    error: str | None = None


def find_calls(text: str) -> list[Call]:
    """Code calls in order of appearance (tool calls first if the text mixes both forms)."""
    calls = [_parse_tool_call(m.group(1)) for m in TOOL_CALL_BLOCK.finditer(text)]
    if calls:
        return calls
    return [Call("fenced", m.group(1)) for m in _FENCE.finditer(text) if m.group(1).strip()]


def _parse_tool_call(body: str) -> Call:
    try:
        obj = json.loads(body)
        args = obj.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        name, code = obj.get("name"), args.get("code")
    except (json.JSONDecodeError, AttributeError) as e:
        return Call("tool_call", None, f"Error: the tool call is not valid JSON ({e}). Use "
                    '<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>')
    if name != "python":
        return Call("tool_call", None, f"Error: unknown tool {name!r}; the only tool is 'python'.")
    if not isinstance(code, str) or not code.strip():
        return Call("tool_call", None, "Error: the python tool needs a non-empty 'code' string.")
    return Call("tool_call", code)


def strip_code(text: str) -> str:
    """The text outside code calls, where a final answer may appear.

    So `print("\\boxed{42}")` inside code is not an answer (grading happens here, outside the
    sandbox, on what the policy itself wrote).
    """
    return _ANY_FENCE.sub(" ", TOOL_CALL_BLOCK.sub(" ", text))


def render_result(result: ExecResult, *, timeout_s: float, max_chars: int) -> str:
    """What the policy sees of one execution: output, or the error, cut to `max_chars`.

    Control and bidi characters the code wrote are shown as escapes (`agentrl.terminal_safe`),
    before the cut so the cap holds: the observation, its tokens and whatever prints it show
    `\\x1b[2J` where the code cleared the screen, and no terminal acts on it (#34 item 10)."""
    out = result.stdout
    if result.status == "ok":
        text = out if out.strip() else EMPTY_OUTPUT
    elif result.status == "timeout":
        text = f"{out}TimeoutError: the code ran longer than {timeout_s:g} s and was stopped."
    elif result.status == "oom":
        text = f"{out}MemoryError: the code used too much memory and was stopped."
    elif result.status == "output_limit":
        text = f"{out}\n[output limit exceeded: the code was stopped]"
    elif result.status == "killed":
        sig = -result.returncode if result.returncode is not None else "?"
        text = f"{out}{result.stderr}The process was killed (signal {sig})."
    else:  # "error": an exception or a non-zero exit
        text = out + result.stderr
        if "Traceback" not in result.stderr:  # sys.exit / os._exit: say so, or it looks fine
            text += f"The code exited with status {result.returncode}."
    return truncate_middle(visible(text.rstrip("\n")), max_chars)


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and the tail (a traceback's last line says what went wrong)."""
    if len(text) <= max_chars:
        return text
    marker = f"\n... [{len(text) - max_chars} characters cut] ...\n"
    head = max(0, (max_chars - len(marker)) // 2)
    tail = max(0, max_chars - len(marker) - head)
    return text[:head] + marker + (text[-tail:] if tail else "")


def observation(calls: list[Call], outputs: list[str]) -> list[dict[str, str]]:
    """Messages that carry the outputs back: one `tool` message per Hermes call (the format
    tool-trained templates expect), one `user` "Output: ..." message for fenced blocks (the
    format the default system prompt teaches)."""
    if calls and calls[0].kind == "tool_call":
        return [{"role": "tool", "content": out} for out in outputs]
    body = "\n\n".join(outputs)
    return [{"role": "user", "content": f"Output: {body}" if "\n" not in body
             else f"Output:\n{body}"}]
