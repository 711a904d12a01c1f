"""The sandbox on both backends: what runs, what is refused, what is contained.

Every case that makes sense for both backends runs on both; the isolation cases
(network, host files, /proc of the host) run on bubblewrap only, because the rlimit
fallback does not isolate by design (see the module docstring of `marlaas.envs.sandbox`).
"""

from __future__ import annotations

import ast
import asyncio
import logging
import os
import shutil
import socket
import tracemalloc
import uuid
from pathlib import Path

import pytest

from marlaas.envs import sandbox as sandbox_module
from marlaas.envs import sandbox_child
from marlaas.envs.sandbox import Sandbox, SandboxLimits, default_sandbox
from marlaas.errors import ConfigError, SandboxError

BWRAP_MISSING = "bubblewrap is not installed here (apt-get install bubblewrap)"


def _make(backend: str) -> Sandbox:
    """ "bwrap" with warm workers, "bwrap-cold" (a bwrap per call) or "rlimit"."""
    if backend.startswith("bwrap") and shutil.which("bwrap") is None:
        pytest.skip(BWRAP_MISSING)
    if backend == "bwrap-cold":
        return Sandbox(backend="bwrap", warm=False)
    return Sandbox(backend=backend)  # type: ignore[arg-type]


@pytest.fixture(params=["bwrap", "bwrap-cold", "rlimit"])
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return _make(request.param)


@pytest.fixture(params=["bwrap", "bwrap-cold"])
def bwrap(request: pytest.FixtureRequest) -> Sandbox:
    return _make(request.param)


@pytest.fixture
def warm() -> Sandbox:
    return _make("bwrap")


