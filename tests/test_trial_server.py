"""The trial server (issue 12, item 7): capped-CPU trial children forked, not started.

- A trial forked by the server gives the result a fresh ``python -m
  autofit.trial.child`` gives (fits and out-of-memory alike).
- A server that cannot start, or dies (idle or under a trial), is given up with
  one warning line; the trial and the later ones run in fresh children.
- A forked child killed from outside is retried once and reported killed; the
  server stays in use.
- When the parent dies (SIGKILL, Ctrl-C) or ends, the server and its child are
  gone within seconds and no work dir is left.
- Starting a trial from the server costs less than starting a fresh child
  (compared with each other, no threshold).

Processes are caught by what they do (``/proc``), as in ``test_trial_faults.py``:
the server is a child of the parent whose command line names
``autofit.trial.server``, a forked trial child is a child of the server.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from proc_watch import (
    GONE_WITHIN_S,
    REPO,
    alive,
    capped,
    leftovers,
    processes,
    script_env,
    wait_for,
)

from autofit.config import TrainConfig
from autofit.trial import measure
from autofit.trial import server as trial_server

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the trial server is Linux only (/proc, prctl)"
)

TINY = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "architectures": ["LlamaForCausalLM"],
}
FITS = {"config": TrainConfig(micro_batch_size=2), "seq_len": 64, "device": "cpu:1GiB",
        "measure_steps": 1}
# the (16, 512, 1000) fp32 logits alone are 32 MiB
OOM = {"config": TrainConfig(micro_batch_size=16), "seq_len": 512, "device": "cpu:64MiB"}
MiB = 1 << 20


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-llama-128.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.fixture(autouse=True)
def server_on(monkeypatch):
    """The server in use, not given up by an earlier test; forks recorded."""
    monkeypatch.delenv("AUTOFIT_TRIAL_SERVER", raising=False)
    trial_server._owner().given_up = None
    forks: list[trial_server.Child | None] = []
    start_child = trial_server.start_child

    def recorded(*args, **kwargs):
        forks.append(start_child(*args, **kwargs))
        return forks[-1]

    monkeypatch.setattr(trial_server, "start_child", recorded)
    yield forks
    trial_server._owner().given_up = None


@pytest.fixture(scope="module", autouse=True)
def _no_server_left():
    yield
    trial_server.shutdown()


# ---------------------------------------------------------------- /proc helpers


def _servers(parent: int) -> list[int]:
    return [pid for pid, ppid, cmd in processes()
            if ppid == parent and b"autofit.trial.server" in cmd and alive(pid)]


def _forked(server: int) -> list[int]:
    return [pid for pid, ppid, _ in processes() if ppid == server and alive(pid)]


def _server_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "autofit" and "trial server" in r.getMessage()]


class _Killer:
    """Kills the forked children of this process's server (the first ``times`` seen)."""

    def __init__(self, times: int, *, server_instead: bool = False) -> None:
        self.times = times
        self.server_instead = server_instead
        self.seen: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            for srv in _servers(os.getpid()):
                for pid in _forked(srv):
                    if pid not in self.seen and len(self.seen) < self.times:
                        self.seen.append(pid)
                        os.kill(srv if self.server_instead else pid, signal.SIGKILL)
            time.sleep(0.01)

    def __enter__(self) -> _Killer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


# ---------------------------------------------------------------- same result


def _same_fields(a, b) -> None:
    for name in ("oom", "fits", "isolation", "batch_shape", "steps", "warmup_steps",
                 "micro_batches_per_step", "capacity_bytes", "resident_bytes", "timed_out",
                 "killed_by", "notes", "config", "device"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.error is None) == (b.error is None)
    if a.error is not None:  # the phase and the allocator's words; byte counts may differ
        assert a.error.split(":")[0] == b.error.split(":")[0]
        assert ("DefaultCPUAllocator" in a.error) == ("DefaultCPUAllocator" in b.error)
    assert set(a.to_dict()) == set(b.to_dict())
    assert (a.peak_allocated_bytes is None) == (b.peak_allocated_bytes is None)
    assert (a.step_time_s is None) == (b.step_time_s is None)


@pytest.mark.parametrize("case", [FITS, pytest.param(OOM, marks=pytest.mark.slow)],
                         ids=["fits", "oom"])  # the OOM path: test_trial.py, fresh children
