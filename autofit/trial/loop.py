"""Run the steps of one trial in *this* process and measure them.

Shared by the in-process runner (``trial.py``) and the trial child
(``autofit/trial/child.py``). The protocol (docs/design.md, "Truth and measurement"):

1. prepare the model as the Trainer does; one set-up step on one sample at the
   batch's full length (``step.setup_batch``) and free it: autograd and kernel
   one-time set-up, lazy imports, first-touch pages and the mappings a process
   keeps after its first real-size step happen here, not in the measurement
   (on the CPU what they leave resident is kept apart, ``RawTrial.setup_bytes``: a run
   counts it, ``autofit.stages.run.whole_run``);
   with ``torch_compile`` the set-up steps are one at every shape the trial will
   step instead (the batch, the run's lengths, the evaluation step): compilation, its
   memory and the compiled code a run keeps happen here, neither measured nor timed
   (``compile_s``);
2. baseline: CPU - RSS after ``malloc_trim``; accelerator - ``memory_allocated``;
3. capped CPU only: ``RLIMIT_AS`` := VmSize + (cap - resident tensors), so the
   cap bounds weights + buffers + batch + everything the steps allocate;
4. ``warmup_steps`` steps (optimizer state appears), reset the peak counters
   (``/proc/self/clear_refs`` or ``reset_peak_memory_stats``), ``measure_steps``
   timed steps, read the peaks. With a replay (``RunSpec.lengths``) the first timed
   step runs before it and at least one after it: a peak over the search's budget or a
   speed a confirmed rival outpaces (``RunSpec.outpaced_below_tokens_per_s``) stops the
   trial after one full-length step, before the replay's cost; the run's peak, the
   longest step after the short ones, is still measured by every trial that goes on;
5. free everything the trial made and check memory is back at the baseline.

An exception is turned into a message *outside* the ``except`` block (its frames
hold the step's tensors), then dropped before the clean-up.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from autofit.trial import procmem
from autofit.trial.oom import is_oom
from autofit.trial.step import (
    RunSpec,
    Stepper,
    StepPlan,
    compile_model,
    cut_batch,
    free_grads,
    move_batch,
    prepare_model,
    setup_batch,
    storage_bytes,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from autofit.config import Batch

__all__ = ["RawTrial", "run_steps", "CPU_LEAK_TOLERANCE", "ACCEL_LEAK_TOLERANCE"]

MiB = 1 << 20
# Memory left above the baseline after a trial that still counts as "recovered".
CPU_LEAK_TOLERANCE = 32 * MiB  # RSS: Python/allocator caches move by a few MiB
ACCEL_LEAK_TOLERANCE = 1 * MiB  # memory_allocated is exact


@dataclass
class RawTrial:
    """What one run of the steps found (plain data; travels as JSON from a child)."""

    oom: bool = False
    error: str | None = None
    timed_out: bool = False
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    device_total_bytes: int | None = None
    step_times_s: list[float] = field(default_factory=list)
    optimizer_times_s: list[float] = field(default_factory=list)  # each timed step's own
    warmup_done: int = 0
    resident_bytes: int | None = None  # weights + buffers + batch, counted on CPU
    baseline_bytes: int | None = None
    leaked_bytes: int | None = None
    recovered: bool | None = None
    notes: list[str] = field(default_factory=list)
    killed_by: str | None = None  # subprocess: the outside signal that ended the child
    run_steps: int = 0  # steps of the run's other lengths replayed (RunSpec.lengths)
    eval_device_total_bytes: int | None = None  # the evaluation step (RunSpec.eval_batch_size)
    eval_oom: bool = False
    eval_error: str | None = None
    compile_s: float | None = None  # torch_compile: the set-up steps that compiled (untimed)
    over_budget: bool = False  # stopped once the peak passed RunSpec.stop_above_bytes
    outpaced: bool = False  # stopped after its first timed step: slower than a rival (RunSpec)
    phase_s: dict[str, float] = field(default_factory=dict)  # where the trial's time went
    # CPU: resident memory the set-up step left for good (trimmed), which a run counts from
    # its model's construction and the measured steps do not (``setup_bytes``)
    setup_bytes: int | None = None

    @property
    def step_time_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    @property
    def optimizer_time_s(self) -> float | None:
        return statistics.median(self.optimizer_times_s) if self.optimizer_times_s else None


def run_step_s(step_s: float, optimizer_s: float | None, micro: int, accum: int) -> float:
    """An optimizer step of the run, from a trial's: the trial runs ``micro`` micro batches
    (``min(accum, 2)``) before its optimizer step, the run ``accum``; the micro batches'
    time scales, the optimizer step's does not. (A trial measured at accumulation 2 for a
    run at 8 would otherwise charge the optimizer step 4x its share: adamw_torch_fused
    measured 1.21x faster than adamw_torch on tiny-gpt2, micro batch 2, a CPU.)"""
    if optimizer_s is None or micro <= 0 or accum == micro or not 0 <= optimizer_s < step_s:
        return step_s * accum / max(micro, 1)
    return (step_s - optimizer_s) / micro * accum + optimizer_s


class _AccelAPI:
    """Allocator counters of one accelerator type.

    ``torch.accelerator`` (torch >= 2.8) when it serves this device type, else the
    per-backend module (``torch.cuda``, ``torch.xpu``) with its older names.
    """

    def __init__(self, device_type: str) -> None:
        acc = getattr(torch, "accelerator", None)
        current = acc.current_accelerator() if acc is not None and acc.is_available() else None
        self.generic = (
            acc is not None
            and current is not None
            and current.type == device_type
            and hasattr(acc, "max_memory_allocated")
        )
        self.mod = acc if self.generic else getattr(torch, device_type)

    def index(self) -> int:
        if self.generic:
            return self.mod.current_device_index()
        return self.mod.current_device()

    def synchronize(self, idx: int) -> None:
        self.mod.synchronize(idx)

    def empty_cache(self) -> None:
        self.mod.empty_cache()

    def allocated(self, idx: int) -> int:
        return int(self.mod.memory_allocated(idx))

    def max_allocated(self, idx: int) -> int:
        return int(self.mod.max_memory_allocated(idx))

    def max_reserved(self, idx: int) -> int:
        return int(self.mod.max_memory_reserved(idx))

    def reset_peak(self, idx: int) -> None:
        self.mod.reset_peak_memory_stats(idx)

    def mem_info(self, idx: int) -> tuple[int, int]:
        """(free, total) bytes of the device, every process counted."""
        if self.generic:
            free, total = self.mod.get_memory_info(idx)
        else:
            free, total = self.mod.mem_get_info(idx)
        return int(free), int(total)


def _accel(device_type: str) -> _AccelAPI:
    return _AccelAPI(device_type)


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        api = _accel(device.type)
        api.synchronize(device.index if device.index is not None else api.index())


class _CpuMeter:
    """Peak resident memory of this process, from /proc (outside the tensor layer)."""

    def __init__(self, resident: int, cap: int | None) -> None:
        self.resident = resident
        self.cap = cap
        self.base: int | None = None
        self.anon_base: int | None = None
        self.previous_limit: tuple[int, int] | None = None

    def baseline(self) -> int | None:
        gc.collect(1)  # the young generations: a full collection costs ~0.3 s here
        procmem.malloc_trim()
        self.base = procmem.rss_bytes()
        self.anon_base = procmem.anon_rss_bytes()
        return self.base

    def arm(self) -> None:
        if self.cap is not None:
            self.previous_limit = procmem.cap_address_space(self.cap - self.resident)
        procmem.reset_peak_rss()

    def disarm(self) -> None:
        if self.previous_limit is not None:
            procmem.restore_address_space(self.previous_limit)
            self.previous_limit = None

    def reset_peak(self) -> None:
        procmem.reset_peak_rss()

    def peaks(self) -> tuple[int | None, int | None, int | None]:
        hwm = procmem.peak_rss_bytes()
        if hwm is None or self.base is None:
            return None, None, None
        peak = max(0, hwm - self.base) + self.resident
        return peak, peak, peak

    def leaked(self) -> int | None:
        """Anonymous memory above the baseline (code pages faulted in are not a leak)."""
        if self.anon_base is None:
            return None
        for generation in (1, 2):  # a full collection only when memory looks held
            gc.collect(generation)
            procmem.malloc_trim()
            now = procmem.anon_rss_bytes()
            if now is None or now - self.anon_base <= self.tolerance:
                break
        return None if now is None else max(0, now - self.anon_base)

    tolerance = CPU_LEAK_TOLERANCE


class _AccelMeter:
    """torch's allocator counters on a CUDA-like device (reset around the measured steps)."""

    def __init__(self, device: torch.device, excluded: int) -> None:
        self.device = device
        self.api = _accel(device.type)
        self.idx = device.index if device.index is not None else self.api.index()
        self.excluded = excluded
        self.base: int | None = None

    def baseline(self) -> int:
        gc.collect(1)
        self.api.synchronize(self.idx)
        self.api.empty_cache()
        self.base = self.api.allocated(self.idx)
        return self.base

    def arm(self) -> None:
        self.reset_peak()

    def disarm(self) -> None:
        pass

    def reset_peak(self) -> None:
        self.api.synchronize(self.idx)
        self.api.reset_peak(self.idx)

    def peaks(self) -> tuple[int | None, int | None, int | None]:
        self.api.synchronize(self.idx)
        alloc = self.api.max_allocated(self.idx) - self.excluded
        reserved = self.api.max_reserved(self.idx) - self.excluded
        free, total = self.api.mem_info(self.idx)
        used = total - free - self.excluded  # every process on the device, context included
        return max(0, alloc), max(0, reserved), max(0, used)

    def leaked(self) -> int | None:
        if self.base is None:
            return None
        for generation in (1, 2):  # a full collection only when memory looks held
            gc.collect(generation)
            self.api.synchronize(self.idx)
            now = self.api.allocated(self.idx)
            if now - self.base <= self.tolerance:
                break
        self.api.empty_cache()
        return max(0, now - self.base)

    tolerance = ACCEL_LEAK_TOLERANCE


