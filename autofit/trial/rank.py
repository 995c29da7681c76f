"""The processes of a trial on several ranks: the launcher and each rank.

``python -m autofit.trial.rank launch WORKDIR PARENT_PID`` is started by
``autofit.trial.ranks`` in a session of its own. It ties its life to the parent's
(``autofit.trial.process.guard_parent``) and runs ``torchrun`` in itself
(``torch.distributed.run.main``: the elastic agent, ``--standalone`` rendezvous, no
restarts) with the arguments in ``WORKDIR/launch.json``; torchrun starts one
``python -m autofit.trial.rank worker WORKDIR OWNER_PID`` per rank.

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
from typing import Any

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


def _write_json(path: Path, data: Any) -> None:
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


def _load_model(payload: dict[str, Any], device: Any) -> Any:
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


def run_rank(model: Any, batch: dict[str, Any], plan: Any, spec: Any, ranks: Any, device: Any,
             *, cap: int | None, warmup_steps: int, measure_steps: int, run: Any,
             deadline: float | None, status: Any) -> tuple[Any, str | None]:
    """Measure this rank's steps (the module docstring's protocol); its ``RawTrial`` and,
    when the ranks agreed to stop early, why (None when every step ran)."""
    import gc

    from autofit.trial import procmem
    from autofit.trial.distributed import wrap
    from autofit.trial.loop import RawTrial, _AccelMeter, _CpuMeter, _evaluate, _first_line, _sync
    from autofit.trial.oom import is_oom
    from autofit.trial.step import (
        Stepper,
        cut_batch,
        move_batch,
        prepare_model,
        setup_batch,
        storage_bytes,
    )

    raw = RawTrial()
    batch = move_batch(batch, device)
    meter: Any = None
    stepper: Any = None
    phase = "set-up"
    stopped_by: str | None = None
    slowest = [0.0]  # the slowest step so far: how long peers may take to reach the agreement

    def agree(code: int) -> int:
        status.sub("waiting for the other ranks")
        return ranks.agree(code, wait_s=AGREE_WAIT_S + 3 * slowest[0])

    def one_step(b: dict[str, Any]) -> tuple[int, int, str | None]:
        """One step, then the agreement: (agreed code, this rank's code, its error or None).
        The agreed code is -1 when the GradScaler skipped the step (inf grads)."""
        err, code = None, 0
        t0 = time.perf_counter()
        try:
            ok = stepper.step(b)
        except Exception as exc:  # noqa: BLE001 - every failure becomes part of the result
            code = 3 if is_oom(exc) else 2
            err = f"{phase} step: {_first_line(exc)}"
            if code == 2 and peer_gone(exc):
                err = f"{phase} step: stopped: another rank stopped ({_first_line(exc)[:120]})"
            ok = True
        else:
            slowest[0] = max(slowest[0], time.perf_counter() - t0)
        if deadline is not None and time.monotonic() > deadline:
            code = max(code, 1)
        agreed = agree(code)
        if agreed == 0 and not ok:
            return -1, code, None
        return agreed, code, err

    def stop(agreed: int, code: int, err: str | None) -> None:
        """Record why this rank stops with the others (``agreed`` > 0)."""
        nonlocal stopped_by
        if err is not None and ": stopped: another rank" in err:
            raw.error = err
            stopped_by = "another rank stopped"
        elif err is not None:  # its own failure
            raw.error = err
            raw.oom = code == 3
            stopped_by = "its own " + ("out of memory" if raw.oom else "failure")
        elif agreed == 1:
            raw.timed_out = True
            stopped_by = "the deadline"
        else:
            stopped_by = f"another rank {_CODE_WORDS.get(agreed, 'stopped')}"
            raw.error = f"{phase} step: stopped: {stopped_by}"

    try:
        status("preparing the model")
        prepare_model(model, plan)
        raw.notes.extend(plan.notes)
        # 1. the set-up step on this rank alone, unwrapped; the bare process
        status("set-up step")
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
        # 2. the wrapper and its set-up step (in lockstep with the peers)
        status(f"wrapping the model ({spec.strategy})")
        stepper = wrap(model, plan, spec, device, ranks.rank)
        stepper.on_phase = status.sub
        phase = "wrapped set-up"
        status("wrapped set-up step")
        agreed, code, err = one_step(setup_batch(batch))
        if agreed > 0:
            stop(agreed, code, err)
            return raw, stopped_by
        stepper.close()
        # 3. baseline
        if device.type == "cpu":
            meter = _CpuMeter(0, cap)
            base = meter.baseline()
            resident = max(0, base - bare) if base is not None and bare is not None else 0
            meter.resident = resident
            raw.resident_bytes = resident
            code = 0
            if cap is not None and resident >= cap:
                code = 3
            agreed = agree(code)
            if agreed > 0:
                if code:
                    raw.oom = True
                    raw.error = (f"the rank's resident weights, buffers and batch ({resident} "
                                 f"bytes) exceed its cap ({cap} bytes)")
                    stopped_by = "its own out of memory"
                else:
                    stop(agreed, 0, None)
                raw.peak_allocated_bytes = raw.peak_reserved_bytes = resident
                raw.device_total_bytes = resident
                return raw, stopped_by
        else:
            meter = _AccelMeter(device, 0)
            meter.baseline()
        raw.baseline_bytes = meter.base
        stepper.reopen()
        # 4. the steps
        phase = "warm-up"
        meter.arm()
        try:
            done = skipped = 0
            while done < warmup_steps:
                status(f"warm-up step {done + 1}/{warmup_steps}")
                agreed, code, err = one_step(batch)
                if agreed == -1 and skipped < 8:
                    skipped += 1
                    continue
                if agreed > 0:
                    stop(agreed, code, err)
                    break
                done += 1
                raw.warmup_done = done
            if stopped_by is None:
                meter.reset_peak()
                for i, length in enumerate(run.lengths if run is not None else ()):
                    phase = f"run (length {length})"
                    status(f"run step {i + 1} (length {length})")
                    agreed, code, err = one_step(cut_batch(batch, length))
                    if agreed > 0:
                        stop(agreed, code, err)
                        break
                    raw.run_steps += 1
            if stopped_by is None:
                phase = "measured"
                for i in range(measure_steps):
                    status(f"measured step {i + 1}/{measure_steps}")
                    _sync(device)
                    t0 = time.perf_counter()
                    agreed, code, err = one_step(batch)
                    if agreed > 0:
                        stop(agreed, code, err)
                        break
                    raw.step_times_s.append(time.perf_counter() - t0)
            if stopped_by is None and run is not None and run.eval_batch_size:
                status("evaluation step")
                _evaluate(stepper, batch, run, meter, raw)
                if agree(2 if raw.eval_error and not raw.eval_oom else 0) > 0:
                    stopped_by = stopped_by or "another rank's evaluation failed"
        finally:
            meter.disarm()
    except Exception as exc:  # noqa: BLE001 - outside the steps (wrapping, set-up)
        raw.oom = is_oom(exc)
        raw.error = f"{phase} step: {_first_line(exc)}"
        stopped_by = "its own " + ("out of memory" if raw.oom else "failure")
    if raw.timed_out:
        stopped_by = stopped_by or "the deadline"
    if meter is not None and meter.base is not None and raw.eval_device_total_bytes is None:
        raw.peak_allocated_bytes, raw.peak_reserved_bytes, raw.device_total_bytes = meter.peaks()
    return raw, stopped_by


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("launch", "worker"):
        print("usage: python -m autofit.trial.rank launch|worker WORKDIR PID", file=sys.stderr)
        return 2
    work = Path(argv[2])
    pid = int(argv[3]) if len(argv) > 3 else os.getppid()
    if argv[1] == "launch":
        return _launch(work, pid)
    return _worker(work, pid)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
