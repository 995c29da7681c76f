"""The processes of a trial on several ranks: the launcher and each rank.

``python -m autofit.trial.rank_process launch WORKDIR PARENT_PID`` is started by
``autofit.trial.ranks`` in a session of its own. It ties its life to the parent's
(``autofit.trial.process.guard_parent``) and runs ``torchrun`` in itself
(``torch.distributed.run.main``: the elastic agent, ``--standalone`` rendezvous, no
restarts) with the arguments in ``WORKDIR/launch.json``; torchrun starts one
``python -m autofit.trial.rank_process worker WORKDIR OWNER_PID`` per rank.

Each rank writes, in ``WORKDIR``:

- ``rank-<r>.pid``: its pid (it leads a process group of its own: torchrun starts it in
  a new session), so that the parent can kill it on a timeout;
- ``rank-<r>.log``: everything it prints;
- ``rank-<r>.status``: what it is doing now (``{"phase": ..., "n": ...}``, ``n`` counting
  the phases it went through), read by the parent for progress and, on a timeout, to
  say which rank is behind;
- ``rank-<r>.json``: its ``RawTrial`` (what ``autofit.trial.loop`` returns), plus
  ``rank``, ``capacity_bytes`` and ``stopped_by`` (the agreement that stopped it).

A rank dies with the launcher (``guard_parent``: parent-death signal, polling).

The measurement, per rank (docs/design.md, "Truth and measurement", "Several processes"):

1. the model prepared as the Trainer does; one set-up step on this rank alone, on the
   unwrapped model, at the batch's full length (kernels, autograd, first-touch
   mappings); its optimizer state and gradients dropped; on the CPU the *bare* process
   is what is resident then less the model's and the batch's tensors;
2. the model wrapped (``autofit.trial.distributed.wrap``: DDP, FSDP2, ZeRO) and one
   wrapped set-up step on one sample (the wrapper's one-time buffers, the collectives'
   first use); a torch optimizer's state dropped again;
3. baseline; on the CPU the rank's *resident* bytes are the baseline less the bare
   process (its shard of the weights, the wrapper's buffers, ZeRO's partitions); the
   rank's cap (``RLIMIT_AS``) is its baseline + (cap - resident);
4. the warm-up steps, the peak reset, the run's other lengths and the timed steps;
   after each step the ranks agree (``Ranks.agree``) and all stop at the first step
   where any rank ran out of memory, failed or passed the deadline;
5. the peak: ``VmHWM`` above the baseline + resident (CPU), or the allocator's peaks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from autofit.config import Batch
    from autofit.trial.distributed import Ranks, RankSpec
    from autofit.trial.loop import RawTrial, _AccelMeter, _CpuMeter
    from autofit.trial.step import RunSpec, Stepper, StepPlan

__all__ = ["main", "peer_gone", "LAUNCH_FILE", "status_path", "result_path", "pid_path", "log_path"]

LAUNCH_FILE = "launch.json"
# How long a rank waits at the agreement for its peers, at least: a rank whose step failed
# arrives early, peers stuck in a collective that waits for it never arrive. Past the
# wait it stops alone, and its exit releases them (a closed connection fails their
# collective at once).
AGREE_WAIT_S = 10.0


def status_path(work: Path, rank: int) -> Path:
    return work / f"rank-{rank}.status"


def result_path(work: Path, rank: int) -> Path:
    return work / f"rank-{rank}.json"


def pid_path(work: Path, rank: int) -> Path:
    return work / f"rank-{rank}.pid"


def log_path(work: Path, rank: int) -> Path:
    return work / f"rank-{rank}.log"


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, path)


class _Status:
    """This rank's ``rank-<r>.status`` file: what it does (``label``, e.g. ``measured step
    2/3``, then ``: forward``, ``: backward``...) and how many phases it went through."""

    def __init__(self, work: Path, rank: int) -> None:
        self.path = status_path(work, rank)
        self.n = 0
        self.label = ""

    def __call__(self, label: str) -> None:
        self.label = label
        self._write(label)

    def sub(self, part: str) -> None:
        """A part of the current label's work (``forward``...; ``""``: the label alone)."""
        self._write(f"{self.label}: {part}" if part else self.label)

    def _write(self, phase: str) -> None:
        self.n += 1
        with contextlib.suppress(OSError):
            _write_json(self.path, {"phase": phase, "n": self.n, "t": time.time()})


# ---------------------------------------------------------------- the launcher


