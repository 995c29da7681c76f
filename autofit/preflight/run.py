"""Run the user's own training command and measure its real peak: ``autofit run``.

    autofit run --device cpu:1GiB -- python train.py tuned.yaml
    autofit run --config tuned.yaml --json -- torchrun --nproc-per-node 2 train.py

    >>> from autofit.preflight.run import run_command
    >>> r = run_command(["python", "-c", "print('hi')"])  # doctest: +SKIP
    >>> r.exit_code, r.survived
    (0, True)

``run_command`` starts the command with a hook (``autofit.trial.runhook``, as a
``sitecustomize.py`` first on ``PYTHONPATH``) that every Python process of the run
loads, the ranks a launcher starts included. Each process that builds a model writes
what it measured: on the CPU the resident high-water mark above the baseline autofit's
trials use (RSS when the first ``nn.Module`` is constructed), on CUDA the allocator's
peaks. The run's measured peak is the largest process's; it is compared with the
whole-run figure of the tuned file (``predicted_run_bytes`` in its metadata), given
with ``config=`` or found among the command's arguments.

The device: ``cpu:CAP`` caps every process's address space at its baseline the way a
trial caps it, so a run that needs more than CAP dies with torch's CPU allocation
failure, as on a full device. On the CPU (``cpu``, ``cpu:CAP``) the command runs in
the environment trials measure in (``autofit.trial.procmem.CHILD_MALLOC_ENV``: one
malloc arena, big blocks mapped apart, one OpenMP thread, no oneDNN kernel cache),
unless the user's environment sets those variables. ``auto`` (the default) measures
whatever each process used.

The command's output passes through live; Ctrl-C reaches it directly (it runs in
autofit's process group, so the terminal interrupts both) and SIGTERM is forwarded.

Known limitations:
    NB: only Python processes that honour ``PYTHONPATH`` and ``site`` are measured
    (not ``python -I`` / ``-S``, not a non-Python program); without any record the
    run's peak is None and a note says why.
    NB: a process killed by a signal (the kernel's OOM killer, SIGKILL) writes no exit
    record: its peak is unknown.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from autofit.errors import BadInputError

__all__ = ["ProcessPeak", "RunRecord", "run_command", "tuned_prediction"]

_CONFIG_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class ProcessPeak:
    """What one process of the run measured (``autofit.trial.runhook``'s record).

    Attributes:
        pid: the process id.
        rank: ``RANK`` of a launched process, None otherwise.
        cpu_peak_bytes: resident high-water mark above the baseline (RSS when the first
            ``nn.Module`` was built); None when no model was built or not on Linux.
        baseline_bytes: RSS at the baseline (interpreter + imported libraries).
        cuda_peak_reserved_bytes: ``max_memory_reserved`` (largest over the devices it
            used); None when it used no CUDA device.
        cuda_peak_allocated_bytes: ``max_memory_allocated`` of the same device.
        address_space_bytes: the largest address space above the baseline's (VmPeak -
            VmSize then): what a ``cpu:CAP`` cap bounds. Above the resident peak by the
            mappings never touched (library code, thread stacks, reserved heap), so a
            run can die under a cap its resident peak is below.
        exited: the process wrote its exit record (False: killed by a signal, ``os._exit``).
        error: the exception that ended it, one line, if any.
    """

    pid: int
    rank: int | None
    cpu_peak_bytes: int | None
    baseline_bytes: int | None
    cuda_peak_reserved_bytes: int | None
    cuda_peak_allocated_bytes: int | None
    address_space_bytes: int | None
    exited: bool
    error: str | None = None

    @property
    def peak_bytes(self) -> int | None:
        """The device peak: CUDA's reserved when it used CUDA, else the CPU's."""
        if self.cuda_peak_reserved_bytes is not None:
            return self.cuda_peak_reserved_bytes
        return self.cpu_peak_bytes


@dataclass(frozen=True)
class RunRecord:
    """One ``autofit run``: the command, how it ended, measured vs. predicted peak.

    Attributes:
        command: the command as run.
        device: ``auto``, ``cpu``, ``cpu:1GiB``, ``cuda:0``, ...
        cap_bytes: the cap each process ran under (``cpu:CAP``), else None.
        exit_code: the command's exit status; 128 + N when signal N ended it.
        survived: it exited 0.
        out_of_memory: a process died of an allocation failure (CPU or CUDA).
        measured_bytes: the largest process's peak (``ProcessPeak.peak_bytes``).
        measured_kind: ``"cuda"`` or ``"cpu"``: which counter ``measured_bytes`` is.
        predicted_bytes: the tuned file's whole-run figure, None without one.
        config: the tuned file the prediction came from.
        processes: every process that built a model or used CUDA.
        notes: what the reader should know (no record, a device mismatch).
        guarded: the run's Trainers were guarded (``autofit run --guard``).
        rescues: the OOMs the guard absorbed (one line each: step, batch, pieces, peak).
    """

    command: tuple[str, ...]
    device: str
    cap_bytes: int | None
    exit_code: int
    survived: bool
    out_of_memory: bool
    measured_bytes: int | None
    measured_kind: str | None
    predicted_bytes: int | None
    config: str | None
    processes: tuple[ProcessPeak, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    guarded: bool = False
    rescues: tuple[str, ...] = ()

    @property
    def ratio(self) -> float | None:
        """measured / predicted, None when either is unknown."""
        if not self.measured_bytes or not self.predicted_bytes:
            return None
        return self.measured_bytes / self.predicted_bytes

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (``ratio`` included)."""
        out = asdict(self)
        out["command"] = list(self.command)
        out["processes"] = [dict(asdict(p), peak_bytes=p.peak_bytes) for p in self.processes]
        out["notes"] = list(self.notes)
        out["ratio"] = self.ratio
        return out