@pytest.fixture
def no_bwrap_on_path(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """bubblewrap looks uninstalled, and the once-per-process choices are made afresh."""
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox_module._bwrap_problem.cache_clear()
    sandbox_module._auto_backend.cache_clear()
    yield
    sandbox_module._bwrap_problem.cache_clear()
    sandbox_module._auto_backend.cache_clear()


def _live_pids_named(comm: str) -> list[int]:
    """Host pids of live (not zombie) processes whose name is `comm`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # not a process, or it just ended
            continue
        name, state = stat[stat.find("(") + 1 : stat.rfind(")")], stat[stat.rfind(")") + 2 :][:1]
        if name == comm and state != "Z":
            pids.append(int(entry))
    return pids


async def _ended(comm: str) -> list[int]:
    """`_live_pids_named(comm)` once it is empty, or after 10 s: the kernel finishes kills
    asynchronously, and a loaded machine may take a while to run a killed process's exit."""
    for _ in range(200):
        if not (live := _live_pids_named(comm)):
            return live
        await asyncio.sleep(0.05)
    return _live_pids_named(comm)


def _named(code: str) -> tuple[str, str]:
    """A fresh process name and `code` prefixed so that it renames its process to it, which
    lets the host find the program and everything it forks."""
    name = "mlsbx" + uuid.uuid4().hex[:8]
    rename = f"import ctypes\nctypes.CDLL(None).prctl(15, {name.encode()!r}, 0, 0, 0)\n"
    return name, rename + code


#: Every process forks for ever; at the process limit it waits and tries again.
FORK_BOMB = """\
import os, time
while True:
    try:
        os.fork()
    except OSError:
        time.sleep(0.05)
"""

#: 20 children that would outlive the program if nothing killed them.
FORK_CROWD = """\
import os, time
for _ in range(20):
    if os.fork() == 0:
        break
time.sleep(60)
"""


async def test_runs_a_program_with_stdin_stdout_stderr_and_a_private_cwd(sandbox: Sandbox) -> None:
    code = (
        "import sys\n"
        "text = sys.stdin.read()\n"
        "with open('scratch.txt', 'w') as f:\n"
        "    f.write(text.upper())\n"
        "print(open('scratch.txt').read())\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    result = await sandbox.run_python(code, stdin="hello sandbox")
    assert result.ok and result.returncode == 0 and result.reason is None
    assert result.stdout == "HELLO SANDBOX\n"
    assert result.stderr == "to stderr\n"
    assert not result.timed_out and not result.truncated


async def test_input_the_program_never_reads_does_not_block(sandbox: Sandbox) -> None:
    result = await sandbox.run_python("print('ignored my input')", stdin="x" * 4_000_000)
    assert result.ok and result.stdout == "ignored my input\n"


async def test_a_failing_program_is_a_result_not_an_exception(sandbox: Sandbox) -> None:
    result = await sandbox.run_python("raise ValueError('boom')")
    assert not result.ok
    assert result.returncode == 1 and result.reason == "exit code 1"
    assert "ValueError: boom" in result.stderr


async def test_sleeping_past_the_wall_clock_is_killed(sandbox: Sandbox) -> None:
    limits = SandboxLimits(wall_seconds=1.0)
    result = await sandbox.run_python(
        "import time\nprint('start', flush=True)\ntime.sleep(60)", limits=limits
    )
    assert not result.ok and result.timed_out and result.reason == "timeout"
    assert result.returncode is None
    assert result.stdout == "start\n"  # output written before the kill is kept
    assert 1.0 <= result.wall_s < 3.0


async def test_an_infinite_loop_is_stopped_by_the_cpu_or_wall_limit(sandbox: Sandbox) -> None:
    # On an idle machine RLIMIT_CPU fires after 1 s; on a loaded one the wall limit may win.
    limits = SandboxLimits(cpu_seconds=1.0, wall_seconds=3.0)
    result = await sandbox.run_python("while True:\n    pass", limits=limits)
    assert not result.ok
    assert result.reason in {"killed by signal SIGXCPU (cpu limit)", "timeout"}
    assert result.wall_s < 5.0


async def test_a_memory_bomb_fails_inside_the_sandbox(sandbox: Sandbox) -> None:
    result = await sandbox.run_python("block = bytearray(2 * 1024**3)\nprint('allocated')")
    assert not result.ok and result.reason == "exit code 1"
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


async def test_a_fork_bomb_is_contained_and_cleaned_up(sandbox: Sandbox) -> None:
    if sandbox.backend_name == "bwrap":
        limits = SandboxLimits(wall_seconds=2.0, max_processes=8)
        name, code = _named(FORK_BOMB)
    else:
        # The fallback's RLIMIT_NPROC does not bind root (and counts all of a user's
        # processes otherwise): a real bomb would reach the host, so run a bounded crowd
        # and check that the group kill at the wall limit leaves none of it behind.
        limits = SandboxLimits(wall_seconds=2.0, max_processes=10_000)
        name, code = _named(FORK_CROWD)
    run = asyncio.create_task(sandbox.run_python(code, limits=limits))
    peak = 0
    while not run.done():
        peak = max(peak, len(_live_pids_named(name)))
        await asyncio.sleep(0.05)
    result = run.result()
    assert result.timed_out and not result.ok
    assert result.wall_s < limits.wall_seconds + 2.0
    assert 2 <= peak <= min(limits.max_processes, 21)  # the host saw the crowd, bounded
    assert await _ended(name) == []


async def test_parent_environment_is_not_visible(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = "s3cret-" + uuid.uuid4().hex
    monkeypatch.setenv("MARLAAS_TEST_SECRET", secret)
    code = "import os\nprint(dict(os.environ))\n"
    if sandbox.backend_name == "bwrap":  # the fallback cannot hide /proc (documented)
        code += (
            f"for path in ('/proc/{os.getpid()}/environ', '/proc/1/environ'):\n"
            "    try:\n"
            "        print(path, open(path, 'rb').read())\n"
            "    except OSError as exc:\n"
            "        print(path, 'refused', type(exc).__name__)\n"
        )
    result = await sandbox.run_python(code)
    assert result.ok, result.stderr
    assert "PATH" in result.stdout  # the environment was printed ...
    assert "MARLAAS_TEST_SECRET" not in result.stdout and secret not in result.stdout
    assert secret not in result.stderr  # ... and holds no secret


async def test_huge_output_is_truncated_with_bounded_parent_memory(sandbox: Sandbox) -> None:
    code = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\n"
    tracemalloc.start()
    try:
        result = await sandbox.run_python(code)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.truncated and not result.ok and result.reason == "output limit"
    assert result.returncode is None and not result.timed_out
    assert result.stdout == "x" * sandbox.limits.output_bytes
    assert peak < 8 * 1024 * 1024  # 100 MB were printed; the parent held a few hundred KiB
    assert result.wall_s < 3.0


async def test_bwrap_has_no_network(bwrap: Sandbox) -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as exc:\n"
            "    print('refused', type(exc).__name__)\n"
        )
        result = await bwrap.run_python(code)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody reached the parent's listening socket
    assert result.ok and result.stdout.startswith("refused")


async def test_bwrap_keeps_host_files_out_of_reach(bwrap: Sandbox, tmp_path: Path) -> None:
    (tmp_path / "secret.txt").write_text("host secret")
    scratch = f"/tmp/marlaas-sandbox-{uuid.uuid4().hex}"
    attempts = [
        ("read", str(tmp_path / "secret.txt")),
        ("write", str(tmp_path / "escape.txt")),
        ("write", "/usr/escape.txt"),
        ("write", scratch),  # the sandbox's own /tmp: allowed, but never the host's
    ]
    code = f"attempts = {attempts!r}\n" + (
        "for mode, path in attempts:\n"
        "    try:\n"
        "        if mode == 'read':\n"
        "            print(mode, path, 'ok', open(path).read())\n"
        "        else:\n"
        "            open(path, 'w').write('x')\n"
        "            print(mode, path, 'ok')\n"
        "    except OSError as exc:\n"
        "        print(mode, path, 'refused', type(exc).__name__)\n"
    )
    result = await bwrap.run_python(code)
    assert result.ok, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[2] for line in lines] == ["refused", "refused", "refused", "ok"]
    assert "host secret" not in result.stdout
    assert not (tmp_path / "escape.txt").exists()
    assert not os.path.exists(scratch)  # the sandbox's /tmp is its own


async def test_bwrap_setup_failure_raises_sandbox_error(
    bwrap: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    mounts = sandbox_child._readonly_mounts
    broken = [*mounts(sandbox_child.base_python()), "--ro-bind", "/nonexistent-marlaas", "/mnt"]
    monkeypatch.setattr(sandbox_child, "_readonly_mounts", lambda python: broken)
    with pytest.raises(SandboxError, match="could not set up"):
        await bwrap.run_python("print('never runs')")


async def test_fallback_warns_once_with_the_fix(
    no_bwrap_on_path: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="marlaas.envs.sandbox"):
        first, second = Sandbox(), Sandbox()
    assert first.backend_name == second.backend_name == "rlimit"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "bwrap not found" in message and "apt-get install bubblewrap" in message
    assert (await first.run_python("print(2 + 2)")).stdout == "4\n"


def test_forcing_bwrap_where_it_cannot_run_raises(no_bwrap_on_path: None) -> None:
    with pytest.raises(SandboxError, match="apt-get install bubblewrap"):
        Sandbox(backend="bwrap")


def test_limits_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="wall_seconds"):
        SandboxLimits(wall_seconds=0)


def test_default_sandbox_is_shared() -> None:
    assert default_sandbox() is default_sandbox()
    assert default_sandbox().backend_name in {"bwrap", "rlimit"}


async def test_bwrap_concurrent_runs_each_get_their_own_process_budget(bwrap: Sandbox) -> None:
    limits = SandboxLimits(max_processes=6)
    code = (
        "import os, time\n"
        "forked = 0\n"
        "for _ in range(5):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(0.5)\n"
        "            os._exit(0)\n"
        "        forked += 1\n"
        "    except OSError:\n"
        "        pass\n"
        "print('forked', forked)\n"
    )
    results = await asyncio.gather(*(bwrap.run_python(code, limits=limits) for _ in range(4)))
    assert [r.stdout for r in results] == ["forked 5\n"] * 4


async def test_cancelling_a_run_kills_the_program(sandbox: Sandbox) -> None:
    name, code = _named("import time\ntime.sleep(60)\n")
    run = asyncio.create_task(sandbox.run_python(code, limits=SandboxLimits(wall_seconds=30)))
    for _ in range(100):
        if _live_pids_named(name):
            break
        await asyncio.sleep(0.02)
    assert _live_pids_named(name), "the program never started"
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert await _ended(name) == []


async def test_runs_leak_no_file_descriptors(sandbox: Sandbox) -> None:
    await sandbox.run_python("print(1)")  # warm up lazily opened descriptors
    sandbox.close()  # an idle warm worker holds one (its socket) until closed
    before = len(os.listdir("/proc/self/fd"))
    for code in ("print(1)", "raise SystemExit(3)", "print('x' * 200_000)", "print(2)"):
        await sandbox.run_python(code)
    sandbox.close()
    assert len(os.listdir("/proc/self/fd")) == before


#: The names a ``python main.py`` program finds in its globals before its first line.
SCRIPT_GLOBALS = ["__name__", "__doc__", "__package__", "__loader__", "__spec__",
                  "__annotations__", "__builtins__", "__file__", "__cached__"]  # fmt: skip


async def test_the_program_runs_as_a_main_script_with_fresh_globals(sandbox: Sandbox) -> None:
    # The bootstrap runs the program in its own interpreter: none of its names may leak.
    code = (
        "import sys\n"
        "import __main__\n"
        "print(list(globals())[:-2])\n"  # less sys and __main__, imported above
        "print(__name__, __file__, sys.argv, __main__.__dict__ is globals(), __spec__)\n"
        "for name in ('cpu', 'mem', 'nproc', 'fsize', 'drop', 'main', 'r', 'os', 'program'):\n"
        "    try:\n"
        "        eval(name)\n"
        "        print('leaked', name)\n"
        "    except NameError:\n"
        "        pass\n"
    )
    result = await sandbox.run_python(code)
    assert result.ok, result.stderr
    names, facts = result.stdout.splitlines()
    assert names == repr(SCRIPT_GLOBALS)
    name, path, argv, is_main_module, spec = facts.split(" ", 4)
    assert name == "__main__" and path.endswith("/main.py") and os.path.isabs(path)
    assert argv == repr([path]) and is_main_module == "True" and spec == "None"


async def test_a_traceback_names_the_program_and_not_the_bootstrap(sandbox: Sandbox) -> None:
    code = "def boom():\n    raise ValueError('boom')\n\n\nboom()\n"
    result = await sandbox.run_python(code)
    assert result.returncode == 1 and result.reason == "exit code 1"
    lines = result.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1] == "ValueError: boom"
    frames = [line.strip() for line in lines if line.lstrip().startswith("File ")]
    assert len(frames) == 2, result.stderr
    assert frames[0].startswith('File "') and frames[0].endswith('main.py", line 5, in <module>')
    assert frames[1].endswith('main.py", line 2, in boom')
    assert "<string>" not in result.stderr


