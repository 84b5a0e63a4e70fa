"""A seccomp deny-list as a raw classic-BPF program for `bwrap --seccomp FD`.

Built by hand with `struct` so the sandbox needs no libseccomp binding (stdlib only). bwrap
installs it after setting up the namespaces, so it constrains only the sandboxed code.

Why these calls (sandbox.md, layer 6): the namespaces and dropped capabilities already make
most of them fail, but each one is kernel attack surface that arithmetic code never needs:
io_uring and bpf (frequent kernel CVEs, and io_uring bypasses per-syscall filtering), ptrace
and process_vm_* (reading other sandboxed processes), the pidfd calls and kcmp (pidfd_getfd
copies another process's descriptors: the sandbox init's fd 0 is the host's status pipe),
mount/unshare/setns/new mount API (namespace games), keyrings, module loading, userfaultfd
(exploit timing primitive), and sockets of every family but AF_UNIX (inet: the network namespace
already has only its own loopback; vsock is not namespaced at all, so a guest could take a port
the host needs; netlink and packet are kernel attack surface).
Setting file times is denied too (#34 item 8): bubblewrap's --dev binds the host's device nodes
(/dev/null, /dev/zero, ...), which are world-writable, and write permission is all
`utime(path, NULL)` asks, so the code set the host's /dev/null times. A read-only remount is no
way out: bubblewrap remounts with nodev, and then the devices cannot be opened at all. The cost:
`os.utime`, and so `shutil.copy2`/`copystat`, fail with EPERM on the sandbox's own files too.
Where sandboxes share their host uid with each other and the caller (an unprivileged caller:
no uid of their own to give them, see `identity.py`), inotify and fanotify are denied as well:
the kernel counts their instances per host uid (128 by default) through every user namespace,
and no per-sandbox limit can divide that (#34 item 7).
Denied calls fail with EPERM rather than killing, so a library probing for io_uring degrades.

Only x86_64 is supported: syscall numbers differ per architecture and an untested table would
risk denying a call python needs. On other machines `build_filter` returns None and the layer
is reported as inactive.
"""

from __future__ import annotations

import errno
import platform
import socket
import struct

_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_SYSCALL_BIT = 0x40000000

# x86_64 numbers from <asm/unistd_64.h>.
_DENIED_X86_64: dict[str, int] = {
    "ptrace": 101, "pivot_root": 155, "chroot": 161, "acct": 163, "mount": 165, "umount2": 166,
    "swapon": 167, "swapoff": 168, "reboot": 169, "init_module": 175, "delete_module": 176,
    "quotactl": 179, "kexec_load": 246, "add_key": 248, "request_key": 249, "keyctl": 250,
    "unshare": 272, "perf_event_open": 298, "open_by_handle_at": 304, "setns": 308,
    "process_vm_readv": 310, "process_vm_writev": 311, "finit_module": 313,
    "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "open_tree": 428, "move_mount": 429,
    "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433, "mount_setattr": 442,
    "kcmp": 312, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438,
    "process_madvise": 440,
    "utime": 132, "utimes": 235, "futimesat": 261, "utimensat": 280,
}
# Per-host-uid quotas, denied only where sandboxes share their uid (`shared_uid`).
_SHARED_QUOTA_X86_64: dict[str, int] = {"inotify_init": 253, "inotify_init1": 294,
                                        "fanotify_init": 300}
_SYS_SOCKET_X86_64 = 41
_SYS_SOCKETPAIR_X86_64 = 53

# Classic BPF opcodes (linux/filter.h) and seccomp return values (linux/seccomp.h).
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000
# Offsets into struct seccomp_data: nr, arch, then args[0] (low 32 bits on little-endian).
_OFF_NR, _OFF_ARCH, _OFF_ARG0 = 0, 4, 16


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def build_filter(*, shared_uid: bool = False) -> bytes | None:
    """The filter for this machine, or None where the architecture is unsupported.

    shared_uid: the sandboxes run as one host uid (the caller's); also deny the calls whose
    per-uid quota they would share.
    """
    if platform.machine() != "x86_64" or struct.pack("=I", 1)[0] != 1:
        return None
    denied_calls = {**_DENIED_X86_64, **(_SHARED_QUOTA_X86_64 if shared_uid else {})}
    denied = sorted(set(denied_calls.values()))
    deny_errno = _RET_ERRNO | errno.EPERM
    # Layout: [0] ld arch, [1] jeq arch, [2] ld nr, [3] jge x32, [4..] jeq denied...,
    # then the socket family check (4 insns: socket or socketpair -> load arg0 -> AF_UNIX or
    # deny), then ALLOW, DENY, KILL. Jumps are relative to the next insn.
    body: list[tuple[int, int, str | None, str | None]] = [
        (_LD_W_ABS, _OFF_ARCH, None, None),
        (_JEQ_K, _AUDIT_ARCH_X86_64, None, "kill"),
        (_LD_W_ABS, _OFF_NR, None, None),
        (_JGE_K, _X32_SYSCALL_BIT, "deny", None),
    ]
    body += [(_JEQ_K, nr, "deny", None) for nr in denied]
    body += [
        (_JEQ_K, _SYS_SOCKET_X86_64, "family", None),
        (_JEQ_K, _SYS_SOCKETPAIR_X86_64, None, "allow"),
        (_LD_W_ABS, _OFF_ARG0, None, None),
        (_JEQ_K, socket.AF_UNIX, "allow", "deny"),
    ]
    labels = {"family": len(body) - 2, "allow": len(body), "deny": len(body) + 1,
              "kill": len(body) + 2}
    program = bytearray()
    for index, (code, k, jt, jf) in enumerate(body):
        jt_off = labels[jt] - index - 1 if jt else 0
        jf_off = labels[jf] - index - 1 if jf else 0
        assert 0 <= jt_off < 256 and 0 <= jf_off < 256, "BPF jump out of range"
        program += _insn(code, k, jt_off, jf_off)
    program += _insn(_RET_K, _RET_ALLOW)
    program += _insn(_RET_K, deny_errno)
    program += _insn(_RET_K, _RET_KILL_PROCESS)
    return bytes(program)
