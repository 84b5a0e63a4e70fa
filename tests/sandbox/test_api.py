"""Public API, config validation, fail-closed behaviour and the unisolated tier."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import agentrl.sandbox as sandbox_pkg
from agentrl.sandbox import (
    ExecResult,
    Sandbox,
    SandboxConfig,
    SandboxUnavailableError,
    isolation_available,
)
from agentrl.sandbox.config import ALLOW_UNISOLATED_ENV, STATUSES
from agentrl.sandbox.seccomp import build_filter

from ._helpers import FAST, SECRET_VALUE, assert_contained, descendants

MISSING = FAST.replace(bwrap_path="/nonexistent/bwrap")


def test_fails_closed_without_bubblewrap() -> None:
    with pytest.raises(SandboxUnavailableError,
                       match=r"(?s)bubblewrap was not found.*apt-get install -y bubblewrap.*"
                             r"allow_unisolated=True.*AGENTRL_SANDBOX_ALLOW_UNISOLATED=1"):
        Sandbox(MISSING)
    assert not isolation_available(MISSING)


def test_fails_closed_when_bubblewrap_cannot_start(bwrap_present: None, tmp_path: Path) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailableError, match=r"(?s)does not work here.*apt-get install"):
        Sandbox(FAST.replace(bwrap_path=str(fake)))


def test_fails_closed_without_an_interpreter(bwrap_present: None) -> None:
    with pytest.raises(SandboxUnavailableError, match="no sandbox interpreter: /usr/nope/python"):
        Sandbox(FAST.replace(python_path="/usr/nope/python"))


def test_extra_ro_paths_are_importable_and_read_only(bwrap_present: None) -> None:
    """The hook math-tir can use to offer packages (sympy): bind them read-only."""
    shared = tempfile.mkdtemp(prefix="agentrl-sandbox-lib-", dir="/tmp")
    try:
        os.chmod(shared, 0o755)  # Readable by the sandbox's unprivileged uid.
        Path(shared, "mathtool.py").write_text("ANSWER = 42\n")
        sb = Sandbox(FAST.replace(extra_ro_paths=(shared,)))
        r = sb.run(f"import sys\nsys.path.insert(0, {shared!r})\nimport mathtool\n"
                   f"print(mathtool.ANSWER)\nopen({shared!r} + '/mathtool.py', 'a')")
        assert (r.status, r.stdout) == ("error", "42\n") and "Errno" in r.stderr, r
        assert Path(shared, "mathtool.py").read_text() == "ANSWER = 42\n"
    finally:
        shutil.rmtree(shared)


def test_setup_failure_is_a_sandbox_error_not_the_codes(bwrap_present: None) -> None:
    """bwrap reports its child before mounting; a failed mount must not read as `error`."""
    hidden = tempfile.mkdtemp(prefix="agentrl-sandbox-hidden-", dir="/tmp")  # 0700: unreadable
    try:
        with pytest.raises(SandboxUnavailableError, match="status 'sandbox_error'"):
            Sandbox(FAST.replace(extra_ro_paths=(os.path.join(hidden, "x"),)))
    finally:
        shutil.rmtree(hidden)


def test_isolation_available_here(bwrap_present: None) -> None:
    assert isolation_available()
    assert Sandbox().layers["bubblewrap_namespaces"]


@pytest.mark.parametrize("via_env", [False, True], ids=["argument", "env_var"])
def test_unisolated_tier_is_explicit_and_still_limited(via_env: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    if via_env:
        monkeypatch.setenv(ALLOW_UNISOLATED_ENV, "1")
    sb = Sandbox(MISSING, allow_unisolated=not via_env)
    assert not sb.isolated and not sb.layers["bubblewrap_namespaces"]
    ok = sb.run("import os\nprint(6 * 7, sorted(os.environ))")
    assert ok.status == "ok" and ok.stdout.startswith("42 ") and SECRET_VALUE not in ok.stdout
    assert sb.run("while True: pass", timeout_s=0.5).status == "timeout"
    assert sb.run("while True: print('x' * 100)").status == "output_limit"
    held = sb.run("import subprocess\nsubprocess.Popen(['sleep', '100'])\nprint('done')")
    assert (held.status, held.stdout) == ("ok", "done\n") and held.wall_s < 1.5, held
    with sb.session() as s:
        s.run("x = 5")
        assert s.run("x + 1").stdout == "6\n"
    time.sleep(0.1)
    assert descendants(os.getpid()) == set()


def test_config_validation_messages() -> None:
    with pytest.raises(ValueError, match="timeout_s must be a positive finite number, got 0"):
        SandboxConfig(timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb must be >= 32"):
        SandboxConfig(memory_mb=8)
    with pytest.raises(ValueError, match="cpu_time_s must be None or a positive number"):
        SandboxConfig(cpu_time_s=-1.0)
    with pytest.raises(ValueError, match="max_processes must be >= 4"):
        SandboxConfig(max_processes=2)
    with pytest.raises(ValueError, match="python_path must be absolute"):
        SandboxConfig(python_path="python3")
    with pytest.raises(ValueError, match="extra_ro_paths entries must be absolute"):
        SandboxConfig(extra_ro_paths=("/",))
    with pytest.raises(ValueError, match="sandbox_uid must be an unprivileged uid"):
        SandboxConfig(sandbox_uid=0)
    with pytest.raises(ValueError, match="with num_sandbox_uids=2 uids after it below 2"):
        SandboxConfig(sandbox_uid=2**32 - 2, num_sandbox_uids=2)
    with pytest.raises(ValueError, match="num_sandbox_uids must be >= 1, got 0"):
        SandboxConfig(num_sandbox_uids=0)
    with pytest.raises(TypeError):
        SandboxConfig(5.0)  # type: ignore[misc]  # keyword-only
    cfg = SandboxConfig(timeout_s=5.0, memory_mb=512, max_processes=64, max_output_bytes=65536,
                        max_file_mb=16, cpu_time_s=None)
    with pytest.raises(AttributeError):
        cfg.timeout_s = 1.0  # type: ignore[misc]  # frozen


def test_run_argument_errors(sb: Sandbox) -> None:
    with sb.session() as session:  # one check for both kinds of call (SandboxConfig.call_timeout)
        for run in (sb.run, session.run):
            with pytest.raises(ValueError, match="timeout_s must be positive"):
                run("1", timeout_s=0)
            with pytest.raises(TypeError, match="code must be str"):
                run(b"print(1)")  # type: ignore[arg-type]
        assert not session.alive  # rejected before an interpreter started


def test_result_shape(sb: Sandbox) -> None:
    r = sb.run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(4)")
    assert isinstance(r, ExecResult) and r.status in STATUSES
    assert (r.status, r.returncode, r.stdout, r.stderr, r.truncated) == ("error", 4, "out\n",
                                                                         "err\n", False)
    assert 0 < r.wall_s < 2 and not r.ok


def test_probe_is_cached_so_construction_is_cheap(sb: Sandbox) -> None:
    start = time.perf_counter()
    for _ in range(50):
        Sandbox(FAST)
    assert time.perf_counter() - start < 0.5


def test_concurrency_is_bounded_and_waiting_is_not_charged(bwrap_present: None) -> None:
    from concurrent.futures import ThreadPoolExecutor

    sb = Sandbox(FAST.replace(max_concurrent=1, timeout_s=0.9))
    start = time.monotonic()
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: sb.run("import time; time.sleep(0.4)"), range(3)))
    assert time.monotonic() - start >= 1.2  # one at a time
    assert [r.status for r in results] == ["ok"] * 3  # each well inside its own 0.9 s


@pytest.mark.slow
def test_one_shot_cpu_limit_is_cpu_not_wall(bwrap_present: None) -> None:
    r = Sandbox(FAST.replace(cpu_time_s=1.0)).run("while True: pass", timeout_s=30)
    assert (r.status, r.returncode) == ("timeout", -signal.SIGXCPU)


def test_concurrent_one_shot_runs(sb: Sandbox) -> None:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: sb.run(f"print({i} ** 2)").stdout, range(16)))
    assert outs == [f"{i ** 2}\n" for i in range(16)]
    assert_contained(sb)


def test_package_is_stdlib_only() -> None:
    allowed = set(sys.stdlib_module_names) | {"agentrl", "__future__"}
    for path in Path(sandbox_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}"


def test_seccomp_filter_is_well_formed() -> None:
    program = build_filter()
    if os.uname().machine != "x86_64":
        assert program is None
        return
    assert program is not None and len(program) % 8 == 0 and len(program) // 8 < 4096


def test_no_zombies_when_the_caller_is_a_subreaper(bwrap_present: None) -> None:
    """A trainer running as PID 1 (docker without --init) or as a subreaper inherits every
    sandbox's init; they must be reaped, not pile up as zombies."""
    script = (
        "import ctypes, os, sys\n"
        "assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER\n"
        "from agentrl.sandbox import Sandbox, SandboxConfig\n"
        "sb = Sandbox(SandboxConfig(timeout_s=2))\n"
        "for code in ('print(1)', 'while True: pass', 'import os; os.fork(); print(2)'):\n"
        "    sb.run(code)\n"
        "with sb.session() as s:\n"
        "    s.run('x = 1')\n"
        "kids = [p for p in os.listdir('/proc') if p.isdigit() and\n"
        "        open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1] == str(os.getpid())]\n"
        "print(len(kids))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60, check=False, cwd=Path(sandbox_pkg.__file__).parents[2])
    assert (out.returncode, out.stdout) == (0, "0\n"), out.stderr