async def test_exit_statuses_are_a_scripts(sandbox: Sandbox) -> None:
    exited = await sandbox.run_python("import sys\nprint('out')\nsys.exit(3)")
    assert exited.returncode == 3 and exited.stdout == "out\n" and exited.stderr == ""
    message = await sandbox.run_python("raise SystemExit('bye')")
    assert message.returncode == 1 and message.stderr == "bye\n"
    syntax = await sandbox.run_python("x = 1\ndef (\n")
    assert syntax.returncode == 1 and "Traceback" not in syntax.stderr
    assert 'main.py", line 2' in syntax.stderr and "SyntaxError" in syntax.stderr
    hooked = await sandbox.run_python(
        "import sys\n"
        "sys.excepthook = lambda t, v, tb: print(t.__name__, tb.tb_frame.f_code.co_filename)\n"
        "1 / 0\n"
    )
    assert hooked.returncode == 1 and hooked.stderr == ""
    kind, filename = hooked.stdout.split()
    assert kind == "ZeroDivisionError" and filename.endswith("/main.py")
    interrupted = await sandbox.run_python("raise KeyboardInterrupt")
    assert interrupted.returncode == -2 and "KeyboardInterrupt" in interrupted.stderr


async def test_the_limits_are_set_before_the_program_runs(sandbox: Sandbox) -> None:
    limits = SandboxLimits(cpu_seconds=1.5, memory_bytes=300 * 1024**2, max_processes=7,
                           file_size_bytes=4096)  # fmt: skip
    code = (
        "import resource as r\n"
        "print([r.getrlimit(getattr(r, 'RLIMIT_' + name))\n"
        "       for name in ('CPU', 'AS', 'NPROC', 'FSIZE', 'CORE')])\n"
    )
    result = await sandbox.run_python(code, limits=limits)
    assert result.ok, result.stderr
    expected = [(2, 3), (300 * 1024**2,) * 2, (7, 7), (4096, 4096), (0, 0)]
    assert result.stdout == f"{expected}\n"


