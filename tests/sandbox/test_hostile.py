"""The hostile-program suite of sandbox.md, one-shot runs.

Every test asserts the status, a bounded return time, and (via `assert_contained`) that nothing
is left running, no cgroup is left behind and the executor still works afterwards.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from collections.abc import Iterator

import pytest

from agentrl.sandbox import Sandbox

from ._helpers import (
    FAST,
    SECRET_ENV,
    SECRET_VALUE,
    assert_bounded,
    assert_contained,
)


@pytest.fixture(autouse=True)
def contained(sb: Sandbox) -> Iterator[None]:
    """After every test: nothing of any sandbox left running, no cgroup, executor alive."""
    yield
    assert_contained(sb)


T = FAST.timeout_s
RUNAWAY_T = 1.0
"""The runaway programs' deadline: each runs for all of it, so it sets the time of the tests
below; a sandbox starts its program in ~20 ms, which leaves every one of them a second of
spinning, forking or filling before the deadline must end it."""

# (name, code, allowed statuses). All must end by the deadline.
RUNAWAY = [
    ("cpu_spin", "while True:\n    pass", {"timeout"}),
    ("sleep_wall_not_cpu", "import time\ntime.sleep(1e6)", {"timeout"}),
    (
        "eight_spinning_threads",
        (
            "import threading\ndef spin():\n    while True: pass\n"
            "for _ in range(8): threading.Thread(target=spin).start()\nspin()"
        ),
        {"timeout"},
    ),
    (
        "sigterm_ignored",
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(1e6)",
        {"timeout"},
    ),
    (
        "fork_bomb",
        "import os\nwhile True:\n    try: os.fork()\n    except OSError: pass",
        {"timeout"},
    ),
    (
        "subprocess_bomb",
        (
            "import subprocess, sys\nwhile True:\n    try:\n        subprocess.Popen("
            "[sys.executable, '-c', 'import time; time.sleep(1000)'])\n    except OSError:\n"
            "        pass"
        ),
        {"timeout"},
    ),
    (
        "thread_bomb",
        (
            "import threading, time\nwhile True:\n"
            "    threading.Thread(target=time.sleep, args=(100,)).start()"
        ),
        {"error", "timeout"},
    ),
    # tmpfs inodes are kernel memory charged to the cgroup, so this may end as an OOM kill.
    (
        "million_files",
        "i = 0\nwhile True:\n    open(f'/tmp/{i}', 'w').close()\n    i += 1",
        {"timeout", "error", "oom"},
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,code,statuses", RUNAWAY, ids=[r[0] for r in RUNAWAY])
def test_runaway_programs_end_at_the_deadline(
    sb: Sandbox, name: str, code: str, statuses: set[str]
) -> None:
    result = sb.run(code, timeout_s=RUNAWAY_T)
    assert result.status in statuses, result
    assert result.wall_s >= (RUNAWAY_T - 0.1 if statuses == {"timeout"} else 0)
    assert_bounded(result, RUNAWAY_T)


FORK_BOMB = {name: code for name, code, _ in RUNAWAY}["fork_bomb"]

QUICK = [
    ("input_sees_eof", "input()", "error", "EOFError"),
    (
        "fd_exhaustion",
        "fs = [open('/dev/null') for _ in range(100000)]",
        "error",
        "Too many open files",
    ),
    ("alloc_64_gib", "x = bytearray(64 << 30)", "oom", "MemoryError"),
    ("gradual_growth", "xs = []\nwhile True:\n    xs.append(bytearray(1 << 20))", "oom", ""),
    (
        "shm_4_gib_many_files",
        "for i in range(4096):\n    open(f'/dev/shm/{i}', 'wb').write(b'x' * (1 << 20))",
        "error",
        "No space left",
    ),
    (
        "shm_4_gib_one_file",
        (
            "with open('/dev/shm/big', 'wb') as f:\n"
            "    for _ in range(4096): f.write(b'x' * (1 << 20))"
        ),
        "error",
        "File too large",
    ),  # RLIMIT_FSIZE; python ignores SIGXFSZ, so EFBIG.
    (
        "fill_tmp",
        "for i in range(4096):\n    open(f'/tmp/{i}', 'wb').write(b'x' * (1 << 20))",
        "error",
        "No space left",
    ),
    (
        "fill_workdir",
        "import os\nfor i in range(4096):\n    open(f'{i}.bin', 'wb').write(b'x' * (1 << 20))",
        "error",
        "No space left",
    ),
    ("deep_recursion", "def f(n): return f(n + 1)\nf(0)", "error", "RecursionError"),
    (
        "deep_recursion_unlimited",  # C recursion past the limit: the C stack overflows.
        (
            "import json, sys\nsys.setrecursionlimit(10**8)\nx = []\n"
            "for _ in range(10**6): x = [x]\njson.dumps(x)"
        ),
        "killed",
        "",
    ),
    ("segfault", "import ctypes\nctypes.string_at(0)", "killed", ""),
    (
        "write_into_stdlib",
        "import os\nopen(os.__file__, 'a').write('raise SystemExit(99)')",
        "error",
        "Permission denied|Read-only file system",
    ),
]


@pytest.mark.parametrize("name,code,status,stderr_has", QUICK, ids=[q[0] for q in QUICK])
def test_resource_abuse_is_contained(
    sb: Sandbox, name: str, code: str, status: str, stderr_has: str
) -> None:
    result = sb.run(code)
    assert result.status in status.split("|"), result
    assert re.search(stderr_has, result.stderr), result.stderr
    assert_bounded(result, T)


def test_stdlib_write_does_not_affect_later_runs(sb: Sandbox) -> None:
    sb.run("import os\nopen(os.__file__, 'a').write('raise SystemExit(99)')")
    later = sb.run("import os, json\nprint(json.dumps([1]))")
    assert (later.status, later.stdout) == ("ok", "[1]\n")


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
@pytest.mark.parametrize("newline", [True, False], ids=["lines", "no_newline"])
def test_output_flood_is_capped_and_killed(sb: Sandbox, stream: str, newline: bool) -> None:
    end = "'\\n'" if newline else "''"
    code = f"import sys\nwhile True:\n    print('x' * 1000, end={end}, file=sys.{stream})"
    result = sb.run(code)
    assert result.status == "output_limit" and result.truncated, result
    captured = getattr(result, stream)
    assert len(captured) == FAST.max_output_bytes and set(captured) <= {"x", "\n"}
    assert result.wall_s < 1.5


def test_invalid_utf8_and_nul_bytes(sb: Sandbox) -> None:
    result = sb.run("import sys\nsys.stdout.buffer.write(b'a\\x00b\\xff\\xfe c\\n')")
    assert result.status == "ok"
    assert result.stdout == "a\x00b\ufffd\ufffd c\n"


def test_child_holding_the_pipe_is_not_a_timeout(sb: Sandbox) -> None:
    code = "import subprocess\nsubprocess.Popen(['sleep', '1000'])\nprint('done', flush=True)"
    result = sb.run(code)
    assert (result.status, result.stdout) == ("ok", "done\n")
    assert result.wall_s < 1.0, "a descendant holding stdout turned into a wait"


def test_double_fork_setsid_daemon_dies(sb: Sandbox) -> None:
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.closerange(0, 3)\n        time.sleep(1000)\n    os._exit(0)\n"
        "os.wait()\nprint('parent done')"
    )
    result = sb.run(code)
    assert (result.status, result.stdout) == ("ok", "parent done\n")
    assert result.wall_s < 1.0


def test_boxed_answer_then_os_exit_keeps_stdout(sb: Sandbox) -> None:
    result = sb.run('import os\nprint("\\\\boxed{42}")\nos._exit(0)')
    assert (result.status, result.returncode, result.stdout) == ("ok", 0, "\\boxed{42}\n")


def test_fourteen_megabyte_source(sb: Sandbox) -> None:
    # Transport, not the compiler, is under test: argv would fail with E2BIG at ~128 KiB.
    body = "# comment line\n" * 550_000
    code = body + "s = '" + "7" * (6 << 20) + "'\nprint(len(s))\n"
    assert len(code) > 14_000_000
    result = sb.run(code, timeout_s=30)
    assert (result.status, result.stdout) == ("ok", f"{6 << 20}\n"), result.stderr[-500:]


def test_host_files_unreadable_and_unchanged(
    sb: Sandbox, host_secret_file: str, root_secret_file: str | None
) -> None:
    targets = [host_secret_file, "/etc/shadow", "/etc/passwd", "/root"]
    if root_secret_file:
        targets.append(root_secret_file)
    before = {p: os.stat(p).st_mtime_ns for p in (host_secret_file, root_secret_file) if p}
    code = (
        f"import os\nfor p in {targets!r}:\n    try: print(open(p).read())\n"
        "    except OSError as e: print('denied', type(e).__name__)\n"
        "    try: open(p, 'w').write('pwned')\n    except OSError: pass\n"
        "    try: print(os.listdir(p))\n    except OSError: pass\n"
    )
    result = sb.run(code)
    assert result.status == "ok", result
    assert SECRET_VALUE not in result.stdout + result.stderr
    assert result.stdout.count("denied") == len(targets)
    for path, mtime in before.items():
        assert os.stat(path).st_mtime_ns == mtime
        with open(path) as f:
            assert f.read() == SECRET_VALUE


def test_environment_has_no_trainer_secrets(sb: Sandbox) -> None:
    code = (
        "import os\nprint(sorted(os.environ))\n"
        "for pid in os.listdir('/proc'):\n    if pid.isdigit():\n"
        "        try: print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "        except OSError as e: print(e)"
    )
    result = sb.run(code)
    assert result.status == "ok"
    assert SECRET_ENV not in result.stdout and SECRET_VALUE not in result.stdout
    assert result.stdout.splitlines()[0] == str(
        sorted(
            [
                "HOME",
                "LANG",
                "LC_ALL",
                "MKL_NUM_THREADS",
                "OMP_NUM_THREADS",
                "OPENBLAS_NUM_THREADS",
                "PATH",
                "PWD",
                "TMPDIR",
            ]
        )
    )


def test_loopback_and_abstract_sockets_unreached(sb: Sandbox) -> None:
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen(8)
    tcp.setblocking(False)
    abstract = socket.socket(socket.AF_UNIX)
    name = f"\0agentrl-sandbox-test-{os.getpid()}"
    abstract.bind(name)
    abstract.listen(8)
    abstract.setblocking(False)
    ports = [tcp.getsockname()[1], 6379, 8265, 10001, 8000]
    code = (
        f"import socket\nfor port in {ports!r}:\n    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=0.5); print('REACHED')\n"
        "    except OSError as e: print('no', port, e)\n"
        "s = socket.socket(socket.AF_UNIX)\n"
        f"try: s.connect({name!r}); print('REACHED')\nexcept OSError as e: print('no unix', e)\n"
        "try: socket.getaddrinfo('example.com', 80); print('REACHED dns')\n"
        "except OSError as e: print('no dns', e)\n"
        "import urllib.request\n"
        "try: urllib.request.urlopen('http://93.184.215.14/', timeout=1); print('REACHED')\n"
        "except OSError as e: print('no http', e)\n"
    )
    try:
        result = sb.run(code)
        for listener in (tcp, abstract):
            with pytest.raises(BlockingIOError):
                listener.accept()
    finally:
        tcp.close()
        abstract.close()
    assert result.status == "ok", result
    lines = result.stdout.splitlines()
    assert len(lines) == len(ports) + 3 and all(line.startswith("no ") for line in lines), lines


def test_killing_outward_hurts_nobody(sb: Sandbox) -> None:
    code = (
        f"import os, signal\nfor pid in (os.getppid(), -1, 1, {os.getpid()}):\n"
        "    try: os.kill(pid, signal.SIGKILL)\n    except OSError as e: print(pid, e)\n"
        "print('survived')"
    )
    result = sb.run(code)
    assert (result.status, result.stdout.splitlines()[-1]) == ("ok", "survived"), result


def test_kernel_escapes_via_ctypes_fail(sb: Sandbox) -> None:
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('ptrace', libc.ptrace(16, 1, 0, 0))\n"  # PTRACE_ATTACH to init
        "print('mount', libc.mount(b'none', b'/tmp', b'tmpfs', 0, None))\n"
        "print('unshare', libc.unshare(0x10000000))\n"  # CLONE_NEWUSER
        "print('unshare_ns', libc.unshare(0x00020000))\n"  # CLONE_NEWNS
        "print('setns', libc.setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0))\n"
        "print('io_uring', libc.syscall(425, 8, ctypes.create_string_buffer(256)))\n"
        "print('bpf', libc.syscall(321, 0, None, 0))\n"
        "print('socket_inet', libc.socket(2, 1, 0))\n"
        "print(open('/proc/self/status').read().split('Seccomp:')[1].split()[0])"
    )
    result = sb.run(code)
    assert result.status == "ok", result
    *calls, seccomp_mode = result.stdout.splitlines()
    assert {line.split()[1] for line in calls} == {"-1"}, result.stdout
    assert seccomp_mode == ("2" if sb.layers["seccomp"] else "0")  # 2: filter mode


def test_reaching_outside_the_guest_is_denied_by_seccomp(sb: Sandbox) -> None:
    """Sockets of any family but AF_UNIX (vsock is not namespaced: a guest could take a port the
    host needs) and the calls that reach other processes' descriptors (pidfd_getfd would copy
    the sandbox init's fd 0, the host's status pipe) fail with seccomp's EPERM, not with
    whatever the namespaces happen to answer; AF_UNIX sockets and socketpairs still work."""
    if not sb.layers["seccomp"]:
        pytest.skip("the seccomp layer is inactive on this architecture")
    code = (
        "import ctypes, socket\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def call(name, *args):\n    ctypes.set_errno(0)\n"
        "    print(name, libc.syscall(*args), ctypes.get_errno())\n"
        "call('socket_vsock', 41, 40, 1, 0)\n"  # AF_VSOCK, SOCK_STREAM
        "call('socket_netlink', 41, 16, 3, 0)\n"  # AF_NETLINK, SOCK_RAW
        "call('socket_packet', 41, 17, 3, 0)\n"  # AF_PACKET
        "call('socketpair_inet', 53, 2, 1, 0, ctypes.create_string_buffer(8))\n"
        "call('pidfd_open', 434, 1, 0)\n"  # the sandbox's init
        "call('pidfd_getfd', 438, -1, 0, 0)\n"
        "call('pidfd_send_signal', 424, -1, 9, None, 0)\n"
        "call('kcmp', 312, 1, 1, 0, 0, 0)\n"
        "a, b = socket.socketpair(); socket.socket(socket.AF_UNIX).close()\n"
        "a.sendall(b'x'); print('unix', b.recv(1).decode())"
    )
    result = sb.run(code)
    assert result.status == "ok", result
    *calls, unix = result.stdout.splitlines()
    assert {tuple(line.split()[1:]) for line in calls} == {("-1", "1")}, result.stdout  # EPERM
    assert unix == "unix x"


@pytest.mark.slow
def test_innocent_program_beside_fork_bomb(sb: Sandbox) -> None:
    bomb_result: list[object] = []
    bomb = threading.Thread(target=lambda: bomb_result.append(sb.run(FORK_BOMB)))
    bomb.start()
    try:
        innocent = sb.run(
            "import subprocess\nprint(sum(range(10**6)))\n"
            "print(subprocess.run(['echo', 'child ok'], capture_output=True,"
            " text=True).stdout, end='')",
            timeout_s=10,
        )
    finally:
        bomb.join()
    assert innocent.status == "ok", innocent
    assert innocent.stdout == f"{sum(range(10**6))}\nchild ok\n"


def test_memory_limit_covers_the_whole_tree(sb: Sandbox) -> None:
    """Three children of 100 MB each stay under every per-process limit; only the cgroup
    (256 MB for the sandbox) stops them, which proves forks cannot leave it."""
    if not sb.layers["cgroup"]:
        pytest.skip("no writable cgroup hierarchy on this machine")
    code = (
        "import os, sys, time\npids = []\nfor _ in range(3):\n    pid = os.fork()\n"
        "    if pid == 0:\n        block = bytearray(100 << 20)\n        time.sleep(0.5)\n"
        "        os._exit(0)\n    pids.append(pid)\n"
        "codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]\n"
        "print(codes)\nsys.exit(1 if any(codes) else 0)"
    )
    result = sb.run(code)
    assert result.status == "oom", result
    assert "-9" in result.stdout