def _resident_now() -> int | None:
    """RSS now, measured as ``_CpuMeter.baseline`` measures it (young garbage collected,
    glibc's free pages given back), so that the two readings differ only by what stays."""
    gc.collect(1)
    procmem.malloc_trim()
    return procmem.rss_bytes()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    head = text[0] if text else ""
    # torch prefixes allocator errors with "[enforce fail at alloc_cpu.cpp:127] err == 0. "
    if "] " in head and head.startswith("[enforce fail"):
        head = head.split("] ", 1)[1].removeprefix("err == 0. ")
    return f"{type(exc).__name__}: {head}"[:500]


def _evaluate(stepper: Stepper, batch: dict[str, torch.Tensor], run: RunSpec,
              meter: _CpuMeter | _AccelMeter, raw: RawTrial) -> None:
    """The evaluation step of ``run``, its peak measured apart from the training's (which
    is read first and kept in ``raw``)."""
    raw.peak_allocated_bytes, raw.peak_reserved_bytes, raw.device_total_bytes = meter.peaks()
    length = run.eval_length or int(batch["input_ids"].shape[1])
    error = None
    meter.reset_peak()
    try:
        stepper.evaluate(cut_batch(batch, length, rows=run.eval_batch_size))
    except Exception as exc:  # noqa: BLE001 - an eval failure is part of the result
        raw.eval_oom = is_oom(exc)
        error = f"evaluation step: {_first_line(exc)}"
    raw.eval_error = error
    raw.eval_device_total_bytes = meter.peaks()[2]