async def test_bwrap_program_runs_as_nobody_without_capabilities(bwrap: Sandbox) -> None:
    # As root the bootstrap's own user namespace grants every capability in it; the program
    # (no longer exec'd, which cleared them) must start without any.
    code = (
        "for line in open('/proc/self/status'):\n"
        "    if line.split(':')[0] in {'Uid', 'Gid', 'CapInh', 'CapPrm', 'CapEff', 'CapAmb'}:\n"
        "        print(*line.split()[:2])\n"
    )
    result = await bwrap.run_python(code)
    assert result.ok, result.stderr
    status = dict(line.split() for line in result.stdout.splitlines())
    assert status == {"Uid:": "65534", "Gid:": "65534", "CapInh:": "0" * 16,
                      "CapPrm:": "0" * 16, "CapEff:": "0" * 16, "CapAmb:": "0" * 16}  # fmt: skip


async def test_a_warm_worker_serves_calls_one_after_another(warm: Sandbox) -> None:
    results = [await warm.run_python(f"print({i})") for i in range(5)]
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(5)]
    assert warm.workers_started == 1
    cold = Sandbox(backend="bwrap", warm=False)
    assert (await cold.run_python("print(1)")).ok and cold.workers_started == 0


#: Leaves what a later call in the same worker could find: a file in /tmp, a SysV shared
#: memory segment, and a process that outlives the program.
LEAVE_BEHIND = """import ctypes, os, time
open("/tmp/left.txt", "w").write("secret of the first call")
libc = ctypes.CDLL(None)
print("shm", libc.shmget(0, 4096, 0o1000 | 0o600) >= 0)  # IPC_PRIVATE, IPC_CREAT
if os.fork() == 0:
    os.setsid()
    time.sleep(60)
    os._exit(0)
print("left")
"""

