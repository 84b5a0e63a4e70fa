"""What of the host a sandbox can see or change beyond its own files (#34 items 8 and 11)."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

import pytest

from agentrl.sandbox import Sandbox

from ._helpers import FAST, assert_contained


@pytest.fixture(autouse=True)
def contained(sb: Sandbox) -> Iterator[None]:
    yield
    assert_contained(sb)


# bubblewrap's --dev binds these host device nodes into the sandbox.
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")


def _metadata(path: str) -> tuple[int, int, int, int, int, int]:
    st = os.stat(path)
    return st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, st.st_mode, st.st_uid, st.st_gid


def test_device_files_keep_the_hosts_metadata(sb: Sandbox) -> None:
    """#34 item 8: `os.utime('/dev/null')` in the sandbox set the host's /dev/null times to now
    (write permission is enough to touch a file). Every way to set times is tried, by path and
    by descriptor; the devices still work."""
    devices = [d for d in DEVICES if os.path.exists(d)]
    before = {d: _metadata(d) for d in devices}
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"for d in {devices!r}:\n"
        "    for how, touch in [('utime', lambda: os.utime(d)),\n"
        "                       ('utime_ns', lambda: os.utime(d, ns=(0, 0))),\n"
        "                       ('utimes', lambda: libc.utimes(d.encode(), None)),\n"
        "                       ('utime_legacy', lambda: libc.utime(d.encode(), None))]:\n"
        "        try:\n            touch()\n        except OSError:\n            pass\n"
        "    try:\n        fd = os.open(d, os.O_RDONLY)\n    except OSError:\n        continue\n"
        "    try:\n        os.utime(fd)\n    except OSError:\n        pass\n"
        "    os.close(fd)\n"
        "open('/dev/null', 'w').write('x')\n"
        "print(len(open('/dev/zero', 'rb').read(8)), len(open('/dev/urandom', 'rb').read(8)))"
    )
    result = sb.run(code)
    assert (result.status, result.stdout) == ("ok", "8 8\n"), result
    assert {d: _metadata(d) for d in devices} == before


def test_setting_file_times_is_denied_inside_too(sb: Sandbox) -> None:
    """What the fix for item 8 costs: the sandbox's own files cannot be touched either
    (copying without `copystat` still works)."""
    r = sb.run("import os, shutil\nopen('a', 'w').write('x')\nshutil.copy('a', 'b')\n"
               "try:\n    os.utime('b')\nexcept PermissionError as e:\n    print('denied')\n"
               "print(open('b').read())")
    assert (r.status, r.stdout) == ("ok", "denied\nx\n"), r


def _host(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_host_boot_facts_are_masked(sb: Sandbox) -> None:
    """#34 item 11: /proc/cmdline (boot parameters), the boot id and the uptime are the host's.
    The files are replaced; where the sandbox has a time namespace (the caller is root) the
    boot-relative clocks start at the sandbox's own start as well."""
    code = (
        "import time\n"
        "for path in ('/proc/cmdline', '/proc/sys/kernel/random/boot_id', '/proc/uptime'):\n"
        "    print(repr(open(path).read()))\n"
        "print(time.clock_gettime(time.CLOCK_BOOTTIME), time.monotonic())\n"
        "ticks = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[19])\n"
        "print(ticks / __import__('os').sysconf('SC_CLK_TCK'))"
    )
    result = sb.run(code)
    assert result.status == "ok", result
    cmdline, boot_id, uptime, clocks, started = result.stdout.splitlines()
    assert ast.literal_eval(cmdline) == ""
    assert ast.literal_eval(boot_id) != _host("/proc/sys/kernel/random/boot_id")
    assert ast.literal_eval(uptime) == "0.00 0.00\n"
    if sb.layers["time_namespace"]:
        boottime, monotonic = map(float, clocks.split())
        assert boottime < FAST.timeout_s and monotonic < FAST.timeout_s, result.stdout
        assert float(started) < FAST.timeout_s, result.stdout
