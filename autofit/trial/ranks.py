"""Trials on several ranks: the exact step under ``torchrun``, every rank measured.

``measure`` (``autofit.trial.runner``) comes here when ``config.world_size > 1``:

    >>> from autofit.config import TrainConfig
    >>> from autofit.trial import measure
    >>> r = measure("tiny-gpt2", TrainConfig(micro_batch_size=2, nproc_per_node=2,
    ...             strategy="fsdp"), seq_len=64, device="cpu:2GiB")      # doctest: +SKIP
    >>> [p["rank"] for p in r.per_rank], r.device_total_bytes == max(
    ...     p["device_total_bytes"] for p in r.per_rank)                  # doctest: +SKIP
    ([0, 1], True)

How: the model, the batch, the step's plan and a ``RankSpec`` (strategy, offload, each
rank's cap, the DeepSpeed config with its ``"auto"`` values filled as transformers fills
them) go to a work dir as for a subprocess trial (``payload.pt``: the user's model is
pickled, each rank loads its own copy; a model given by name is rebuilt by each rank).
``python -m autofit.trial.rank_process launch`` runs ``torchrun`` (``torch.distributed.run``,
standalone rendezvous, no restart) over ``nproc_per_node * nnodes`` rank processes on
this machine: gloo on the CPU, NCCL on CUDA (rank ``r`` on ``cuda:<local rank>``); each
rank of a capped CPU (``cpu:2GiB``) is capped on its own. What one rank runs and
measures: ``autofit.trial.rank_process``; how it wraps the model: ``autofit.trial.distributed``.

While the ranks run, ``progress`` (a callable taking a line) hears what each rank does.

The result: ``TrialResult.per_rank`` holds one dict per rank (``rank``, ``oom``,
``error``, ``peak_allocated_bytes``, ``peak_reserved_bytes``, ``device_total_bytes``,
``resident_bytes``, ``capacity_bytes``, ``step_time_s``, ``stopped_by``,
``last_output``); the top-level peaks are the peaking rank's (the one with the largest
``device_total_bytes``), ``capacity_bytes`` the smallest rank's, the step time the
slowest rank's (ranks wait for each other), ``tokens_per_s`` per rank. One rank out of
memory makes the trial ``oom`` (every rank stops at the same step).

A rank that hangs or dies: the trial's ``timeout_s`` kills the launcher and every rank
(their process groups), and the error says which rank was behind, in what phase, and
the last line it printed; a rank that died names its exit and last line. Nothing
outlives the caller: the launcher dies with it, the ranks with the launcher
(``autofit.trial.process.guard_parent``), and the work dir goes on every exit path.

Known limitations:
    NB: ``nnodes > 1`` runs every rank on this machine (its memory per rank is the run's;
    its speed is not: the communication is local).
    NB: on the CPU every rank is its own process, so ``world_size * cap`` must fit in
    this machine's memory.
    NB: a rank's process starts with the interpreter and its imports (seconds); the
    trial server's fork is not used for ranks.
    NB: a rank killed from outside (the host's out-of-memory killer) is reported
    (``killed_by``), not retried as a single trial process is.
    NB: the CUDA path (NCCL, ``cuda:<local rank>``) has not been run on a machine with
    several GPUs by these tests; the CPU path (gloo) has.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from autofit.config import TrainConfig
from autofit.errors import BadInputError, MissingDependencyError, UnknownDeviceError

if TYPE_CHECKING:
    import torch
    from transformers import TrainingArguments

    from autofit.config import Batch, ModelSource, ModelSpec, Progress
    from autofit.probe.device import DeviceInfo
    from autofit.trial.distributed import RankSpec
    from autofit.trial.loop import RawTrial
    from autofit.trial.step import RunSpec, StepPlan

__all__ = ["RankRun", "run_ranks", "rank_spec", "rank_caps", "check_ranks", "RANK_MALLOC_ENV"]

# glibc for rank processes: allocations of 128 KiB or more are mappings of their own and
# free memory above 128 KiB goes back to the kernel, so a rank's RSS follows its tensors
# (the setting found when several ranks were first probed here). Measured with this
# protocol on tiny-gpt2, 2 ranks, micro batch 2 x 64: DDP 437 MB and FSDP 324 MB per rank,
# the same (within 2 MB) with the single child's 64 KiB / trim 0.
RANK_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
POLL_S = 0.25
EXIT_GRACE_S = 10.0  # after every rank wrote its result, how long the launcher may take


class RankStatus(TypedDict):
    """A rank's ``rank-<r>.status`` file (``autofit.trial.rank_process``): what it does now, how
    many phases it went through, when (``time.time()``)."""

    phase: str
    n: int
    t: float


@dataclass
class RankRun:
    """What the ranks found: the trial's ``RawTrial`` (the peaking rank's numbers, the
    trial's verdict) and one dict per rank."""

    raw: Any
    per_rank: tuple[dict[str, Any], ...]
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- the plan


