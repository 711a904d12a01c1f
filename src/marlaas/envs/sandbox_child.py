"""What the sandbox starts (`marlaas.envs.sandbox`): the child's command line, under
bubblewrap or as a plain interpreter, and the bootstrap program it runs first, which sets
the limits, drops privileges and then runs the model's program in the same interpreter.
The isolation and limits each gives are described in the sandbox's module docstring."""

from __future__ import annotations

import math
import os
import shutil
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from marlaas.errors import SandboxError

if TYPE_CHECKING:
    from marlaas.envs.sandbox_call import SandboxLimits

MiB = 1 << 20
#: The unprivileged uid and gid the program runs as under bwrap.
NOBODY = 65534
#: Where the program's source lies inside the bwrap sandbox.
SANDBOX_MAIN = "/tmp/main.py"
PYTHON_FLAGS = ["-I", "-S", "-B", "-X", "utf8"]

#: The drop of a one-off bootstrap run by bwrap as root (`BOOTSTRAP`, argv drop == "1"): it
#: becomes NOBODY and enters a user namespace of its own that maps NOBODY to itself, so
#: RLIMIT_NPROC counts this sandbox only (where the kernel refuses that namespace, the count
#: covers every uid-65534 process of the host). Entering it grants every capability inside
#: it, which an exec as NOBODY would clear and none does now: capset clears them, and the
#: process is made dumpable again (as an exec leaves it), so that its /proc/self stays
#: readable to it.
_DROP = f"""\
if drop == "1":
    import ctypes
    os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE, so that we may write our own maps
    if libc.unshare(0x10000000) == 0:  # CLONE_NEWUSER
        for path, text in (("self/setgroups", "deny"), ("self/uid_map", "{NOBODY} {NOBODY} 1"),
                           ("self/gid_map", "{NOBODY} {NOBODY} 1"),
                           ("sys/user/max_user_namespaces", "0")):
            with open("/proc/" + path, "w") as f:
                f.write(text)
        # _LINUX_CAPABILITY_VERSION_3, this process; no effective, permitted, inheritable
        if libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()) != 0:
            raise OSError(ctypes.get_errno(), "capset")
        libc.prctl(4, 1, 0, 0, 0)  # new credentials may have cleared it
"""

#: Sets the limits (`cpu`, `mem`, `nproc`, `fsize`) and runs the program at `main` as
#: ``python <flags> main`` would run it: a fresh ``__main__`` module (the globals and loader
#: such a program has), sys.argv == [main], and an uncaught exception printed by
#: sys.excepthook without this frame, exit 1 (a KeyboardInterrupt re-raised, so that the
#: interpreter exits by SIGINT as it does). The tail of both `BOOTSTRAP` and `WORKER`.
_RUN = f"""\
for res, value in ((r.RLIMIT_CORE, 0), (r.RLIMIT_AS, int(mem)), (r.RLIMIT_FSIZE, int(fsize)),
                   (r.RLIMIT_NPROC, int(nproc))):
    r.setrlimit(res, (value, value))
r.setrlimit(r.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
sys.argv, sys.orig_argv = [main], [sys.executable, *{PYTHON_FLAGS!r}, main]
program = type(sys)("__main__")
vars(program).update(__annotations__=dict(), __builtins__=__builtins__, __file__=main,
                     __cached__=None)
program.__loader__ = sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", main)
sys.modules["__main__"] = program
try:
    with open(main, "rb") as f:
        code = compile(f.read(), main, "exec", dont_inherit=True)
    exec(code, vars(program))
except SystemExit:
    raise
except BaseException as exc:
    exc.__traceback__ = tb = exc.__traceback__.tb_next  # without this bootstrap's frame
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    hook = getattr(sys, "excepthook", None)
    try:
        if hook is None:
            sys.stderr.write("sys.excepthook is missing\\n")
            sys.__excepthook__(type(exc), exc, tb)
        else:
            hook(type(exc), exc, tb)
    except SystemExit:
        raise
    except BaseException as error:  # as the interpreter reports a failing excepthook
        error.__context__, error.__traceback__ = None, error.__traceback__.tb_next
        sys.stderr.write("Error in sys.excepthook:\\n")
        sys.__excepthook__(type(error), error, error.__traceback__)
        sys.stderr.write("\\nOriginal exception was:\\n")
        sys.__excepthook__(type(exc), exc, tb)
    if isinstance(exc, KeyboardInterrupt):
        sys.excepthook = lambda *args: None  # printed already
        raise
    raise SystemExit(1) from None
"""

#: Runs in the child and then runs the program in the same interpreter (one interpreter start
#: per call; see `marlaas.envs.sandbox`); argv: cpu, memory, nproc, fsize, drop, main.
BOOTSTRAP = (
    "import os, resource as r, sys\ncpu, mem, nproc, fsize, drop, main = sys.argv[1:]\n"
    + _DROP
    + _RUN
)

