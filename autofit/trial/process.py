"""The trial child's life and death: its work dir, its start, its end, what it leaves.

A subprocess trial (``autofit.trial.runner``) writes its payload (a pickled copy of
the user's model) in a work dir ``<tmp>/autofit-trial-<parent pid>-<random>`` and
starts ``python -m autofit.trial.child WORKDIR PARENT_PID``. Nothing may outlive
the parent, however it ends:

- the parent removes the work dir on every exit path (``workdir``, a context
  manager) and kills the child with its process group on every exit path
  (``stop``, from a ``finally``: a timeout, Ctrl-C, SIGTERM handled by the CLI);
- the child runs in a session (process group) of its own, so a terminal's Ctrl-C
  reaches the parent only, which then stops the child itself;
- the parent may die without a ``finally`` (``kill -9``, SIGTERM to a script that
  does not handle it): the child then gets ``PARENT_DEATH_SIGNAL`` from the kernel
  (Linux ``prctl(PR_SET_PDEATHSIG)``) and, as a fallback (other systems; a parent
  gone before the request), polls ``os.getppid()``; either way it removes its work
  dir and exits with its group (``guard_parent``, set up before torch is imported);
- work dirs whose owner is dead are removed at the next start (``sweep``).

A CPU trial child may instead be forked by the trial server
(``autofit.trial.server``), itself a child of the parent: the child then guards
against the server's death (``guard_parent(work, server_pid, owner_pid=parent)``)
and removes its work dir only when the parent is gone too; the server dies with
the parent, taking its running child and that child's work dir along.

    >>> from autofit.trial.process import describe_signal
    >>> describe_signal(9)
    'SIGKILL (signal 9)'

Known limitations:
    NB: the child's clean-up runs Python code (a signal handler in the main thread,
    the polling thread otherwise); a C call that holds the GIL for long delays it.
    NB: a work dir named the old way (no pid) is never swept: its owner is unknown.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType
    from typing import IO

__all__ = [
    "OUTSIDE_SIGNALS",
    "child_env",
    "PARENT_DEATH_SIGNAL",
    "PREFIX",
    "describe_signal",
    "guard_parent",
    "killed_by",
    "pid_alive",
    "start",
    "stop",
    "sweep",
    "workdir",
]

PREFIX = "autofit-trial-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-")
# Sent by the kernel to the child when its parent dies. Not SIGTERM, which keeps its
# default action (die at once) for whoever else sends it; not SIGKILL, which would
# leave no chance to remove the work dir.
PARENT_DEATH_SIGNAL = getattr(signal, "SIGUSR2", None)  # None: not a POSIX system
PARENT_POLL_S = 0.5  # the fallback's period: the child dies within about this long
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# A live owner started before its dir last changed (it made the dir, then the child
# wrote in it); a process holding the pid that started this much later is another one.
# Seconds: the boot time's 1 s resolution and a wall clock stepped while trials ran.
REUSED_AFTER_S = 60.0

# Signals that end a process only when something outside it sends them: the host's
# out-of-memory killer (SIGKILL), a user, a scheduler. A child dying of one of these
# says nothing about the trial's memory (SIGABRT, SIGSEGV... are the child's own).
OUTSIDE_SIGNALS = frozenset(
    getattr(signal, name) for name in ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP")
    if hasattr(signal, name)
)


def describe_signal(signum: int) -> str:
    """``'SIGKILL (signal 9)'``: a signal's name and number."""
    try:
        return f"{signal.Signals(signum).name} (signal {signum})"
    except ValueError:
        return f"signal {signum}"


def killed_by(returncode: int | None) -> str | None:
    """The name of the outside signal that ended a child (``Popen.returncode``), else None."""
    if returncode is None or returncode >= 0 or -returncode not in OUTSIDE_SIGNALS:
        return None
    return signal.Signals(-returncode).name


# ---------------------------------------------------------------- the parent's side


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A fresh work dir named after this process, removed on every exit path.

    Leftovers of dead parents in the same temp dir are swept first (``sweep``).
    """
    sweep()
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def start(args: list[str], *, env: dict[str, str], log: IO[bytes] | int) -> subprocess.Popen:
    """Start a child in a session of its own (its own process group), output to ``log``."""
    return subprocess.Popen(
        args,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C at a terminal reaches the parent, which stops it
    )


def stop(proc: subprocess.Popen) -> None:
    """Kill a child still running, with its process group, and reap it. Idempotent.

    ``proc``: a ``Popen``, or a trial server's child (``server.Child``, alike).
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group the child leads (start())
        with contextlib.suppress(ProcessLookupError):
            proc.kill()  # its own pid, should the group be gone already
    proc.wait()


