"""What the process tests watch from outside (``/proc``), shared by
``test_trial_faults.py`` and ``test_trial_server.py``: processes by what they do,
a capped child, leftovers in a temp dir, a script's environment. (The ``own_tmp`` fixture is in ``conftest.py``.)"""

from __future__ import annotations

import os
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GONE_WITHIN_S = 5.0


def stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    fields = stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")  # a zombie has ended


def processes() -> list[tuple[int, int, bytes]]:
    """(pid, parent pid, command line) of every process."""
    out = []
    for d in Path("/proc").iterdir():
        fields = stat(int(d.name)) if d.name.isdigit() else None
        try:
            if fields:
                out.append((int(d.name), int(fields[1]), (d / "cmdline").read_bytes()))
        except OSError:
            continue
    return out


def capped(pid: int) -> bool:
    """The process has set RLIMIT_AS: a trial child in its measured steps
    (autofit.trial.loop)."""
    try:
        for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
            if line.startswith("Max address space"):
                return line.split()[3] != "unlimited"
    except OSError:
        pass
    return False


def wait_for(predicate, timeout_s: float, what: str):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def leftovers(tmp: Path) -> list[str]:
    """autofit's entries in a temp dir (work dirs, TrainingArguments' output dirs...)."""
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("autofit-"))


def script_env(tmp: Path) -> dict[str, str]:
    """The environment of a script run by a test: temp and cache under ``tmp``, this
    checkout importable, no hub, the trial server at its default (on)."""
    env = dict(os.environ)
    env.pop("AUTOFIT_TRIAL_SERVER", None)
    env.update(TMPDIR=str(tmp), AUTOFIT_CACHE_DIR=str(tmp.parent / "cache"),
               PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    return env
