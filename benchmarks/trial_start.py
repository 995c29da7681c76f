"""What starting a capped-CPU trial costs: from the ``measure`` call to the child's work.

Runs ``autofit.trial.measure("tiny-llama", ..., device="cpu:2GiB")`` ``--repeat`` times
in one process and times, for each call, the moment the trial child opens its
``payload.pt`` (the first thing it does once its imports are done; seen with
Linux inotify, so the child is not touched) and the end of the call:

    OMP_NUM_THREADS=1 python benchmarks/trial_start.py                # both ways, 5 each
    OMP_NUM_THREADS=1 python benchmarks/trial_start.py --mode fresh   # one way

``fresh`` starts ``python -m autofit.trial.child`` for every trial
(``AUTOFIT_TRIAL_SERVER=0``); ``server`` forks each child from the pre-imported
trial server (``autofit.trial.server``), started by the first trial. Each way runs
in a process of its own (nothing imported or started by the other). Prints one
line per trial and the medians; ``--json`` for the numbers.

Known limitations:
    NB: Linux only (inotify, /proc). The first call of a process also pays the
    parent's own imports (the Trainer, for the step plan), the same both ways.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import select
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IN_OPEN = 0x20  # <sys/inotify.h>


class _FirstOpen:
    """The wall time of the first open of ``path`` by anyone (inotify, in a thread)."""

    def __init__(self, path: Path) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_CLOEXEC)
        if self.fd < 0 or self.libc.inotify_add_watch(self.fd, os.fsencode(path), IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), f"inotify on {path}")
        self.at: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while not self.done.is_set():
            if select.select([self.fd], [], [], 0.05)[0]:
                os.read(self.fd, 4096)
                self.at = time.time()
                return

    def close(self) -> float | None:
        self.done.set()
        self.thread.join()
        os.close(self.fd)
        return self.at


def run(mode: str, repeat: int) -> list[dict[str, float]]:
    """``repeat`` trials in this process, the ``mode`` way; seconds per trial."""
    if mode == "fresh":
        os.environ["AUTOFIT_TRIAL_SERVER"] = "0"
    sys.path.insert(0, str(ROOT))
    from autofit.config import TrainConfig
    from autofit.trial import measure, runner

    opened: list[_FirstOpen] = []
    run_child = runner._run_child

    def watched(work, *args, **kwargs):
        if not opened:  # the first attempt of the trial (a killed one is retried)
            opened.append(_FirstOpen(work / "payload.pt"))
        return run_child(work, *args, **kwargs)

    runner._run_child = watched
    out = []
    for _ in range(repeat):
        opened.clear()
        t0 = time.time()
        r = measure("tiny-llama", TrainConfig(micro_batch_size=1), seq_len=64, device="cpu:2GiB",
                    measure_steps=1)
        t1 = time.time()
        at = opened[0].close() if opened else None
        if not r.fits or at is None:
            raise SystemExit(f"trial failed or not seen: {r.error}")
        out.append({"to_child_work_s": at - t0, "measure_s": t1 - t0})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("fresh", "server", "both"), default="both")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        print(json.dumps(run(args.mode, args.repeat)))
        return 0
    modes = ("fresh", "server") if args.mode == "both" else (args.mode,)
    results = {}
    for mode in modes:  # a process each: nothing imported or started by the other
        done = subprocess.run(
            [sys.executable, __file__, "--mode", mode, "--repeat", str(args.repeat), "--_child"],
            check=True, capture_output=True, text=True,
        )
        results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        print(json.dumps(results, indent=1))
        return 0
    for mode, trials in results.items():
        starts = [t["to_child_work_s"] for t in trials]
        walls = [t["measure_s"] for t in trials]
        print(f"{mode}: measure() -> child's work, s: " + ", ".join(f"{s:.2f}" for s in starts)
              + f"  (median {statistics.median(starts):.2f}, median after the first "
              f"{statistics.median(starts[1:]) if len(starts) > 1 else float('nan'):.2f}); "
              f"measure() wall median {statistics.median(walls):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
