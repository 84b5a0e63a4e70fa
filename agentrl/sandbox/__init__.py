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
3. Root is dropped (`setpriv`, uid 65534, no-new-privs) when the caller is root.
4. rlimits (`prlimit`, applied inside the sandbox's user namespace so RLIMIT_NPROC is counted
   per sandbox): CPU, address space (backstop), file size, processes, open files, core=0.
5. bubblewrap: every namespace (user, pid, net, ipc, uts, cgroup, mount), die-with-parent, new
   session, no capabilities, no nested user namespaces, read-only /usr only (no /etc, /home,
   /root), sized tmpfs /tmp, /dev/shm and work dir, a cleared environment, `python3 -I -u`.
   The PID namespace is what reliably kills a whole tree: its init is SIGKILLed via a pidfd.
   Inside, that init (PID 1) reaps orphans; the caller is deliberately not made a
   subreaper, since every stage of the chain is exec'd in place and nothing is orphaned to it.
6. seccomp (x86_64): a hand-built BPF deny-list (io_uring, bpf, ptrace, mount, unshare/setns,
   keyrings, module loading, userfaultfd, inet sockets).

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