def run_command(command: Sequence[str], *, device: str | None = None,
                config: str | os.PathLike[str] | None = None,
                record: str | os.PathLike[str] | None = None,
                env: dict[str, str] | None = None, guard: bool = False) -> RunRecord:
    """Run ``command`` to its end and measure every process's peak memory.

    Args:
        command: the program and its arguments (``["python", "train.py", "tuned.yaml"]``).
        device: ``None``/``"auto"`` (measure what the processes use), ``"cpu"``,
            ``"cpu:CAP"`` (cap every process at CAP above its baseline), ``"cuda[:N]"``.
        config: the tuned file whose whole-run figure the peak is compared with;
            default: the first argument of the command that is a file autofit tuned.
        record: also write the JSON record (``RunRecord.to_dict``) to this file.
        env: the command's environment (default: this process's).
        guard: guard every ``transformers.Trainer`` of the command (``autofit.guard``): an
            OOM inside a micro step is split and the run goes on; the rescues are written
            beside the tuned file (``<name>-guard.jsonl``, which ``autofit check`` reads)
            and listed in ``RunRecord.rescues``.

    Returns:
        The ``RunRecord``; ``exit_code`` is the command's.

    Raises:
        BadInputError: an empty command, a command that cannot be started (not found,
            not executable), an unreadable ``config``, an unknown device, a ``record``
            path that cannot be written (all before the command starts).
    """
    command = [str(c) for c in command]
    if not command:
        raise BadInputError("no command to run: give it after --, e.g. "
                            "autofit run -- python train.py tuned.yaml")
    name, kind, cap = _device(device)
    predicted, config_path, notes = _prediction(command, config, name)
    if record is not None:  # before the run: a long run must not end on a path it cannot write
        from autofit.emit.output import check_output

        check_output(record, name="--record")
    with tempfile.TemporaryDirectory(prefix="autofit-run-") as tmp:
        hook_dir, records = Path(tmp) / "hook", Path(tmp) / "records"
        hook_dir.mkdir()
        records.mkdir()
        shutil.copyfile(Path(__file__).resolve().parent.parent / "trial" / "runhook.py",
                        hook_dir / "sitecustomize.py")
        child_env = _child_env(dict(os.environ if env is None else env), hook_dir, records,
                               kind, cap)
        notes += _launch_env(config_path, child_env)
        guard_record = None
        if guard:
            from autofit.trial.guard import record_beside

            guard_record = (record_beside(config_path) if config_path is not None
                            else records / "guard.jsonl")
            _guard_env(child_env, guard_record)
        started = time.time()
        exit_code = _run(command, child_env)
        processes = _read_records(records)
        rescues = _rescues_since(guard_record, started) if guard_record is not None else ()
    result = _record(command, name, cap, exit_code, processes, predicted, config_path, notes)
    if guard:
        result = replace(result, rescues=rescues, guarded=True)
    if record is not None:
        _write_record(Path(record), result)
    return result