def rank_caps(dev: DeviceInfo, world_size: int) -> tuple[int | None, ...]:
    """Each rank's cap in bytes (the device's, on every rank; None: not capped)."""
    cap = dev.capacity_bytes if getattr(dev, "capped", False) else None
    return (cap,) * world_size


def check_ranks(config: TrainConfig, dev: DeviceInfo) -> None:
    """Raise when this machine cannot run ``config``'s ranks as a trial (one line, what to do),
    before any process starts: what no trial runs (a knob conflict: FSDP2 with a
    bitsandbytes optimizer), and what a CPU cannot (FSDP2's ``CPUOffloadPolicy`` asks the
    accelerator: "Cannot access accelerator device when none is available")."""
    from autofit.knobs import KNOBS, conflict

    world = config.world_size
    why = conflict({k.name: getattr(config, k.name) for k in KNOBS})
    if why is not None:
        raise BadInputError(why)
    if dev.kind == "cpu" and config.strategy in ("fsdp", "fsdp-shard-grad-op", "hsdp") \
            and config.offload != "none":
        from autofit.errors import fix

        raise BadInputError(
            f"FSDP2 with offload {config.offload} needs an accelerator (its CPUOffloadPolicy "
            "moves the shards to one), so CPU ranks cannot run it: plan it with "
            + fix("autofit estimate", "estimate()") + " for the GPUs, or trial with "
            + fix("--offload none", "offload='none'") + " or a ZeRO strategy")
    if dev.kind == "cpu":
        if dev.capped and world * dev.capacity_bytes > dev.total_bytes:
            from autofit.probe.device import format_bytes

            raise BadInputError(
                f"{world} ranks x {dev.name} need {format_bytes(world * dev.capacity_bytes)}, "
                f"more than this machine's {format_bytes(dev.total_bytes)}: every rank is a "
                "process here; use a smaller cap or fewer ranks")
        return
    import torch

    count = torch.accelerator.device_count() if hasattr(torch, "accelerator") else 0
    if count < world:
        raise UnknownDeviceError(
            f"{world} ranks need {world} {dev.kind} devices on this machine (each rank its "
            f"own; nnodes > 1 runs every rank here), it has {count}: plan with "
            "`autofit estimate`, or trial on fewer ranks")
    if dev.kind != "cuda":
        raise UnknownDeviceError(f"trials on several ranks run on CUDA or the CPU, not {dev.kind}")


def _find_unused(module: torch.nn.Module, config: TrainConfig) -> bool:
    """DDP's ``find_unused_parameters`` as the Trainer sets it (``ddp_find_unused_parameters``
    unset): ``not gradient checkpointing`` for a ``PreTrainedModel``, else True."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return True
    return not config.gradient_checkpointing if isinstance(module, PreTrainedModel) else True


class _WorldArgs:
    """A ``TrainingArguments`` seen with the run's ``world_size`` (it is 1 in this process)."""

    def __init__(self, args: TrainingArguments, world_size: int) -> None:
        self._args = args
        self.world_size = world_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._args, name)


