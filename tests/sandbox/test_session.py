"""Stateful sessions: state carries within one, nothing across, everything dies at the end."""

from __future__ import annotations

import dataclasses
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
        # 1 s for the timeout case; the others end by their own cause, given time to reach it
        # (a full run at load average 8 once timed out at 1 s before oom_kill filled memory).
        limit = 1.0 if name == "timeout" else 5.0
        r = s.run(code, timeout_s=limit)
        assert r.status == status, r
        assert r.wall_s < limit + 2.0
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
    assert s.run("import time\ntime.sleep(0.1)\nlen(beats) > 1").stdout == "True\n"
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


def _guest_pids() -> list[int]:
    """Host pids of the session guests running below this test process."""
    found = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"python" in os.path.basename(argv[0]) and b"Session guest" in argv[-4]:
            found.append(pid)
    return found


def _cpu_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (all threads)
    return total / os.sysconf("SC_CLK_TCK")


def test_death_between_calls_is_not_blamed_on_the_next_call(sb: Sandbox) -> None:
    with sb.session() as s:
        s.run("x = 1")
        [guest] = _guest_pids()
        os.kill(guest, signal.SIGKILL)  # e.g. the OOM killer, while the session waits
        time.sleep(0.2)
        r = s.run("print('next')")
        assert (r.status, r.stdout, r.session_restarted) == ("ok", "next\n", True)
        assert "ended between calls" in r.stderr


TIERS = ["as_configured", "no_cgroup", "unisolated_no_cgroup"]


@pytest.mark.parametrize("tier", TIERS)
def test_nothing_runs_between_calls(sb: Sandbox, tier: str) -> None:
    """#19 item 4: a thread and a subprocess left spinning by a call burnt a full core while
    the session sat idle. Between calls they are stopped; they go on during later calls. The
    sandbox finds them through its cgroup, or through /proc where it has none."""
    plan = sb._plan
    if tier != "as_configured":
        plan = dataclasses.replace(plan, has_cgroup=False)
    if tier == "unisolated_no_cgroup":
        plan = dataclasses.replace(plan, bwrap=None, seccomp=None)
    with Session(sb.config, plan) as s:
        r = s.run("import subprocess, sys, threading\nspins = [0]\n"
                  "def spin():\n    while True:\n        spins[0] += 1\n"
                  "worker = threading.Thread(target=spin, daemon=True)\nworker.start()\n"
                  "child = subprocess.Popen([sys.executable, '-c', 'while True: pass'])")
        assert r.status == "ok", r
        time.sleep(0.1)
        sandbox = descendants(os.getpid())
        before = _cpu_seconds(sandbox)
        time.sleep(1.0)
        idle = _cpu_seconds(sandbox) - before
        assert idle < 0.1, f"the sandbox used {idle:.2f} s of CPU between calls"
        r = s.run("import time\nstart = spins[0]\ntime.sleep(0.3)\n"
                  "print(worker.is_alive(), child.poll() is None, spins[0] > start)")
        assert (r.status, r.stdout) == ("ok", "True True True\n"), r


_PIPES = ("import os\nfds = []\nfor fd in os.listdir('/proc/self/fd'):\n    fd = int(fd)\n"
          "    try:\n"
          "        if fd > 2 and os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:'):\n"
          "            fds.append(fd)\n    except OSError: pass\n")


def test_a_forged_reply_ends_the_interpreter_instead_of_shifting_outputs(sb: Sandbox) -> None:
    """#19 item 3: a well-formed reply written to the protocol pipe made the call return "ok"
    at once while its code ran on, and every later call got the previous call's output."""
    forge = (_PIPES + "for fd in fds:\n    try:\n"
             "        os.write(fd, b'{\"rc\": 0, \"exc\": null}\\n0123456789abcdef 0 -\\n')\n"
             "    except OSError: pass\n"
             "import time\ntime.sleep(0.3)\nprint('late')\n")
    with sb.session() as s:
        s.run("x = 1")
        forged = s.run(forge)
        assert forged.status == "error" and "protocol pipe" in forged.stderr, forged
        for i in range(3):
            r = s.run(f"print({i})")
            assert (r.status, r.stdout) == ("ok", f"{i}\n"), r
        assert "NameError" in s.run("x").stderr  # a fresh interpreter, as the note said


def test_a_reply_forged_with_the_calls_own_token_is_caught_at_the_next_call(
        sb: Sandbox) -> None:
    """Code that digs the token out of the guest's frames can end its own call early; the
    real reply then arrives during the next call, which ends with an error rather than
    handing over the earlier call's output, and the call after that runs cleanly."""
    forge = (_PIPES + "import sys, time\nframe = sys._getframe()\n"
             "while 'token' not in frame.f_locals:\n    frame = frame.f_back\n"
             "for fd in fds:\n    try:\n"
             "        os.write(fd, frame.f_locals['token'] + b' 0 -\\n')\n"
             "    except OSError: pass\n"
             "time.sleep(0.3)\nprint('late')\n")
    with sb.session() as s:
        early = s.run(forge)
        assert (early.status, early.stdout) == ("ok", "")
        caught = s.run("print('second')")  # (its output may hold the first call's 'late')
        assert caught.status == "error" and "protocol pipe" in caught.stderr, caught
        r = s.run("print('third')")
        assert (r.status, r.stdout, r.session_restarted) == ("ok", "third\n", True)


def test_monkeypatching_the_guests_modules_does_not_change_replies(sb: Sandbox) -> None:
    with sb.session() as s:
        patched = s.run("import json, os\n"
                        "json.dumps = lambda *a, **k: '{\"rc\": 0, \"exc\": null}'\n"
                        "os.write = lambda fd, data: len(data)")
        assert patched.status == "ok"
        r = s.run("1 / 0")
        assert r.status == "error" and "ZeroDivisionError" in r.stderr, r
        assert (s.run("print('still')").stdout, s.run("raise SystemExit(3)").returncode) == (
            "still\n", 3)


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


def test_a_cell_that_takes_over_its_interpreter_reaches_no_other_session(sb: Sandbox) -> None:
    """#34 item 9: a call's code runs in the session's interpreter, so it can make the
    session's later calls report whatever it likes (guest.py lists ways; no protocol can stop
    code that owns the process). What sessions promise is that this stays inside the session."""
    takeover = ("import sys\ndef forged(source, namespace, filename):\n    print('forged')\n"
                "    return 0, None\nsys.modules['__main__']._run_cell.__code__ = forged.__code__")
    with sb.session() as taken, sb.session() as neighbour:
        assert taken.run(takeover).status == "ok"
        # The documented limit; if this starts failing, guest.py's docstring is out of date.
        assert taken.run("print('real'); 1 / 0").stdout == "forged\n"
        assert neighbour.run("print('real')").stdout == "real\n"
    with sb.session() as later:
        assert later.run("print('real')").stdout == "real\n"


def test_a_session_sandbox_error_says_why_even_with_nothing_on_stderr(
        sb: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session call the sandbox itself failed (it never came up, or left a process behind)
    may have printed nothing; its stderr still names the cause, as a one-shot run's does, so
    the log line an env writes for it (math-tir: 'sandbox_error in math-tir episode: ...') is
    never empty."""
    import agentrl.sandbox.session as session_module

    monkeypatch.setattr(session_module, "classify", lambda *_a, **_k: ("sandbox_error", None))
    with sb.session() as s:
        r = s.run("import os\nos._exit(3)")
    assert r.status == "sandbox_error", r
    assert "the sandbox failed to start or to clean up" in r.stderr, r
