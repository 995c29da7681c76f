"""The search engine: the fastest configuration that fits, estimated then confirmed.

The engine asks two questions and never knows how they are answered:

* the estimator, "how much memory does this configuration take?" (cheap: every
  candidate), and
* the trial runner, "does it fit on the device, and how fast is it?" (real
  micro-steps: the few best candidates).

For every combination of the knobs' values (``autofit.knobs``: precision, gradient
checkpointing, optimizer, ...) the estimate gives the largest micro batch whose device
total fits ``capacity * (1 - margin)``; the throughput model (``autofit.search.speed``)
ranks the combinations at their limits; trials confirm the best few at their
predicted limit and bracket the true limit between the largest size that fit and
the smallest that failed: at the calibrated estimate's guess where it can place the
limit, else at the bracket's geometric midpoint (a peak flat in the micro batch: the
trials stay O(log n), and no combination is rejected on one number above its
smallest size); a combination predicted ``PREDICTED_SLOWER`` times slower than one already
confirmed is not tried (its trials could not make it the fastest), and a trial whose speed
no untried rival could beat times one step, not three;
measured peaks recalibrate the estimate of the rest (a per-combination ratio of
measured to estimated, and their mean for combinations not tried yet). The final
choice is the fastest *measured* candidate; within it, the largest micro batch
that fits with the margin.

Trials are recorded in an optuna study (``autofit.search.study``: an out-of-memory
trial is a completed trial whose constraint ``device_total - budget`` is positive,
not a failure; a trial that failed otherwise is not an answer and runs again next
time). With SQLite storage a tuning run resumes after a crash (finished trials are
not run again), runs on one cache at once share their trials (each waits for a trial
the other is measuring), and a repeated run with the same cache key answers from the
cache with no trials.

Known limitations:
    NB: the micro batch limit is searched on the allowed sizes only (divisors of
    the target batch per device when a target is given).
    NB: combinations are confirmed in predicted order; one whose prediction is far
    too slow is never tried.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError, UnmodelledStepError
from autofit.knobs import KNOBS, describe_choice
from autofit.search.space import SearchSpace

__all__ = ["Candidate", "SearchOutcome", "Engine", "DEFAULT_MARGIN", "ENGINE_VERSION"]

DEFAULT_MARGIN = 0.10
SPEED_TIE = 0.05  # measured throughputs this close are a tie (step-time noise)
# a combination predicted this many times slower than one a trial confirmed is not tried:
# its trials could not make it the fastest (the model's ranking errors are well under 2x:
# checkpointing is predicted 1.33x slower, the chunked loss on a CPU ~6x, both confirmed
# by measurement; ``autofit.search.speed``)
PREDICTED_SLOWER = 2.0
# a trial whose first timed step is this many times slower than a confirmed combination's
# measured speed stops there (``RunSpec.outpaced_below_tokens_per_s``): beyond the noise of
# one step (+-10% on a loaded CPU) it cannot be chosen, so its run is not replayed, its
# other timed steps and its evaluation step not run (a 32-true step on a CPU with bf16:
# 1.5x a bf16-mixed one)
OUTPACED = 1.3
# Part of the cache key: bump it when a change to the search makes cached answers stale
# (2: the margin no longer subtracts measured fragmentation twice; line calibration;
# 3: study parameters and candidate rows per knob, rows carry the uncalibrated estimate;
# 4: the default margin from the modelled run + a 3% safety, answers carry the run's need;
# 5: a flat peak is bracketed by bisection, an OOM keeps a measured ratio;
# 6: the chunked_loss knob is searched; 7: the activation_offloading knob, a study parameter;
# 8: the torch_compile knob, searched when asked; 9: the strategy and offload knobs, the
# speed model's communication; 10: a combination predicted PREDICTED_SLOWER times slower
# than a confirmed one is not tried, trials stop above the budget; 11: a trial OUTPACED
# times slower than a confirmed rival in its first timed step stops there; 12: the trial's
# speed amortises the optimizer step over the run's accumulation, and a combination that
# differs from a confirmed one only in an optimizer too cheap to matter is not tried;
# 13: on a CPU, 16-bit candidates carry what oneDNN keeps for the run's other lengths;
# 14: the liger_kernels knob; 15: liger's chunked-loss moment; 16: the simulated backward
# sums gradients that meet in place, as eager autograd does).
ENGINE_VERSION = 16


@dataclass
class Candidate:
    """One combination of the knobs' values, and what is known about it."""

    choice: dict[str, Any]  # knob name -> value (registry order)
    micro_batch: int | None = None  # the largest allowed micro batch expected to fit
    raw_estimate_bytes: int | None = None  # device total estimated at micro_batch, as estimated
    estimate_bytes: int | None = None  # the same, calibrated by the trials
    predicted_tokens_per_s: float | None = None
    calibration: float | None = None  # measured / estimated device total, once measured
    confirmed_micro_batch: int | None = None  # largest that fit with the margin in a trial
    measured_tokens_per_s: float | None = None
    measured_optimizer_share: float | None = None  # of the run's step, in the confirming trial
    measured_bytes: int | None = None
    failed_micro_batch: int | None = None  # smallest that did not fit (OOM or over margin)
    measured: dict[int, int] = field(default_factory=dict)  # micro batch -> measured bytes
    oom_micro_batch: int | None = None  # smallest micro batch that ran out of memory
    status: str = "estimated"  # estimated | confirmed | rejected | infeasible | skipped | slower
    reason: str = ""

    @property
    def key(self) -> tuple[Any, ...]:
        return tuple(self.choice.values())

    def label(self) -> str:
        return describe_choice(self.choice)

    @property
    def applied_calibration(self) -> float | None:
        """Calibrated / raw estimate at ``micro_batch``: what the trials did to the estimate."""
        if self.estimate_bytes is None or not self.raw_estimate_bytes:
            return None
        return self.estimate_bytes / self.raw_estimate_bytes


