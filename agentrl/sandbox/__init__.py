"""Run untrusted, model-written Python (math-tir's tool calls) without trusting it.

Stdlib only. Layers, outer to inner, each useful alone (tests/sandbox runs a suite of hostile
programs against them: bombs, floods, escapes, secrets, loopback services):

1. Supervision in the caller (`process.py`): bounded concurrency (`max_concurrent`), code
   goes in through a memfd or a pipe (never argv), stdin is /dev/null, a wall deadline
   separate from CPU time, non-blocking reads with a per-stream output cap that kills on
   overflow, then always kill, verify, clean up.
   Processes are started from one long-lived thread because bwrap's die-with-parent signal
   fires when the *thread* that forked it exits.
2. A cgroup per execution where /sys/fs/cgroup is writable (v2, or v1 memory/pids/cpu):
   memory, pids and a CPU quota; OOM kills are reported as `oom`. bwrap waits on --block-fd
   until its init has been moved in, so nothing of the code ever runs outside it.
3. When the caller is root, root is dropped to a host uid of the sandbox's own (`unshare
   --setuid`, one uid per live sandbox from a range, locked across processes: `identity.py`),
   so the kernel's per-user quotas (inotify instances, pending signals and POSIX timers,
   message queues), which user namespaces do not separate, are not shared between sandboxes;
   and a time namespace starts the sandbox's boot-relative clocks at zero.
4. rlimits (`prlimit`, applied inside the sandbox's user namespace so RLIMIT_NPROC and
   RLIMIT_SIGPENDING are counted per sandbox): CPU, address space (backstop), file size,
   processes, open files, pending signals, core=0.
5. bubblewrap: every namespace (user, pid, net, ipc, uts, cgroup, mount), die-with-parent, new
   session, no capabilities, no nested user namespaces, read-only /usr only (no /etc, /home,
   /root), sized tmpfs /tmp, /dev/shm and work dir, /proc's host facts (boot parameters, boot
   id, uptime) replaced, a cleared environment, `python3 -I -u`.
   The PID namespace is what reliably kills a whole tree: its init is SIGKILLed via a pidfd.
   Inside, that init (PID 1) reaps orphans; the caller is deliberately not made a
   subreaper, since every stage of the chain is exec'd in place and nothing is orphaned to it.
6. seccomp (x86_64): a hand-built BPF deny-list (io_uring, bpf, ptrace, mount, unshare/setns,
   keyrings, module loading, userfaultfd, sockets but AF_UNIX, setting file times: the host's
   device nodes are bound in; inotify and fanotify where sandboxes share the caller's uid).

What a session does not isolate: the calls of one session share one interpreter, so a call's
code can change what the session's later calls do (rebind `print`, swap the code of the
guest's own functions, install a trace function, write the interpreter's memory with ctypes)
and so forge their output and status. Sessions keep episodes apart from each other and from
the host; within an episode, a later call's result is only as trustworthy as the code that ran
before it. Check anything the reward depends on outside the session (math-tir grades the
answer outside the sandbox), or in a fresh `Sandbox.run`.

Isolation is probed when a `Sandbox` is built. If bubblewrap or user namespaces are missing it
raises `SandboxUnavailableError` with the fix, unless the caller opts into the unisolated tier
(`allow_unisolated=True` or AGENTRL_SANDBOX_ALLOW_UNISOLATED=1): layers 1-4 only, in a fresh
0700 host directory; the code can then read world-readable host files, use the network, and a
`setsid` daemon escapes when no cgroup is writable. It is never chosen silently.

Statuses: ok, error (non-zero exit/exception), timeout (wall or CPU), oom, output_limit,
killed (died from a signal), sandbox_error (infrastructure: never score it as the model's; the
code cannot fake it, since it is decided by a notice sent before the code runs).

    sb = Sandbox(SandboxConfig(timeout_s=5.0))
    sb.run("print(6 * 7)").stdout                      # '42\\n'
    with sb.session() as s:
        s.run("x = 21"); s.run("x * 2").stdout          # '42\\n'
"""

from agentrl.sandbox.config import ExecResult, SandboxConfig, SandboxUnavailableError
from agentrl.sandbox.sandbox import Sandbox, isolation_available
from agentrl.sandbox.session import Session

__all__ = [
    "ExecResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxUnavailableError",
    "Session",
    "isolation_available",
]