def _resolved_deepspeed(config: TrainConfig, module: torch.nn.Module, use_cpu: bool,
                        user: dict[str, object] | None = None) -> dict[str, Any]:
    """The DeepSpeed config the tuned file carries (``user``: the user's own, as given),
    every ``"auto"`` filled as transformers
    fills it (``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``_finalize``: batch
    sizes, accumulation, clipping, precision, the bucket sizes from the hidden size), and
    ``zero_allow_untested_optimizer`` as ``deepspeed_optim_sched`` sets it for the
    Trainer's own optimizer."""
    import copy
    import tempfile

    from transformers import TrainingArguments
    from transformers.integrations import deepspeed as hf_ds

    from autofit.knobs import KNOBS
    from autofit.trial.step import _accelerate_state_kept, _restore_environ

    # the tuned file's fields (autofit.emit.training_arguments_dict: each knob writes its own)
    kwargs: dict[str, Any] = {"per_device_train_batch_size": config.micro_batch_size,
                              "gradient_accumulation_steps": config.grad_accum_steps,
                              "use_cpu": use_cpu}
    for k in KNOBS:
        k.emit(config, kwargs)
    ds = copy.deepcopy(user if user is not None else kwargs.pop("deepspeed"))
    kwargs.pop("deepspeed", None)
    for k in ("fsdp", "fsdp_config", "output_dir"):
        kwargs.pop(k, None)
    before = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="autofit-args-") as tmp, _accelerate_state_kept():
        try:
            args = _WorldArgs(TrainingArguments(output_dir=tmp, report_to=[], **kwargs),
                              config.world_size)
            hf = hf_ds.HfTrainerDeepSpeedConfig(ds)
            try:
                hf.trainer_config_process(args)
                hf.trainer_config_finalize(args, module, 1)
                out = copy.deepcopy(hf.config)
            finally:
                del hf
                hf_ds.unset_hf_deepspeed_config()  # no ZeRO-3 init for later models here
        finally:
            _restore_environ(before)
    if "optimizer" not in out:
        out["zero_allow_untested_optimizer"] = True
    return out


def rank_spec(config: TrainConfig, module: torch.nn.Module, dev: DeviceInfo,
              timeout_s: float | None, deepspeed: dict[str, object] | None = None) -> Any:
    """The ``RankSpec`` of ``config`` on ``dev`` (``module``: the model, meta or real;
    ``deepspeed``: the user's DeepSpeed config instead of the one autofit emits)."""
    from autofit.trial.distributed import ZERO_STAGES, RankSpec

    if config.strategy not in ZERO_STAGES:
        deepspeed = None
    else:
        try:
            import deepspeed as _  # noqa: F401
        except ImportError:
            raise MissingDependencyError(
                f"strategy {config.strategy} runs under DeepSpeed, which is not installed: "
                "pip install 'autofit[deepspeed]' (or measure --strategy fsdp)") from None
        deepspeed = _resolved_deepspeed(config, module, use_cpu=dev.kind == "cpu",
                                        user=deepspeed)
    return RankSpec(nproc_per_node=config.nproc_per_node, nnodes=config.nnodes,
                    strategy=config.strategy, offload=config.offload,
                    find_unused_parameters=_find_unused(module, config), deepspeed=deepspeed,
                    caps=rank_caps(dev, config.world_size),
                    timeout_s=float(timeout_s) if timeout_s else 1800.0)


# ---------------------------------------------------------------- running


def _env(device_type: str) -> dict[str, str]:
    from autofit.trial.process import child_env

    env = child_env()
    env.update(RANK_MALLOC_ENV)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if device_type == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU trial: no rank may take a GPU
    return env


def _torchrun_args(work: Path, world_size: int) -> list[str]:
    return ["--nnodes", "1", "--nproc-per-node", str(world_size), "--standalone",
            "--max-restarts", "0", "--monitor-interval", "0.2",
            "--log-dir", str(work / "torchrun"),  # not a torchelastic_* dir in the temp dir
            "-m", "autofit.trial.rank_process", "worker", str(work), str(os.getpid())]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _statuses(work: Path, world: int) -> list[RankStatus | None]:
    from autofit.trial.rank_process import status_path

    return [_read_json(status_path(work, r)) for r in range(world)]