def _passed_budget(meter: _CpuMeter | _AccelMeter, run: RunSpec | None, raw: RawTrial, what: str
                   ) -> bool:
    """Whether the peak since the warm-up passed ``run.stop_above_bytes`` (then noted in
    ``raw``): the peak only grows, so the trial's verdict (over the budget) is settled."""
    limit = run.stop_above_bytes if run is not None else None
    if limit is None:
        return False
    total = meter.peaks()[2]
    if total is None or total <= limit:
        return False
    raw.over_budget = True
    raw.notes.append(f"stopped after {what}: the peak ({total} bytes) passed the budget "
                     f"({limit} bytes); the steps left cannot bring it back under")
    return True


def _timed_step(stepper: Stepper, batch: dict[str, torch.Tensor], device: torch.device,
                meter: _CpuMeter | _AccelMeter, run: RunSpec | None, raw: RawTrial,
                deadline: float | None) -> str | None:
    """One timed full-length step (its time in ``raw.step_times_s``), and why the trial
    stops there, if it does: ``"budget"`` (its peak passed the budget), ``"outpaced"`` (its
    first step is slower than ``run.outpaced_below_tokens_per_s``: ``raw.outpaced``) or
    ``"deadline"``."""
    _sync(device)
    t0 = time.perf_counter()
    stepper.step(batch)
    _sync(device)
    took = time.perf_counter() - t0
    raw.step_times_s.append(took)
    raw.optimizer_times_s.append(stepper.optimizer_s)
    if _passed_budget(meter, run, raw, "a timed step"):
        return "budget"
    slower = run.outpaced_below_tokens_per_s if run is not None else None
    if slower and len(raw.step_times_s) == 1 and took > 0:
        rows, length = (int(n) for n in batch["input_ids"].shape[:2])
        accum = stepper.plan.grad_accum_steps
        speed = accum * rows * length / run_step_s(
            took, stepper.optimizer_s, stepper.plan.micro_batches_per_step, accum)
        if speed < slower:
            raw.outpaced = True
            raw.notes.append(f"stopped after its first timed step: {speed:,.0f} tokens/s, below "
                             f"{slower:,.0f} (a confirmed rival's speed over the search's "
                             "outpacing factor): it cannot be chosen, its run is not replayed")
            return "outpaced"
    if deadline is not None and time.monotonic() > deadline:
        return "deadline"
    return None


