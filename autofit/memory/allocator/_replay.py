"""`replay`: a stream of allocator events through a fresh model of the device kind."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from autofit.errors import BadInputError
from autofit.memory.allocator._common import (
    AllocEvent,
    ReplayResult,
)
from autofit.memory.allocator._cpu_model import CpuAllocatorModel
from autofit.memory.allocator._cuda_model import CudaCachingAllocatorModel
from autofit.memory.allocator._model_base import _ModelBase

__all__ = ["replay"]


def replay(
    events: Iterable[AllocEvent],
    device_kind: Literal["cuda", "cpu"],
    capacity_bytes: int | None = None,
    expandable_segments: bool = False,
) -> ReplayResult:
    """Replays events through a fresh allocator model of a device kind.

    Args:
        events: Allocs and frees in program order.
        device_kind: ``"cuda"`` for the caching allocator, ``"cpu"`` for glibc.
        capacity_bytes: Memory the allocator may take; ``None`` for unlimited.
        expandable_segments: CUDA only: model ``expandable_segments:True``.

    Returns:
        Peaks, final values and whether (and where) an allocation failed.

    Raises:
        BadInputError: Unknown device kind, expandable segments on CPU, or a
            malformed event stream.

    Example:
        >>> r = replay([AllocEvent("alloc", 0, 1)], "cuda")
        >>> r.peak_allocated_bytes, r.peak_reserved_bytes
        (512, 2097152)
    """
    model: _ModelBase
    if device_kind == "cuda":
        model = CudaCachingAllocatorModel(capacity_bytes, expandable_segments)
    elif device_kind == "cpu":
        if expandable_segments:
            raise BadInputError("expandable_segments applies to CUDA only; drop it for 'cpu'")
        model = CpuAllocatorModel(capacity_bytes)
    else:
        raise BadInputError(f"device_kind must be 'cuda' or 'cpu', got {device_kind!r}")
    return model.replay(events)
