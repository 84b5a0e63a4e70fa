"""The cgroup layer: v2 logic against a fake hierarchy (this CI host may be v1), and the live
hierarchy where one is writable."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from agentrl.sandbox.cgroup import CgroupFactory
from agentrl.sandbox.launch import cgroup_factory


def _fake_v2(root: Path, enabled: str) -> Path:
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "cgroup.subtree_control").write_text(enabled)
    return root


def test_v2_limits_oom_and_cleanup_on_a_fake_tree(tmp_path: Path) -> None:
    factory = CgroupFactory._detect_v2(str(_fake_v2(tmp_path, "cpu memory pids\n")))
    assert factory is not None and factory.version == 2
    group = factory.create(256 << 20, 32, 0.5)
    (d,) = group.dirs.values()
    read = {name: Path(d, name).read_text() for name in
            ("memory.max", "memory.swap.max", "pids.max", "cpu.max")}
    assert read == {"memory.max": str(256 << 20), "memory.swap.max": "0", "pids.max": "32",
                    "cpu.max": "50000 100000"}
    assert group.procs_files == [os.path.join(d, "cgroup.procs")]
    Path(d, "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n")
    assert group.oom_kills() == 2
    Path(d, "cgroup.procs").write_text("")
    assert group.kill(timeout_s=0.1) and Path(d, "cgroup.kill").read_text() == "1"
    for name in os.listdir(d):  # A real cgroupfs directory has no removable files.
        os.unlink(os.path.join(d, name))
    group.remove()
    assert not os.path.exists(d)


def test_v2_without_the_memory_controller_is_unusable(tmp_path: Path) -> None:
    fake = _fake_v2(tmp_path, "cpu\n")
    os.chmod(fake / "cgroup.subtree_control", 0o444)  # Enabling fails, like EBUSY would.
    if os.geteuid() == 0:  # root ignores file modes: make the write fail another way.
        (fake / "cgroup.subtree_control").unlink()
        (fake / "cgroup.subtree_control").mkdir()
    assert CgroupFactory._detect_v2(str(fake)) is None


def test_live_group_contains_and_kills_a_process_tree() -> None:
    factory = cgroup_factory()
    if factory is None:
        pytest.skip("no writable cgroup hierarchy on this machine")
    group = factory.create(64 << 20, 8, None)
    try:
        join = " ".join(f'echo $$ > "{p}";' for p in group.procs_files)
        proc = subprocess.Popen(["/bin/sh", "-c", f"{join} sleep 100 & sleep 100 & wait"])
        deadline = time.monotonic() + 5
        while len(group.pids()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(group.pids()) == 3  # sh and both sleeps, however they were forked
        assert group.kill(timeout_s=5)
        assert proc.wait(timeout=5) != 0 and group.pids() == set()
    finally:
        group.kill()
        group.remove()
    assert all(not os.path.exists(d) for d in group.dirs.values())


def test_groups_of_dead_callers_are_swept() -> None:
    """A caller killed with SIGKILL runs no cleanup; the next one removes what it left."""
    factory = cgroup_factory()
    if factory is None:
        pytest.skip("no writable cgroup hierarchy on this machine")
    dead = subprocess.Popen(["true"])
    dead.wait()  # Its pid is now free (reuse within this test is vanishingly unlikely).
    name = f"agentrl-sandbox-{dead.pid}-0"
    leftovers = [os.path.join(parent, name) for parent in factory.parents.values()]
    for path in leftovers:
        os.mkdir(path)
    mine = factory.create(64 << 20, 8, None)  # A live owner's group must survive the sweep.
    try:
        assert factory.collect_stale() >= 1
        assert not any(os.path.exists(path) for path in leftovers)
        assert all(os.path.exists(d) for d in mine.dirs.values())
    finally:
        mine.remove()
