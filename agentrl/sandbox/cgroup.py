"""One cgroup per execution (sandbox.md layer 2): memory, pids and cpu limits, OOM reporting,
and a kill that reaches every process however it was forked.

Works on cgroup v2 (one unified tree, controllers enabled in our cgroup's subtree_control) and
on v1 (a hierarchy per controller; many container hosts still mount v1). Groups are created
under the caller's own cgroup, so a container's limits still apply above them. Where nothing is
writable (unprivileged, no delegation) `CgroupFactory.detect()` returns None and the other
layers (PID namespace, rlimits) carry the load; the sandbox reports the layer as inactive.

Processes must be in the group before they fork, or children escape it: the isolated tier
moves bwrap's init while bwrap blocks on --block-fd (`process.Child._admit`); the unisolated
tier has a shell write its own pid before exec'ing the rest of the chain (`command.py`).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_ROOT = "/sys/fs/cgroup"
_V1_CONTROLLERS = ("memory", "pids", "cpu")
_counter = itertools.count()
_PREFIX = "agentrl-sandbox-"
_CPU_PERIOD_US = 100_000


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for v2) -> our path in that hierarchy, from /proc/self/cgroup."""
    paths: dict[str, str] = {}
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            paths[name] = path
    return paths


def _v1_mounts() -> dict[str, str]:
    """v1 controller -> mount point, from /proc/self/mountinfo."""
    mounts: dict[str, str] = {}
    for line in _read("/proc/self/mountinfo").splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(rfields) >= 3 and rfields[0] == "cgroup":
            for option in rfields[2].split(","):
                if option in _V1_CONTROLLERS:
                    mounts.setdefault(option, fields[4])
    return mounts


@dataclass(frozen=True)
class CgroupFactory:
    """Where per-execution groups can be made: parent directory per controller."""

    version: int
    parents: dict[str, str]
    """controller -> parent dir (v2: the single key "" holds the unified parent)."""

    @classmethod
    def detect(cls) -> CgroupFactory | None:
        """Probe once: a writable hierarchy with a memory controller, else None."""
        own = _own_cgroups()
        if os.path.exists(os.path.join(_ROOT, "cgroup.controllers")):
            return cls._detect_v2(os.path.join(_ROOT, own.get("", "/").lstrip("/")))
        parents = {}
        for controller, mount in _v1_mounts().items():
            parent = os.path.join(mount, own.get(controller, "/").lstrip("/"))
            if os.access(parent, os.W_OK):
                parents[controller] = parent
        return cls(1, parents) if "memory" in parents else None

    @classmethod
    def _detect_v2(cls, parent: str) -> CgroupFactory | None:
        if not os.access(parent, os.W_OK):
            return None
        enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
        available = _read(os.path.join(parent, "cgroup.controllers")).split()
        missing = [c for c in ("memory", "pids", "cpu") if c in available and c not in enabled]
        if missing:
            try:  # Fails with EBUSY when our own cgroup holds processes (no internal processes).
                _write(os.path.join(parent, "cgroup.subtree_control"),
                       " ".join("+" + c for c in missing))
            except OSError:
                pass
            enabled = _read(os.path.join(parent, "cgroup.subtree_control")).split()
        return cls(2, {"": parent}) if "memory" in enabled else None

    def collect_stale(self) -> int:
        """Remove groups left by dead processes (SIGKILLed or os._exit'ed callers run no
        cleanup); their name holds the owner's pid. Returns how many were removed."""
        stale: dict[str, dict[str, str]] = {}
        for controller, parent in self.parents.items():
            for name in _listdir(parent):
                owner = name.split("-")[2] if name.startswith(_PREFIX) else ""
                if owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                    stale.setdefault(name, {})[controller] = os.path.join(parent, name)
        for dirs in stale.values():
            group = Cgroup(self.version, dirs)
            group.kill(timeout_s=1.0)  # Unisolated leftovers; bwrap ones died with their parent.
            group.remove()
        return len(stale)

    def create(self, memory_bytes: int, max_pids: int, cpu_cores: float | None) -> Cgroup:
        """Make a fresh group with these limits; OSError if the kernel refuses."""
        name = f"{_PREFIX}{os.getpid()}-{next(_counter)}"
        dirs = {c: os.path.join(parent, name) for c, parent in self.parents.items()}
        group = Cgroup(self.version, dirs)
        try:
            for path in dirs.values():
                os.mkdir(path, 0o755)
            group.set_limits(memory_bytes, max_pids, cpu_cores)
        except OSError:
            group.remove()
            raise
        return group


