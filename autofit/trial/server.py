"""The trial server: capped-CPU trial children forked from a pre-imported process.

A fresh ``python -m autofit.trial.child`` spends seconds importing torch and
transformers before its first step. The trial server pays that once per autofit
process: started lazily by the first CPU subprocess trial
(``python -m autofit.trial.server OWNER_PID``, with the child's environment, so
glibc's allocator settings ``procmem.CHILD_MALLOC_ENV`` are read at *its* start
and inherited by every fork), it imports torch, transformers (its Trainer and
model classes), peft when installed and ``autofit.trial``, runs no torch op and
starts no thread, then forks one child per trial. The child is the same program
as a fresh one (``autofit.trial.child.main`` over the work dir's ``payload.pt``,
``result.json`` back, output in ``child.log``); it applies the cap itself
(``RLIMIT_AS`` in ``autofit.trial.loop``) on an allocator that has held no tensor.

    >>> from autofit.trial import server
    >>> server.enabled() in (True, False)   # Linux, and AUTOFIT_TRIAL_SERVER is not "0"
    True

The parent's side (``start_child``) returns a ``Child``, a ``subprocess.Popen``
look-alike (``pid``, ``poll``, ``wait``, ``kill``, ``returncode``) that
``autofit.trial.runner`` and ``process.stop`` use as they use a fresh child's.
The protocol is one JSON object a line over the server's stdin / stdout:
``{"work": DIR, "cwd": DIR}`` in; ``{"ready": ...}`` once, ``{"pid": N}`` per fork,
``{"pid": N, "returncode": RC}`` when the child ends (``Popen``'s convention:
``-9`` killed by SIGKILL). One trial at a time per server; a trial asked for while
the server is busy (another thread) starts a fresh child.

Nothing outlives the caller, as with fresh children (``autofit.trial.process``):

- the server runs in a session of its own and dies with its owner: parent-death
  signal, end of file on its stdin, a watch on ``os.getppid()``; it then kills the
  running child's process group and removes that child's work dir; the owner
  kills it at exit (``atexit``);
- each child leads a process group of its own (the owner kills it by that group
  on a timeout, Ctrl-C, SIGTERM) and dies with the server (``guard_parent``); it
  removes its work dir only when the owner is gone too, so that the owner can
  rerun the trial in a fresh process;
- a child killed from outside is reported by its signal (``killed_by``) and
  retried once by the runner, as today.

Falling back: if the server cannot start (an import fails, a thread is running
after the imports, no ready line within ``START_TIMEOUT_S``) or dies, one warning
line on the ``autofit`` logger says so and every later trial of this process
starts a fresh ``python -m autofit.trial.child``; a trial whose server died under
it is run again that way. ``AUTOFIT_TRIAL_SERVER=0`` turns the server off.

Known limitations:
    NB: CPU trials only: a process that imported bitsandbytes (with peft) may hold
    an initialised CUDA driver, which a fork cannot use; accelerator trials start
    fresh children.
    NB: the server is started with this process's environment, executable and
    ``sys.path`` of the moment; when they change it is restarted (once idle), but
    not for the variables no child reads (``_UNREAD``: pytest's per-test one, the cache
    folder).
    Modules a trial imports beyond the preloaded ones (a model's own
    ``modeling_*``, tenths of a second) are imported by each child.
    NB: Linux only (parent-death signal, ``/proc``); elsewhere trials start fresh
    children.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import importlib
import importlib.util
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from autofit.trial import process

__all__ = ["Child", "Lost", "enabled", "prepare", "start_child", "shutdown", "PRELOAD",
           "START_TIMEOUT_S"]

logger = logging.getLogger("autofit")

# Imported by the server before it forks: what every trial child imports (the
# step's Trainer pieces, the model classes' machinery), so that a child starts at
# its work. Optional ones are skipped when missing.
PRELOAD = (
    "torch",
    "autofit.trial.child",
    "autofit.trial.loop",
    "autofit.trial.model",
    "autofit.trial.state",
    "autofit.probe.model",
)
PRELOAD_OPTIONAL = (
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.trainer",
    "peft",
)
START_TIMEOUT_S = 300.0  # imports on a loaded machine; past this the server is given up
KILLED_REPORT_S = 30.0  # a killed child's exit reported by then, or the server is given up
_ENV = "AUTOFIT_TRIAL_SERVER"
# environment variables no trial child reads, left out of the server's key: a change of
# them alone does not restart the server (pytest sets the first per test; a session that
# moves its cache between tunes sets the second)
_UNREAD = frozenset({"PYTEST_CURRENT_TEST", "AUTOFIT_CACHE_DIR"})


class Lost(Exception):
    """The server died (or stopped answering) while a trial child of it ran."""


def enabled() -> bool:
    """Whether CPU trial children come from the server (Linux, not turned off)."""
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "fork")
        and os.environ.get(_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    )


# ---------------------------------------------------------------- the owner's side

class _Owner:
    """This process's side of its server: the server (None until a trial starts it), why
    this process starts fresh children from now on (None: it does not), whether
    ``shutdown`` runs at exit; ``lock`` guards the three."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.server: _Server | None = None
        self.given_up: str | None = None
        self.at_exit = False


