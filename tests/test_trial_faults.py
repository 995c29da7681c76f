"""Faults around the trial process (issue 11, items 3 and 5).

- A trial child killed from outside (SIGKILL: what the host's OOM killer sends;
  SIGTERM) is not an out-of-memory result: it is retried once in a fresh process,
  and killed again it is reported as killed, by its signal, with ``oom=False``.
- When autofit (the parent) dies - SIGTERM, SIGINT, SIGKILL - its trial child is
  gone within 5 s and no work dir (with payload.pt, a pickled copy of the user's
  model) is left; leftovers of dead parents are swept at the next start.

Children are caught mid-run by what they do, not by timing: a child exists (its
start-up imports take seconds), or a child has set its address-space cap (it is in
the measured steps, 100000 of them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from proc_watch import (
    GONE_WITHIN_S,
    REPO,
    alive,
    capped,
    leftovers,
    processes,
    script_env,
    stat,
    wait_for,
)

from autofit.config import TrainConfig
from autofit.trial import TrialResult, measure, trial_from_dict
from autofit.trial import process as trial_process
from autofit.trial import runner as trial_runner

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc to find the trial processes"
)

TINY = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "architectures": ["LlamaForCausalLM"],
}


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-llama-64.json"
    path.write_text(json.dumps(TINY))
    return str(path)


# ---------------------------------------------------------------- /proc helpers


def _trial_children(parent: int) -> list[int]:
    """``parent``'s trial children: fresh ones, and those its trial server forked."""
    procs = processes()
    servers = {pid for pid, ppid, cmd in procs if ppid == parent and b"autofit.trial.server" in cmd}
    return [pid for pid, ppid, cmd in procs
            if (ppid == parent and b"autofit.trial.child" in cmd) or ppid in servers]


# ---------------------------------------------------------------- item 3: a killed child


def _fake_python(tmp_path: Path, script: str) -> tuple[Path, Path]:
    """An executable standing in for python: logs each start, then runs ``script``."""
    starts = tmp_path / "starts"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho start >> "{starts}"\n{script}\n')
    fake.chmod(0o755)
    return fake, starts


def _count(starts: Path) -> int:
    return len(starts.read_text().splitlines()) if starts.exists() else 0


# SIGKILL (what the host's OOM killer sends) in the fast set; SIGTERM the same path, slow
@pytest.mark.parametrize("sig", ["KILL", pytest.param("TERM", marks=pytest.mark.slow)])
def test_a_child_killed_twice_is_reported_killed_not_oom(
    sig, tiny_path, tmp_path, own_tmp, monkeypatch
):
    fake, starts = _fake_python(tmp_path, f"kill -{sig} $$")
    monkeypatch.setattr(trial_runner.sys, "executable", str(fake))
    monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "0")  # the fake stands in for a fresh child
    r = measure(tiny_path, TrainConfig(micro_batch_size=1), seq_len=8, device="cpu:1GiB")
    name = f"SIG{sig}"
    number = int(signal.Signals[name])
    assert _count(starts) == 2  # retried once, in a fresh process
    assert not r.oom and not r.fits and r.killed_by == name
    assert f"killed by {name} (signal {number})" in r.error
    assert "out-of-memory killer or another process" in r.error and "\n" not in r.error
    assert leftovers(own_tmp) == []


def test_a_child_killed_once_is_retried_and_the_retry_measures(
    tiny_path, tmp_path, own_tmp, monkeypatch
):
    # kill -9 of the real trial child from outside, mid-trial; its retry runs untouched
    starts, killed = [], []
    stop = threading.Event()

    def killer():
        while not stop.is_set():
            for pid in _trial_children(os.getpid()):
                if pid not in starts:
                    starts.append(pid)
                    if not killed:
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            time.sleep(0.02)

    watcher = threading.Thread(target=killer, daemon=True)
    watcher.start()
    try:
        r = measure(tiny_path, TrainConfig(micro_batch_size=1), seq_len=8, device="cpu:1GiB",
                    measure_steps=1)
    finally:
        stop.set()
        watcher.join()
    assert len(killed) == 1 and len(starts) == 2
    assert r.fits and not r.oom and r.killed_by is None and r.peak_allocated_bytes
    assert any("killed by SIGKILL (signal 9)" in n for n in r.notes)
    assert leftovers(own_tmp) == []


