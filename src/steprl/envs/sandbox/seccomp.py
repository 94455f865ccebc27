"""A small seccomp filter: the system calls that make memory no file system bound refuse (EPERM).

Everything model code writes to a file system lands in the sandbox's one sized tmpfs (see
`runner`). These calls make memory outside it: `memfd_create` an anonymous file (16 MiB each
under RLIMIT_FSIZE, 256 per process under RLIMIT_NOFILE, 64 processes: 256 GiB), System V
`shmget`/`msgget`/`semget` segments, queues and semaphore sets that outlive the process that
made them, POSIX `mq_open` queues. Python's own modules need none of them (multiprocessing's
semaphores and arenas live in /dev/shm, which is the sized tmpfs). Every system call of a
foreign ABI (i386 or x32 code on x86_64, arm32 on aarch64: reachable through ctypes) is refused
too, so the numbers below cannot be dodged.

A deny-list, not an allow-list: the first layer is the namespaces and limits, this is one hole
closed (see the package docstring).
"""

from __future__ import annotations

import errno
import platform
import struct

_ARCH_OFFSET, _NR_OFFSET = 4, 0  # in struct seccomp_data
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, ..|JGE|K, BPF_RET|K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno
_X32 = 0x40000000  # x86_64's x32 ABI: the same numbers with this bit set

# machine -> (AUDIT_ARCH_*, numbers of memfd_create, memfd_secret, shmget, msgget, semget, mq_open)
_TABLES = {
    "x86_64": (0xC000003E, (319, 447, 29, 68, 64, 240)),
    "aarch64": (0xC00000B7, (279, 447, 194, 186, 190, 180)),
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)  # struct sock_filter


def deny_filter(machine: str | None = None) -> bytes | None:
    """The compiled BPF program for bwrap's `--seccomp FD`, or None on a machine not listed."""
    machine = machine or platform.machine()
    if machine not in _TABLES:
        return None
    arch, numbers = _TABLES[machine]
    refuse = _ERRNO | errno.EPERM
    prog = [_op(_LD_ABS, _ARCH_OFFSET), _op(_JEQ, arch, jt=1), _op(_RET, refuse), _op(_LD_ABS, _NR_OFFSET)]
    if machine == "x86_64":
        prog.append(_op(_JGE, _X32, jt=len(numbers) + 1))  # past the checks and ALLOW: refuse
    prog += [_op(_JEQ, nr, jt=len(numbers) - i) for i, nr in enumerate(numbers)]
    prog += [_op(_RET, _ALLOW), _op(_RET, refuse)]
    return b"".join(prog)
