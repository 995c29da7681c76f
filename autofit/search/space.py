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
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autofit.errors import BadInputError
from autofit.knobs import KNOBS, conflict, is_choice, knob, restrict

if TYPE_CHECKING:
    from autofit.probe.device import DeviceInfo

__all__ = ["SearchSpace", "build_space", "micro_batch_options", "divisors", "check_batch_size",
           "MAX_BATCH_SIZE"]

# The largest effective batch (samples per optimizer step) and micro batch accepted.
# Published large-batch runs stay below 2**17 samples per step (LAMB's BERT: 64k; LARS
# on ImageNet: 32k-128k; LLM pre-training: ~4M tokens, a few thousand sequences), so
# 2**20 leaves 8x headroom while keeping every loop over batch sizes small: a typo
# such as 1000000007 is an error at once, not a search that exhausts the machine.
MAX_BATCH_SIZE = 2**20


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
    loss_impl: str = "model"  # TrainConfig.loss_impl, fixed: from the user's training_args
    nnodes: int = 1  # world_size = nproc_per_node x nnodes
    # TrainConfig.torch_compile_mode of the compiled candidates, fixed: the user's
    compile_mode: str | None = None
    # TrainConfig.torch_compile_regional of the compiled candidates, fixed: the user's launch
    # recipe (accelerate's regional compilation)
    compile_regional: bool = False

    @property
    def nproc_per_node(self) -> int:
        return max(1, self.world_size // self.nnodes)

    def __post_init__(self) -> None:
        # a knob that is no choice with this loss (TRL's: autofit's chunked loss) is left out
        names = [k.name for k in KNOBS if k.name in self.choices
                 and is_choice(k, self.loss_impl)]
        unknown = set(self.choices) - {k.name for k in KNOBS}
        if unknown:
            raise BadInputError(f"unknown knob(s) {', '.join(sorted(unknown))}")
        # a copy in registry order, so that combinations and keys read the same everywhere
        object.__setattr__(self, "choices", {n: tuple(self.choices[n]) for n in names})
        if not self.micro_batches or any(not v for v in self.choices.values()):
            raise BadInputError("the search space is empty: allow at least one value of every "
                                "knob and one micro batch")
        if not self.combos():  # every combination conflicts: the first one says why
            first = dict(zip(self.choices, (v[0] for v in self.choices.values()), strict=True))
            raise BadInputError(f"the search space is empty: {conflict(first)}")

    def values(self, name: str) -> tuple[Any, ...]:
        """The values searched for knob ``name``."""
        return self.choices[name]

    def accumulation(self, micro_batch: int) -> int:
        """Gradient accumulation steps that keep the effective batch."""
        if self.target_batch_size is None:
            return 1
        return max(1, self.target_batch_size // (micro_batch * self.world_size))

    def combos(self) -> list[dict[str, Any]]:
        """Every combination of the knobs' values that can be trained (``knobs.conflict``:
        e.g. activation offloading only with checkpointing), as ``{knob name: value}``."""
        names = list(self.choices)
        every = (dict(zip(names, vs, strict=True)) for vs in itertools.product(*self.choices.values()))
        return [c for c in every if conflict(c) is None]

    def describe(self) -> list[Any]:
        """Plain data for a cache key."""
        return [[n, list(v)] for n, v in self.choices.items()] + [
            self.micro_batches[-1], self.target_batch_size, self.world_size, self.optim_args,
            *(() if self.loss_impl == "model" else (self.loss_impl,))] + (
            [self.nnodes] if self.nnodes != 1 else [])


def check_batch_size(name: str, value: object, *, optional: bool = False) -> int | None:
    """``value`` as a batch size (1 to ``MAX_BATCH_SIZE`` samples), or a BadInputError naming it.

    ``True``, ``"16"`` and ``7.5`` are refused: a batch size is a whole number of samples.
    """
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInputError(f"{name} must be a whole number of samples (an int), "
                            f"got {type(value).__name__} {value!r}")
    if value < 1:
        raise BadInputError(f"{name} must be at least 1, got {value}")
    if value > MAX_BATCH_SIZE:
        raise BadInputError(f"{name} {value} is more than {MAX_BATCH_SIZE} samples per step "
                            f"(2**20, far above any published run); give a smaller {name}")
    return int(value)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (a positive int), ascending, in O(sqrt(n)) steps.

        >>> divisors(12)
        [1, 2, 3, 4, 6, 12]
    """
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def micro_batch_options(
    target_batch_size: int | None, world_size: int, max_micro_batch: int
) -> tuple[tuple[int, ...], str | None]:
    """Allowed micro batch sizes, and a note when the target cannot be met exactly.

    With a target, the micro batch must divide ``target / world_size`` so that
    ``micro * accumulation * world_size == target``. Both sizes are checked
    (``check_batch_size``: whole numbers, at most ``MAX_BATCH_SIZE``).
    """
    check_batch_size("max_micro_batch", max_micro_batch)
    if target_batch_size is None:
        return tuple(range(1, max_micro_batch + 1)), None
    check_batch_size("target_batch_size", target_batch_size)
    note = None
    per_device = target_batch_size // world_size
    if per_device * world_size != target_batch_size or per_device == 0:
        per_device = max(1, round(target_batch_size / world_size))
        note = (
            f"target batch {target_batch_size} is not a multiple of {world_size} devices; "
            f"using {per_device * world_size}, the nearest that is"
        )
    options = tuple(d for d in divisors(per_device) if d <= max_micro_batch)
    return options, note


def build_space(
    device: DeviceInfo,
    *,
    max_micro_batch: int = 256,
    target_batch_size: int | None = None,
    world_size: int = 1,
    optim_args: str | None = None,
    reasons: list[str] | None = None,
    loss_impl: str = "model",
    nnodes: int = 1,
    compile_mode: str | None = None,
    compile_regional: bool = False,
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
                       world_size=world_size, optim_args=optim_args, loss_impl=loss_impl,
                       nnodes=nnodes, compile_mode=compile_mode,
                       compile_regional=compile_regional)