def _progress_line(statuses: list[RankStatus | None], spec: RankSpec) -> str:
    """``2 ranks (fsdp): rank 0 measured step 2/3 · rank 1 measured step 2/3``: each rank's
    step (its forward, backward... are left out: they change too fast to read)."""
    parts = [f"rank {r} {s['phase'].split(': ')[0] if s else 'starting'}"
             for r, s in enumerate(statuses)]
    return f"{spec.world_size} ranks ({spec.strategy}): " + " · ".join(parts)


def _last_line(path: Path) -> str:
    """The last meaningful line a rank printed (warnings of the libraries skipped)."""
    try:
        data = path.read_bytes()[-8000:].decode("utf-8", "replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in data.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Warning" not in ln and not ln.startswith(_CHATTER):
            return ln[:300]
    return ""


# lines the libraries print on their own: never what a rank was doing
_CHATTER = ("warnings.warn", "[W", "W1", "[transformers]", "[rank", "[20", "Failed to load CPU")


def _kill_ranks(work: Path, world: int) -> None:
    from autofit.trial.rank_process import pid_path

    for r in range(world):
        try:
            pid = int(pid_path(work, r).read_text().strip())
        except (OSError, ValueError):
            continue
        for kill in (os.killpg, os.kill):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)


_EXIT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*exitcode\s*:\s*(-?\d+)")


def _exit_codes(launch_log: Path) -> dict[int, int]:
    """Each failed rank's exit code, from torchrun's failure summary."""
    try:
        text = launch_log.read_text(errors="replace")
    except OSError:
        return {}
    return {int(r): int(c) for r, c in _EXIT.findall(text)}


def run_ranks(model: ModelSource | ModelSpec, batch: Batch, plan: StepPlan, spec: RankSpec,
              tdev: torch.device, *, warmup_steps: int, measure_steps: int, timeout_s: float | None,
              run: RunSpec | None = None, progress: Progress | None = None) -> RankRun:
    """Run the trial's steps on ``spec.world_size`` ranks under torchrun; see the module."""
    import torch

    from autofit.trial import process
    from autofit.trial.rank_process import LAUNCH_FILE, result_path

    world = spec.world_size
    deadline = None if timeout_s is None else time.time() + float(timeout_s)
    timed_out = False
    with process.workdir() as work:
        torch.save({"model": model, "batch": {k: v.detach().cpu() for k, v in batch.items()},
                    "plan": plan, "spec": spec, "device": str(tdev.type),
                    "warmup_steps": warmup_steps, "measure_steps": measure_steps,
                    "deadline_wall": deadline, "run": run}, work / "payload.pt")
        (work / LAUNCH_FILE).write_text(json.dumps(_torchrun_args(work, world)))
        log = open(work / "launch.log", "wb")  # noqa: SIM115 - closed below
        proc = None
        last = None
        try:
            proc = process.start([sys.executable, "-m", "autofit.trial.rank_process", "launch",
                                  str(work), str(os.getpid())], env=_env(tdev.type), log=log)
            grace = 0.5 + 0.1 * float(timeout_s) if timeout_s else 0.0
            all_done_at = None
            while proc.poll() is None:
                now = time.time()
                if deadline is not None and now > deadline + min(5.0, grace):
                    timed_out = True
                    break
                statuses = _statuses(work, world)
                if progress is not None:
                    line = _progress_line(statuses, spec)
                    if line != last:
                        progress(line)
                        last = line
                if all(result_path(work, r).is_file() for r in range(world)):
                    all_done_at = all_done_at or now
                    if now - all_done_at > EXIT_GRACE_S:
                        break  # every rank answered; the launcher's exit is not waited for
                time.sleep(POLL_S)
            statuses = _statuses(work, world)
        finally:
            if proc is not None:
                process.stop(proc)
            _kill_ranks(work, world)  # each leads its own group (torchrun's new sessions)
            log.close()
        return _collect(work, spec, statuses, timed_out=timed_out, timeout_s=timeout_s)


