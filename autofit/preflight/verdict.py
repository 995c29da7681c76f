"""The answer of a pre-flight check: ``PreflightReport``, and ``PreflightError`` when it does not fit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autofit.config import TrainConfig
from autofit.errors import DoesNotFitError
from autofit.knobs import choice_of, describe_choice
from autofit.memory.breakdown import MemoryEstimate

__all__ = ["PreflightReport", "PreflightError"]


@dataclass(frozen=True)
class PreflightReport:
    """The answer of a pre-flight check.

    Attributes:
        fits: True when the configuration runs here (after the fix, if one was made).
        config: the ``TrainConfig`` checked last (the fixed one when ``changes``).
        requested: the ``TrainConfig`` as given.
        estimate: the analytic estimate of ``config`` (None for a model autofit
            cannot estimate).
        trial: the ``TrialResult`` that decided, or None (estimate only).
        from_cache: the trial came from the cache; none ran.
        problems: everything that stops the run, one line each (empty when it fits).
        reasons: how the verdict was reached, one line each.
        changes: field -> (old, new) of what ``fix=True`` changed.
        device: the device checked.
        capacity_bytes: what the device offers now.
        seq_len: tokens of the worst-case sample.
        eval_estimate: the evaluation step's estimate, when an eval batch was checked.
        eval_batch_size: ``per_device_eval_batch_size`` after the check.
        trials_run: trials this check ran (0 on a cache hit).
    """

    fits: bool
    config: TrainConfig
    requested: TrainConfig
    estimate: MemoryEstimate | None
    trial: Any
    from_cache: bool
    problems: tuple[str, ...]
    reasons: tuple[str, ...]
    changes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    device: str = ""
    capacity_bytes: int = 0
    seq_len: int = 0
    eval_estimate: MemoryEstimate | None = None
    eval_batch_size: int | None = None
    trials_run: int = 0
    step_fails: bool = False  # the estimate found a step that fails whatever its memory

    @property
    def trial_failed(self) -> bool:
        """The trial failed for a reason other than memory (``trial.error`` names it): the
        verdict is not a memory one (``autofit check`` exits 4, as ``measure`` does)."""
        t = self.trial
        return t is not None and not t.oom and t.error is not None

    @property
    def fails_otherwise(self) -> bool:
        """The run fails for a reason other than memory: its trial did (``trial_failed``),
        or, without one, the estimate found that its step fails (``StepFailsError``)."""
        return self.trial_failed or self.step_fails

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the ``autofit check --json`` object)."""
        return {
            "fits": self.fits,
            "step_fails": self.step_fails,
            "estimate": self.estimate.to_dict() if self.estimate else None,
            "trial": self.trial.to_dict() if self.trial is not None else None,
            "from_cache": self.from_cache,
            "reasons": list(self.reasons),
            "problems": list(self.problems),
            "config": self.config.to_dict(),
            "requested": self.requested.to_dict(),
            "changes": {k: list(v) for k, v in self.changes.items()},
            "device": self.device,
            "capacity_bytes": self.capacity_bytes,
            "seq_len": self.seq_len,
            "eval_estimate": self.eval_estimate.to_dict() if self.eval_estimate else None,
            "eval_batch_size": self.eval_batch_size,
            "trials_run": self.trials_run,
        }

    def headline(self) -> str:
        """The verdict in one line: fits or not, where the number comes from (measured now,
        from the cache, estimated) and the numbers.

            autofit: fits on cpu:1GiB: measured 812 MiB of 1.00 GiB (micro batch 8 x 2)
        """
        from autofit.probe.device import format_bytes

        c, t = self.config, self.trial
        if t is not None and t.fits and t.device_total_bytes is not None:
            from autofit.trial.result import setup_left_out

            once = setup_left_out(t)  # (the checker's need counts it)
            need = f"measured {format_bytes(t.device_total_bytes + once)}" + (
                f" (with {format_bytes(once)} of one-time set-up)" if once else "")
        elif t is not None and t.oom:
            need = "out of memory in a trial"
        elif self.estimate is not None:
            need = f"estimated {format_bytes(self.estimate.device_total_bytes)}"
        else:
            need = "no estimate"
        if self.from_cache:
            need += " (from the cache)"
        cap = f" of {format_bytes(self.capacity_bytes)}" if self.capacity_bytes else ""
        head = (f"autofit: {'fits' if self.fits else 'DOES NOT FIT'} on {self.device}: "
                f"{need}{cap} (micro batch {c.micro_batch_size} x {c.grad_accum_steps})")
        return head + (f"; {self.problems[0]}" if self.problems else "")

    def summary(self) -> str:
        """The verdict, the problems and the reasons as plain text."""
        c = self.config
        head = (f"autofit pre-flight on {self.device}: "
                f"{'fits' if self.fits else 'DOES NOT FIT'} — micro batch {c.micro_batch_size} x "
                f"accumulation {c.grad_accum_steps}, {describe_choice(choice_of(c))}")
        lines = [head]
        lines += [f"  ✗ {p}" for p in self.problems]
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


class PreflightError(DoesNotFitError):
    """The configuration cannot run here; ``problems`` lists every reason (exit code 3; 4
    when the trial failed for a reason other than memory)."""

    def __init__(self, report: PreflightReport, hint: str | None = None) -> None:
        self.report = report
        if report.fails_otherwise:
            self.exit_code = 4
        self.problems = report.problems
        n = len(report.problems)
        lines = [f"pre-flight on {report.device}: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  {i}. {p}" for i, p in enumerate(report.problems, 1)]
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))
