"""The README's examples run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _example(name: str) -> str:
    text = README.read_text()
    m = re.search(rf"<!-- example: {name} .*?-->\s*```python\n(.*?)```", text, re.DOTALL)
    assert m, f"README has no example named {name!r}"
    return m.group(1)


def test_chat_env_example_runs_and_scores(tmp_path):
    code = _example("chat-env")
    assert len(code.strip().splitlines()) <= 22
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[-1] == "1.0 True"
    assert "Repeat after me:" in out.stdout and "<|im_start|>assistant" in out.stdout