def test_a_child_that_crashes_by_itself_is_not_retried(tiny_path, tmp_path, own_tmp, monkeypatch):
    fake, starts = _fake_python(tmp_path, "echo 'Segmentation fault' >&2\nkill -SEGV $$")
    monkeypatch.setattr(trial_runner.sys, "executable", str(fake))
    monkeypatch.setenv("AUTOFIT_TRIAL_SERVER", "0")  # the fake stands in for a fresh child
    r = measure(tiny_path, TrainConfig(micro_batch_size=1), seq_len=8, device="cpu:1GiB")
    assert _count(starts) == 1 and not r.oom and r.killed_by is None
    assert "SIGSEGV (signal 11)" in r.error


def test_killed_by_round_trips_and_old_dicts_load():
    r = TrialResult(oom=False, peak_allocated_bytes=None, peak_reserved_bytes=None,
                    device_total_bytes=None, step_time_s=None, tokens_per_s=None,
                    samples_per_s=None, error="killed", config={}, device="cpu:1GiB",
                    batch_shape=(1, 8), isolation="subprocess", isolation_reason="r", steps=0,
                    killed_by="SIGKILL")
    d = json.loads(json.dumps(r.to_dict()))
    assert trial_from_dict(d) == r
    del d["killed_by"]  # a result cached before the field existed
    assert trial_from_dict(d).killed_by is None


# ---------------------------------------------------------------- item 5: the parent dies


def _kill(parent: subprocess.Popen, child: int | None) -> None:
    """A failed test leaves no process running on the shared cores."""
    if parent.poll() is None:
        parent.kill()
        parent.wait()
    if child is not None and alive(child):
        os.kill(child, signal.SIGKILL)


def _assert_child_gone_and_nothing_left(child: int, tmp: Path) -> None:
    wait_for(lambda: not alive(child), GONE_WITHIN_S, f"the trial child {child} to end")
    wait_for(lambda: leftovers(tmp) == [], GONE_WITHIN_S,
              f"the work dir to be removed (left: {leftovers(tmp)})")


MEASURE_FOREVER = """
from autofit import TrainConfig, measure
measure({model!r}, TrainConfig(micro_batch_size=1), seq_len=16, device="cpu:1GiB",
        measure_steps=100000, timeout_s=600)
"""


# each signal a fresh script with a trial; all in the slow set (30 s each, load-sensitive:
# the fast suite's ten minutes)
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGINT, marks=pytest.mark.slow),
                                 pytest.param(signal.SIGKILL, marks=pytest.mark.slow)])
def test_a_script_killed_mid_trial_takes_its_child_and_payload_along(sig, tiny_path, own_tmp):
    parent = subprocess.Popen(
        [sys.executable, "-c", MEASURE_FOREVER.format(model=tiny_path)],
        env=script_env(own_tmp), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    child = None
    try:
        child = wait_for(lambda: _trial_children(parent.pid), 120, "a trial child")[0]
        wait_for(lambda: capped(child), 120, "the child's measured steps")
        assert any((own_tmp / d / "payload.pt").exists() for d in leftovers(own_tmp)
                   if d.startswith("autofit-trial-"))
        parent.send_signal(sig)
        parent.wait(timeout=180)  # generous: a loaded machine is slow to unwind
        _assert_child_gone_and_nothing_left(child, own_tmp)
    finally:
        _kill(parent, child)


# a whole `autofit tune` each; slow (30 s each: the fast suite's ten minutes)
@pytest.mark.parametrize("sig, code", [pytest.param(signal.SIGTERM, 143, marks=pytest.mark.slow),
                                       pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)])
def test_cli_tune_stopped_by_a_signal_cleans_up(sig, code, own_tmp):
    parent = subprocess.Popen(
        [sys.executable, "-m", "autofit", "tune", "tiny-gpt2", "--dataset", "tiny-samples",
         "--device", "cpu:1GiB", "-o", str(own_tmp.parent / "tuned.yaml")],
        env=script_env(own_tmp), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True,
    )
    child = None
    try:
        child = wait_for(lambda: _trial_children(parent.pid), 120, "a trial child")[0]
        parent.send_signal(sig)
        _, err = parent.communicate(timeout=60)
        assert parent.returncode == code, err
        assert err.strip().splitlines()[-1] == "autofit: interrupted"
        assert "Traceback" not in err
        assert not (own_tmp.parent / "tuned.yaml").exists()
        _assert_child_gone_and_nothing_left(child, own_tmp)
    finally:
        _kill(parent, child)


GUARDED_WITHOUT_PDEATHSIG = """
import sys, time
from pathlib import Path
from autofit.trial import process
process._request_parent_death_signal = lambda: False  # the fallback alone: poll getppid()
work = Path(sys.argv[1])
process.guard_parent(work, int(sys.argv[2]))
(work / "guarded").touch()
time.sleep(120)
"""

