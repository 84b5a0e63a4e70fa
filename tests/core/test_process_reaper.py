"""The reaper of process groups: a group registered with it dies when the reaper is stopped
(as when the command exits), and the next use starts a fresh reaper."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from agentrl import process_reaper


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # A zombie counts as gone.
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_stopping_the_reaper_ends_its_groups_and_the_next_use_starts_another() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        first = process_reaper.group_reaper()
        first.watch(child.pid)
        process_reaper.stop_group_reaper()
        assert not first.alive(), "the reaper is still running"
        deadline = time.monotonic() + 10
        while _alive(child.pid) and time.monotonic() < deadline:
            child.poll()
            time.sleep(0.05)
        assert not _alive(child.pid), "the registered group outlived its reaper"
        second = process_reaper.group_reaper()
        assert second is not first and second.alive()
    finally:
        child.kill()
        child.wait()
        process_reaper.stop_group_reaper()
