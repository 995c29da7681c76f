"""``TrialResult``: what one trial measured on the device (see ``autofit.trial.runner``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["TrialResult", "trial_from_dict", "setup_left_out", "with_run_additions"]


@dataclass(frozen=True)
class TrialResult:
    """What one trial measured. Sizes in bytes, times in seconds; ``None`` = not measured.

    ``oom`` is True when the step ran out of memory: a completed trial whose memory
    constraint is violated, not a failure. ``error`` is set for an OOM (its message)
    and for any other failure (then ``oom`` is False). ``killed_by`` names the signal
    that ended the trial process from outside (the host's out-of-memory killer sends
    SIGKILL), in the attempt and its one retry: not an out-of-memory result, so
    ``oom`` is False and ``error`` says so. On a CPU the three memory
    fields are equal and include weights, buffers and batch (see the module
    docstring); on an accelerator they are the allocator's peaks. With several ranks
    (``config["world_size"] > 1``) ``per_rank`` holds each rank's numbers and the
    top-level ones are those of the rank that peaks (``autofit.trial.ranks``);
    ``tokens_per_s`` is then one rank's.
    """

    oom: bool
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    device_total_bytes: int | None
    step_time_s: float | None  # median of the measured steps (one optimizer step each)
    tokens_per_s: float | None  # of the run: its accumulation amortises the optimizer step
    samples_per_s: float | None
    error: str | None
    config: dict[str, Any]  # TrainConfig.to_dict() of what ran (seq_len = T of the batch)
    device: str
    batch_shape: tuple[int, int]  # (B, T) of one micro batch
    isolation: str  # "in-process" | "subprocess"
    isolation_reason: str
    steps: int  # measured steps completed
    warmup_steps: int = 0  # warm-up steps completed
    micro_batches_per_step: int = 1  # min(grad_accum_steps, 2): see autofit.trial.step
    capacity_bytes: int | None = None  # what the device offers (the cap on a capped CPU)
    resident_bytes: int | None = None  # CPU: weights + buffers + batch inside the peak
    timed_out: bool = False
    recovered: bool | None = None  # in-process: memory back at the baseline afterwards
    leaked_bytes: int | None = None
    notes: tuple[str, ...] = ()
    killed_by: str | None = None  # "SIGKILL", ...: ended the trial process (and its retry)
    run_steps: int = 0  # steps of the run's other lengths replayed before the measured ones
    eval_device_total_bytes: int | None = None  # the evaluation step, with the states alive
    eval_oom: bool = False  # the evaluation step ran out of memory (the training did not)
    eval_error: str | None = None
    compile_s: float | None = None  # torch_compile: the set-up steps that compiled (not timed)
    over_budget: bool = False  # stopped once its peak passed the search's budget (RunSpec)
    # stopped after its first timed step: slower than a confirmed rival (RunSpec); its
    # speed and that step's peak are measured, its run is not
    outpaced: bool = False
    # several ranks (world_size > 1): one dict per rank (autofit.trial.ranks); the peaks
    # above are the peaking rank's, capacity_bytes the smallest rank's
    per_rank: tuple[dict[str, Any], ...] = ()
    phase_s: dict[str, float] = field(default_factory=dict)  # where the trial's time went
    # the optimizer step's share of the run's optimizer step (its accumulation amortising
    # it; None where it was not timed apart: a trial on several ranks)
    optimizer_share: float | None = None
    # CPU: resident memory the trial's set-up step left for good (autograd's and the math
    # libraries' one-time set-up, first-touch pages of their code), outside the peaks above,
    # which start after it; a run counts it once (autofit run's baseline is its model's
    # construction), so the whole-run figure adds it (None: not a CPU trial)
    setup_bytes: int | None = None
    setup_counted: bool = False  # the device totals above hold setup_bytes (a tune's trial)

    @property
    def fits(self) -> bool:
        """The steps ran to the end without running out of memory or failing."""
        return not self.oom and self.error is None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["batch_shape"] = list(self.batch_shape)
        d["notes"] = list(self.notes)
        d["per_rank"] = [dict(p) for p in self.per_rank]
        return d


def trial_from_dict(d: dict[str, object]) -> TrialResult:
    """A ``TrialResult`` from ``to_dict()`` output (fields unknown to this version dropped)."""
    from dataclasses import fields

    names = {f.name for f in fields(TrialResult)}
    kw = {k: v for k, v in d.items() if k in names}
    if kw.get("batch_shape") is not None:
        kw["batch_shape"] = tuple(kw["batch_shape"])
    if kw.get("notes") is not None:
        kw["notes"] = tuple(kw["notes"])
    if kw.get("per_rank") is not None:
        kw["per_rank"] = tuple(dict(p) for p in kw["per_rank"])
    return TrialResult(**kw)


def setup_left_out(trial: Any) -> int:
    """What a CPU trial's set-up step left resident where its device totals leave it out
    (``setup_bytes`` not yet ``setup_counted``): a run counts it. 0 for anything else."""
    if getattr(trial, "setup_counted", False):
        return 0
    return int(getattr(trial, "setup_bytes", None) or 0)


def with_run_additions(result: TrialResult, extra: int, notes: list[str]) -> TrialResult:
    """``result`` with ``extra`` bytes (what a run adds to the trial's step and evaluation)
    in its device totals, ``notes`` appended, and its set-up residue counted in: the tune's
    (``autofit.stages.run.WholeRun.with_growth``) and the check's own trials alike."""
    import dataclasses

    once = setup_left_out(result)
    ev = result.eval_device_total_bytes
    return dataclasses.replace(
        result, device_total_bytes=result.device_total_bytes + extra + once,
        eval_device_total_bytes=ev + extra + once if ev is not None else None,
        notes=(*result.notes, *notes), setup_counted=bool(once) or result.setup_counted)