def test_a_forked_trial_gives_what_a_fresh_child_gives(case, tiny_path, own_tmp, server_on,
                                                       monkeypatch):
    forked = measure(tiny_path, **case)
    assert len(server_on) == 1 and isinstance(server_on[0], trial_server.Child)
    monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "0")
    fresh = measure(tiny_path, **case)
    assert len(server_on) == 1  # not asked: the server is off
    _same_fields(forked, fresh)
    assert forked.fits is (case is FITS) and forked.oom is (case is OOM)
    # the same steps on the same tensors: the peaks above the baseline agree closely
    assert abs(forked.peak_allocated_bytes - fresh.peak_allocated_bytes) < 16 * MiB
    assert leftovers(own_tmp) == []


# ---------------------------------------------------------------- falling back


FAKE_PYTHON = """#!/bin/sh
case "$*" in
  *autofit.trial.server*) echo "no server here" >&2; exit 3 ;;
esac
exec "{python}" "$@"
"""


@pytest.mark.slow  # 20 s: it waits out the server's start-up timeout
def test_a_server_that_cannot_start_is_given_up_with_one_warning(
    tiny_path, own_tmp, server_on, tmp_path, monkeypatch, caplog
):
    trial_server.shutdown()
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.format(python=sys.executable))
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))
    with caplog.at_level(logging.WARNING, logger="autofit"):
        first = measure(tiny_path, **FITS)
        second = measure(tiny_path, **FITS)
    assert first.fits and second.fits and first.isolation == "subprocess"
    (warning,) = _server_warnings(caplog)
    assert "could not be started" in warning and "exit status 3" in warning
    assert "no server here" in warning and "fresh process" in warning
    assert server_on == [None, None]
    assert leftovers(own_tmp) == []


@pytest.mark.slow  # the fast set kills one under a trial (the same give-up path)
def test_a_server_killed_while_idle_is_given_up_with_one_warning(
    tiny_path, own_tmp, server_on, caplog
):
    assert measure(tiny_path, **FITS).fits
    (srv,) = _servers(os.getpid())
    os.kill(srv, signal.SIGKILL)
    wait_for(lambda: not alive(srv), GONE_WITHIN_S, "the server to die")
    with caplog.at_level(logging.WARNING, logger="autofit"):
        second = measure(tiny_path, **FITS)
        third = measure(tiny_path, **FITS)
    assert second.fits and third.fits and second.killed_by is None
    (warning,) = _server_warnings(caplog)
    assert "died (killed by SIGKILL (signal 9))" in warning and "fresh process" in warning
    assert server_on[1:] == [None, None]
    assert _servers(os.getpid()) == []
    assert leftovers(own_tmp) == []


def test_a_server_killed_under_a_trial_reruns_it_in_a_fresh_child(
    tiny_path, own_tmp, server_on, caplog
):
    assert measure(tiny_path, **FITS).fits  # the server is up: the next trial is forked
    with caplog.at_level(logging.WARNING, logger="autofit"), _Killer(1, server_instead=True) as k:
        r = measure(tiny_path, **FITS)
    assert len(k.seen) == 1
    assert r.fits and not r.oom and r.killed_by is None and r.peak_allocated_bytes
    (warning,) = _server_warnings(caplog)
    assert "died" in warning or "stopped answering" in warning
    wait_for(lambda: not alive(k.seen[0]), GONE_WITHIN_S, "the forked child to end")
    assert leftovers(own_tmp) == []


def test_a_forked_child_killed_twice_is_reported_killed_and_the_server_stays(
    tiny_path, own_tmp, server_on, caplog
):
    with caplog.at_level(logging.WARNING, logger="autofit"), _Killer(2) as k:
        r = measure(tiny_path, **FITS)
    assert len(k.seen) == 2  # retried once, forked again
    assert not r.oom and not r.fits and r.killed_by == "SIGKILL"
    assert "killed by SIGKILL (signal 9)" in r.error
    assert _server_warnings(caplog) == [] and trial_server._owner().given_up is None
    again = measure(tiny_path, **FITS)
    assert again.fits and isinstance(server_on[-1], trial_server.Child)
    assert leftovers(own_tmp) == []


# ---------------------------------------------------------------- nothing outlives the parent


def _kill_all(*pids: int | None) -> None:
    """A failed test leaves no process running on the shared cores."""
    for pid in pids:
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


MEASURE_FOREVER = """
from autofit import TrainConfig, measure
measure({model!r}, TrainConfig(micro_batch_size=1), seq_len=16, device="cpu:1GiB",
        measure_steps=100000, timeout_s=600)
"""


