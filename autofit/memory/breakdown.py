"""The result of an estimate: three peaks and what fills them.

``breakdown`` splits ``device_total_bytes`` into the components of MEMORY.md, at
the moment of the peak: ``weights + gradients + optimizer_states + activations +
temporaries == peak_allocated_bytes`` and ``overhead`` holds the rest (allocator
cache above the live tensors, runtime context, cuBLAS workspace), so the six add
up to ``device_total_bytes``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

try:
    from enum import StrEnum
except ImportError:  # Python 3.10: what 3.11's StrEnum is
    from enum import Enum

    class StrEnum(str, Enum):  # type: ignore[no-redef]
        __str__ = str.__str__
        __format__ = str.__format__

__all__ = ["COMPONENTS", "Component", "MemoryEstimate"]


class Component(StrEnum):
    """What a byte of a training step's device memory is for (torch's mem_tracker
    ``_MemRefType``): the keys of ``MemoryEstimate.breakdown`` and the category of each
    recorded storage. A ``StrEnum``: a member is its value (``Component.WEIGHTS ==
    "weights"``), so the JSON and the breakdown dicts users read keep plain names.

    - ``WEIGHTS``: the parameters (quantized ones too) and autocast's 16-bit copies, the
      model's buffers;
    - ``GRADIENTS``: ``.grad`` of the trainable parameters (a strategy's gradient buckets);
    - ``OPTIMIZER_STATES``: the optimizer's state after its first step;
    - ``ACTIVATIONS``: what the forward saves for backward (the batch on the device);
    - ``TEMPORARIES``: what an op or a phase holds for a moment (loss gradients, a block's
      backward, the optimizer step's scratch, the CPU math libraries' caches);
    - ``OVERHEAD``: the device total above the live tensors (allocator cache, runtime
      context, cuBLAS workspace); never a recorded storage's category.
    """

    WEIGHTS = "weights"
    GRADIENTS = "gradients"
    OPTIMIZER_STATES = "optimizer_states"
    ACTIVATIONS = "activations"
    TEMPORARIES = "temporaries"
    OVERHEAD = "overhead"


COMPONENTS: tuple[str, ...] = tuple(c.value for c in Component)


@dataclass(frozen=True)
class MemoryEstimate:
    """Device memory of one training step of one configuration.

    Attributes:
        peak_allocated_bytes: most bytes held by live tensors at once
            (``torch.cuda.max_memory_allocated`` on a GPU).
        peak_reserved_bytes: most bytes the allocator holds at once
            (``torch.cuda.max_memory_reserved``); equals allocated on the CPU.
        device_total_bytes: what the device must have: reserved + context + workspace.
        capacity_bytes: what the device offers to the training process.
        fits: ``device_total_bytes <= capacity_bytes``.
        breakdown: component -> bytes at the peak (see ``COMPONENTS``).
        method: ``"analytic"`` or ``"simulate"``.
        peak_phase: ``"forward"``, ``"backward"`` or ``"optimizer"``.
        run_peak_reserved_bytes: with a dataset: the most the allocator holds over the
            whole run replayed in its order (``autofit.memory.run``); None otherwise.
        run_device_total_bytes: with a dataset: what the whole run needs (the least
            capacity it runs through, never below this step's), + context and
            workspace; ``fits`` then compares it with the capacity. None otherwise.
        host_bytes: pinned host memory the step holds outside the device: with
            ``activation_offloading``, the offloaded activations (each block rounded up
            to a power of two by torch's host caching allocator, which keeps them for the
            next step); 0 when nothing is offloaded. Not part of ``device_total_bytes``.
            With several processes: the host memory of a node (its ranks' offloaded
            shares together, ``autofit.memory.ranks``).
        per_rank: with several processes, one dict per rank (``rank``,
            ``peak_allocated_bytes``, ``peak_reserved_bytes``, ``device_total_bytes``,
            ``host_bytes`` (the rank's share), ``breakdown``); the top-level figures are
            those of the rank that peaks. Empty for one process.
        peak_rank: the rank whose figures are the top-level ones (the lowest on ties).
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    device_total_bytes: int
    capacity_bytes: int
    fits: bool
    breakdown: dict[str, int]
    method: str
    device: str
    peak_phase: str
    model: str = ""
    num_params: int = 0
    trainable_params: int = 0
    seq_len: int = 0
    config: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    run_peak_reserved_bytes: int | None = None
    run_device_total_bytes: int | None = None
    host_bytes: int = 0
    per_rank: tuple[dict[str, Any], ...] = ()
    peak_rank: int = 0

    def __post_init__(self) -> None:
        # plain str keys (a ``Component`` is one, but yaml's safe dumper and repr tell them
        # apart): what users and the golden files read stays byte-identical
        if any(type(k) is not str for k in self.breakdown):
            object.__setattr__(self, "breakdown", {str(k): v for k, v in self.breakdown.items()})

    @property
    def needed_bytes(self) -> int:
        """What the device must have: the whole run's need when known, else this step's."""
        return (self.run_device_total_bytes if self.run_device_total_bytes is not None
                else self.device_total_bytes)

    @property
    def run_fragmentation_bytes(self) -> int | None:
        """What the run needs above this step (fragmentation over the run), when known."""
        if self.run_device_total_bytes is None:
            return None
        return max(0, self.run_device_total_bytes - self.device_total_bytes)

    @property
    def headroom_bytes(self) -> int:
        """Capacity left above the need (negative when it does not fit)."""
        return self.capacity_bytes - self.needed_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["notes"] = list(self.notes)
        if self.per_rank:
            d["per_rank"] = [dict(r) for r in self.per_rank]
        else:  # one process: the keys of a single-rank estimate only
            del d["per_rank"], d["peak_rank"]
        d["headroom_bytes"] = self.headroom_bytes
        return d
