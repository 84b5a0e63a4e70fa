"""Session guest: the persistent interpreter that runs *inside* the sandbox.

Not imported by the package: `launch.py` passes this file's source to `python3 -I -u -c`, so
it must stay stdlib-only and self-contained. Protocol (host -> guest on the fd named in
argv[1]): a 32-byte header `!Qd16s` (code length, CPU seconds or 0, the call's random token)
then the UTF-8 code; (guest -> host on the fd named in argv[2]) one line per call,
`TOKEN RC EXC` (EXC an exception class name or `-`), written only after stdout/stderr are
flushed, so the host has all of a call's output once it sees the line.

User code runs in this process, so it can reach the reply pipe; the token ties a reply to its
call, so a line the code writes without the token is not a reply, and the host ends the
interpreter on any line that is not the awaited reply. What the reply is built from is bound
before user code runs, so a cell that merely rebinds `os.write` changes nothing here.

This is not a boundary against a cell that sets out to take over the session (#34 item 9): it
runs with everything this process has. It can read the token from this module's frames, the
next calls' tokens from the control pipe, swap the code of `_run_cell`, or install a trace
function that rewrites its locals, and then answer later calls without running them. No
channel design fixes that while the session's state lives in the process the cell ran in; see
the package docstring for what a session does and does not promise.

stdin is /dev/null (an `input()` ends at once), and the code runs in one namespace like a
notebook cell: the value of a trailing expression is printed.
"""

import ast
import builtins
import linecache
import math
import os
import resource
import struct
import sys
import traceback
from collections.abc import Callable

_HEADER = struct.Struct("!Qd16s")


def _read_exact(fd: int, size: int,
                read: Callable[[int, int], bytes] = os.read) -> bytes | None:
    chunks, remaining = [], size
    while remaining:
        chunk = read(fd, min(remaining, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _limit_cpu(seconds: float) -> None:
    """Per-call CPU budget: RLIMIT_CPU is cumulative per process, so move the soft limit."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def _run_cell(source: str, namespace: dict[str, object], filename: str) -> tuple[int, str | None]:
    """Execute like a notebook cell; returns (exit-like code, exception name)."""
    try:
        tree = ast.parse(source, filename)
    except (SyntaxError, ValueError) as exc:
        traceback.print_exception(type(exc), exc, None)
        return 1, type(exc).__name__
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    # Tracebacks then show the offending source line, as they would for a file.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        exec(compile(tree, filename, "exec"), namespace)  # noqa: S102 - the purpose.
        if last is not None:
            value = eval(compile(last, filename, "eval"), namespace)
            if value is not None:
                print(repr(value))
    except SystemExit as exc:
        return _exit_code(exc), None
    except BaseException as exc:  # noqa: BLE001 - report everything, as python would.
        try:
            tb = exc.__traceback__
            traceback.print_exception(type(exc), exc, tb.tb_next if tb else None)
        except BaseException:  # noqa: BLE001 - e.g. MemoryError while formatting.
            os.write(2, f"{type(exc).__name__}\n".encode())
        return 1, type(exc).__name__
    return 0, None


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is None:  # no console (sys.__stdout__ / __stderr__ may be None)
            continue
        try:
            stream.flush()
        except BaseException:  # noqa: BLE001, S110 - user code may have replaced or closed it.
            pass


def main() -> None:
    ctl_fd, msg_fd = int(sys.argv[1]), int(sys.argv[2])
    # Bound now, before any cell can monkeypatch the modules they come from.
    write, getpid, exit_, unpack, run_cell, flush = (os.write, os.getpid, os._exit,
                                                     _HEADER.unpack, _run_cell, _flush)
    header_size = _HEADER.size
    # Subprocesses of user code must not inherit the protocol fds.
    os.set_inheritable(msg_fd, False)
    os.set_inheritable(ctl_fd, False)
    sys.argv = [""]
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    pid, count = getpid(), 0
    while True:
        header = _read_exact(ctl_fd, header_size)
        if header is None:
            return
        size, cpu_s, token = unpack(header)
        data = _read_exact(ctl_fd, size)
        if data is None:
            return
        count += 1
        if cpu_s > 0:
            _limit_cpu(cpu_s)
        rc, exc = run_cell(data.decode("utf-8", "surrogatepass"), namespace, f"<cell {count}>")
        flush()
        if getpid() != pid:  # A fork made by the cell finished it: end like a script would.
            exit_(rc)
        name = exc.encode("ascii", "replace") if exc and exc.isidentifier() else b"-"
        write(msg_fd, b"%s %d %s\n" % (token, rc, name))

if __name__ == "__main__":
    main()