def _replay_moot(meter: _CpuMeter | _AccelMeter, run: RunSpec, raw: RawTrial) -> bool:
    """Whether the first timed step's peak is so far under the budget that the replay
    cannot change the verdict (``RunSpec.replay_within``); noted in ``raw`` when it is."""
    if run.replay_within is None or run.stop_above_bytes is None:
        return False
    total = meter.peaks()[2]
    if total is None or total * (1 + run.replay_within) >= run.stop_above_bytes:
        return False
    raw.notes.append(f"the run's first lengths not replayed: the longest step's peak "
                     f"({total} bytes) is more than {100 * run.replay_within:g}% under the "
                     f"budget ({run.stop_above_bytes} bytes), more than what short batches "
                     "leave fragmented can add")
    return True


def _decided(times: list[float], spread: float | None, asked: int) -> bool:
    """Whether the timed steps so far settle the step time: two that agree within
    ``spread`` (a fraction); the median of any more steps lies between them when at most
    one more is asked, and the two already agree within the tie the search allows."""
    if spread is None or len(times) != 2 or asked != 3:
        return False
    a, b = sorted(times)
    return b - a <= spread * a


def _replay_spent(run: RunSpec | None, i: int, t0: float, raw: RawTrial) -> bool:
    """Whether the replay's time bound (``RunSpec.replay_s``, from ``t0``) is spent before
    its ``i``-th length (the first always runs); noted in ``raw`` when it is."""
    if run is None or run.replay_s is None or not i or time.monotonic() - t0 <= run.replay_s:
        return False
    raw.notes.append(f"replayed {i} of the run's {len(run.lengths)} first lengths (the "
                     f"replay's bound: {run.replay_s:g} s)")
    return True


def _compile_steps(stepper: Stepper, batch: dict[str, torch.Tensor], run: RunSpec | None) -> None:
    """One step at every shape the trial will step, so that each is compiled before the
    baseline: the batch (its static graph), the run's other lengths (a second shape
    recompiles once with symbolic ones) and the evaluation step (eval mode is a graph of
    its own)."""
    stepper.step(batch)
    for length in dict.fromkeys(run.lengths if run is not None else ()):
        stepper.step(cut_batch(batch, length))
    if run is not None and run.eval_batch_size:
        length = run.eval_length or int(batch["input_ids"].shape[1])
        stepper.evaluate(cut_batch(batch, length, rows=run.eval_batch_size))