#: Standard-library modules a warm worker imports once, so that its calls find them loaded
#: (a fresh interpreter takes ~12 ms of CPU to import ast, json and fractions). Only modules
#: without per-process random state: a forked call must not share the worker's (random,
#: tempfile and uuid are imported by the program itself, seeded afresh).
WARM_MODULES = ("ast", "bisect", "collections", "fractions", "functools", "heapq",
                "itertools", "json", "math", "re", "string")  # fmt: skip

#: A warm sandbox worker (`marlaas.envs.sandbox`, backend bwrap): started once under bwrap
#: (argv: the fd of its end of a unix socket), it serves one call at a time. Per call the
#: parent sends a JSON header [cpu, memory, nproc, fsize, tmp size] with four descriptors
#: (program source, stdin, stdout, stderr); the worker forks a child that, before anything
#: of the program runs, becomes NOBODY (if root), enters new user, mount and IPC namespaces
#: of its own (uid NOBODY mapped to itself, no nested user namespaces), mounts a fresh
#: size-capped tmpfs at /tmp with the source read-only at SANDBOX_MAIN, drops every
#: capability and leaves the worker's loop to run the program as `_RUN` does. The worker
#: itself never reads a call's source, input or output. After the program exits, the
#: worker (a child subreaper, not dumpable: a program can neither trace it nor read its
#: memory) kills every other process of its pid namespace, reaps them, and answers
#: {"status": wait status, "setup": ""} or, where the child could not set up,
#: {"setup": why}. It exits at EOF, or when the sweep cannot finish: the parent then sees
#: EOF and retires it.
WORKER = f"""\
import atexit, ctypes, fcntl, gc, json, os, resource as r, socket, sys, time
import {", ".join(WARM_MODULES)}
libc = ctypes.CDLL(None, use_errno=True)
sock = socket.socket(fileno=int(sys.argv[1]))
root = os.geteuid() == 0
def check(ok, what):
    if not ok:
        raise OSError(ctypes.get_errno(), what)
check(libc.prctl(36, 1, 0, 0, 0) == 0, "PR_SET_CHILD_SUBREAPER")
check(libc.prctl(4, 0, 0, 0, 0) == 0, "PR_SET_DUMPABLE")
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
os.close(null)
gc.freeze()  # the worker's objects: never collected again, nor copied by a call's collections
sock.sendall(b'{{"ready": true}}\\n')
while True:
    try:
        header, fds, _, _ = socket.recv_fds(sock, 4096, 4)
    except OSError:
        os._exit(0)
    if not header or len(fds) != 4:
        os._exit(0)
    cpu, mem, nproc, fsize, tmp_size = json.loads(header)
    setup_r, setup_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            # stdin, stdout, stderr, the setup pipe, the source: first above every target
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 8) for fd in (*fds[1:], setup_w, fds[0])]
            for target, fd in enumerate(high):
                os.dup2(fd, target)
            os.closerange(5, 1 << 20)
            if root:
                os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY})
            check(libc.prctl(4, 1, 0, 0, 0) == 0, "PR_SET_DUMPABLE")  # to write our maps
            # CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWIPC
            check(libc.unshare(0x10000000 | 0x00020000 | 0x08000000) == 0, "unshare")
            for path, text in (("self/setgroups", "deny"), ("self/uid_map", "{NOBODY} {NOBODY} 1"),
                               ("self/gid_map", "{NOBODY} {NOBODY} 1"),
                               ("sys/user/max_user_namespaces", "0")):
                with open("/proc/" + path, "w") as f:
                    f.write(text)
            # MS_NOSUID | MS_NODEV; then MS_BIND, and a read-only remount of the bind
            check(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 2 | 4,
                             b"size=%d,mode=1777" % tmp_size) == 0, "mount /tmp")
            main = {SANDBOX_MAIN!r}
            with open(main, "wb") as f:
                while chunk := os.read(4, 1 << 16):
                    f.write(chunk)
            os.close(4)
            os.chmod(main, 0o444)
            check(libc.mount(main.encode(), main.encode(), None, 4096, None) == 0, "bind")
            check(libc.mount(None, main.encode(), None, 4096 | 32 | 1 | 2 | 4, None) == 0,
                  "read-only " + main)
            os.chdir("/tmp")
            # _LINUX_CAPABILITY_VERSION_3, this process; no effective, permitted, inheritable
            check(libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0),
                              (ctypes.c_uint32 * 6)()) == 0, "capset")
            check(libc.prctl(4, 1, 0, 0, 0) == 0, "PR_SET_DUMPABLE")
        except BaseException as exc:
            os.write(3, repr(exc).encode() or b"?")
            os._exit(127)
        os.close(3)
        break
    for fd in (*fds, setup_w):
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    setup = b""
    while chunk := os.read(setup_r, 4096):
        setup += chunk
    os.close(setup_r)
    deadline = time.monotonic() + 2.0
    while True:  # every process the call left: killed, then reaped (a subreaper's)
        try:
            os.kill(-1, 9)
        except ProcessLookupError:
            break
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if time.monotonic() > deadline:
            os._exit(0)
        time.sleep(0.0005)
    reply = {{"setup": setup.decode(errors="replace")}} if setup else {{"status": status}}
    sock.sendall(json.dumps(reply).encode() + b"\\n")
interrupted, status = False, 0
try:
{textwrap.indent(_RUN, "    ")}
except SystemExit as exc:  # the interpreter's handling of an uncaught SystemExit
    if exc.code is None or isinstance(exc.code, int):
        status = exc.code or 0
    else:
        try:
            sys.stderr.write(str(exc.code) + "\\n")
        except BaseException:
            pass
        status = 1
except KeyboardInterrupt:  # printed by _RUN already; the interpreter exits by SIGINT
    interrupted = True
# The interpreter's exit without its teardown of every module and object (~4 ms a call in
# a forked worker): the threads it waits for, the atexit callbacks, the flushed streams.
if "threading" in sys.modules:
    sys.modules["threading"]._shutdown()
atexit._run_exitfuncs()
for stream in (sys.stdout, sys.stderr):
    try:
        stream.flush()
    except BaseException:
        status = status or 120
if interrupted:
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
os._exit(status & 0xFF)
"""