@dataclass(frozen=True)
class Cgroup:
    """A per-execution group; `kill` then `remove` always, even after failures."""

    version: int
    dirs: dict[str, str]

    def set_limits(self, memory_bytes: int, max_pids: int, cpu_cores: float | None) -> None:
        quota = None if cpu_cores is None else max(1000, int(cpu_cores * _CPU_PERIOD_US))
        if self.version == 2:
            d = self.dirs[""]
            _write(os.path.join(d, "memory.max"), str(memory_bytes))
            _write_optional(os.path.join(d, "memory.swap.max"), "0")
            _write_optional(os.path.join(d, "pids.max"), str(max_pids))
            if quota is not None:
                _write_optional(os.path.join(d, "cpu.max"), f"{quota} {_CPU_PERIOD_US}")
            return
        _write(os.path.join(self.dirs["memory"], "memory.limit_in_bytes"), str(memory_bytes))
        _write_optional(os.path.join(self.dirs["memory"], "memory.memsw.limit_in_bytes"),
                        str(memory_bytes))
        if "pids" in self.dirs:
            _write(os.path.join(self.dirs["pids"], "pids.max"), str(max_pids))
        if "cpu" in self.dirs and quota is not None:
            _write(os.path.join(self.dirs["cpu"], "cpu.cfs_period_us"), str(_CPU_PERIOD_US))
            _write(os.path.join(self.dirs["cpu"], "cpu.cfs_quota_us"), str(quota))

    @property
    def procs_files(self) -> list[str]:
        """Files a process writes its pid into to join every controller of the group."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    @property
    def controllers(self) -> list[str]:
        """Active controllers, for reporting."""
        if self.version == 2:
            return ["memory", "pids", "cpu"]
        return sorted(self.dirs)

    def pids(self) -> set[int]:
        """Processes still in the group (any controller)."""
        found: set[int] = set()
        for procs in self.procs_files:
            found.update(int(p) for p in _read(procs).split())
        return found

    def oom_kills(self) -> int:
        """How many processes the kernel OOM-killed in the group (memory limit hit)."""
        if self.version == 2:
            text = _read(os.path.join(self.dirs[""], "memory.events"))
        else:
            text = _read(os.path.join(self.dirs["memory"], "memory.oom_control"))
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def kill(self, timeout_s: float = 5.0) -> bool:
        """SIGKILL everything in the group until it is empty; True if it emptied in time."""
        if self.version == 2:
            _write_optional(os.path.join(self.dirs[""], "cgroup.kill"), "1")
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return True
            if time.monotonic() > deadline:
                return False
            for pid in pids:  # pids.max bounds how many a fork bomb can add per round.
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.002)

    def remove(self) -> None:
        """rmdir every controller's directory (retrying briefly while the kernel drains it)."""
        for path in self.dirs.values():
            for attempt in range(100):
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if attempt == 99:  # The next process's collect_stale() retries it.
                        logger.warning("cannot remove cgroup %s: %s", path, exc)
                    time.sleep(0.005)


def _write_optional(path: str, value: str) -> None:
    """Write a limit the kernel may not offer (no swap accounting, no cgroup.kill before 5.14)."""
    try:
        _write(path, value)
    except OSError:
        pass