def run_steps(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    plan: StepPlan,
    device: torch.device,
    *,
    warmup_steps: int,
    measure_steps: int,
    cap_bytes: int | None = None,
    excluded_bytes: int = 0,
    deadline: float | None = None,
    run: RunSpec | None = None,
) -> RawTrial:
    """Prepare ``model`` (mutated: the caller owns a copy or a snapshot) and measure.

    ``run``: the run's other lengths (one step each, after the warm-up, before the timed
    steps: their peak counts) and an evaluation step after the timed steps, measured
    apart (``eval_device_total_bytes``; an out-of-memory there is ``eval_oom``, not
    the training's).
    ``cap_bytes``: a CPU cap (weights + buffers + batch + the steps' memory).
    ``excluded_bytes``: accelerator bytes that belong to no part of the run (the
    user's original model when the trial runs on a copy beside it).
    ``deadline``: ``time.monotonic()`` after which no further step starts.
    """
    trial = _Steps(device, deadline)
    raw = trial.raw
    batch = move_batch(batch, device)
    error: str | None = None
    oom = False
    try:
        before = _resident_now() if device.type == "cpu" else None
        forward = trial.set_up(model, batch, plan, run)
        if not trial.baseline(model, batch, plan, forward, cap_bytes, excluded_bytes):
            return raw
        if before is not None and raw.baseline_bytes is not None:
            raw.setup_bytes = max(0, raw.baseline_bytes - before)
        trial.steps(batch, warmup_steps=warmup_steps, measure_steps=measure_steps, run=run)
    except Exception as exc:  # noqa: BLE001 - every failure becomes part of the result
        oom = is_oom(exc)
        error = f"{trial.phase} step: {_first_line(exc)}"
        # NB: nothing else here; `exc` and its frames (the step's tensors) go at block end
    if error is not None:
        raw.oom = oom
        raw.error = error
    trial.clean_up(model)
    return raw