def _collect(work: Path, spec: RankSpec, statuses: list[RankStatus | None], *, timed_out: bool,
             timeout_s: float | None) -> RankRun:
    """The ranks' results as one trial: the peaking rank's numbers, the verdict, per rank."""
    from autofit.trial.loop import RawTrial
    from autofit.trial.oom import is_oom
    from autofit.trial.process import describe_signal
    from autofit.trial.rank_process import log_path, result_path

    world = spec.world_size
    codes = _exit_codes(work / "launch.log")
    per: list[dict[str, Any]] = []
    raws: dict[int, RawTrial] = {}
    for r in range(world):
        data = _read_json(result_path(work, r))
        last = _last_line(log_path(work, r))
        if data is not None:
            fields = {k: v for k, v in data.items() if k in RawTrial.__dataclass_fields__}
            raws[r] = RawTrial(**fields)
            raw = raws[r]
            per.append({"rank": r, "oom": raw.oom, "error": raw.error,
                        "peak_allocated_bytes": raw.peak_allocated_bytes,
                        "peak_reserved_bytes": raw.peak_reserved_bytes,
                        "device_total_bytes": raw.device_total_bytes,
                        "resident_bytes": raw.resident_bytes,
                        "capacity_bytes": data.get("capacity_bytes"),
                        "step_time_s": raw.step_time_s, "stopped_by": data.get("stopped_by"),
                        "last_output": None})
            continue
        status = statuses[r]
        phase = status["phase"] if status else "starting"
        code = codes.get(r)
        if timed_out:
            error = f"did not finish: in {phase!r} at the deadline"
        elif code is not None and code < 0:
            error = f"died ({describe_signal(-code)}) in {phase!r}"
        elif code is not None:
            error = f"exited with status {code} in {phase!r}"
        else:
            error = f"ended without a result in {phase!r}"
        oom = not timed_out and is_oom(RuntimeError(last)) and code is not None and code != -9
        per.append({"rank": r, "oom": oom, "error": error + (f"; its last output: {last}"
                                                              if last else ""),
                    "peak_allocated_bytes": None, "peak_reserved_bytes": None,
                    "device_total_bytes": None, "resident_bytes": None,
                    "capacity_bytes": spec.caps[r] if r < len(spec.caps) else None,
                    "step_time_s": None, "stopped_by": None, "last_output": last or None,
                    "phase_n": status["n"] if status else 0, "stuck_in": phase})
    raw = _verdict(per, raws, spec, timed_out=timed_out, timeout_s=timeout_s)
    if not timed_out:  # a rank ended by a signal from outside (the host's OOM killer): said so
        from autofit.trial.process import killed_by

        raw.killed_by = next((k for r in range(world) if r not in raws
                              and (k := killed_by(codes.get(r))) is not None), None)
    why = _launch_failure(work, statuses)
    if why is not None and not raws:
        raw.error = why if not raw.timed_out else f"{raw.error} ({why})"
    for p in per:
        p.pop("phase_n", None)
        p.pop("stuck_in", None)
    notes = list(dict.fromkeys(n for r in raws.values() for n in r.notes))
    if spec.nnodes > 1:
        notes.append(f"{spec.nnodes} nodes x {spec.nproc_per_node} ran as {world} processes on "
                     "this machine (each rank's memory is the run's; the speed is not)")
    raw.notes = notes
    return RankRun(raw, tuple(per), notes)