@functools.lru_cache(maxsize=1)
def _owner() -> _Owner:
    """The one ``_Owner`` of this process (a fork inherits it: ``_current`` checks)."""
    return _Owner()


def prepare(env: dict[str, str]) -> None:
    """Start the server now if none runs (it imports while the payload is written)."""
    if not enabled():
        return
    with _owner().lock:
        try:
            _current(env)
        except Exception as e:  # noqa: BLE001 - never fail a trial because of the server
            _give_up_locked(_owner().server, f"could not be started ({type(e).__name__}: {e})")


def start_child(work: Path, *, env: dict[str, str], until: float | None) -> Child | None:
    """Fork a trial child over ``work`` from the server, or None: start a fresh one.

    None when the server is off, given up (warned once), busy with another trial,
    or fails now (warned once). ``until``: ``time.time()`` past which waiting for a
    starting server raises ``subprocess.TimeoutExpired`` (the trial's deadline).
    """
    if not enabled():
        return None
    with _owner().lock:
        try:
            srv = _current(env)
        except Exception as e:  # noqa: BLE001 - never fail a trial because of the server
            _give_up_locked(_owner().server, f"could not be started ({type(e).__name__}: {e})")
            return None
    if srv is None or not srv.busy.acquire(blocking=False):
        return None
    try:
        return srv.fork(work, until)
    except subprocess.TimeoutExpired:
        srv.busy.release()
        raise
    except Lost as e:
        _give_up(srv, str(e))
    except Exception as e:  # noqa: BLE001 - never fail a trial because of the server
        _give_up(srv, f"{type(e).__name__}: {e}")
    return None


def shutdown() -> None:
    """Kill this process's server (at exit; tests). A later trial starts a new one."""
    owner = _owner()
    with owner.lock:
        srv, owner.server = owner.server, None
    if srv is not None and srv.owner == os.getpid():
        srv.kill()


def _current(env: dict[str, str]) -> _Server | None:
    """This process's server for ``env`` (``_owner().lock`` held): restarted when the key
    changed."""
    owner = _owner()
    if owner.given_up is not None:
        return None
    key = (sys.executable, tuple(sorted((k, v) for k, v in env.items() if k not in _UNREAD)))
    srv = owner.server
    if srv is not None and srv.owner != os.getpid():
        srv = owner.server = None  # inherited by a fork of the owner: the owner's, not ours
    if srv is not None and srv.key != key and srv.busy.acquire(blocking=False):
        srv.kill()  # idle, but started with another environment
        srv = owner.server = None
    if srv is None:
        try:
            srv = owner.server = _Server(key, env)
        except OSError as e:
            _give_up_locked(None, f"could not be started ({type(e).__name__}: {e})")
            return None
        if not owner.at_exit:
            atexit.register(shutdown)
            owner.at_exit = True
    return srv