class _Steps:
    """One trial's steps in order (``run_steps``): set-up, baseline, the steps (warm-up,
    replay, timed, evaluation), clean-up; ``raw`` the measurement so far, ``phase`` the
    step running (for an error), ``lap`` the seconds of each part in ``raw.phase_s``."""

    def __init__(self, device: torch.device, deadline: float | None) -> None:
        self.device, self.deadline = device, deadline
        self.raw = RawTrial()
        self.clock = time.monotonic()
        self.stepper: Stepper | None = None
        self.meter: _CpuMeter | _AccelMeter | None = None
        self.phase = "set-up"

    def lap(self, name: str) -> None:  # seconds since the previous lap, in raw.phase_s
        now = time.monotonic()
        self.raw.phase_s[name] = round(now - self.clock, 3)
        self.clock = now

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline

    def set_up(self, model: torch.nn.Module, batch: Batch, plan: StepPlan,
               run: RunSpec | None) -> Callable[..., object] | None:
        """1. the model prepared; the set-up step on one sample at full length (compiled
        steps under torch.compile), then freed; the compiled forward (None: eager)."""
        raw = self.raw
        prepare_model(model, plan)
        raw.notes.extend(plan.notes)
        forward = (compile_model(model, getattr(plan.config, "torch_compile_mode", None),
                                 getattr(plan.config, "torch_compile_regional", False))
                   if plan.torch_compile else None)
        stepper = self.stepper = Stepper(model, plan, self.device, forward)
        if forward is None:
            stepper.step(setup_batch(batch))
        else:
            t0 = time.perf_counter()
            _compile_steps(stepper, batch, run)
            raw.compile_s = time.perf_counter() - t0
            raw.notes.append(f"torch.compile: set-up steps compiled in {raw.compile_s:.1f} s "
                             "(before the baseline, not timed)")
        stepper.close()
        self.stepper = None
        return forward

    def baseline(self, model: torch.nn.Module, batch: Batch, plan: StepPlan,
                 forward: Callable[..., object] | None, cap_bytes: int | None,
                 excluded_bytes: int) -> bool:
        """2. the baseline and the stepper of the steps; False (an out-of-memory recorded)
        when the weights, buffers and batch alone pass a CPU cap."""
        raw, device = self.raw, self.device
        if device.type == "cpu":
            resident = storage_bytes(model.parameters(), model.buffers(), batch.values())
            raw.resident_bytes = resident
            meter = self.meter = _CpuMeter(resident, cap_bytes)
            if cap_bytes is not None and resident >= cap_bytes:
                raw.oom = True
                raw.error = (
                    f"the weights, buffers and batch alone ({resident} bytes) exceed the cap "
                    f"({cap_bytes} bytes)"
                )
                raw.peak_allocated_bytes = raw.peak_reserved_bytes = resident
                raw.device_total_bytes = resident
                return False
        else:
            meter = self.meter = _AccelMeter(device, excluded_bytes)
        raw.baseline_bytes = meter.baseline()
        self.stepper = Stepper(model, plan, device, forward)
        self.stepper.sync = None if device.type == "cpu" else (lambda: _sync(device))
        self.lap("set-up")
        return True

    def steps(self, batch: Batch, *, warmup_steps: int, measure_steps: int,
              run: RunSpec | None) -> None:
        """3.-4. the warm-up, the peak reset, the replay of the run's other lengths, the
        timed steps and the evaluation, while the meter is armed."""
        raw, meter = self.raw, self.meter
        self.phase = "warm-up"
        meter.arm()
        try:
            self._warm_up(batch, warmup_steps)
            self.lap("warm-up")
            self.phase = "measured"
            if not raw.timed_out:
                meter.reset_peak()
                stop = self._replay(batch, run)
                self._timed(batch, run, measure_steps, stop)
            raw.phase_s["timed"] = round(sum(raw.step_times_s), 3)
            self.lap("steps")
            if (run is not None and run.eval_batch_size and not raw.timed_out
                    and not raw.over_budget and not raw.outpaced):
                _evaluate(self.stepper, batch, run, meter, raw)
                self.lap("evaluation")
        finally:
            meter.disarm()

    def _warm_up(self, batch: Batch, warmup_steps: int) -> None:
        raw, stepper = self.raw, self.stepper
        done = 0
        skipped_extra = 0
        while done < warmup_steps:
            ok = stepper.step(batch)
            if not ok and skipped_extra < 8:
                skipped_extra += 1  # fp16 loss scale still settling: no state yet
                continue
            done += 1
            raw.warmup_done = done
            if self._past_deadline():
                raw.timed_out = True
                break
        if stepper.skipped_steps:
            raw.notes.append(f"GradScaler skipped {stepper.skipped_steps} step(s) (inf grads)")

    def _replay(self, batch: Batch, run: RunSpec | None) -> bool:
        """The run's other lengths, one step each, after a first timed step; whether the
        trial stops there (over budget, outpaced, the deadline)."""
        raw, meter = self.raw, self.meter
        lengths = run.lengths if run is not None else ()
        if not lengths:
            return False
        # the first timed step before the replay: an over-budget or outpaced
        # trial is settled by it, before the replay's cost
        why = _timed_step(self.stepper, batch, self.device, meter, run, raw, self.deadline)
        raw.timed_out = why == "deadline"
        stop = why is not None
        moot = not stop and _replay_moot(meter, run, raw)
        t0 = time.monotonic()
        for i, length in enumerate(() if stop or moot else lengths):
            if _replay_spent(run, i, t0, raw):
                break
            self.phase = f"run (length {length})"
            self.stepper.step(cut_batch(batch, length))
            raw.run_steps += 1
            if _passed_budget(meter, run, raw, f"replayed step {i + 1}"):
                stop = True
                break
            if self._past_deadline():
                raw.timed_out = stop = True
                break
        raw.phase_s["replay"] = round(time.monotonic() - t0, 3)
        self.phase = "measured"
        return stop

    def _timed(self, batch: Batch, run: RunSpec | None, measure_steps: int,
               stop: bool) -> None:
        """The timed steps still owed, until their median is decided."""
        raw = self.raw
        spread = run.decisive_spread if run is not None else None
        # at least one full-length step after the replay: the run's peak is there
        owed = 0 if stop else max(measure_steps - len(raw.step_times_s), 1)
        for k in range(owed):
            why = _timed_step(self.stepper, batch, self.device, self.meter, run, raw,
                              self.deadline)
            if why is not None:
                raw.timed_out = why == "deadline" and k < owed - 1
                break
            if _decided(raw.step_times_s, spread, measure_steps):
                raw.notes.append(f"{len(raw.step_times_s)} timed steps of "
                                 f"{measure_steps}: they agree within "
                                 f"{100 * spread:.1f}%, a further one cannot move "
                                 "their median out of them")
                break

    def clean_up(self, model: torch.nn.Module) -> None:
        """The peaks; 5. what the trial made freed, then the baseline checked."""
        raw, meter = self.raw, self.meter
        if meter is not None and meter.base is not None and raw.eval_device_total_bytes is None:
            raw.peak_allocated_bytes, raw.peak_reserved_bytes, raw.device_total_bytes = \
                meter.peaks()
        if self.stepper is not None:
            self.stepper.close()
        self.stepper = None
        free_grads(model)
        if meter is not None and meter.base is not None:
            leaked = meter.leaked()
            raw.leaked_bytes = leaked
            raw.recovered = leaked is not None and leaked <= meter.tolerance
        self.lap("clean-up")