def rlimit_values(limits: SandboxLimits) -> tuple[int, int, int, int]:
    """What the child sets: CPU seconds (whole, at least 1), address space, processes,
    file size."""
    cpu = max(1, math.ceil(limits.cpu_seconds))
    return cpu, limits.memory_bytes, limits.max_processes, limits.file_size_bytes


def bootstrap_args(limits: SandboxLimits, *, drop: bool, main: str) -> list[str]:
    numbers = rlimit_values(limits)
    return [*PYTHON_FLAGS, "-c", BOOTSTRAP, *map(str, numbers), str(int(drop)), main]


def child_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


def base_python() -> str:
    """The real interpreter behind this one (a venv's python links to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def bwrap_argv(code_fd: int, status_fd: int, code_len: int, limits: SandboxLimits) -> list[str]:
    """The bwrap command line running the program in `code_fd` ("/tmp/main.py" inside)."""
    privileged = os.geteuid() == 0
    tmp_size = limits.tmp_bytes(code_len)
    argv = _bwrap(privileged, nested_users=False)
    argv += ["--json-status-fd", str(status_fd), "--perms", "1777", "--size", str(tmp_size),
             "--tmpfs", "/tmp", "--perms", "0444", "--file", str(code_fd), SANDBOX_MAIN,
             "--chdir", "/tmp", "--", base_python()]  # fmt: skip
    return argv + bootstrap_args(limits, drop=privileged, main=SANDBOX_MAIN)


def worker_argv(sock_fd: int) -> list[str]:
    """The bwrap command line of a warm worker (`WORKER`) serving calls on `sock_fd`. Its
    calls make their own user namespaces (where they mount their own /tmp), so nested
    ones are not disabled here but by each call inside its own; as root the worker keeps
    CAP_KILL, which its sweep needs for the calls' NOBODY processes (its pid namespace
    holds nothing else)."""
    privileged = os.geteuid() == 0
    argv = _bwrap(privileged, nested_users=True)
    if privileged:
        argv += ["--cap-add", "CAP_KILL"]
    argv += ["--size", str(MiB), "--tmpfs", "/tmp", "--chdir", "/", "--", base_python()]
    return [*argv, *PYTHON_FLAGS, "-c", WORKER, str(sock_fd)]


def _bwrap(privileged: bool, *, nested_users: bool) -> list[str]:
    """The isolation and read-only mounts every sandbox process starts under (up to /tmp)."""
    # Not --unshare-all: as root it adds a user namespace that maps 65534 to host root.
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-ipc", "--unshare-pid",
            "--unshare-net", "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent",
            "--new-session", "--clearenv"]  # fmt: skip
    if privileged:
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]
        argv += [] if nested_users else ["--disable-userns"]
        argv += ["--cap-drop", "ALL"]
    for name, value in child_env("/tmp").items():
        argv += ["--setenv", name, value]
    return [*argv, *_readonly_mounts(base_python()), "--proc", "/proc", "--dev", "/dev"]


def _readonly_mounts(python: str) -> list[str]:
    """bwrap arguments for a read-only root of /usr, the top-level links and Python."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    if os.path.commonpath([prefix, "/usr"]) != "/usr":
        # bwrap would create the mount point's parents as 0700 root: uid 65534 could not pass.
        for parent in reversed(Path(prefix).parents[:-1]):
            argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", prefix, prefix]
    if not any(os.path.commonpath([python, root]) == root for root in (prefix, "/usr")):
        raise SandboxError(f"the interpreter {python} lies outside {prefix} and /usr")
    return argv