def _launch(work: Path, parent: int) -> int:
    from autofit.trial.process import guard_parent

    guard_parent(work, parent)
    args = json.loads((work / LAUNCH_FILE).read_text())
    from torch.distributed import run as torchrun

    try:
        torchrun.main(args)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:  # noqa: BLE001 - ChildFailedError: the ranks' files say what
        print(f"torchrun: {type(e).__name__}: {str(e).strip()[:2000]}", flush=True)
        return 1
    return 0


# ---------------------------------------------------------------- a rank


def _redirect(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _worker(work: Path, owner: int) -> int:
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    _redirect(log_path(work, rank))
    pid_path(work, rank).write_text(str(os.getpid()))
    from autofit.trial.process import guard_parent

    guard_parent(work, os.getppid(), owner_pid=owner)  # dies with the launcher
    status = _Status(work, rank)
    status("starting")
    import torch

    torch.set_num_threads(1)
    from autofit.trial.loop import RawTrial

    try:
        payload = torch.load(work / "payload.pt", weights_only=False)
        spec = payload["spec"]
        device = torch.device(payload["device"])
        if device.type != "cpu":
            device = torch.device(device.type, local)
            torch.accelerator.set_device_index(device)
        cap = spec.caps[rank] if rank < len(spec.caps) else None
        wall = payload.get("deadline_wall")
        deadline = time.monotonic() + (wall - time.time()) if wall else None
        status("joining the process group")
        from autofit.trial.distributed import join

        ranks = join(spec, device)
        status("loading the model")
        model = _load_model(payload, device)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, not raised
        from autofit.trial.oom import is_oom

        raw = RawTrial(oom=is_oom(exc), error=f"loading the model: {type(exc).__name__}: {exc}")
        _write_json(result_path(work, rank), {**asdict(raw), "rank": rank,
                                              "capacity_bytes": None, "stopped_by": None})
        status("done")
        return 0
    raw, stopped_by = run_rank(model, payload["batch"], payload["plan"], spec, ranks, device,
                               cap=cap, warmup_steps=int(payload["warmup_steps"]),
                               measure_steps=int(payload["measure_steps"]),
                               run=payload.get("run"), deadline=deadline, status=status)
    _write_json(result_path(work, rank), {**asdict(raw), "rank": rank, "capacity_bytes": cap,
                                          "stopped_by": stopped_by})
    status("done")
    if stopped_by is None:
        import torch.distributed as dist

        with contextlib.suppress(Exception):  # leaving anyway
            dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # a stopped rank may leave threads blocked in a collective: do not join them


def _load_model(payload: dict[str, object], device: torch.device) -> torch.nn.Module:
    import torch

    from autofit.trial.model import ModelRef, materialize

    torch.manual_seed(int(payload.get("seed", 0)))  # every rank builds the same weights
    plan = payload["plan"]
    model = payload["model"]
    if isinstance(model, ModelRef):
        model = materialize(model, device)
    if plan.precision.endswith("-true"):
        from autofit.probe.peft import upcast_adapters

        model.to(dtype=plan.param_dtype)
        upcast_adapters(model)
    return model.to(device)


_CODE_WORDS = {1: "passed the deadline", 2: "failed", 3: "ran out of memory"}
# what a collective raises when a peer process is gone (its exit closed the connection)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "communicator was aborted", "NCCL communicator", "remote worker crashing")


def peer_gone(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer rank is gone."""
    text = str(exc)
    return any(w in text for w in _PEER_GONE)


def run_rank(model: torch.nn.Module, batch: Batch, plan: StepPlan, spec: RankSpec,
             ranks: Ranks, device: torch.device, *, cap: int | None, warmup_steps: int,
             measure_steps: int, run: RunSpec | None, deadline: float | None,
             status: _Status) -> tuple[RawTrial, str | None]:
    """Measure this rank's steps (the module docstring's protocol); its ``RawTrial`` and,
    when the ranks agreed to stop early, why (None when every step ran)."""
    from autofit.trial.oom import is_oom
    from autofit.trial.step import move_batch

    rank = _RankSteps(ranks, status, deadline)
    raw = rank.raw
    batch = move_batch(batch, device)
    try:
        bare = rank.set_up(model, batch, plan, device)
        if not rank.wrap(model, batch, plan, spec, device):
            return raw, rank.stopped_by
        if not rank.baseline(model, device, cap, bare):
            return raw, rank.stopped_by
        rank.steps(batch, device, warmup_steps=warmup_steps, measure_steps=measure_steps,
                   run=run)
    except Exception as exc:  # noqa: BLE001 - outside the steps (wrapping, set-up)
        from autofit.trial.loop import _first_line

        raw.oom = is_oom(exc)
        raw.error = f"{rank.phase} step: {_first_line(exc)}"
        rank.stopped_by = "its own " + ("out of memory" if raw.oom else "failure")
    if raw.timed_out:
        rank.stopped_by = rank.stopped_by or "the deadline"
    meter = rank.meter
    if meter is not None and meter.base is not None and raw.eval_device_total_bytes is None:
        raw.peak_allocated_bytes, raw.peak_reserved_bytes, raw.device_total_bytes = meter.peaks()
    return raw, rank.stopped_by


class _RankSteps:
    """One rank's measurement in steps (``run_rank``): the set-up, the wrapper, the baseline
    and the steps, each step followed by the ranks' agreement; ``raw`` the measurement so
    far, ``stopped_by`` why the ranks stopped together (None while they go on)."""

    def __init__(self, ranks: Ranks, status: _Status, deadline: float | None) -> None:
        from autofit.trial.loop import RawTrial

        self.ranks, self.status, self.deadline = ranks, status, deadline
        self.raw = RawTrial()
        self.meter: _CpuMeter | _AccelMeter | None = None
        self.stepper: Stepper | None = None
        self.phase = "set-up"
        self.stopped_by: str | None = None
        self.slowest = 0.0  # the slowest step so far: how long peers may take to agree

    def agree(self, code: int) -> int:
        self.status.sub("waiting for the other ranks")
        return self.ranks.agree(code, wait_s=AGREE_WAIT_S + 3 * self.slowest)

    def one_step(self, b: Batch) -> tuple[int, int, str | None]:
        """One step, then the agreement: (agreed code, this rank's code, its error or None).
        The agreed code is -1 when the GradScaler skipped the step (inf grads)."""
        from autofit.trial.loop import _first_line
        from autofit.trial.oom import is_oom

        err, code = None, 0
        t0 = time.perf_counter()
        try:
            ok = self.stepper.step(b)
        except Exception as exc:  # noqa: BLE001 - every failure becomes part of the result
            code = 3 if is_oom(exc) else 2
            err = f"{self.phase} step: {_first_line(exc)}"
            if code == 2 and peer_gone(exc):
                err = f"{self.phase} step: stopped: another rank stopped ({_first_line(exc)[:120]})"
            ok = True
        else:
            self.slowest = max(self.slowest, time.perf_counter() - t0)
        if self.deadline is not None and time.monotonic() > self.deadline:
            code = max(code, 1)
        agreed = self.agree(code)
        if agreed == 0 and not ok:
            return -1, code, None
        return agreed, code, err

    def stop(self, agreed: int, code: int, err: str | None) -> None:
        """Record why this rank stops with the others (``agreed`` > 0)."""
        raw = self.raw
        if err is not None and ": stopped: another rank" in err:
            raw.error = err
            self.stopped_by = "another rank stopped"
        elif err is not None:  # its own failure
            raw.error = err
            raw.oom = code == 3
            self.stopped_by = "its own " + ("out of memory" if raw.oom else "failure")
        elif agreed == 1:
            raw.timed_out = True
            self.stopped_by = "the deadline"
        else:
            self.stopped_by = f"another rank {_CODE_WORDS.get(agreed, 'stopped')}"
            raw.error = f"{self.phase} step: stopped: {self.stopped_by}"

    def _stepped(self, b: Batch) -> bool:
        """One step and the agreement; False (the stop recorded) when the ranks stop."""
        agreed, code, err = self.one_step(b)
        if agreed > 0:
            self.stop(agreed, code, err)
            return False
        return True

    def set_up(self, model: torch.nn.Module, batch: Batch, plan: StepPlan,
               device: torch.device) -> int | None:
        """1. the set-up step on this rank alone, unwrapped; the bare process's bytes (CPU;
        None elsewhere)."""
        import gc

        from autofit.trial import procmem
        from autofit.trial.step import Stepper, prepare_model, setup_batch, storage_bytes

        self.status("preparing the model")
        prepare_model(model, plan)
        self.raw.notes.extend(plan.notes)
        self.status("set-up step")
        plain = Stepper(model, plan, device)
        plain.step(setup_batch(batch))
        plain.close()
        del plain
        bare = None
        if device.type == "cpu":
            gc.collect(1)
            procmem.malloc_trim()
            rss = procmem.rss_bytes()
            if rss is not None:
                bare = rss - storage_bytes(model.parameters(), model.buffers(), batch.values())
        return bare

    def wrap(self, model: torch.nn.Module, batch: Batch, plan: StepPlan, spec: RankSpec,
             device: torch.device) -> bool:
        """2. the wrapper and its set-up step (in lockstep with the peers); False when the
        ranks stop there."""
        from autofit.trial.distributed import wrap
        from autofit.trial.step import setup_batch

        self.status(f"wrapping the model ({spec.strategy})")
        self.stepper = wrap(model, plan, spec, device, self.ranks.rank)
        self.stepper.on_phase = self.status.sub
        self.phase = "wrapped set-up"
        self.status("wrapped set-up step")
        if not self._stepped(setup_batch(batch)):
            return False
        self.stepper.close()
        return True

    def baseline(self, model: torch.nn.Module, device: torch.device, cap: int | None,
                 bare: int | None) -> bool:
        """3. the baseline (on the CPU the rank's resident bytes, agreed against its cap);
        False when the ranks stop there."""
        from autofit.trial.loop import _AccelMeter, _CpuMeter

        raw = self.raw
        if device.type == "cpu":
            meter = self.meter = _CpuMeter(0, cap)
            base = meter.baseline()
            resident = max(0, base - bare) if base is not None and bare is not None else 0
            meter.resident = resident
            raw.resident_bytes = resident
            code = 0
            if cap is not None and resident >= cap:
                code = 3
            agreed = self.agree(code)
            if agreed > 0:
                if code:
                    raw.oom = True
                    raw.error = (f"the rank's resident weights, buffers and batch ({resident} "
                                 f"bytes) exceed its cap ({cap} bytes)")
                    self.stopped_by = "its own out of memory"
                else:
                    self.stop(agreed, 0, None)
                raw.peak_allocated_bytes = raw.peak_reserved_bytes = resident
                raw.device_total_bytes = resident
                return False
        else:
            meter = self.meter = _AccelMeter(device, 0)
            meter.baseline()
        raw.baseline_bytes = meter.base
        self.stepper.reopen()
        return True

    def steps(self, batch: Batch, device: torch.device, *, warmup_steps: int,
              measure_steps: int, run: RunSpec | None) -> None:
        """4. the warm-up steps, the peak reset, the run's other lengths, the timed steps and
        the evaluation step, while the meter is armed."""
        self.phase = "warm-up"
        self.meter.arm()
        try:
            self._warm_up(batch, warmup_steps)
            if self.stopped_by is None:
                self.meter.reset_peak()
                self._run_lengths(batch, run)
            if self.stopped_by is None:
                self._measured(batch, device, measure_steps)
            if self.stopped_by is None and run is not None and run.eval_batch_size:
                from autofit.trial.loop import _evaluate

                self.status("evaluation step")
                _evaluate(self.stepper, batch, run, self.meter, self.raw)
                if self.agree(2 if self.raw.eval_error and not self.raw.eval_oom else 0) > 0:
                    self.stopped_by = self.stopped_by or "another rank's evaluation failed"
        finally:
            self.meter.disarm()

    def _warm_up(self, batch: Batch, warmup_steps: int) -> None:
        done = skipped = 0
        while done < warmup_steps:
            self.status(f"warm-up step {done + 1}/{warmup_steps}")
            agreed, code, err = self.one_step(batch)
            if agreed == -1 and skipped < 8:
                skipped += 1
                continue
            if agreed > 0:
                self.stop(agreed, code, err)
                break
            done += 1
            self.raw.warmup_done = done

    def _run_lengths(self, batch: Batch, run: RunSpec | None) -> None:
        from autofit.trial.step import cut_batch

        for i, length in enumerate(run.lengths if run is not None else ()):
            self.phase = f"run (length {length})"
            self.status(f"run step {i + 1} (length {length})")
            if not self._stepped(cut_batch(batch, length)):
                break
            self.raw.run_steps += 1

    def _measured(self, batch: Batch, device: torch.device, measure_steps: int) -> None:
        from autofit.trial.loop import _sync

        self.phase = "measured"
        for i in range(measure_steps):
            self.status(f"measured step {i + 1}/{measure_steps}")
            _sync(device)
            t0 = time.perf_counter()
            if not self._stepped(batch):
                break
            self.raw.step_times_s.append(time.perf_counter() - t0)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("launch", "worker"):
        print("usage: python -m autofit.trial.rank_process launch|worker WORKDIR PID",
              file=sys.stderr)
        return 2
    work = Path(argv[2])
    pid = int(argv[3]) if len(argv) > 3 else os.getppid()
    if argv[1] == "launch":
        return _launch(work, pid)
    return _worker(work, pid)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
