"""The memory of a whole training run: the simulated step, replayed in the run's order.

One step's peak is not the run's. Batches of different padded lengths follow each
other, and the caching allocator keeps the segments each one made: a long batch
after many short ones may find no cached block large enough and reserve a new
segment while the old ones stay cached. ``simulate_run`` replays the run:

1. the run's micro batches in the Trainer's order (``autofit.probe.run.run_order``),
   their lengths rounded up to at most ``max_buckets`` bucket lengths (quantiles of
   the run's lengths, the longest always one of them: never below the truth);
2. one simulated training step per distinct (micro batch, bucket) shape
   (``Simulator.run``: two steps of the Trainer's step on fake tensors, with
   accumulation), cut at its marks into the first micro batch of a step (it creates
   the gradients), an accumulating micro batch, and the optimizer step (it frees the
   gradients; the first one creates the optimizer's states);
3. the run's sequence of steps rebuilt from those pieces — the weights and the first
   step as simulated, then for every optimizer step its micro batches' pieces and the
   optimizer piece, each with fresh ids — and replayed through one allocator model of
   the target (``autofit.memory.allocator``), which keeps its cache from step to step.

The result is the run's peak allocated and reserved bytes, the device total, the
worst step alone (the longest batch's two steps, what ``simulate`` reports) and the
growth of the peak over the steps: ``converged_step`` is the last step at which the
reserved peak grew.

    >>> from autofit.probe.model import build_model
    >>> from autofit.probe.device import resolve_device
    >>> from autofit.probe.run import run_order
    >>> from autofit.memory.simulate import Simulator
    >>> module, task = build_model("tiny-gpt2")
    >>> sim = Simulator(module, task=task, device=resolve_device("A100-80GB"))
    >>> order = run_order([40, 200, 90, 120, 64, 256, 30, 77], micro_batch_size=2)
    >>> run = simulate_run(sim, TrainConfig(micro_batch_size=2), order)
    >>> run.peak_reserved_bytes >= run.step_peak_reserved_bytes
    True

Evaluation and saving (``eval_steps`` / ``save_steps``): after every ``eval_steps``-th
optimizer step the replay runs an evaluation — a block of ``eval_bytes`` (the eval
batch's working set above what the run keeps: its activations, logits and loss, and
autocast's 16-bit weight copies; ``eval_working_set``) allocated between the training
steps, where the gradients are gone and the optimizer states stay — and after every
``save_steps``-th a checkpoint save of ``save_bytes``. A run shorter than the interval
still evaluates / saves once, at the end (the Trainer does at its last step).

Known limitations:
    NB: an evaluation is one block of its working set, not its stream of allocations:
    on a caching allocator it may find room that its many smaller blocks would not.
    NB: a save moves tensors to the host (``safetensors`` and ``torch.save``): it
    needs no device memory on a GPU, and measured +0.7 MiB of RSS for a 74 MiB model
    on the CPU (``SAVE_BYTES`` = 0 by default).
    NB: bucketing rounds lengths up: the replay can only see more memory than the run.
    NB: a step whose optimizer replaces its states (rather than updating them in
    place) cannot be stitched; the step estimate stands in, and a note says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.config import TrainConfig
from autofit.errors import BadInputError
from autofit.memory.breakdown import Component

if TYPE_CHECKING:  # pragma: no cover
    from autofit.memory.allocator import AllocEvent
    from autofit.memory.breakdown import MemoryEstimate
    from autofit.memory.simulate import SimulationResult, Simulator
    from autofit.probe.run import RunOrder

__all__ = ["RunEstimate", "simulate_run", "bucket_edges", "eval_working_set", "DEFAULT_BUCKETS",
           "DEFAULT_MAX_STEPS"]

DEFAULT_BUCKETS = 8
DEFAULT_MAX_STEPS = 1000  # optimizer steps replayed (~3k events each for a small model)


@dataclass(frozen=True)
class RunEstimate:
    """The simulated run's memory (bytes) and how it grew.

    Attributes:
        peak_allocated_bytes: most bytes in live tensors at once over the run.
        peak_reserved_bytes: most bytes the allocator held at once over the run on the
            target (its cache is released and the request retried when the device is
            full, so this stays within the capacity unless the run does not fit).
        device_total_bytes: what the run needs: the least allocator capacity it runs
            through (found by replaying), never less than the worst-case step's reserved
            peak (the longest batch throughout, which trials measure and a run with another
            order may meet), + the device's context/workspace.
        step_peak_reserved_bytes: the longest batch's steps alone (``simulate``'s number).
        steps: optimizer steps replayed.
        reserved_by_step: the reserved peak after each replayed step (the growth curve).
        converged_step: the last step (from 1) at which the reserved peak grew.
        buckets: the ``(micro batch, length)`` shapes simulated, longest first.
        oom_step: the first step that runs out of memory on the target, or None.
        unlimited_peak_reserved_bytes: the reserved peak with no capacity limit (the
            cache never released: what ``max_memory_reserved`` shows on a huge card).
        notes: how the run was replayed.
        peak_phase: ``"train"``, ``"eval"`` or ``"save"``: what decides the run's need
            (the phase that runs out of memory just below it).
        evaluations, saves: evaluation passes and checkpoint saves replayed.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    step_peak_reserved_bytes: int
    steps: int
    reserved_by_step: tuple[int, ...]
    converged_step: int
    buckets: tuple[tuple[int, int], ...]
    oom_step: int | None
    unlimited_peak_reserved_bytes: int = 0
    overhead_bytes: int = 0
    notes: tuple[str, ...] = ()
    peak_phase: str = "train"  # where the reserved peak was met: train, eval or save
    evaluations: int = 0  # evaluation passes replayed
    saves: int = 0  # checkpoint saves replayed

    @property
    def fragmentation_bytes(self) -> int:
        """What the run needs above its worst single step: fragmentation over the run."""
        return max(0, self.device_total_bytes - self.overhead_bytes - self.step_peak_reserved_bytes)


