"""What the sandbox starts (`marlaas.envs.sandbox`): the child's command line, under
bubblewrap or as a plain interpreter, and the bootstrap program it runs first, which sets
the limits, drops privileges and then runs the model's program in the same interpreter.
The isolation and limits each gives are described in the sandbox's module docstring."""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from marlaas.errors import SandboxError

if TYPE_CHECKING:
    from marlaas.envs.sandbox import SandboxLimits

MiB = 1 << 20
#: The unprivileged uid and gid the program runs as under bwrap.
NOBODY = 65534
#: Where the program's source lies inside the bwrap sandbox.
SANDBOX_MAIN = "/tmp/main.py"
PYTHON_FLAGS = ["-I", "-S", "-B", "-X", "utf8"]

#: Runs in the child and then runs the program in the same interpreter (one interpreter start
#: per call; see `marlaas.envs.sandbox`); argv: cpu, memory, nproc, fsize, drop, main.
#: With drop == "1" (bwrap ran as root) it becomes NOBODY and enters a user namespace of its
#: own that maps NOBODY to itself, so RLIMIT_NPROC counts this sandbox only (where the
#: kernel refuses that namespace, the count covers every uid-65534 process of the host).
#: Entering it grants every capability inside it, which an exec as NOBODY would clear and
#: none does now: capset clears them, and the process is made dumpable again (as an exec
#: leaves it), so that its /proc/self stays readable to it. Then the program runs as
#: ``python <flags> main`` would run it: a fresh ``__main__`` module (the globals and loader
#: such a program has), sys.argv == [main], and an uncaught exception printed by
#: sys.excepthook without this frame, exit 1 (a KeyboardInterrupt re-raised, so that the
#: interpreter exits by SIGINT as it does).
BOOTSTRAP = f"""\
import os, resource as r, sys
cpu, mem, nproc, fsize, drop, main = sys.argv[1:]
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


def bootstrap_args(limits: SandboxLimits, *, drop: bool, main: str) -> list[str]:
    cpu = max(1, math.ceil(limits.cpu_seconds))
    numbers = (cpu, limits.memory_bytes, limits.max_processes, limits.file_size_bytes)
    return [*PYTHON_FLAGS, "-c", BOOTSTRAP, *map(str, numbers), str(int(drop)), main]


def child_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


def base_python() -> str:
    """The real interpreter behind this one (a venv's python links to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", sys.executable))


def bwrap_argv(code_fd: int, status_fd: int, code_len: int, limits: SandboxLimits) -> list[str]:
    """The bwrap command line running the program in `code_fd` ("/tmp/main.py" inside)."""
    python, bwrap = base_python(), shutil.which("bwrap") or "bwrap"
    privileged = os.geteuid() == 0
    # Not --unshare-all: as root it adds a user namespace that maps 65534 to host root.
    argv = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv",
            "--json-status-fd", str(status_fd)]  # fmt: skip
    if privileged:
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY),
                 "--disable-userns", "--cap-drop", "ALL"]  # fmt: skip
    for name, value in child_env("/tmp").items():
        argv += ["--setenv", name, value]
    tmp_size = code_len + 8 * limits.file_size_bytes + MiB
    argv += [*_readonly_mounts(python), "--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(tmp_size), "--tmpfs", "/tmp",
             "--perms", "0444", "--file", str(code_fd), SANDBOX_MAIN, "--chdir", "/tmp",
             "--", python]  # fmt: skip
    return argv + bootstrap_args(limits, drop=privileged, main=SANDBOX_MAIN)


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