def _give_up(srv: _Server | None, why: str) -> None:
    with _owner().lock:
        _give_up_locked(srv, why)


def _give_up_locked(srv: _Server | None, why: str) -> None:
    owner = _owner()
    if srv is not None:
        srv.kill()
        if owner.server is srv:
            owner.server = None
    if owner.given_up is None:
        owner.given_up = why
        logger.warning(
            "the trial server %s; every trial starts a fresh process from now on "
            "(seconds of imports each)", why,
        )


class _Server:
    """The owner's handle on a server process: its pipes, its state, one trial at a time."""

    def __init__(self, key: tuple, env: dict[str, str]) -> None:
        self.key = key
        self.owner = os.getpid()
        self.busy = threading.Lock()  # held from a fork to the child's exit report
        # the server's own output; no name, so nothing to sweep
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed by kill()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autofit.trial.server", str(os.getpid())],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            start_new_session=True,  # no terminal signal; children get groups of their own
        )
        self.buf = b""
        self.ready = False

    # the line protocol

    def send(self, msg: dict[str, object]) -> None:
        try:
            self.proc.stdin.write((json.dumps(msg) + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            raise Lost(self.died()) from None

    def read(self, until: float | None) -> dict[str, Any]:
        """The next message; ``TimeoutExpired`` past ``until`` (wall clock), ``Lost`` at EOF."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = None if until is None else max(0.0, until - time.time())
            if not select.select([fd], [], [], left)[0]:
                raise subprocess.TimeoutExpired(self.proc.args, left or 0.0)
            chunk = os.read(fd, 65536)
            if not chunk:
                raise Lost(self.died())
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            raise Lost(f"sent garbage ({line[:80]!r})") from None

    def died(self) -> str:
        """Why the server is gone: its exit and the last line it wrote."""
        try:
            code = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            how = "stopped answering"
        else:
            end = f"killed by {process.describe_signal(-code)}" if code < 0 else f"exit status {code}"
            how = f"died ({end})"
        with contextlib.suppress(OSError):
            self.log.seek(0, os.SEEK_END)
            self.log.seek(max(0, self.log.tell() - 2000))
            tail = self.log.read().decode("utf-8", "replace").strip().splitlines()
            if tail:
                how += f": {tail[-1][:200]}"
        return how

    # a trial

    def wait_ready(self, until: float | None) -> None:
        if self.ready:
            return
        limit = time.time() + START_TIMEOUT_S - (time.monotonic() - self.started)
        try:
            msg = self.read(limit if until is None else min(until, limit))
        except subprocess.TimeoutExpired:
            if until is not None and until < limit:
                raise  # the trial's deadline: the server goes on starting for the next one
            raise Lost(f"did not start within {START_TIMEOUT_S:g}s") from None
        except Lost as e:
            raise Lost(f"could not be started: it {e}") from None
        if not msg.get("ready"):
            raise Lost(f"could not be used ({msg.get('why', msg)})")
        self.ready = True

    def fork(self, work: Path, until: float | None) -> Child:
        """A child over ``work`` (``busy`` held; released when the child's end is read)."""
        self.wait_ready(until)
        self.send({"work": str(work), "cwd": os.getcwd()})
        try:
            msg = self.read(time.time() + KILLED_REPORT_S)
        except subprocess.TimeoutExpired:
            raise Lost(f"did not fork within {KILLED_REPORT_S:g}s") from None
        pid = msg.get("pid")
        if not isinstance(pid, int) or "returncode" in msg:
            raise Lost(f"answered {msg!r} to a fork")
        return Child(self, pid)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.proc.wait(timeout=10.0)
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            with contextlib.suppress(OSError, ValueError):
                f.close()


class Child:
    """A trial child forked by the server, used like the ``subprocess.Popen`` of a fresh one.

    ``wait`` raises ``Lost`` when the server dies first; the child is then killed
    by ``kill`` (its group first, from ``process.stop``) and counts as killed.
    """

    def __init__(self, server: _Server, pid: int) -> None:
        self.server = server
        self.pid = pid
        self.args = ["autofit.trial.server", "fork", str(pid)]
        self.returncode: int | None = None
        self.lost: str | None = None
        self.killed = False

    def _end(self, returncode: int) -> int:
        self.returncode = returncode
        if self.server.busy.locked():
            self.server.busy.release()
        return returncode

    def _read_end(self, until: float | None) -> int:
        msg = self.server.read(until)
        if msg.get("pid") != self.pid or not isinstance(msg.get("returncode"), int):
            raise Lost(f"answered {msg!r} for child {self.pid}")
        return self._end(msg["returncode"])

    def poll(self) -> int | None:
        if self.returncode is not None or self.lost is not None:
            return self.returncode
        try:
            return self._read_end(time.time())
        except subprocess.TimeoutExpired:
            return None
        except Lost as e:
            self._lose(str(e))
            return None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if self.lost is not None:
            raise Lost(self.lost)
        until = None if timeout is None else time.time() + timeout
        if self.killed:  # its exit is due now; a server that does not say so is given up
            until = time.time() + KILLED_REPORT_S if until is None else until
        try:
            return self._read_end(until)
        except subprocess.TimeoutExpired:
            if not self.killed:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
            self._lose(f"did not report a killed child within {KILLED_REPORT_S:g}s")
            return self._end(-int(signal.SIGKILL))
        except Lost as e:
            self._lose(str(e))
            raise Lost(self.lost) from None

    def kill(self) -> None:
        self.killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)
        if self.lost is not None and self.returncode is None:
            self._end(-int(signal.SIGKILL))  # nobody will report it: it is killed

    def _lose(self, why: str) -> None:
        self.lost = why
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # it dies with the server anyway
        _give_up(self.server, why)


# ---------------------------------------------------------------- the server's side

class _Serving:
    """The server process's state: the child running now and its work dir (None between
    trials), for ``_die``."""

    def __init__(self) -> None:
        self.running: tuple[int, Path] | None = None


@functools.lru_cache(maxsize=1)
def _serving() -> _Serving:
    return _Serving()


def main(argv: list[str]) -> int:
    """``python -m autofit.trial.server OWNER_PID``: preload, say ready, fork on request."""
    owner = int(argv[1])  # started in a session of its own (_Server)
    inp, out = os.dup(0), os.dup(1)  # the protocol; stray prints go to the log
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    os.close(devnull)
    _watch_owner(owner)
    t0 = time.monotonic()
    why = _preload()
    _send(out, {"ready": why is None, "why": why, "pid": os.getpid(),
                "imports_s": round(time.monotonic() - t0, 3)})
    if why is not None:
        return 1
    _serve(owner, inp, out)
    return 0


def _preload() -> str | None:
    """Import what a trial child needs; why forking is unsafe (or None)."""
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - reported to the owner, which starts fresh children
            return f"importing {name}: {type(e).__name__}: {e}"
    for name in PRELOAD_OPTIONAL:
        with contextlib.suppress(Exception):
            if importlib.util.find_spec(name.partition(".")[0]) is not None:
                importlib.import_module(name)
    import torch

    torch.set_num_threads(1)  # as the child does; sets a number, starts no pool
    if torch.cuda.is_initialized():
        return "CUDA was initialised by an import (a fork could not use it)"
    threads = _threads()
    if threads is not None and threads > 1:
        return f"{threads} threads run after the imports (a fork copies one of them only)"
    gc.collect()
    gc.freeze()  # the imports' objects: never collected, never copied by a child's gc
    return None


def _threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _send(fd: int, msg: dict[str, object]) -> None:
    data = (json.dumps(msg) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _watch_owner(owner: int) -> None:
    """Die with the owner: its death signal (Linux), checked again in the serve loop."""
    if process.PARENT_DEATH_SIGNAL is not None:
        signal.signal(process.PARENT_DEATH_SIGNAL, lambda signum, frame: _check_owner(owner))
        process._request_parent_death_signal()
    _check_owner(owner)


def _check_owner(owner: int) -> None:
    if os.getppid() != owner:
        _die(remove=True)


def _die(*, remove: bool) -> None:
    """Kill the running child (its group) and exit; ``remove``: its work dir too."""
    running = _serving().running
    if running is not None:
        pid, work = running
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)
        if remove and work.name.startswith(process.PREFIX):  # never anything but a work dir
            shutil.rmtree(work, ignore_errors=True)
    os._exit(0)


class _Lines:
    """JSON lines from a file descriptor; None at end of file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def ready(self) -> bool:
        return b"\n" in self.buf

    def fill(self) -> bool:
        chunk = os.read(self.fd, 65536)
        self.buf += chunk
        return bool(chunk)

    def next(self) -> dict[str, Any]:
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)


def _serve(owner: int, inp: int, out: int) -> None:
    serving = _serving()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes select (wakeup fd)
    signal.set_wakeup_fd(wake_w)
    lines = _Lines(inp)
    while True:
        while not lines.ready():
            if select.select([inp], [], [], process.PARENT_POLL_S)[0] and not lines.fill():
                return  # the owner closed our stdin: no trial runs, nothing to remove
            _check_owner(owner)
        request = lines.next()
        work = Path(request["work"])
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            _child(request, owner, (inp, out, wake_r, wake_w))  # never returns
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # as the child does: no window without its group
        serving.running = (pid, work)
        _send(out, {"pid": pid})
        code = _wait(pid, owner, lines, wake_r)
        serving.running = None
        _send(out, {"pid": pid, "returncode": code})


def _wait(pid: int, owner: int, lines: _Lines, wake_r: int) -> int:
    """The child's exit status (``Popen`` convention); dies with the owner meanwhile."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        ready = select.select([lines.fd, wake_r], [], [], process.PARENT_POLL_S)[0]
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        if lines.fd in ready and not lines.fill():
            # the owner's end closed mid-trial: it is exiting (its fds go before its pid)
            for kill in (os.killpg, os.kill):
                with contextlib.suppress(OSError):
                    kill(pid, signal.SIGKILL)
            end = time.monotonic() + 5.0
            while time.monotonic() < end:  # remove the work dir once it is surely gone
                _check_owner(owner)
                time.sleep(0.05)
            _die(remove=False)  # it lives on: the work dir is its own (swept otherwise)
        _check_owner(owner)


def _child(request: dict[str, object], owner: int, fds: tuple[int, ...]) -> None:
    """In the forked child: become a fresh trial child, run it, exit."""
    code = 1
    try:
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)  # a group of its own, killed as one (process.stop)
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, process.PARENT_DEATH_SIGNAL):
            if sig is not None:
                signal.signal(sig, signal.SIG_DFL)
        for fd in fds:
            os.close(fd)
        work = Path(request["work"])
        log = os.open(work / "child.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(devnull)
        with contextlib.suppress(OSError):
            os.chdir(request.get("cwd") or ".")
        _name(b"autofit-trial")
        from autofit.trial import child

        argv = [child.__file__, str(work), str(os.getppid()), str(owner)]
        sys.argv = list(argv)
        code = child.main(argv)
    except KeyboardInterrupt:
        code = 128 + int(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # die of it, as Python does
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - the log says what; the exit status says that it did
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # what the imports registered, as at a fresh child's exit
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(BaseException):
                stream.flush()
        os._exit(code)


def _name(name: bytes) -> None:
    """The process's short name (``ps``, ``/proc/PID/comm``): Linux ``PR_SET_NAME``."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name), 0, 0, 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
