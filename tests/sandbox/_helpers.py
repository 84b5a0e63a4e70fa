"""Helpers shared by the sandbox tests: containment checks and the test secret."""

from __future__ import annotations

import os
import time

from agentrl.sandbox import ExecResult, Sandbox, SandboxConfig
from agentrl.sandbox.launch import cgroup_factory

SECRET_ENV = "AGENTRL_TEST_SECRET"
SECRET_VALUE = "trainer-secret-6f1d3c"
# Set at import, before any sandbox starts: the trainer's environment must never reach the code.
os.environ[SECRET_ENV] = SECRET_VALUE

FAST = SandboxConfig(timeout_s=2.0, memory_mb=256, max_processes=32, max_output_bytes=4096)


def descendants(root: int) -> set[int]:
    """Every live process below `root` (zombies included): sandboxes must leave none."""
    import psutil

    try:
        return {p.pid for p in psutil.Process(root).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()

def leftover_cgroups() -> list[str]:
    """This test process's per-execution cgroups that still exist."""
    factory = cgroup_factory()
    if factory is None:
        return []
    prefix = f"agentrl-sandbox-{os.getpid()}-"
    return [os.path.join(parent, name) for parent in factory.parents.values()
            for name in os.listdir(parent) if name.startswith(prefix)]


def assert_contained(sb: Sandbox) -> None:
    """Nothing of the sandbox left running or mounted, and the executor still works."""
    deadline = time.monotonic() + 2.0
    while descendants(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert descendants(os.getpid()) == set(), "sandbox processes survived"
    assert leftover_cgroups() == []
    after = sb.run("print('alive')")
    assert (after.status, after.stdout) == ("ok", "alive\n"), after


def assert_bounded(result: ExecResult, limit_s: float) -> None:
    """Returned within the deadline plus cleanup slack."""
    assert result.wall_s < limit_s + 3.0, result
