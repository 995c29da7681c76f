"""The margin kept free, from evidence: what the run adds above its longest step, + a safety.

A trial measures the longest batch's steps; the run is more than that. The default
margin is what the *modelled* run needs above that step — the run's micro batches in
the Trainer's order with its evaluations and saves, replayed through the allocator
model of the target (``autofit.memory.run``) — as a fraction of the capacity, plus
``SAFETY`` (3%): a stated allowance for what neither the model nor a short trial
sees (run-to-run noise of the measured peak; small allocations of the Trainer's own
bookkeeping). The *measured* part is the engine's: a trial's device total holds the
fragmentation its steps met, and its calibration carries it to the rest.

    >>> from autofit.probe.device import resolve_device
    >>> m = run_margin(None, None, None, resolve_device("cpu:4GiB"))
    >>> m.fraction, m.run_bytes
    (0.03, 0)

On the CPU large blocks are not cached (each is its own mapping, returned when
freed), so the allocator model's replay adds nothing (``benchmarks/results/run_replay.md``)
and the margin is the safety alone; what it does not model — small blocks of short
batches fragmenting glibc's heap — is measured instead: a trial replays the run's
first lengths before its longest step again, when its first longest step peaks close
enough to the budget for that to matter (``autofit.stages.run.trial_run``).
On a caching allocator (CUDA) the replay runs once, for the configuration the
estimate alone would pick; what it adds above that configuration's longest step
is kept free for every candidate.

Known limitations:
    NB: the fragmentation over the run is modelled for one configuration (the one
    the estimate would choose) and kept as bytes for all: a much smaller candidate
    keeps more than it needs.
    NB: ``SAFETY`` is a judgment, not a measurement; ``margin=`` overrides it all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.probe.device import DeviceInfo, format_bytes

if TYPE_CHECKING:  # pragma: no cover
    from autofit.memory.run import RunEstimate
    from autofit.probe.run import RunOrder

__all__ = ["SAFETY", "MAX_MARGIN", "RunMargin", "run_margin", "given_margin"]

SAFETY = 0.03  # kept free above the modelled run, for what neither model nor trial sees
MAX_MARGIN = 0.5  # never keep more than half the device free by default


@dataclass(frozen=True)
class RunMargin:
    """The fraction of the capacity kept free, and why.

    Attributes:
        fraction: kept free (the engine's budget is ``capacity * (1 - fraction)``).
        run_bytes: what the modelled run needs above its longest step.
        reason: one line for ``FitResult.reasons``.
        run: the replayed run it came from (None on the CPU or when given).
        config: the configuration whose run was replayed.
    """

    fraction: float
    run_bytes: int
    reason: str
    run: RunEstimate | None = None
    config: TrainConfig | None = None


def given_margin(fraction: float, device: DeviceInfo) -> RunMargin:
    """The margin a user gave (``--margin`` / ``margin=``): kept as given."""
    return RunMargin(fraction, 0, f"margin {100 * fraction:g}% of "
                     f"{format_bytes(device.capacity_bytes)}: as given (the run is not "
                     "modelled into it)")


def run_margin(simulator: Any, config: TrainConfig | None, order: RunOrder | None,
               device: DeviceInfo, *, eval_steps: int | None = None, eval_bytes: int = 0,
               save_steps: int | None = None, safety: float = SAFETY) -> RunMargin:
    """The default margin for ``device``: the modelled run above its longest step + ``safety``.

    Args:
        simulator: a ``Simulator`` of the model on ``device`` (unused on the CPU).
        config: the configuration the estimate alone would pick (None: nothing fits it).
        order: its run order (``probe.run.run_order``).
        device: the target.
        eval_steps, eval_bytes, save_steps: the run's evaluations and saves
            (``memory.run.simulate_run``).
        safety: kept free above the modelled run.
    """
    cap = format_bytes(device.capacity_bytes)
    if device.allocator != "cuda" or config is None or order is None or simulator is None:
        why = ("on the CPU large blocks are not cached (each is its own mapping), and what "
               "short batches leave fragmented on the heap is measured: a trial whose longest "
               "step peaks within 10% of the budget replays the run's first lengths and steps "
               "the longest again"
               if device.allocator != "cuda" else "nothing fits the estimate to replay a run of")
        return RunMargin(safety, 0, f"margin {100 * safety:g}% of {cap}: a stated safety; "
                         f"{why}")
    from autofit.memory.run import simulate_run

    run = simulate_run(simulator, config, order, max_buckets=4, max_steps=200,
                       eval_steps=eval_steps, eval_bytes=eval_bytes, save_steps=save_steps)
    extra = run.fragmentation_bytes
    fraction = min(MAX_MARGIN, safety + extra / device.capacity_bytes)
    what = (f"the run replayed in the Trainer's order ({run.steps} optimizer steps, "
            f"lengths in {len(run.buckets)} bucket(s)"
            + (f", {run.evaluations} evaluation(s)" if run.evaluations else "")
            + f") at micro batch {config.micro_batch_size} × {config.grad_accum_steps} needs "
            f"{format_bytes(extra)} above its longest step (fragmentation over the run, "
            f"decided in its {run.peak_phase} phase)")
    return RunMargin(fraction, extra,
                     f"margin {100 * fraction:.1f}% of {cap}: {what} + {100 * safety:g}% safety",
                     run, config)
