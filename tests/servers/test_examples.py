"""The proxy examples run as documented (the Agents SDK one is in the dev extra)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_openai_agents_sdk_example_records_trajectories():
    pytest.importorskip("agents")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "proxy_openai_agents.py"), "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
        env={
            "PATH": "/usr/bin:/bin",
            "OPENAI_AGENTS_DISABLE_TRACING": "1",
            "HOME": str(Path.home()),
        },
    )
    assert out.returncode == 0, out.stderr[-2000:]
    episodes = re.findall(
        r"^ep\d+-\S+: (\d+) tokens, (\d+) turns, reward ([\d.]+)$", out.stdout, re.MULTILINE
    )
    assert len(episodes) >= 2, out.stdout + out.stderr[-3000:]
    assert all(int(tokens) > 0 for tokens, _, _ in episodes)
    # A random tiny model may make the agent give up (its episode still counts); the proxy
    # itself must never refuse or fail the SDK's requests.
    for error in ("BadRequestError", "InternalServerError", "APIStatusError"):
        assert error not in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_langchain_example_records_trajectories():
    """#17 item 7: the LangChain example runs as written, its dependency in the `examples`
    extra that set-up installs."""
    pytest.importorskip("langchain_openai")
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "proxy_langchain.py"), "--model", "tiny"],
        capture_output=True, text=True, timeout=600, check=False, cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home())},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    episodes = re.findall(r"^ep\d+-\S+: (\d+) turns, drift=(\w+), (\d+) tokens$", out.stdout,
                          re.MULTILINE)
    assert len(episodes) == 2, out.stdout
    assert all(turns == "2" and drift == "False" for turns, drift, _ in episodes), out.stdout
