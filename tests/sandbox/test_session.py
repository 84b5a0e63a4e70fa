"""Stateful sessions: state carries within one, nothing across, everything dies at the end."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from agentrl.sandbox import Sandbox, SandboxConfig, Session

from ._helpers import FAST, assert_contained, descendants


@pytest.fixture(autouse=True)
def contained(sb: Sandbox) -> Iterator[None]:
    """After every test: nothing of any sandbox left running, no cgroup, executor alive."""
    yield
    assert_contained(sb)


def test_state_carries_and_trailing_expression_is_shown(sb: Sandbox) -> None:
    with sb.session() as s:
        assert s.run("x = 21").stdout == ""
        assert s.run("print(x * 2)").stdout == "42\n"
        r = s.run("import math\ny = math.sqrt(x + 4)\ny")
        assert (r.status, r.returncode, r.stdout, r.stderr) == ("ok", 0, "5.0\n", "")
        assert s.run("None").stdout == ""  # Like a notebook: None is not echoed.
        assert s.run("print('a')").stdout == "a\n"
        assert s.run("print('b')").stdout == "b\n"  # Output is per call.


def test_errors_keep_the_session(sb: Sandbox) -> None:
    with sb.session() as s:
        s.run("x = 1")
        r = s.run("y = 2\n1 / 0")
        assert r.status == "error" and r.returncode == 1
        assert "ZeroDivisionError" in r.stderr and "1 / 0" in r.stderr  # Source line shown.
        assert s.run("def broken(:").status == "error"
        assert s.run("input()").stderr.strip().endswith("EOFError: EOF when reading a line")
        assert (s.run("import sys; sys.exit(3)").returncode, s.run("x + y").stdout) == (3, "3\n")
        oom = s.run("big = bytearray(64 << 30)")
        assert oom.status == "oom" and "MemoryError" in oom.stderr
        after = s.run("x")
        assert (after.stdout, after.session_restarted) == ("1\n", False)


CRASHES = [
    ("timeout", "while True:\n    pass", "timeout"),
    ("segfault", "import ctypes\nctypes.string_at(0)", "killed"),
    ("flood", "while True:\n    print('x' * 1000)", "output_limit"),
    ("oom_kill", "xs = []\nwhile True:\n    xs.append(bytearray(1 << 20))", "oom"),
    ("os_exit", "print('\\\\boxed{42}')\nimport os\nos._exit(0)", "ok"),
]


@pytest.mark.parametrize("name,code,status", CRASHES, ids=[c[0] for c in CRASHES])
def test_a_crash_ends_only_that_call(sb: Sandbox, name: str, code: str, status: str) -> None:
    with sb.session() as s:
        s.run("x = 'old state'")
        r = s.run(code, timeout_s=1.0)
        assert r.status == status, r
        assert r.wall_s < 3.0
        if name == "os_exit":
            assert r.stdout == "\\boxed{42}\n"
        assert not s.alive and descendants(os.getpid()) == set()
        fresh = s.run("print('fresh'); x")
        assert fresh.session_restarted and fresh.stdout == "fresh\n"
        assert "fresh one" in fresh.stderr and "NameError" in fresh.stderr
        again = s.run("x = 2\nx")
        assert (again.stdout, again.session_restarted, again.stderr) == ("2\n", False, "")


def test_background_thread_and_process_die_at_session_end(sb: Sandbox) -> None:
    s = sb.session()
    s.run("import subprocess, threading, time\nbeats = []\n"
          "def beat():\n    while True:\n        beats.append(1)\n        time.sleep(0.01)\n"
          "threading.Thread(target=beat, daemon=False).start()\n"
          "child = subprocess.Popen(['sleep', '1000'])")
    time.sleep(0.1)
    assert int(s.run("len(beats)").stdout) > 0  # The thread runs between calls.
    assert len(descendants(os.getpid())) >= 3  # bwrap, its init, the guest, sleep
    s.close()
    assert descendants(os.getpid()) == set()
    with pytest.raises(RuntimeError, match="after close"):
        s.run("1")


def test_nothing_carries_across_sessions(sb: Sandbox) -> None:
    with sb.session() as first:
        first.run("secret = 'first'\nopen('/tmp/mark', 'w').write('1')\n"
                  "open('mark', 'w').write('1')\nimport fractions")
    with sb.session() as second:
        r = second.run("import os, sys\nprint(os.path.exists('/tmp/mark'), os.path.exists('mark'),"
                       " 'fractions' in sys.modules)\nsecret")
        assert r.stdout == "False False False\n" and "NameError" in r.stderr


def test_output_up_to_the_cap_arrives_whole(bwrap_present: None) -> None:
    sb = Sandbox(FAST.replace(max_output_bytes=1 << 20))
    with sb.session() as s:
        for size in (1, 65_535, 65_537, 700_000):
            r = s.run(f"import sys\n_ = sys.stdout.write('a' * {size})\n_ = sys.stderr.write('e')")
            assert (r.status, len(r.stdout), r.stderr, r.truncated) == ("ok", size, "e", False)
        big = s.run("data = '" + "9" * (14 << 20) + "'\nlen(data)", timeout_s=30)
        assert big.stdout == f"{14 << 20}\n"


def test_fork_inside_a_cell_reports_once(sb: Sandbox) -> None:
    with sb.session() as s:
        r = s.run("import os\npid = os.fork()\nif pid == 0:\n    print('child')\n"
                  "else:\n    os.waitpid(pid, 0)\n    print('parent')")
        assert (r.status, sorted(r.stdout.split())) == ("ok", ["child", "parent"])
        assert s.run("pid > 0").stdout == "True\n"


def test_session_outlives_the_thread_that_started_it(sb: Sandbox) -> None:
    """bwrap's die-with-parent fires on the *thread* that forked it; we spawn elsewhere."""
    holder: list[Session] = []

    def starter() -> None:
        s = sb.session()
        s.run("v = 7")
        holder.append(s)

    t = threading.Thread(target=starter)
    t.start()
    t.join()
    time.sleep(0.2)
    with holder[0] as s:
        r = s.run("v * 6")
        assert (r.stdout, r.session_restarted) == ("42\n", False)