@pytest.mark.parametrize("sig", [pytest.param(signal.SIGKILL, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGKILL", "SIGINT"])  # slow: 24 s each, the fast suite's 10 min
def test_a_parent_killed_mid_trial_takes_server_and_child_along(sig, tiny_path, own_tmp):
    parent = subprocess.Popen(
        [sys.executable, "-c", MEASURE_FOREVER.format(model=tiny_path)],
        env=script_env(own_tmp), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    srv = child = None
    try:
        srv = wait_for(lambda: _servers(parent.pid), 180, "the trial server")[0]
        child = wait_for(lambda: _forked(srv), 180, "a forked trial child")[0]
        wait_for(lambda: capped(child), 120, "the child's measured steps")
        parent.send_signal(sig)
        parent.wait(timeout=60)
        wait_for(lambda: not alive(child), GONE_WITHIN_S, "the trial child to end")
        wait_for(lambda: not alive(srv), GONE_WITHIN_S, "the server to end")
        wait_for(lambda: leftovers(own_tmp) == [], GONE_WITHIN_S,
                  f"the work dir to be removed (left: {leftovers(own_tmp)})")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        _kill_all(child, srv)


MEASURE_ONCE = """
import sys, time
from autofit import TrainConfig, measure
r = measure({model!r}, TrainConfig(micro_batch_size=1), seq_len=16, device="cpu:1GiB")
print(r.fits, flush=True)
if sys.argv[1] == "stay":
    time.sleep(600)
"""


@pytest.mark.parametrize("end", [pytest.param("exit", marks=pytest.mark.slow),
                                 pytest.param("SIGKILL", marks=pytest.mark.slow)])
def test_an_idle_server_ends_with_its_parent(end, tiny_path, own_tmp):
    parent = subprocess.Popen(
        [sys.executable, "-c", MEASURE_ONCE.format(model=tiny_path),
         "stay" if end == "SIGKILL" else "go"],
        env=script_env(own_tmp), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    srv = None
    try:
        srv = wait_for(lambda: _servers(parent.pid), 180, "the trial server")[0]
        assert parent.stdout.readline().strip() == "True"
        if end == "SIGKILL":
            parent.kill()
        parent.wait(timeout=60)
        wait_for(lambda: not alive(srv), GONE_WITHIN_S, "the server to end")
        assert leftovers(own_tmp) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        _kill_all(srv)


# ---------------------------------------------------------------- cheaper


@pytest.mark.slow  # a timing comparison: benchmarks/first_minute.py measures the cost
def test_a_forked_trial_starts_faster_than_a_fresh_child(tiny_path, own_tmp, monkeypatch):
    walls: dict[str, list[float]] = {"server": [], "fresh": []}
    assert measure(tiny_path, **FITS).fits  # the server starts here
    for mode in ("server", "fresh", "server", "fresh"):
        if mode == "fresh":
            monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "0")
        else:
            monkeypatch.delenv("AUTOFIT_TRIAL_SERVER", raising=False)
        t0 = time.perf_counter()
        assert measure(tiny_path, **FITS).fits
        walls[mode].append(time.perf_counter() - t0)
    print(f"measure() wall, s: {walls}")
    # relative only: the fresh child imports torch and transformers, the fork does not
    assert min(walls["server"]) < min(walls["fresh"])


def test_the_server_is_kept_across_variables_no_child_reads(monkeypatch):
    """Its key leaves out what no trial child reads (a restart costs seconds of imports:
    under pytest every test changed PYTEST_CURRENT_TEST, and most the cache folder); any
    other change of the environment restarts it."""
    made = []

    class Fake:
        def __init__(self, key, env):
            self.key, self.owner, self.busy = key, os.getpid(), threading.Lock()
            made.append(self)

        def kill(self):
            pass

    monkeypatch.setattr(trial_server, "_Server", Fake)
    owner = trial_server._Owner()
    owner.at_exit = True
    monkeypatch.setattr(trial_server, "_owner", lambda: owner)
    env = {"PATH": "/bin", "PYTEST_CURRENT_TEST": "a", "AUTOFIT_CACHE_DIR": "/x"}
    with owner.lock:
        first = trial_server._current(env)
        same = trial_server._current({**env, "PYTEST_CURRENT_TEST": "b",
                                      "AUTOFIT_CACHE_DIR": "/y"})
        other = trial_server._current({**env, "MALLOC_ARENA_MAX": "2"})
    assert same is first and other is not first and len(made) == 2
