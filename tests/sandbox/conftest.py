"""Fixtures: a real sandbox (skipped only when bubblewrap is not installed) and host secrets."""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest

from agentrl.sandbox import Sandbox, SandboxConfig
from agentrl.sandbox.command import resolve_bwrap

from ._helpers import FAST, SECRET_VALUE


@pytest.fixture(scope="session")
def bwrap_present() -> None:
    if resolve_bwrap(SandboxConfig()) is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")


@pytest.fixture(scope="package", autouse=True)
def no_other_children() -> None:
    """The sandbox tests count this process's children (a sandbox must leave none): first end
    the long-lived ones earlier tests may have left: the idle grammar compile workers and the
    reaper of process groups (browsers, command agents), and MiniWoB's idle pooled browsers."""
    from agentrl.engine.grammar_worker import stop_idle_workers
    from agentrl.process_reaper import stop_group_reaper
    from environments.miniwob.pool import close_pool

    from ._helpers import descendants

    gc.collect()  # an env an earlier test dropped without close() gives its browser back
    stop_idle_workers()
    close_pool()
    stop_group_reaper()
    left = descendants(os.getpid())
    assert not left, f"processes started by earlier tests are still running: {_named(left)}"


def _named(pids: set[int]) -> list[str]:
    import psutil

    out = []
    for pid in sorted(pids):
        try:
            out.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:160]}")
        except psutil.Error:
            out.append(f"{pid} (gone)")
    return out


@pytest.fixture(scope="session")
def sb(bwrap_present: None) -> Iterator[Sandbox]:
    """A strict sandbox; construction failing here is a test failure, not a skip."""
    sandbox = Sandbox(FAST)
    assert sandbox.isolated
    yield sandbox


@pytest.fixture()
def host_secret_file(tmp_path: os.PathLike[str]) -> Iterator[str]:
    path = os.path.join(str(tmp_path), "secret.txt")
    with open(path, "w") as f:
        f.write(SECRET_VALUE)
    yield path


@pytest.fixture()
def root_secret_file() -> Iterator[str | None]:
    """A secret in /root when we may write there (we run as root in CI)."""
    path = f"/root/agentrl-sandbox-test-secret-{os.getpid()}"
    try:
        with open(path, "w") as f:
            f.write(SECRET_VALUE)
    except OSError:
        yield None
        return
    yield path
    os.unlink(path)
