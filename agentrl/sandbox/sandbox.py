"""`Sandbox`: decide the isolation once (fail closed), then run code one-shot or in sessions."""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from agentrl.sandbox.command import Plan, isolated_env, resolve_bwrap, resolve_python
from agentrl.sandbox.config import (
    ALLOW_UNISOLATED_ENV,
    ExecResult,
    SandboxConfig,
    SandboxUnavailableError,
)
from agentrl.sandbox.launch import cgroup_factory, run_once
from agentrl.sandbox.seccomp import build_filter
from agentrl.sandbox.session import Session

logger = logging.getLogger(__name__)

_PROBE_CODE = "import sys; print(6 * 7); sys.stdout.flush()"
_probe_lock = threading.Lock()
_probe_cache: dict[tuple[SandboxConfig, bool], Plan | str] = {}
_FIX = (
    "Fix: install bubblewrap (`apt-get install -y bubblewrap`) and allow unprivileged user "
    "namespaces (Docker: a seccomp profile that permits them, e.g. `--security-opt "
    "seccomp=unconfined`; Ubuntu 24.04: `sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`"
    "). Or accept the weaker unisolated tier (rlimits, cgroup and a dropped uid only: the code "
    "can read world-readable host files and reach the network) with "
    f"Sandbox(config, allow_unisolated=True) or {ALLOW_UNISOLATED_ENV}=1."
)


def _probe(cfg: SandboxConfig, plan: Plan) -> str | None:
    """Run a trivial program through the full chain; None if it worked, else why not."""
    result = run_once(cfg, plan, _PROBE_CODE, timeout_s=30.0, clock=time.monotonic())
    if result.status == "ok" and result.stdout == "42\n":
        return None
    detail = (result.stderr or result.stdout).strip().splitlines()[-3:]
    return f"a test program ended with status {result.status!r}: {' | '.join(detail)}"


def _uids(cfg: SandboxConfig) -> range | None:
    """The uids sandboxes run as, one each, when the caller is root (else: the caller's)."""
    if os.geteuid() != 0:
        return None
    return range(cfg.sandbox_uid, cfg.sandbox_uid + cfg.num_sandbox_uids)


def _time_namespaces_work() -> bool:
    """Whether `unshare --time` works here (root with CAP_SYS_ADMIN, Linux >= 5.6)."""
    try:
        done = subprocess.run(["unshare", "--time", "--", "/bin/true"], env=isolated_env(),
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                              check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _isolated_plan(cfg: SandboxConfig) -> Plan | str:
    """The strongest plan that works here, or why bubblewrap cannot be used."""
    bwrap, python = resolve_bwrap(cfg), resolve_python(cfg)
    if bwrap is None:
        return f"bubblewrap was not found ({cfg.bwrap_path!r} is not an executable)"
    if python is None:
        return (f"no sandbox interpreter: {cfg.python_path or '/usr/bin/python3'} is missing "
                f"(set SandboxConfig.python_path to a python under /usr or extra_ro_paths)")
    uids = _uids(cfg)
    seccomp = build_filter(shared_uid=uids is None) if cfg.seccomp else None
    has_cgroup = cgroup_factory() is not None
    time_namespace = uids is not None and _time_namespaces_work()
    plan = Plan(bwrap, python, uids, has_cgroup, seccomp, time_namespace)
    why = _probe(cfg, plan)
    if why is not None and has_cgroup:  # The cgroup layer is optional: retry without it.
        plan = Plan(bwrap, python, uids, False, seccomp, time_namespace)
        if _probe(cfg, plan) is None:
            logger.warning("agentrl.sandbox: running without the cgroup layer: %s", why)
            return plan
    return plan if why is None else f"bubblewrap at {bwrap} does not work here: {why}"


def _plan_for(cfg: SandboxConfig, allow_unisolated: bool) -> Plan:
    """Cached per config, so constructing many Sandboxes is cheap."""
    key = (cfg, allow_unisolated)
    with _probe_lock:
        if key not in _probe_cache:
            found = _isolated_plan(cfg)
            if isinstance(found, str) and allow_unisolated:
                found = _unisolated_plan(cfg, found)
            _probe_cache[key] = found
        found = _probe_cache[key]
    if isinstance(found, str):
        raise SandboxUnavailableError(
            f"agentrl.sandbox cannot isolate model-written code on this machine: {found}. {_FIX}")
    return found


def _unisolated_plan(cfg: SandboxConfig, why: str) -> Plan | str:
    python = resolve_python(cfg)
    if python is None:
        return f"{why}; no interpreter for the unisolated tier either"
    plan = Plan(None, python, _uids(cfg), cgroup_factory() is not None, None)
    failed = _probe(cfg, plan)
    if failed is not None:
        return f"{why}; the unisolated tier failed too: {failed}"
    logger.warning("agentrl.sandbox: running model-written code UNISOLATED (allowed "
                   "explicitly): %s", why)
    return plan


def isolation_available(config: SandboxConfig | None = None) -> bool:
    """Whether bubblewrap isolation works here (probes once; never raises)."""
    try:
        _plan_for(config or SandboxConfig(), allow_unisolated=False)
    except SandboxUnavailableError:
        return False
    return True


class Sandbox:
    """Runs untrusted Python under every isolation layer available; see the package docs.

    Thread-safe: `run` and `session` may be called from many threads at once.
    """

    def __init__(self, config: SandboxConfig | None = None,
                 allow_unisolated: bool = False) -> None:
        self.config = config or SandboxConfig()
        allow = allow_unisolated or os.environ.get(ALLOW_UNISOLATED_ENV, "") == "1"
        self._plan = _plan_for(self.config, allow)
        slots = self.config.max_concurrent or max(4, 2 * (os.cpu_count() or 1))
        self._slots = threading.BoundedSemaphore(slots)

    @property
    def isolated(self) -> bool:
        """bubblewrap (namespaces) is in use; False only in the opted-in unisolated tier."""
        return self._plan.bwrap is not None

    @property
    def python(self) -> str:
        """The interpreter the code runs under (resolved when the sandbox was built)."""
        return self._plan.python

    @property
    def layers(self) -> dict[str, bool]:
        """Which layers are active on this machine (for logs and the benchmark)."""
        return {
            "bubblewrap_namespaces": self._plan.bwrap is not None,
            "cgroup": self._plan.has_cgroup,
            "drop_root": self._plan.uids is not None,  # to a uid of each sandbox's own
            "rlimits": True,
            "seccomp": self._plan.seccomp is not None,
            "time_namespace": self._plan.time_namespace,
            "wall_deadline_and_output_cap": True,
        }

    def run(self, code: str, timeout_s: float | None = None) -> ExecResult:
        """Run `code` as `python3 -I -u main.py` in a fresh sandbox; never raises for bad code."""
        timeout = self.config.call_timeout(code, timeout_s)
        with self._slots:
            return run_once(self.config, self._plan, code, timeout, time.monotonic())

    def session(self) -> Session:
        """A persistent interpreter (one per episode); starts on its first `run`."""
        return Session(self.config, self._plan, self._slots)