@functools.lru_cache(maxsize=1)
def _swept() -> set[str]:
    """The temp dirs this process swept already."""
    return set()


def sweep(tmp: str | os.PathLike | None = None, *, force: bool = False) -> list[Path]:
    """Remove the work dirs of trial parents that are dead; the paths removed.

    A work dir ``autofit-trial-<pid>-*`` belongs to a dead parent when no process has
    that pid, or the process that has it started well after the dir last changed
    (``REUSED_AFTER_S``: the pid was reused). Dirs of live parents, of other users
    and of the old naming are left alone. Done once per process and temp dir unless
    ``force``.
    """
    root = Path(tmp if tmp is not None else tempfile.gettempdir())
    swept = _swept()
    if str(root) in swept and not force:
        return []
    swept.add(str(root))
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return []
    for entry in entries:
        m = _NAME.match(entry.name)
        if m is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid():
                continue
        except OSError:
            continue
        if _owner_alive(int(m.group(1)), st.st_mtime):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc: kill() said it exists
    return state not in ("Z", "X")


def _owner_alive(pid: int, changed: float) -> bool:
    """Whether process ``pid`` lives and is the one that wrote a dir last changed at ``changed``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds the pid: not ours to judge
    started = _start_time(pid)
    return started is None or started <= changed + REUSED_AFTER_S


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started (epoch seconds), from /proc; None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rpartition(")")[2].split()[19])  # field 22: starttime
        for line in Path("/proc/stat").read_text().splitlines():
            if line.startswith("btime "):
                return int(line.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return None


def child_env() -> dict[str, str]:
    """The environment of a trial's processes: this one's, glibc's allocator set to measure
    (``procmem.CHILD_MALLOC_ENV``), this checkout and ``sys.path`` importable."""
    from autofit.trial import procmem

    env = dict(os.environ)
    env.update(procmem.CHILD_MALLOC_ENV)
    package_root = str(Path(__file__).resolve().parents[2])  # the directory holding autofit/
    paths = [package_root] + [p if p else os.getcwd() for p in sys.path if isinstance(p, str)]
    seen: list[str] = []
    for p in paths:
        if p not in seen and os.path.isdir(p):
            seen.append(p)
    env["PYTHONPATH"] = os.pathsep.join(seen)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


# ---------------------------------------------------------------- the child's side


def guard_parent(work: Path, parent_pid: int, *, owner_pid: int | None = None) -> None:
    """In the child: when ``parent_pid`` dies, remove ``work`` and exit with the group.

    Call first thing in the child's main thread, before the slow imports.
    ``owner_pid``: the process whose work dir ``work`` is, when it is not the parent
    (a child forked by the trial server): ``work`` is then removed only if the owner
    is gone too (a live owner reruns the trial from it).
    """
    guard = _Guard(work, parent_pid, owner_pid)
    if PARENT_DEATH_SIGNAL is not None:
        signal.signal(PARENT_DEATH_SIGNAL, guard.on_signal)
        _request_parent_death_signal()
    threading.Thread(target=guard.poll, name="autofit-parent-watch", daemon=True).start()
    guard.check()  # the parent may be gone already (before the request above)


def _request_parent_death_signal() -> bool:
    """Linux: ask the kernel for ``PARENT_DEATH_SIGNAL`` when the parent dies."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _Guard:
    def __init__(self, work: Path, parent_pid: int, owner_pid: int | None = None) -> None:
        self.work = work
        self.parent_pid = parent_pid
        self.owner_pid = owner_pid

    def orphaned(self) -> bool:
        return os.getppid() != self.parent_pid

    def check(self) -> None:
        if self.orphaned():
            self.die()

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        # PR_SET_PDEATHSIG also fires when the parent's *thread* that started us ends
        # while the parent lives on: then getppid() is unchanged and we carry on.
        self.check()

    def poll(self) -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            self.check()

    def die(self) -> None:
        owner_gone = self.owner_pid is None or not pid_alive(self.owner_pid)
        if owner_gone and self.work.name.startswith(PREFIX):  # never anything but a work dir
            shutil.rmtree(self.work, ignore_errors=True)
        with contextlib.suppress(OSError):
            if os.getpgid(0) == os.getpid():  # we lead our group (start()): take it along
                os.killpg(0, signal.SIGKILL)
        os._exit(1)