def bucket_edges(lengths: list[int] | tuple[int, ...], max_buckets: int) -> list[int]:
    """At most ``max_buckets`` lengths; every length rounds up to one (the longest included).

    Example:
        >>> bucket_edges([5, 9, 9, 30, 12, 7], 3)
        [7, 9, 30]
    """
    if max_buckets < 1:
        raise BadInputError(f"max_buckets must be at least 1, got {max_buckets}")
    distinct = sorted(set(lengths))
    if len(distinct) <= max_buckets:
        return distinct
    ordered = sorted(lengths)
    n = len(ordered)
    edges = {ordered[min(n - 1, math.ceil(q * n / max_buckets) - 1)]
             for q in range(1, max_buckets + 1)}
    edges.add(ordered[-1])
    return sorted(edges)


def _round_up(length: int, edges: list[int]) -> int:
    import bisect

    return edges[bisect.bisect_left(edges, length)]


@dataclass(frozen=True)
class _Pieces:
    """A simulated step cut at its marks (events of ``Simulator.run``)."""

    prefix: tuple[AllocEvent, ...]  # the weights (and what exists before the first step)
    first_micro0: tuple[AllocEvent, ...]  # step 0: creates the gradients
    first_micro1: tuple[AllocEvent, ...]  # step 0 accumulating (empty without accumulation)
    first_optimizer: tuple[AllocEvent, ...]  # step 0: creates the states, frees the grads
    micro0: tuple[AllocEvent, ...]  # a steady step's first micro batch
    micro1: tuple[AllocEvent, ...]  # a steady accumulating micro batch
    optimizer: tuple[AllocEvent, ...]  # a steady optimizer step


def _cut(result: SimulationResult) -> _Pieces:
    at = dict(result.marks)
    ev = result.events

    def piece(start: str, end: str) -> tuple[AllocEvent, ...]:
        if start not in at:
            return ()
        return ev[at[start]:at[end]]

    accum = "step0/micro1" in at
    return _Pieces(
        prefix=ev[:at["step0/micro0"]],
        first_micro0=piece("step0/micro0", "step0/micro1" if accum else "step0/optimizer"),
        first_micro1=piece("step0/micro1", "step0/optimizer") if accum else (),
        first_optimizer=piece("step0/optimizer", "step1/micro0"),
        micro0=piece("step1/micro0", "step1/micro1" if accum else "step1/optimizer"),
        micro1=piece("step1/micro1", "step1/optimizer") if accum else (),
        optimizer=piece("step1/optimizer", "end"),
    )