def _verdict(per: list[dict[str, object]], raws: dict[int, RawTrial], spec: RankSpec, *,
             timed_out: bool, timeout_s: float | None) -> Any:
    """One ``RawTrial``: peaks of the peaking rank, the first rank's own out-of-memory or
    failure as the error, the slowest rank's steps, the run's own timeout."""
    from autofit.trial.loop import RawTrial

    measured = [p for p in per if p["device_total_bytes"] is not None]
    top = max(measured, key=lambda p: p["device_total_bytes"]) if measured else None
    out = RawTrial()
    if top is not None:
        src = raws[top["rank"]]
        out.peak_allocated_bytes = max(p["peak_allocated_bytes"] or 0 for p in measured)
        out.peak_reserved_bytes = max(p["peak_reserved_bytes"] or 0 for p in measured)
        out.device_total_bytes = top["device_total_bytes"]
        out.resident_bytes = src.resident_bytes
    if raws and len(raws) == len(per):
        times = [raws[r].step_times_s for r in sorted(raws)]
        n = min(len(t) for t in times)
        # ranks wait for each other: step i took as long as its slowest rank
        out.step_times_s = [max(t[i] for t in times) for i in range(n)]
        out.warmup_done = min(r.warmup_done for r in raws.values())
        out.run_steps = min(r.run_steps for r in raws.values())
        evals = [r.eval_device_total_bytes for r in raws.values()
                 if r.eval_device_total_bytes is not None]
        out.eval_device_total_bytes = max(evals) if len(evals) == len(raws) else None
        out.eval_oom = any(r.eval_oom for r in raws.values())
        out.eval_error = next((f"rank {k}: {r.eval_error}" for k, r in sorted(raws.items())
                               if r.eval_error), None)
        comp = [r.compile_s for r in raws.values() if r.compile_s is not None]
        out.compile_s = max(comp) if comp else None
    own = [p for p in per if p["oom"]]
    failed = [p for p in per if p["error"] is not None and not p["oom"]
              and not str(p.get("stopped_by") or "").startswith("another rank")]
    if own:
        p = own[0]
        out.oom = True
        out.error = f"rank {p['rank']}: {p['error']}"
        if len(own) > 1:
            out.error += f" (ranks {', '.join(str(q['rank']) for q in own)} ran out of memory)"
    elif timed_out or any(raws[r].timed_out for r in raws):
        out.timed_out = True
        out.error = _timeout_message(per, timeout_s)
    elif failed:
        p = failed[0]
        out.error = f"rank {p['rank']}: {p['error']}"
        if p.get("last_output") and p["last_output"] not in p["error"]:
            out.error += f" (its last output: {p['last_output']})"
    elif len(raws) < len(per):
        out.error = "; ".join(f"rank {p['rank']}: {p['error']}" for p in per
                              if p["rank"] not in raws)
    return out


def _launch_failure(work: Path, statuses: list[RankStatus | None]) -> str | None:
    """Why torchrun started no rank (its last line), when no rank ever wrote a status."""
    if any(s is not None for s in statuses):
        return None
    last = _last_line(work / "launch.log")
    return f"torchrun started no rank: {last}" if last else "torchrun started no rank"


def _timeout_message(per: list[dict[str, object]], timeout_s: float | None) -> str:
    """``timeout after 40s: rank 1 was furthest behind, in 'warm-up step 1/1: forward' (its
    last output: ...); rank 0 waited in 'warm-up step 1/1: backward'``."""
    left = [p for p in per if p["device_total_bytes"] is None and p.get("stuck_in")]
    head = f"timeout after {timeout_s:g}s" if timeout_s else "timeout"
    if not left:
        return head
    low = min(p["phase_n"] for p in left)
    behind = [p for p in left if p["phase_n"] == low]
    if len(behind) == len(left) and len(left) > 1:
        return (f"{head}: ranks {', '.join(str(p['rank']) for p in left)} all stuck in "
                f"{left[0]['stuck_in']!r}" + "".join(
                    f"; rank {p['rank']} last printed: {p['last_output']}" for p in left
                    if p["last_output"]))
    words = "; ".join(f"rank {p['rank']} was furthest behind, in {p['stuck_in']!r}"
                      + (f" (its last output: {p['last_output']})" if p["last_output"] else "")
                      for p in behind)
    rest = [p for p in left if p not in behind]
    if rest:
        words += "; " + "; ".join(f"rank {p['rank']} waited in {p['stuck_in']!r}" for p in rest)
    return f"{head}: {words}"