def test_sessions_from_many_threads(sb: Sandbox) -> None:
    results: dict[int, str] = {}

    def episode(i: int) -> None:
        with sb.session() as s:
            s.run(f"v = {i}")
            results[i] = s.run("v * 2").stdout

    threads = [threading.Thread(target=episode, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i * 2}\n" for i in range(8)}


def test_garbage_collected_session_is_killed(sb: Sandbox) -> None:
    s = sb.session()
    s.run("import threading, time\nthreading.Thread(target=time.sleep, args=(1000,)).start()")
    assert descendants(os.getpid())
    del s
    gc.collect()
    assert descendants(os.getpid()) == set()


@pytest.mark.slow
def test_session_cpu_budget_is_per_call(bwrap_present: None) -> None:
    sb = Sandbox(FAST.replace(cpu_time_s=1.0, timeout_s=5.0))
    with sb.session() as s:
        spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
        assert [s.run(spin).status for _ in range(3)] == ["ok"] * 3  # 1.2 s CPU in all
        r = s.run("while True: pass")
        assert (r.status, r.returncode) == ("timeout", -signal.SIGXCPU)  # CPU, not wall


def test_session_respects_config(bwrap_present: None) -> None:
    cfg = SandboxConfig(timeout_s=0.5)
    with Sandbox(cfg).session() as s:
        assert s.run("import time; time.sleep(2)").status == "timeout"
        assert s.run("1 + 1", timeout_s=5).stdout == "2\n"


def test_forked_caller_can_run_and_cannot_kill_the_parents_session(sb: Sandbox) -> None:
    with sb.session() as s:
        s.run("v = 1")
        pid = os.fork()
        if pid == 0:  # The child: its own spawner works; closing the copy must be a no-op.
            code = 1
            try:
                s.close()
                code = 0 if sb.run("print(2)").stdout == "2\n" else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert (s.run("v").stdout, s.alive) == ("1\n", True)


def test_death_between_calls_is_not_blamed_on_the_next_call(sb: Sandbox) -> None:
    with sb.session() as s:
        s.run("import os, threading, time\n"
              "threading.Thread(target=lambda: (time.sleep(0.1), os._exit(9))).start()")
        time.sleep(0.5)
        r = s.run("print('next')")
        assert (r.status, r.stdout, r.session_restarted) == ("ok", "next\n", True)
        assert "ended between calls" in r.stderr


def test_a_flood_on_the_protocol_pipe_is_capped_where_it_is_read(sb: Sandbox) -> None:
    """Guest code that finds the session's message pipe (any pipe fd of its own) and writes
    100 MiB into it: the host keeps at most its small protocol cap, ends the call like an output
    flood, and the next call runs in a fresh interpreter. Before the cap the caller buffered it
    all (+300 MiB of RSS) and the call came back as an ordinary error."""
    import tracemalloc

    flood = (
        "import os\nblob = b'x' * (1 << 20)\n"
        "for fd in os.listdir('/proc/self/fd'):\n    fd = int(fd)\n"
        "    if fd < 3: continue\n    try:\n"
        "        if os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:'):\n"
        "            for _ in range(100): os.write(fd, blob)\n"
        "    except OSError: pass\n"
    )
    with sb.session() as s:
        assert s.run("x = 1").status == "ok"
        tracemalloc.start()
        try:
            result = s.run(flood)
            peak_mib = tracemalloc.get_traced_memory()[1] / 2**20  # what the caller allocated
        finally:
            tracemalloc.stop()
        assert result.status == "output_limit", result
        assert peak_mib < 16, peak_mib
        after = s.run("print(6 * 7)")
        assert (after.status, after.stdout, after.session_restarted) == ("ok", "42\n", True)