STAND_IN_PARENT = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())],
                 start_new_session=True)
time.sleep(120)
"""


def test_without_a_parent_death_signal_the_child_polls_its_parent(tmp_path):
    work = tmp_path / "autofit-trial-1-x"
    work.mkdir()
    (work / "payload.pt").write_bytes(b"pickled model")
    parent = subprocess.Popen(
        [sys.executable, "-c", STAND_IN_PARENT, GUARDED_WITHOUT_PDEATHSIG, str(work)],
        env=script_env(tmp_path),
    )
    child = None
    try:
        wait_for(lambda: (work / "guarded").exists(), 60, "the child's guard")
        (child,) = _children(parent.pid)
        parent.kill()
        parent.wait()
        wait_for(lambda: not alive(child), GONE_WITHIN_S, "the orphaned child to end")
        assert not work.exists()
    finally:
        _kill(parent, child)


def _children(parent: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        fields = stat(int(d.name)) if d.name.isdigit() else None
        if fields and int(fields[1]) == parent:
            out.append(int(d.name))
    return out


# ---------------------------------------------------------------- item 5: the sweep


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_leftovers_of_dead_parents_are_swept_at_the_next_start(own_tmp):
    dead = own_tmp / f"autofit-trial-{_dead_pid()}-abc"
    reused = own_tmp / f"autofit-trial-{os.getpid()}-def"  # our pid, but older than us
    live = own_tmp / f"autofit-trial-{os.getpid()}-ghi"
    old_style = own_tmp / "autofit-trial-jkl"  # no pid: owner unknown, kept
    other = own_tmp / "someone-else"
    for d in (dead, reused, live, old_style, other):
        d.mkdir()
        (d / "payload.pt").write_bytes(b"pickled model")
    day_ago = time.time() - 86400
    os.utime(reused, (day_ago, day_ago))
    with trial_process.workdir() as work:
        assert work.parent == own_tmp and work.name.startswith(f"autofit-trial-{os.getpid()}-")
        assert not dead.exists() and not reused.exists()
        assert live.exists() and old_style.exists() and other.exists()
    assert not work.exists()


# ---------------------------------------------------------------- a failed trial is no verdict
# issue 23: `check` of a 2-rank FSDP file with CPU offload reported the crashed trial ("Cannot
# access accelerator device when none is available") as "does NOT fit" and prescribed a
# smaller micro batch. A trial that fails for another reason than memory is exit 4, its cause.
CRASH = "RuntimeError: Cannot access accelerator device when none is available"


def _crashed(config, *a, **k) -> TrialResult:
    return TrialResult(oom=False, peak_allocated_bytes=None, peak_reserved_bytes=None,
                       device_total_bytes=None, step_time_s=None, tokens_per_s=None,
                       samples_per_s=None, error=CRASH, config=config.to_dict(), device="cpu",
                       batch_shape=(config.micro_batch_size, 32), isolation="subprocess",
                       isolation_reason="test", steps=0)


def test_a_trial_failed_for_another_reason_than_memory_is_exit_4_with_its_cause(
        tiny_path, tmp_path, monkeypatch, capsys):
    import autofit.trial
    from autofit.cli import main
    from autofit.preflight import PreflightError
    from autofit.preflight.check import run_check

    monkeypatch.setenv("AUTOFIT_CACHE_DIR", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(autofit.trial, "measure",
                        lambda model, config, *a, **k: calls.append(config) or _crashed(config))
    args = tmp_path / "train_args.yaml"
    args.write_text("per_device_train_batch_size: 4\ngradient_accumulation_steps: 2\n"
                    "use_cpu: true\n")
    code = main(["check", str(args), "--model", str(tiny_path), "--seq-len", "32",
                 "--device", "cpu", "--no-cache"])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert code == 4, out
    assert "Cannot access accelerator device" in out and "does NOT fit" not in out
    assert "micro batch 2 x accumulation 4" not in out  # no smaller micro batch prescribed
    # with fix=True no smaller micro batch is tried either: one trial, and exit 4 in Python
    calls.clear()
    report = run_check(str(tiny_path), TrainConfig(micro_batch_size=4, grad_accum_steps=2),
                       seq_len=32, device="cpu", cache=False, fix=True)
    assert report.trial_failed and not report.fits and len(calls) == 1
    assert not report.changes and CRASH in report.problems[0]
    assert PreflightError(report).exit_code == 4
