"""Run model-written Python confined by bubblewrap: one-shot runs and stateful sessions.

    box = Sandbox(SandboxLimits(wall_s=3.0))   # the operator's maximums; probes the host once
    res = box.run("print(1 + 1)")              # ExecResult(stdout="2\\n", error=ErrorKind.OK, ...)
    with box.session() as s:                   # one interpreter per trajectory
        s.run("x = 41"); s.run("x + 1")        # .stdout == "42\\n"
    with box.session(rpc=Rpc(handler)) as s:   # cells may call the host: handler(JSON) -> JSON
        s.run("import sandbox_host; print(sandbox_host.call([1, 2]))")

Design (reference/reliability.md §1.3; every point is backed by a SBX test):

* As root, the command line is `setpriv --pdeathsig` > `prlimit` (CPU, AS, FSIZE, NOFILE, NPROC,
  CORE=0) > `unshare --pid --mount` > `sh` (mounts one tmpfs sized in bytes and inodes, then
  `setpriv --reuid` to a per-run outside uid from a pool: never root, since RLIMIT_NPROC binds
  neither root nor a user namespace mapped to outside root) > `bwrap` (new user, PID, network,
  IPC, UTS namespaces; `--die-with-parent`, `--new-session`, `--disable-userns`, no
  capabilities, a cleared environment, read-only `/usr` = the interpreter and system libs and
  nothing else of the host) > `python3 -I`. Each helper execs the next: Popen is a vfork+exec,
  with no `preexec_fn` in a threaded parent.
* All the code can store is `tmpfs_bytes`, summed over every writable place: the one tmpfs is
  bound at `/tmp` (the working dir) and at `/dev/shm`; `/`, `/dev` (bwrap's own tmpfs, unsized)
  and `/sandbox` are read-only; `SandboxLimits.tmpfs_inodes` bounds the files (kernel memory,
  not bytes). A seccomp deny-list (`seccomp.py`) refuses memory outside any file system:
  `memfd_create`, System V IPC, POSIX message queues, and every call of a foreign ABI.
* A wall-clock deadline (from exec start, not from the admission queue) SIGKILLs the PID
  namespace that holds the whole sandbox: every descendant dies, `setsid`/double-fork escapes
  included, and all are reaped inside the tree, so no zombie reaches the host's PID 1.
* stdout/stderr are read concurrently with a byte cap (head and tail kept, decoded with
  `errors="replace"`); a flood past the cap kills the run (`output_limit`), never deadlocks.
* A session's cells may call back into the host (`rpc.py`): framed JSON requests on stdout,
  replies on the control channel, bounded in count and size per cell; no host resource enters
  the sandbox.

Modules: `limits` (records), `probe` (capabilities), `runner` (command line, spawn, kill, uid
pool), `capture` (byte caps, the pump), `box` (`Sandbox`), `session` (`SandboxSession` and its
in-sandbox server), `rpc` (host calls), `seccomp` (the deny-list).

Not enforced here: no seccomp allow-list (it needs a per-Python list: a second layer, not the
first) and no memory/pids cgroup (RLIMIT_AS and the per-uid RLIMIT_NPROC bound memory and
processes instead; `oom` is read from `MemoryError`/ENOMEM in the traceback). So the kernel's
socket and pipe buffers are bounded only through file descriptors: 56 MiB of socketpair
buffers per process at RLIMIT_NOFILE 256, times RLIMIT_NPROC. Not as root, there is no per-run
uid: no RLIMIT_NPROC (it would count this user's own processes), no outer PID namespace, so
bwrap's helper may be orphaned to PID 1 after a kill, and no mount of our own: `/tmp` and
`/dev/shm` are two bwrap tmpfs that split the bytes (15/16 and 1/16), with no bound on the
number of files; the probe says so. Each
process's uid pool starts at a random offset of the range; two processes sharing a range could,
rarely, share a uid (and so an NPROC budget).
"""

from steprl.envs.sandbox.box import Sandbox
from steprl.envs.sandbox.limits import ErrorKind, ExecResult, SandboxLimits, SandboxUnavailable
from steprl.envs.sandbox.probe import SandboxCapabilities, probe_capabilities
from steprl.envs.sandbox.rpc import Rpc, RpcError
from steprl.envs.sandbox.session import SandboxSession

__all__ = [
    "ErrorKind",
    "ExecResult",
    "Rpc",
    "RpcError",
    "Sandbox",
    "SandboxCapabilities",
    "SandboxLimits",
    "SandboxSession",
    "SandboxUnavailable",
    "probe_capabilities",
]