def _stitchable(p: _Pieces) -> bool:
    """A steady step frees only what its own first micro batch made (the gradients) and
    leaves nothing behind: then its pieces can follow any other step's."""
    def balance(*pieces: tuple[AllocEvent, ...]) -> tuple[set[int], set[int]]:
        made = {e.id for pc in pieces for e in pc if e.kind == "alloc"}
        gone = {e.id for pc in pieces for e in pc if e.kind == "free"}
        return gone - made, made - gone

    foreign, left = balance(p.micro0, p.micro1, p.optimizer)
    accum_foreign, accum_left = balance(p.micro1)
    return not foreign and not left and not accum_foreign and not accum_left


def _renamed(events: tuple[AllocEvent, ...], tag: int) -> list[AllocEvent]:
    from dataclasses import replace

    shift = tag << 40  # ids of one simulation stay below 2**40
    return [replace(e, id=e.id + shift) for e in events]


def simulate_run(
    sim: Simulator,
    config: TrainConfig,
    order: RunOrder,
    *,
    max_buckets: int = DEFAULT_BUCKETS,
    max_steps: int = DEFAULT_MAX_STEPS,
    eval_steps: int | None = None,
    eval_bytes: int = 0,
    save_steps: int | None = None,
    save_bytes: int = 0,
) -> RunEstimate:
    """Replay the run of ``order`` with ``config`` (see the module docstring).

    Args:
        sim: a ``Simulator`` of the model on the target device.
        config: the training configuration (its micro batch and accumulation are the
            order's; precision, checkpointing, optimizer apply).
        order: the run's micro batches (``probe.run.run_order``).
        max_buckets: distinct lengths simulated at most.
        max_steps: optimizer steps replayed at most (the rest repeats what was seen).
        eval_steps: evaluate after every this many optimizer steps (None: never).
        eval_bytes: an evaluation's working set on the device (``eval_working_set``).
        save_steps: save a checkpoint after every this many optimizer steps (None: never).
        save_bytes: device bytes a save allocates (0 on a GPU: it copies to the host).
    """
    if not order.lengths or not order.steps:
        raise BadInputError("the run has no micro batches to replay")
    if max_steps < 1:
        raise BadInputError(f"max_steps must be at least 1, got {max_steps}")
    for name, every in (("eval_steps", eval_steps), ("save_steps", save_steps)):
        if every is not None and (isinstance(every, bool) or not isinstance(every, int)
                                  or every < 1):
            raise BadInputError(f"{name} must be a positive integer or None, got {every!r}")
    dev = sim.device
    edges = bucket_edges(order.lengths, max_buckets)
    shapes = [(s, _round_up(n, edges)) for s, n in zip(order.sizes, order.lengths, strict=True)]
    accum = min(config.grad_accum_steps, 2)
    pieces: dict[tuple[int, int], _Pieces] = {}
    for shape in sorted(set(shapes), key=lambda sl: (sl[1], sl[0]), reverse=True):
        size, length = shape
        run = sim.run(config.replace(micro_batch_size=size, grad_accum_steps=accum),
                      seq_len=length)
        pieces[shape] = _cut(run)
    longest = max(pieces, key=lambda sl: (sl[1], sl[0]))
    step_peak = sim.run(config.replace(micro_batch_size=longest[0], grad_accum_steps=accum),
                        seq_len=longest[1]).replay.peak_reserved_bytes
    notes = [f"{len(order)} micro batches in {len(order.steps)} optimizer steps; "
             f"{order.note}; lengths rounded up to {len(edges)} bucket(s): "
             + ", ".join(map(str, edges))]
    if not all(_stitchable(p) for p in pieces.values()):
        notes.append("the optimizer step replaces its states: the run cannot be stitched "
                     "from simulated steps; the longest batch's step stands in")
        return RunEstimate(
            peak_allocated_bytes=int(step_peak), peak_reserved_bytes=int(step_peak),
            device_total_bytes=int(step_peak + dev.overhead_bytes),
            step_peak_reserved_bytes=int(step_peak), steps=0, reserved_by_step=(),
            converged_step=0, buckets=tuple(pieces), oom_step=None,
            unlimited_peak_reserved_bytes=int(step_peak), overhead_bytes=dev.overhead_bytes,
            notes=tuple(notes))

    steps = order.steps[:max_steps]
    extras = _between_steps(len(steps), eval_steps, eval_bytes, save_steps, save_bytes)
    capacity = dev.capacity_bytes - dev.overhead_bytes  # what the allocator may take
    on_card = _replay_run(pieces, shapes, steps, dev.allocator, capacity, extras)
    unlimited = _replay_run(pieces, shapes, steps, dev.allocator, None, extras)
    need = _least_capacity(pieces, shapes, steps, dev.allocator, extras,
                           lo=unlimited.peak_allocated, hi=unlimited.peak_reserved)
    # where the run needs its memory: the phase that runs out just below the least
    # capacity it goes through (on the CPU, nothing cached: the phase of the peak)
    below = _replay_run(pieces, shapes, steps, dev.allocator,
                        max(0, need - max(2 << 20, need // 100)), extras)
    peak_phase = below.peak_phase if below.oom_step is not None else unlimited.peak_phase
    if len(order.steps) > max_steps:
        notes.append(f"replayed the first {max_steps} of {len(order.steps)} optimizer steps")
    evals = sum(1 for phases in extras.values() for ph, _ in phases if ph == "eval")
    saves = sum(1 for phases in extras.values() for ph, _ in phases if ph == "save")
    if evals or saves:
        notes.append(f"{evals} evaluation(s) of {eval_bytes / 2**20:,.0f} MiB working set and "
                     f"{saves} save(s) of {save_bytes / 2**20:,.0f} MiB between the steps")
    by_step = unlimited.by_step
    grew = [i + 1 for i in range(len(by_step)) if i == 0 or by_step[i] > by_step[i - 1]]
    notes.append("the allocator releases its cached blocks and retries when the device is "
                 "full: the run needs less than it reserves on a large card")
    return RunEstimate(
        peak_allocated_bytes=int(unlimited.peak_allocated),
        peak_reserved_bytes=int(max(on_card.peak_reserved, step_peak)
                                if on_card.oom_step is None else on_card.peak_reserved),
        device_total_bytes=int(max(need, step_peak) + dev.overhead_bytes),
        step_peak_reserved_bytes=int(step_peak),
        steps=len(by_step),
        reserved_by_step=tuple(by_step),
        converged_step=grew[-1],
        buckets=tuple(sorted(pieces, key=lambda sl: (sl[1], sl[0]), reverse=True)),
        oom_step=on_card.oom_step,
        unlimited_peak_reserved_bytes=int(unlimited.peak_reserved),
        overhead_bytes=dev.overhead_bytes,
        notes=tuple(notes),
        peak_phase=peak_phase,
        evaluations=evals,
        saves=saves,
    )


def _between_steps(n_steps: int, eval_steps: int | None, eval_bytes: int,
                   save_steps: int | None, save_bytes: int) -> dict[int, list[tuple[str, int]]]:
    """Step index (from 0) -> the evaluations and saves run after it, in the Trainer's
    order (evaluate, then save); a run shorter than an interval does it once at its end."""
    out: dict[int, list[tuple[str, int]]] = {}
    for phase, every, size in (("eval", eval_steps, eval_bytes), ("save", save_steps, save_bytes)):
        if every is None:
            continue
        at = [s - 1 for s in range(every, n_steps + 1, every)] or [n_steps - 1]
        for i in at:
            out.setdefault(i, []).append((phase, int(size)))
    return out


def eval_working_set(eval_estimate: MemoryEstimate, training_weights_bytes: int) -> int:
    """An evaluation's bytes above what the training run keeps between its steps.

    ``eval_estimate``: ``estimate_eval(..., training=config)`` of the eval batch;
    ``training_weights_bytes``: the run's weights (``memory.analytic.weights_bytes``).
    The run already holds the weights and the optimizer states; the evaluation adds its
    activations, logits and loss, and the 16-bit weight copies autocast caches.
    """
    b = eval_estimate.breakdown
    return int(max(0, b[Component.WEIGHTS] - training_weights_bytes) + b[Component.ACTIVATIONS]
               + b[Component.TEMPORARIES])


@dataclass(frozen=True)
class _Replayed:
    peak_allocated: int
    peak_reserved: int
    by_step: tuple[int, ...]  # reserved peak after each step
    oom_step: int | None
    peak_phase: str = "train"


def _replay_run(pieces: dict[tuple[int, int], _Pieces], shapes: list[tuple[int, int]],
                steps: tuple[int, ...], allocator: str, capacity: int | None,
                extras: dict[int, list[tuple[str, int]]] | None = None) -> _Replayed:
    """One replay of the run's steps through a fresh allocator model of ``capacity``,
    with the evaluations and saves of ``extras`` (``_between_steps``) between them."""
    from autofit.memory.allocator import AllocEvent, CpuAllocatorModel, CudaCachingAllocatorModel

    model: Any = (CudaCachingAllocatorModel(capacity) if allocator == "cuda"
                  else CpuAllocatorModel(capacity))
    tag = 0
    by_step: list[int] = []
    peak_phase = "train"
    k = 0  # index of the micro batch
    for i, n_micro in enumerate(steps):
        group = shapes[k:k + n_micro]
        k += n_micro
        first = pieces[group[0]]
        if i == 0:  # the weights and the first step, as the first shape's simulation made them
            chunks = [list(first.prefix), list(first.first_micro0)]
            for shape in group[1:]:
                tag += 1
                chunks.append(_renamed(pieces[shape].micro1 or pieces[shape].first_micro1, tag))
            chunks.append(list(first.first_optimizer))
        else:
            tag += 1
            own = tag  # the step's first micro batch and its optimizer share ids (the grads)
            chunks = [_renamed(first.micro0, own)]
            for shape in group[1:]:
                tag += 1
                chunks.append(_renamed(pieces[shape].micro1, tag))
            chunks.append(_renamed(first.optimizer, own))
        labelled = [("train", c) for c in chunks]
        for phase, size in (extras or {}).get(i, ()):
            if size > 0:
                tag += 1
                block = (tag << 40) - 1  # an id no simulated tensor has
                labelled.append((phase, [AllocEvent("alloc", block, size),
                                         AllocEvent("free", block, size)]))
        for phase, chunk in labelled:
            before = model.peak_reserved_bytes
            r = model.replay(chunk)
            if r.oom:
                return _Replayed(r.peak_allocated_bytes, r.peak_reserved_bytes,
                                 tuple(by_step), i + 1, phase)
            if model.peak_reserved_bytes > before:
                peak_phase = phase
        by_step.append(model.peak_reserved_bytes)
    return _Replayed(model.peak_allocated_bytes, model.peak_reserved_bytes, tuple(by_step), None,
                     peak_phase)


def _least_capacity(pieces: dict[tuple[int, int], _Pieces], shapes: list[tuple[int, int]],
                    steps: tuple[int, ...], allocator: str,
                    extras: dict[int, list[tuple[str, int]]] | None = None, *,
                    lo: int, hi: int) -> int:
    """The smallest allocator capacity the run goes through without running out (the
    allocator frees its cached blocks and retries before it fails), to 1% or 2 MiB."""
    if allocator != "cuda":
        return hi  # nothing is cached on the CPU: what it reserves is what it needs
    lo, hi = max(0, lo - 1), hi  # lo fails (below the live bytes), hi fits (unlimited peak)
    while hi - lo > max(2 << 20, hi // 100):
        mid = (lo + hi) // 2
        if _replay_run(pieces, shapes, steps, allocator, mid, extras).oom_step is None:
            hi = mid
        else:
            lo = mid
    return hi
