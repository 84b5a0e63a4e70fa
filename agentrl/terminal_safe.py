"""Text that cannot act on a terminal: `visible(text)` writes control and bidi characters as
escapes a reader sees, so an observation, a completion or a log line printed to a terminal
shows what it holds instead of doing it (#34 item 10).

Code the policy runs, and the policy itself, can write anything. Printed raw, `\\x1b]52;c;...`
sets the clipboard (OSC 52), `\\x1b]0;...\\x07` the window title, `\\x1b[2J` clears the screen,
`\\r` and backspace overwrite what a log line said, and U+202E reverses how the rest of a line
reads (Trojan Source, CVE-2021-42574).

Escaped, one character each:
- C0 controls except `\\n` and `\\t` (ESC, BEL, NUL, `\\r`, backspace, ...) and DEL: `\\x1b`;
- C1 controls (U+0080-U+009F, which some terminals obey as ESC-sequences): `\\x9b`;
- the bidi controls (U+202A-U+202E, U+2066-U+2069, U+200E, U+200F, U+061C): `\\u202e`.
Every other character, emoji and joiners included, is left as it is.

A literal backslash is doubled only where it would otherwise be misread: in a run of
backslashes right before an escaped character, or before text that reads as an escape
(`x` and 2 hex digits, `u` and 4). So LaTeX (`\\frac`) and paths stay as written, and the
result reads back exactly: in a run of n backslashes before escape-like text, an odd n is
(n - 1) / 2 backslashes and the escaped character, an even n is n / 2 backslashes and the
text as written; every other backslash is itself.
"""

from __future__ import annotations

import re

_UNSAFE = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_ESCAPE_LIKE = r"x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}"
_PATTERN = re.compile(rf"(\\+)(?=[{_UNSAFE}]|{_ESCAPE_LIKE})|[{_UNSAFE}]")


def _escape(match: re.Match[str]) -> str:
    backslashes = match.group(1)
    if backslashes:
        return backslashes * 2
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def visible(text: str) -> str:
    """`text` with control and bidi characters written as `\\x1b` / `\\u202e` (see the module
    docstring); text without them comes back unchanged."""
    return _PATTERN.sub(_escape, text)