#: What a call finds: /tmp, the shared memory segments of its IPC namespace, and the
#: processes of its pid namespace with their names.
LOOK_AROUND = """import os
print(sorted(os.listdir("/tmp")))
print(len(open("/proc/sysvipc/shm").read().splitlines()) - 1)
names = []
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    names.append(open(f"/proc/{pid}/stat").read().split(" ")[1])
print(names)
"""


async def test_a_call_leaves_nothing_for_the_next_in_its_worker(warm: Sandbox) -> None:
    name, code = _named(LEAVE_BEHIND)
    first = await warm.run_python(code)
    assert first.ok and first.stdout == "shm True\nleft\n", first.stderr
    second = await warm.run_python(LOOK_AROUND)
    assert second.ok, second.stderr
    assert warm.workers_started == 1  # the same worker served both
    files, segments, processes = second.stdout.splitlines()
    assert files == "['main.py']" and segments == "0"
    # bwrap's init, the worker and this program: the first call's process is gone
    assert len(ast.literal_eval(processes)) == 3 and name not in processes
    assert _live_pids_named(name) == []


async def test_a_worker_that_cannot_isolate_calls_gives_way_to_cold_calls(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip(BWRAP_MISSING)
    flags = "0x10000000 | 0x00020000 | 0x08000000"
    assert flags in sandbox_child.WORKER
    # An invalid unshare flag: the call's setup fails before any of the program runs.
    monkeypatch.setattr(sandbox_child, "WORKER", sandbox_child.WORKER.replace(flags, "1"))
    sandbox = Sandbox(backend="bwrap")
    with caplog.at_level(logging.WARNING, logger="marlaas.envs.sandbox"):
        results = [await sandbox.run_python("print(input())", stdin=f"{i}\n") for i in range(2)]
    assert [r.stdout for r in results] == ["0\n", "1\n"]  # both ran, cold, with their input
    warnings = [r for r in caplog.records if "warm workers unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "unshare" in warnings[0].getMessage()


async def test_calls_beyond_the_workers_wait_for_one_outside_their_wall_clock() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip(BWRAP_MISSING)
    sandbox = Sandbox(backend="bwrap", workers=2)
    limits = SandboxLimits(wall_seconds=1.0)
    code = "import time\ntime.sleep(0.3)\nprint('done')\n"
    results = await asyncio.gather(*(sandbox.run_python(code, limits=limits) for _ in range(8)))
    # 8 calls x 0.3 s on 2 workers take ~1.2 s: each call's clock starts at its worker
    assert all(r.ok and r.stdout == "done\n" and r.wall_s < 1.0 for r in results), results
    assert sandbox.workers_started == 2
    with pytest.raises(ConfigError, match="workers"):
        Sandbox(backend="bwrap", workers=0)


async def test_warm_calls_draw_their_own_randomness(warm: Sandbox) -> None:
    code = "import random, sys\nprint(random.random())\n"
    first, second = [await warm.run_python(code) for _ in range(2)]
    assert first.ok and second.ok and first.stdout != second.stdout
    assert warm.workers_started == 1


async def test_a_program_can_neither_read_nor_stop_its_worker_unnoticed(warm: Sandbox) -> None:
    code = (
        "import os\n"
        "try:\n"
        "    open(f'/proc/{os.getppid()}/mem', 'rb').read(1)\n"
        "    print('read the worker')\n"
        "except OSError as exc:\n"
        "    print('refused', type(exc).__name__)\n"
        "try:\n"
        "    os.kill(os.getppid(), 9)\n"
        "except OSError as exc:\n"
        "    print('refused', type(exc).__name__)\n"
    )
    result = await warm.run_python(code)
    assert "read the worker" not in result.stdout
    # As root the worker is another uid: the kill is refused. Otherwise it succeeds, and the
    # call ends as one whose worker died; either way the next call gets a working worker.
    assert (result.ok and result.stdout.count("refused") == 2) or (
        result.reason == "sandbox worker died" and not result.ok
    ), result
    assert (await warm.run_python("print('next')")).stdout == "next\n"


def test_the_sandbox_bench_measures_each_backend_side_by_side(tmp_path: Path) -> None:
    from marlaas.envs.bench import run_sandbox_bench

    if shutil.which("bwrap") is None:
        pytest.skip(BWRAP_MISSING)
    result = run_sandbox_bench(calls=3, json_path=tmp_path / "sandbox.json")
    rows = {row["backend"]: row for row in result["rows"]}
    assert list(rows) == ["bwrap", "bwrap cold", "rlimit"]
    # /proc/stat counts in ticks of 10 ms: three warm calls may fit in none
    assert all(row["available"] and row["mean_ms"] > 0 for row in rows.values())
    assert all(row["machine_cpu_ms"] >= 0 for row in rows.values())
    assert (tmp_path / "sandbox.json").exists()