def tuned_prediction(path: str | os.PathLike[str]) -> tuple[int | None, dict[str, Any]]:
    """(``predicted_run_bytes``, metadata) of a tuned file; raises ``BadInputError`` when
    the file cannot be read (``autofit.emit.read_config``)."""
    from autofit.emit import read_config

    _, meta = read_config(path)
    value = meta.get("predicted_run_bytes")
    return (int(value) if value else None), meta


def _device(device: str | None) -> tuple[str, str | None, int | None]:
    """(name, kind or None for auto, cap bytes or None)."""
    if device is None or str(device).strip().lower() == "auto":
        return "auto", None, None
    from autofit.probe.device import resolve_device

    info = resolve_device(device)
    if not info.present:
        raise BadInputError(f"{info.name} is not a device of this machine: autofit run "
                            "measures a real run; use --device cpu:CAP, cpu or cuda")
    return info.name, info.kind, (info.capacity_bytes if info.capped else None)


def _prediction(command: list[str], config: Any, device: str
                ) -> tuple[int | None, str | None, list[str]]:
    notes: list[str] = []
    if config is not None:
        predicted, meta = tuned_prediction(config)
        path = str(config)
    else:
        predicted, meta, path = None, {}, None
        for candidate in _file_arguments(command):
            try:
                value, found = tuned_prediction(candidate)
            except BadInputError:
                continue
            if found:  # a file autofit wrote (it carries autofit's metadata)
                predicted, meta, path = value, found, candidate
                break
    if path is not None and predicted is None:
        notes.append(f"{path} carries no whole-run figure (not tuned by autofit, or by an "
                     "older version): measured only")
    planned = meta.get("device")
    if planned and device != "auto" and str(planned) != device:
        notes.append(f"{path} was tuned for {planned}, this run is on {device}")
    return predicted, path, notes


def _launch_env(config_path: str | None, env: dict[str, str]) -> list[str]:
    """What the tuned file's launch file asks of the environment that no TrainingArguments
    field carries (``autofit.emit.launch``): a regional compile, which ``accelerate launch
    --config_file`` turns into ``ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION`` for the
    Trainer; set here too, so that a plain ``python train.py`` runs what was tuned. Returns
    the note saying so (nothing when unset, or when the environment says it already)."""
    if config_path is None:
        return []
    from autofit.emit.launch import accelerate_path, launch_settings
    from autofit.knobs.compile import REGIONAL_ENV

    launched = launch_settings(config_path)
    if not launched or not launched["regional"] or REGIONAL_ENV in env:
        return []
    env[REGIONAL_ENV] = "true"
    return [f"{REGIONAL_ENV}=true for the command: {accelerate_path(config_path).name} "
            "compiles each block apart (regional torch.compile), as tuned"]


def _file_arguments(command: list[str]) -> Iterator[str]:
    """Arguments that name an existing .yaml/.yml/.json file (``--x=FILE`` too)."""
    for arg in command[1:]:
        for part in (arg, arg.partition("=")[2]):
            if part.lower().endswith(_CONFIG_SUFFIXES) and os.path.isfile(part):
                yield part


def _guard_env(env: dict[str, str], guard_record: Path) -> None:
    """The child guards its Trainers (the hook's ``GUARD_ENV``), with autofit importable
    (its folder on ``PYTHONPATH`` after the hook's) and the rescues sent to ``guard_record``."""
    from autofit.trial.runhook import GUARD_ENV

    env[GUARD_ENV] = "1"
    env["AUTOFIT_GUARD_RECORD"] = str(guard_record)
    package_parent = str(Path(__file__).resolve().parent.parent.parent)
    parts = env["PYTHONPATH"].split(os.pathsep)
    env["PYTHONPATH"] = os.pathsep.join(parts[:1] + [package_parent] + parts[1:])


def _rescues_since(path: Path, started: float) -> tuple[str, ...]:
    """The rescue lines a guarded run wrote to ``path`` since ``started``."""
    from autofit.trial.guard import read_record

    return tuple(r.line() for r in read_record(path) if r.time >= started)


