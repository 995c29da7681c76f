"""The search space: the values of every registered knob, and the allowed micro batches.

    >>> from autofit.probe.device import resolve_device
    >>> space = build_space(resolve_device("A100-80GB"), optimizer=["adamw_torch"],
    ...                     target_batch_size=32)
    >>> space.values("precision"), space.micro_batches[-1], space.accumulation(8)
    (('bf16-mixed', '32-true'), 32, 4)

``build_space`` takes one keyword per knob (``precision=``, ``gradient_checkpointing=``,
``optimizer=``, ...: a value or a list of values); an unrestricted knob searches
its defaults for the device, with their reason.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from autofit.errors import BadInputError
from autofit.knobs import KNOBS, knob, restrict

__all__ = ["SearchSpace", "build_space", "micro_batch_options"]


@dataclass(frozen=True)
class SearchSpace:
    """What may be chosen: each knob's values (registry order), and the micro batches (ascending).

    ``choices`` maps a knob name to its values; a knob left out keeps the
    ``TrainConfig`` default. ``optim_args`` and ``world_size`` are fixed for every
    candidate.
    """

    choices: Mapping[str, tuple[Any, ...]]
    micro_batches: tuple[int, ...]
    target_batch_size: int | None = None
    world_size: int = 1
    optim_args: str | None = None

    def __post_init__(self) -> None:
        names = [k.name for k in KNOBS if k.name in self.choices]
        unknown = set(self.choices) - set(names)
        if unknown:
            raise BadInputError(f"unknown knob(s) {', '.join(sorted(unknown))}")
        # a copy in registry order, so that combinations and keys read the same everywhere
        object.__setattr__(self, "choices", {n: tuple(self.choices[n]) for n in names})
        if not self.micro_batches or any(not v for v in self.choices.values()):
            raise BadInputError("the search space is empty: allow at least one value of every "
                                "knob and one micro batch")

    def values(self, name: str) -> tuple[Any, ...]:
        """The values searched for knob ``name``."""
        return self.choices[name]

    def accumulation(self, micro_batch: int) -> int:
        """Gradient accumulation steps that keep the effective batch."""
        if self.target_batch_size is None:
            return 1
        return max(1, self.target_batch_size // (micro_batch * self.world_size))

    def combos(self) -> list[dict[str, Any]]:
        """Every combination of the knobs' values, as ``{knob name: value}``."""
        names = list(self.choices)
        return [dict(zip(names, vs, strict=True))
                for vs in itertools.product(*self.choices.values())]

    def describe(self) -> list[Any]:
        """Plain data for a cache key."""
        return [[n, list(v)] for n, v in self.choices.items()] + [
            self.micro_batches[-1], self.target_batch_size, self.world_size, self.optim_args]


def micro_batch_options(
    target_batch_size: int | None, world_size: int, max_micro_batch: int
) -> tuple[tuple[int, ...], str | None]:
    """Allowed micro batch sizes, and a note when the target cannot be met exactly.

    With a target, the micro batch must divide ``target / world_size`` so that
    ``micro * accumulation * world_size == target``.
    """
    if max_micro_batch < 1:
        raise BadInputError(f"max_micro_batch must be at least 1, got {max_micro_batch}")
    if target_batch_size is None:
        return tuple(range(1, max_micro_batch + 1)), None
    if target_batch_size < 1:
        raise BadInputError(f"target_batch_size must be positive, got {target_batch_size}")
    note = None
    per_device = target_batch_size // world_size
    if per_device * world_size != target_batch_size or per_device == 0:
        per_device = max(1, round(target_batch_size / world_size))
        note = (
            f"target batch {target_batch_size} is not a multiple of {world_size} devices; "
            f"using {per_device * world_size}, the nearest that is"
        )
    options = tuple(d for d in range(1, min(per_device, max_micro_batch) + 1) if per_device % d == 0)
    return options, note


def build_space(
    device: Any,
    *,
    max_micro_batch: int = 256,
    target_batch_size: int | None = None,
    world_size: int = 1,
    optim_args: str | None = None,
    reasons: list[str] | None = None,
    **allowed: Any,
) -> SearchSpace:
    """The space the caller allows on ``device``, with a reason for every default.

    ``allowed`` holds one keyword per knob (its name): a value or a list of values;
    None or absent searches the knob's defaults. A value the device cannot run
    raises the knob's ``AutofitError`` (e.g. bf16 on a T4).
    """
    reasons = reasons if reasons is not None else []
    for name in allowed:
        knob(name)  # an unknown name is a bad input, not a silent no-op
    choices = {k.name: restrict(k, device, allowed.get(k.name), reasons) for k in KNOBS}
    if not all(choices.values()):
        raise BadInputError("the search space is empty: allow at least one value of "
                            + ", ".join(k.name for k in KNOBS))
    micro, note = micro_batch_options(target_batch_size, world_size, max_micro_batch)
    if note:
        reasons.append(note)
    return SearchSpace(choices, micro, target_batch_size=target_batch_size,
                       world_size=world_size, optim_args=optim_args)