@dataclass
class SearchOutcome:
    """What the engine found: the choice (or None) and everything it looked at."""

    choice: Candidate | None
    config: TrainConfig | None
    candidates: list[Candidate]
    trials: list[Any]  # TrialResult, in the order they ran
    reasons: list[str]
    confirmed: bool
    ooms: int = 0
    stopped_early: bool = False
    from_cache: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


EstimateFn = Callable[[TrainConfig], int]  # -> estimated device total bytes
SpeedFn = Callable[[TrainConfig], float]  # -> predicted tokens/s
TrialFn = Callable[[TrainConfig], Any]  # -> TrialResult


class Engine:
    """Runs the search (see the module docstring). One instance, one search.

    Args:
        space: what may be chosen.
        capacity_bytes: what the device offers.
        estimate: ``config -> estimated device total bytes``.
        speed: ``config -> predicted tokens/s``.
        trial: ``config -> TrialResult`` on the device, or None to plan from the
            estimate alone (no device present).
        margin: fraction of capacity kept free.
        confirm_top: how many combinations to confirm with trials.
        time_budget_s: stop starting trials after this long; return the best so far.
        recorder: optional ``TrialRecorder`` (optuna study) to log and resume trials.
        progress: called with a line of text before each trial.
        started_at: ``clock()`` value the time budget counts from (default: now).
        add_fragmentation: report the allocator fragmentation (reserved -
            allocated) measured in trials with the margin. It is kept free once: a
            trial's device total is the reserved peak (plus the context), so the
            margin is kept above allocated + fragmentation; subtracting it from the
            budget as well counted it twice (a T4 plan lost a micro batch to it).
        trial_word: how the reasons call what a trial gives: ``"measured"``, or
            ``"simulated"`` when the trials are simulations of the step.
    """

    def __init__(
        self,
        space: SearchSpace,
        capacity_bytes: int,
        *,
        estimate: EstimateFn,
        speed: SpeedFn,
        trial: TrialFn | None,
        seq_len: int,
        margin: float = DEFAULT_MARGIN,
        confirm_top: int = 3,
        max_trials: int = 12,
        time_budget_s: float | None = None,
        recorder: Any = None,
        progress: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        started_at: float | None = None,
        add_fragmentation: bool = False,
        trial_word: str = "measured",
    ) -> None:
        if not 0 <= margin < 1:
            raise BadInputError(f"margin must be in [0, 1), got {margin}")
        self.space = space
        self.capacity = capacity_bytes
        self.margin = margin
        self.add_fragmentation = add_fragmentation
        self.trial_word = trial_word  # "measured" (real trials) or "simulated"
        self.fragmentation = 0  # largest reserved - allocated seen in a trial
        self._estimate = estimate
        self._speed = speed
        self._trial = trial
        self.seq_len = seq_len
        self.confirm_top = confirm_top
        self.max_trials = max_trials
        self.time_budget_s = time_budget_s
        self.recorder = recorder
        self._progress = progress or (lambda _: None)
        self._clock = clock
        self._start = clock() if started_at is None else started_at
        self.trials: list[Any] = []
        self.ooms = 0
        self._est_cache: dict[tuple, int] = {}

    @property
    def budget(self) -> int:
        """Device total bytes a candidate may take: capacity x (1 - margin).

        Measured device totals hold the fragmentation (reserved - allocated) they
        met, and calibrated estimates are scaled to them, so the margin is kept
        above allocated + measured fragmentation without subtracting it again.
        """
        return int(self.capacity * (1 - self.margin))

    # -- the estimate side -------------------------------------------------------
    def config(self, c: Candidate, micro_batch: int) -> TrainConfig:
        return TrainConfig(
            micro_batch_size=micro_batch,
            grad_accum_steps=self.space.accumulation(micro_batch),
            optim_args=self.space.optim_args,
            seq_len=self.seq_len,
            world_size=self.space.world_size,
            loss_impl=self.space.loss_impl,
            nproc_per_node=self.space.nproc_per_node,
            nnodes=self.space.nnodes,
            torch_compile_mode=(self.space.compile_mode if c.choice.get("torch_compile")
                                else None),
            torch_compile_regional=(self.space.compile_regional
                                    and bool(c.choice.get("torch_compile"))),
            **c.choice,
        )

    def _raw_estimate(self, c: Candidate, b: int) -> int:
        key = (*c.key, b)
        if key not in self._est_cache:
            self._est_cache[key] = int(self._estimate(self.config(c, b)))
        return self._est_cache[key]

    def _calibration(self, c: Candidate) -> float:
        if c.calibration is not None:
            return c.calibration
        return self._borrowed_calibration(c)

    def _borrowed_calibration(self, c: Candidate) -> float:
        """The ratio an untried combination borrows: the mean of those measured with the
        same values of the knobs that calibrate apart (the optimizer: its state and step
        dominate the estimate's error), else 1.0.

        NB: borrowing across optimizers once made every untried combination look
        infeasible after 8-bit trials measured 2.5x their estimate (a false "nothing fits").
        """
        apart = [k.name for k in KNOBS if k.calibrates_apart and k.name in c.choice]
        known = [x.calibration for x in self._candidates if x.calibration is not None
                 and all(x.choice[n] == c.choice[n] for n in apart)]
        return sum(known) / len(known) if known else 1.0

    def estimated(self, c: Candidate, b: int) -> int:
        """Device total bytes at micro batch ``b``, calibrated by what trials measured.

        One measurement scales the estimate (measured / estimated). Two or more fit
        ``measured = alpha * estimate + beta`` by least squares, so that an estimate
        whose fixed part (weights, states) and per-sample part are off by different
        factors still lands on the limit (a ratio alone walks there one size at a
        time). Above the largest measured size, an out-of-memory size bounds the
        need from below: the line from that measurement to the capacity at the OOM
        size, when it is higher.
        """
        raw = self._raw_estimate(c, b)
        line = _fit_line([(float(self._raw_estimate(c, x)), float(m))
                          for x, m in c.measured.items()]) if len(c.measured) >= 2 else None
        need = raw * self._calibration(c) if line is None else line[0] * raw + line[1]
        oom = c.oom_micro_batch
        below = [x for x in c.measured if oom is not None and x < oom]
        if below and b > max(below):
            xm = max(below)
            pivot = _fit_line([(float(self._raw_estimate(c, xm)), float(c.measured[xm])),
                               (float(self._raw_estimate(c, oom)), float(self.capacity))])
            if pivot is not None:
                need = max(need, pivot[0] * raw + pivot[1])
        return int(need)

    def _largest_fitting(self, c: Candidate, below: int | None = None,
                         sizes: Sequence[int] | None = None) -> int | None:
        """Largest of ``sizes`` (ascending; default: the allowed micro batches) below
        ``below`` whose calibrated estimate fits the budget.

        ``sizes`` may be a ``range`` up to the target batch: it is cut and searched in
        place (O(log n) estimates, nothing materialised).
        """
        options = self.space.micro_batches if sizes is None else sizes
        if below is not None:
            options = options[:bisect.bisect_left(options, below)]
        lo, hi, best = 0, len(options) - 1, None
        while lo <= hi:  # the estimate grows with the micro batch: binary search
            mid = (lo + hi) // 2
            if self.estimated(c, options[mid]) <= self.budget:
                best, lo = options[mid], mid + 1
            else:
                hi = mid - 1
        return best

    def _refresh(self, c: Candidate) -> None:
        if c.status in ("confirmed", "rejected"):
            return
        upper = c.failed_micro_batch
        try:
            b = self._largest_fitting(c, below=upper)
        except UnmodelledStepError as e:  # its memory cannot be estimated: never chosen
            c.micro_batch, c.status, c.predicted_tokens_per_s = None, "infeasible", None
            c.estimate_bytes = c.raw_estimate_bytes = None
            c.reason = str(e)
            return
        c.micro_batch = b
        if b is None:
            c.status, c.predicted_tokens_per_s = "infeasible", None
            c.estimate_bytes = c.raw_estimate_bytes = None
            one = self.estimated(c, self.space.micro_batches[0])
            c.reason = (f"micro batch {self.space.micro_batches[0]} needs ~{_gib(one)} "
                        f"> budget {_gib(self.budget)}")
            return
        c.status = "estimated"
        c.raw_estimate_bytes = self._raw_estimate(c, b)
        c.estimate_bytes = self.estimated(c, b)
        c.predicted_tokens_per_s = self._speed(self.config(c, b))

    # -- the trial side ----------------------------------------------------------
    def _out_of_time(self) -> bool:
        if self.time_budget_s is None:
            return False
        return self._clock() - self._start >= self.time_budget_s

    def _run_trial(self, c: Candidate, b: int) -> Any:
        config = self.config(c, b)
        waited: list[bool] = []

        def waiting() -> None:  # another run on the same cache is measuring it: share
            waited.append(True)
            self._progress(f"trial {c.label()}, micro batch {b}: another autofit run on this "
                           "cache is measuring it; waiting for its result")

        cached, claim = (self.recorder.reserve(config, on_wait=waiting)
                         if self.recorder is not None else (None, None))
        if cached is not None:
            if not waited:
                self._progress(f"trial {c.label()}, micro batch {b}: from the study (resumed)")
            result = cached
        else:
            noun = "trial" if self.trial_word == "measured" else "simulation"
            self._progress(f"{noun} {len(self.trials) + 1}: {c.label()}, micro batch {b} "
                           f"(estimate {_gib(self.estimated(c, b))})")
            asked: dict[str, Any] = {}
            if getattr(self._trial, "timed_steps", False):
                asked["timed_steps"] = self._timed_steps(c)
            if getattr(self._trial, "outpaced_below", False):
                asked["outpaced_below"] = self._outpaced_below(c)
            try:
                result = self._trial(config, **asked)
            except BaseException:
                if self.recorder is not None:  # interrupted: the claim is given up
                    self.recorder.release(claim)
                raise
            if self.recorder is not None:
                self.recorder.record(config, result, self._raw_estimate(c, b), self.budget,
                                     claim=claim)
        self.trials.append(result)
        if result.oom:
            self.ooms += 1
        alloc, reserved = result.peak_allocated_bytes, result.peak_reserved_bytes
        if alloc is not None and reserved is not None and reserved > alloc:
            self.fragmentation = max(self.fragmentation, int(reserved - alloc))
        return result

    def _confirm(self, c: Candidate) -> None:
        """Trials at the predicted limit, then bisection in a narrow window."""
        best_fit: int | None = None
        b = c.micro_batch
        while b is not None and len(self.trials) < self.max_trials and not self._out_of_time():
            r = self._run_trial(c, b)
            raw = self._raw_estimate(c, b)
            if getattr(r, "outpaced", False) and not r.oom and r.error is None:
                self._slower(c, r)
                return
            if not r.oom and (r.error is not None or r.device_total_bytes is None):
                # a failure that is not an OOM (a timeout, a crash): do not guess further
                c.status, c.reason = "rejected", f"trial failed: {r.error}"
                return
            if r.oom:
                # the true need is above the capacity: calibrate to at least that; once a
                # size was measured, its ratio stays (the pivot in ``estimated`` carries
                # the OOM above it; raising the ratio condemned the measured fits too)
                if not c.measured:
                    c.calibration = max(self._calibration(c), self.capacity / raw)
                c.failed_micro_batch = b if c.failed_micro_batch is None else min(c.failed_micro_batch, b)
                c.oom_micro_batch = b if c.oom_micro_batch is None else min(c.oom_micro_batch, b)
            else:
                measured = int(r.device_total_bytes)
                c.calibration = measured / raw
                c.measured[b] = measured
                if measured <= self.budget:
                    best_fit = b
                    c.confirmed_micro_batch = b
                    c.measured_bytes = measured
                    c.measured_tokens_per_s = r.tokens_per_s
                    c.measured_optimizer_share = getattr(r, "optimizer_share", None)
                else:  # fits the device but not the margin
                    c.failed_micro_batch = b if c.failed_micro_batch is None else min(c.failed_micro_batch, b)
            b = self._next_size(c, best_fit)
        if best_fit is None:
            if b is None and c.failed_micro_batch is not None:  # the bracket closed: none fits
                c.status = "rejected"
                smaller = [x for x in self.space.micro_batches if x < c.failed_micro_batch]
                c.reason = (f"micro batch {c.failed_micro_batch} did not fit in a trial; "
                            + (f"micro batch {smaller[0]} is estimated at "
                               f"{_gib(self.estimated(c, smaller[0]))} (calibrated by the trials) "
                               f"> budget {_gib(self.budget)}" if smaller
                               else "nothing smaller is allowed"))
            elif c.status != "rejected":
                c.status = "skipped"
                c.reason = "not confirmed (out of time or trials)"
            return
        c.status = "confirmed"
        c.micro_batch = best_fit
        c.raw_estimate_bytes = self._raw_estimate(c, best_fit)
        c.estimate_bytes = self.estimated(c, best_fit)
        c.predicted_tokens_per_s = self._speed(self.config(c, best_fit))

    def _fastest_confirmed(self) -> Candidate | None:
        confirmed = [x for x in self._candidates if x.status == "confirmed"
                     and x.measured_tokens_per_s]
        return max(confirmed, key=lambda x: x.measured_tokens_per_s or 0.0, default=None)

    def _outpaced_below(self, c: Candidate) -> float | None:
        """The speed under which a trial of ``c`` stops after its first timed step: the
        fastest confirmed measured speed over ``OUTPACED``; None before any is confirmed."""
        best = self._fastest_confirmed()
        return None if best is None else (best.measured_tokens_per_s or 0.0) / OUTPACED

    def _slower(self, c: Candidate, r: object) -> None:
        """``c``'s trial stopped after its first timed step, outpaced by a confirmed rival:
        not confirmed (its run was not replayed), never chosen; its speed is kept."""
        best = self._fastest_confirmed()
        c.status = "slower"
        c.measured_tokens_per_s = r.tokens_per_s
        c.measured_bytes = r.device_total_bytes  # one full-length step's peak, no run
        if best is None or not r.tokens_per_s:
            c.reason = "stopped after its first timed step: a confirmed rival is faster"
            return
        c.reason = (f"{self.trial_word} {r.tokens_per_s:,.0f} tokens/s in its first timed step, "
                    f"{(best.measured_tokens_per_s or 0.0) / r.tokens_per_s:.1f}x slower than "
                    f"{best.label()} ({best.measured_tokens_per_s:,.0f}, fits): stopped there, "
                    "its run not replayed")

    def _next_size(self, c: Candidate, best_fit: int | None) -> int | None:
        """The next micro batch to try: bracket the limit between best_fit and failed.

        Below a failure the calibrated estimate proposes the largest size it expects
        to fit; where it cannot place the limit (``_places_limit``: a peak flat in the
        micro batch) the next size halves the bracket instead (geometric midpoint), so
        the trials stay O(log n), not one size down per failure.
        """
        upper = c.failed_micro_batch
        if upper is not None:
            options = self.space.micro_batches
            lo = 0 if best_fit is None else bisect.bisect_right(options, best_fit)
            hi = bisect.bisect_left(options, upper)
            if lo >= hi:  # nothing allowed between the best fit and the failure
                return None
            # below a failure: the largest calibrated fit between best_fit and upper
            b = self._largest_fitting(c, below=upper)
            if b is not None and best_fit is not None and b <= best_fit:
                b = None
            if self._places_limit(c, options[lo], upper, b, best_fit):
                return b
            return _geometric_midpoint(options, lo, hi, best_fit, upper)
        # no failure yet: go up only if the calibrated estimate says the next size fits
        if best_fit is None:
            return None
        bigger = [x for x in self.space.micro_batches if x > best_fit]
        if bigger and self.estimated(c, bigger[0]) <= self.budget:
            return self._largest_fitting(c)
        return None

    def _places_limit(self, c: Candidate, first: int, upper: int, proposal: int | None,
                      best_fit: int | None) -> bool:
        """Whether the calibrated estimate can say where between ``first`` (the smallest
        untried size above the best fit) and the failure at ``upper`` the limit is.

        It cannot when it does not grow over the bracket (a flat estimate, e.g. a
        frozen base whose weights dominate: calibrated, every size needs the same), when
        it still says the failed size fits (a flat pivot after an OOM: it would step
        down one size per trial), or when it would reject the combination on one
        number (one OOM or one measurement, nothing seen to fit): an OOM bounds the
        need at that size only.
        """
        if self.estimated(c, upper) <= self.budget:
            return False
        if self._raw_estimate(c, first) >= self._raw_estimate(c, upper):
            return False
        return not (proposal is None and best_fit is None and len(c.measured) < 2)

    # -- the search ----------------------------------------------------------------
    def run(self) -> SearchOutcome:
        reasons: list[str] = []
        self._candidates = [Candidate(choice) for choice in self.space.combos()]
        for c in self._candidates:
            self._refresh(c)
        feasible = [c for c in self._candidates if c.status == "estimated"]
        if not feasible:
            return SearchOutcome(None, None, self._candidates, self.trials, reasons, False)
        stopped = False
        if self._trial is None:
            best = max(feasible, key=lambda c: c.predicted_tokens_per_s or 0.0)
            reasons.append("planned from the estimate alone: no trial could run on this device")
            return self._outcome(best, reasons, confirmed=False)
        tried: set[tuple] = set()
        while len([c for c in self._candidates if c.key in tried]) < self.confirm_top:
            pending = [c for c in self._candidates if c.status == "estimated" and c.key not in tried]
            if not pending:
                break
            if self._out_of_time() or len(self.trials) >= self.max_trials:
                stopped = True
                break
            c = max(pending, key=lambda x: x.predicted_tokens_per_s or 0.0)
            tried.add(c.key)
            if self._outpaced(c) or self._optimizer_sibling(c):
                continue
            self._confirm(c)
            for other in self._candidates:  # measured peaks recalibrate the rest
                if other.key not in tried:
                    self._refresh(other)
        confirmed = [c for c in self._candidates if c.status == "confirmed"]
        if stopped:
            reasons.append("time budget or trial limit reached: best confirmed candidate so far")
        if confirmed:
            best = self._fastest_measured(confirmed, reasons)
            return self._outcome(best, reasons, confirmed=True, stopped=stopped)
        pending = [c for c in self._candidates if c.status == "estimated"]
        if pending:
            best = max(pending, key=lambda c: c.predicted_tokens_per_s or 0.0)
            reasons.append("no candidate could be confirmed; the choice rests on the estimate")
            return self._outcome(best, reasons, confirmed=False, stopped=stopped)
        return SearchOutcome(None, None, self._candidates, self.trials, reasons, False,
                             ooms=self.ooms, stopped_early=stopped)

    def _timed_steps(self, c: Candidate) -> int | None:
        """1 when no other combination could still rival ``c``'s speed (each is predicted
        ``PREDICTED_SLOWER`` times slower, or out of the running): its measured speed
        decides nothing, one timed step reports it; else None (the trial's default)."""
        mine = c.predicted_tokens_per_s or 0.0
        rivals = [x for x in self._candidates if x is not c
                  and x.status in ("estimated", "confirmed")
                  and PREDICTED_SLOWER * (x.predicted_tokens_per_s or 0.0) > mine]
        return None if rivals else 1

    def _outpaced(self, c: Candidate) -> bool:
        """Whether a confirmed combination is predicted ``PREDICTED_SLOWER`` times faster
        than ``c`` (then ``c`` is skipped, with the reason): a slower candidate's trials
        cost time (the chunked loss's on a CPU: ~6x a step) and cannot win."""
        mine = c.predicted_tokens_per_s or 0.0
        fast = [x for x in self._candidates if x.status == "confirmed"
                and (x.predicted_tokens_per_s or 0.0) >= PREDICTED_SLOWER * mine]
        if not fast or mine <= 0:
            return False
        best = max(fast, key=lambda x: x.predicted_tokens_per_s or 0.0)
        c.status = "skipped"
        c.reason = (f"not tried: predicted {(best.predicted_tokens_per_s or 0.0) / mine:.1f}x "
                    f"slower than {best.label()}, which fits (measured)")
        return True

    def _optimizer_sibling(self, c: Candidate) -> bool:
        """Whether a confirmed combination runs ``c``'s very step (every knob but the
        optimizer the same, at the micro batch ``c`` would run) with an optimizer step so
        small a share of its run's step that even a free one would not make ``c``
        ``SPEED_TIE`` faster (then ``c`` is skipped, with the reason): the forward and
        backward are the same, only the optimizer step could differ. (The quick start's
        three AdamW implementations at micro batch 2 x accumulation 8: their optimizer
        steps are ~2% of the run's; two of the three trials decided nothing.)"""
        if c.micro_batch is None:
            return False
        for x in self._candidates:
            share = x.measured_optimizer_share
            if (x.status != "confirmed" or share is None or not 0 <= share < 1
                    or x.confirmed_micro_batch != c.micro_batch
                    or any(v != x.choice.get(k) for k, v in c.choice.items()
                           if k != "optimizer")):
                continue
            gain = share / (1 - share)
            if gain >= SPEED_TIE:
                continue
            c.status = "skipped"
            c.reason = (f"not tried: the step of {x.label()} (measured) but for its optimizer, "
                        f"whose step is {100 * share:.1f}% of that run's; even a free one would "
                        f"make it {100 * gain:.1f}% faster, within the {100 * SPEED_TIE:g}% "
                        "measurement tie")
            return True
        return False

    def _divisor_hint(self, c: Candidate, b: int) -> str | None:
        """When keeping the target forces a micro batch well below what fits, say which
        nearby targets would not (a prime target allows only 1 and itself)."""
        per = (self.space.target_batch_size or 0) // self.space.world_size
        free = self._largest_fitting(c, below=c.failed_micro_batch, sizes=range(b + 1, per + 1))
        if free is None or free < 1.5 * b:  # a few percent of speed is not worth a new target
            return None
        below, above = free * max(1, per // free), free * (per // free + 1)
        alts = " or ".join(str(t * self.space.world_size) for t in dict.fromkeys((below, above)))
        return (f"micro batch {b} is the largest divisor of {per} (the target per device) that "
                f"fits, but {free} is estimated to fit: a target batch of {alts} would keep "
                f"micro batches of {free} ({free / b:.1f}x fewer, larger steps)")

    def _fastest_measured(self, confirmed: list[Candidate], reasons: list[str]) -> Candidate:
        """The fastest measured candidate; within measurement noise, the one predicted fastest.

        A trial's speed is the median of its timed steps (``autofit.trial.measure``: 3
        on the CPU, where single steps vary by +-10% here); candidates measured within
        ``SPEED_TIE`` of the fastest are a tie that the noisy number does not decide: the
        throughput model (which does not vary from run to run) ranks them, then the
        lower measured peak. The reasons say so whenever there is a tie.
        """
        top = max(c.measured_tokens_per_s or 0.0 for c in confirmed)
        tied = [c for c in confirmed if (c.measured_tokens_per_s or 0.0) >= (1 - SPEED_TIE) * top]
        best = max(tied, key=lambda c: (c.predicted_tokens_per_s or 0.0, -(c.measured_bytes or 0),
                                        c.measured_tokens_per_s or 0.0))
        fastest = max(confirmed, key=lambda c: c.measured_tokens_per_s or 0.0)
        if len(tied) > 1:
            rest = [c for c in tied if c is not best]
            predicted = best.predicted_tokens_per_s or 0.0
            if all((c.predicted_tokens_per_s or 0.0) < predicted for c in rest):
                why = "the throughput model predicts it fastest"
            elif all((c.measured_bytes or 0) > (best.measured_bytes or 0) for c in rest
                     if (c.predicted_tokens_per_s or 0.0) == predicted):
                why = f"predicted as fast, it {self.trial_word} the least memory"
            else:
                why = "predicted as fast with as much memory: the faster measured"
            noted = ("" if best is fastest else
                     f"; {fastest.label()} {self.trial_word} {fastest.measured_tokens_per_s:,.0f} "
                     f"vs {best.measured_tokens_per_s or 0.0:,.0f} tokens/s")
            reasons.append(f"{', '.join(c.label() for c in tied)}: {self.trial_word} within "
                           f"{100 * SPEED_TIE:.0f}% of each other (step-time noise), so the "
                           f"measured speed does not decide; {best.label()}: {why}{noted}")
        return best

    def _outcome(self, best: Candidate, reasons: list[str], *, confirmed: bool,
                 stopped: bool = False) -> SearchOutcome:
        b = best.confirmed_micro_batch if confirmed else best.micro_batch
        assert b is not None
        config = self.config(best, b)
        speed = best.measured_tokens_per_s if confirmed else best.predicted_tokens_per_s
        how = self.trial_word if confirmed else "predicted"
        reasons.insert(0, f"chosen: {best.label()} at micro batch {b} × accumulation "
                          f"{config.grad_accum_steps} — fastest {how} ({speed:,.0f} tokens/s)"
                       if speed else f"chosen: {best.label()} at micro batch {b}")
        if confirmed:
            nxt = [x for x in self.space.micro_batches if x > b]
            if best.failed_micro_batch is not None:
                reasons.append(f"micro batch {b}: {self.trial_word} {_gib(best.measured_bytes)} ≤ budget "
                               f"{_gib(self.budget)}; {best.failed_micro_batch} did not fit")
            elif nxt:
                reasons.append(f"micro batch {b}: {self.trial_word} {_gib(best.measured_bytes)}; "
                               f"{nxt[0]} is estimated at "
                               f"{_gib(self.estimated(best, nxt[0]))} > budget {_gib(self.budget)}")
            else:
                reasons.append(f"micro batch {b}: the largest allowed")
        frag = (f" above the allocated peak + {_gib(self.fragmentation)} allocator "
                f"fragmentation (reserved - allocated) {self.trial_word} in trials"
                if self.add_fragmentation and self.fragmentation else "")
        reasons.append(f"margin: {100 * self.margin:.0f}% of {_gib(self.capacity)} kept free{frag} "
                       f"(budget {_gib(self.budget)} for the device total)")
        if self.space.target_batch_size is not None:
            eff = config.effective_batch_size
            if eff == self.space.target_batch_size:
                reasons.append(f"effective batch kept: {b} × {config.grad_accum_steps} × "
                               f"{self.space.world_size} = {eff}")
                hint = self._divisor_hint(best, b)
                if hint:
                    reasons.append(hint)
            else:
                reasons.append(f"effective batch {eff} instead of {self.space.target_batch_size}: "
                               "the nearest the device count allows")
        else:  # the effective batch changes the training: say it was not the user's
            reasons.append(f"effective batch {config.effective_batch_size} (= {b} × "
                           f"{config.grad_accum_steps} × {self.space.world_size}): no target "
                           "batch was given (--target-batch-size, or a training arguments "
                           "file's batch), so the fastest micro batch that fits was taken")
        return SearchOutcome(best, config, self._candidates, self.trials, reasons, confirmed,
                             ooms=self.ooms, stopped_early=stopped)


def _geometric_midpoint(options: Sequence[int], lo: int, hi: int, best_fit: int | None,
                        upper: int) -> int:
    """The allowed size in ``options[lo:hi]`` (ascending, not empty) nearest in ratio to
    ``sqrt(low * upper)``, ``low`` the best fit or else the smallest size in the bracket:
    1..256 with no fit tries 16, then 64 or 4; the bracket's ratio halves in log."""
    low = best_fit if best_fit is not None else options[lo]
    mid = math.sqrt(low * upper)
    k = bisect.bisect_left(options, mid, lo, hi)  # options[k] >= mid, or k == hi
    near = [i for i in (k - 1, k) if lo <= i < hi]
    return options[min(near, key=lambda i: abs(math.log(options[i] / mid)))]


def _fit_line(pts: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least-squares (alpha >= 0, beta) of ``y = alpha * x + beta``; None if x is constant."""
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    var = sum((x - mx) ** 2 for x, _ in pts)
    if var <= 0:
        return None
    alpha = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / var)
    return alpha, my - alpha * mx


def _gib(n: float | None) -> str:
    if n is None:
        return "?"
    from autofit.probe.device import format_bytes

    return format_bytes(n)