def _child_env(env: dict[str, str], hook_dir: Path, records: Path, kind: str | None,
               cap: int | None) -> dict[str, str]:
    from autofit.trial.procmem import CHILD_MALLOC_ENV
    from autofit.trial.runhook import CAP_ENV, HOOK_DIR_ENV, RECORD_DIR_ENV

    env[RECORD_DIR_ENV] = str(records)
    env[HOOK_DIR_ENV] = str(hook_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(hook_dir)] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop(CAP_ENV, None)
    if cap is not None:
        env[CAP_ENV] = str(cap)
    if kind == "cpu":  # measure as the trials measure, unless the user set these
        for k, v in CHILD_MALLOC_ENV.items():
            env.setdefault(k, v)
    return env


def _run(command: list[str], env: dict[str, str]) -> int:
    """Start the command, wait for it (SIGTERM forwarded), return its exit status."""
    try:
        proc = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        raise BadInputError(f"{command[0]}: command not found; give the program to run "
                            "after --, e.g. autofit run -- python train.py tuned.yaml") from None
    except PermissionError:
        raise BadInputError(f"{command[0]}: not executable (permission denied)") from None
    except OSError as e:
        raise BadInputError(f"{command[0]}: cannot start it ({e.strerror or e})") from None
    try:
        with _forwarding(proc):
            code = proc.wait()
    except KeyboardInterrupt:
        # Ctrl-C came between the start and the forwarding (the command has it too, in
        # this process group): wait for the command as if it had been ignored here
        with _forwarding(proc):
            code = proc.wait()
    return 128 + -code if code < 0 else code


@contextlib.contextmanager
def _forwarding(proc: subprocess.Popen) -> Iterator[None]:
    """While the command runs: Ctrl-C is the command's (it is in this process group, so the
    terminal sends SIGINT to both: passing it on would interrupt it twice; this process
    waits for the command to end and reports), SIGTERM is passed on to it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
                signal.SIGTERM: signal.signal(signal.SIGTERM, forward)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)


def _read_records(folder: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(folder.glob("*.json")):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(p.read_text()))
    return out


def _process(raw: dict[str, object]) -> ProcessPeak | None:
    cuda = max(raw.get("cuda") or [], key=lambda d: d.get("peak_reserved_bytes", 0),
               default=None)
    if "baseline_rss_bytes" not in raw and cuda is None:
        return None  # built no model, used no CUDA: a launcher, a helper, a tokenizer job
    rank = raw.get("rank")
    return ProcessPeak(
        pid=int(raw["pid"]),
        rank=int(rank) if rank not in (None, "") else None,
        cpu_peak_bytes=raw.get("peak_bytes"),
        baseline_bytes=raw.get("baseline_rss_bytes"),
        cuda_peak_reserved_bytes=cuda["peak_reserved_bytes"] if cuda else None,
        cuda_peak_allocated_bytes=cuda["peak_allocated_bytes"] if cuda else None,
        address_space_bytes=raw.get("address_space_bytes"),
        exited=bool(raw.get("exited")),
        error=raw.get("error"),
    )


def _record(command: list[str], device: str, cap: int | None, exit_code: int,
            raw: list[dict[str, object]], predicted: int | None, config: str | None,
            notes: list[str]) -> RunRecord:
    from autofit.trial.oom import OOM_MESSAGES

    processes = tuple(sorted((p for p in map(_process, raw) if p is not None),
                             key=lambda p: (p.rank is None, p.rank or 0, p.pid)))
    cuda = [p.cuda_peak_reserved_bytes for p in processes if p.cuda_peak_reserved_bytes]
    cpu = [p.cpu_peak_bytes for p in processes if p.cpu_peak_bytes is not None]
    measured, kind = (max(cuda), "cuda") if cuda else (max(cpu), "cpu") if cpu else (None, None)
    if not raw:
        notes.append("no Python process of the command reported (not Python, or run with "
                     "-I / -S): nothing measured")
    elif not processes:
        notes.append("no process built a torch model: nothing measured")
    notes += [f"process {p.pid} ended without its exit record (killed by a signal?): "
              "its peak is unknown" for p in processes if not p.exited]
    oom = any(p.error and any(m in p.error for m in OOM_MESSAGES) for p in processes)
    return RunRecord(command=tuple(command), device=device, cap_bytes=cap,
                     exit_code=exit_code, survived=exit_code == 0, out_of_memory=oom,
                     measured_bytes=measured, measured_kind=kind, predicted_bytes=predicted,
                     config=config, processes=processes, notes=tuple(notes))


def _write_record(path: Path, result: RunRecord) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    except OSError as e:
        raise BadInputError(f"could not write the record {path} ({e.strerror or e}); "
                            "choose another path") from None
