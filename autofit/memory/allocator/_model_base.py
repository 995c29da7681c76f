"""What the CUDA and CPU allocator models share: blocks, stats, handles, replay."""

from __future__ import annotations

from collections.abc import Iterable

from autofit.errors import BadInputError
from autofit.memory.allocator._common import AllocEvent, ReplayResult, SimulatedOutOfMemoryError


class _Block:
    """A block of a segment (``struct Block``): allocated, free, or unmapped."""

    __slots__ = (
        "size",
        "addr",
        "small",
        "allocated",
        "mapped",
        "prev",
        "next",
        "segment",
        "requested",
        "category",
    )

    def __init__(
        self,
        size: int,
        addr: int,
        small: bool,
        segment: _ExpandableSegment | None = None,
        mapped: bool = True,
    ) -> None:
        self.size = size
        self.addr = addr
        self.small = small
        self.allocated = False
        self.mapped = mapped
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.segment = segment
        self.requested = 0
        self.category = ""

    def splice(self, before: _Block | None, after: _Block | None) -> None:
        """Links this block between ``before`` and ``after`` (``Block::splice``)."""
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after


class _ExpandableSegment:
    """A virtual address range mapped page by page (``struct ExpandableSegment``)."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int) -> None:
        self.base = base
        self.page = page  # 2 MiB in the small pool, 20 MiB in the large pool
        self.size = size  # page * max_handles


class _Stats:
    """Current and peak counters shared by both models."""

    __slots__ = (
        "allocated",
        "reserved",
        "requested",
        "peak_allocated",
        "peak_reserved",
        "peak_requested",
        "peak_index",
        "reserved_peak_index",
        "peak_phase",
        "by_category",
        "peak_by_category",
        "reserved_peak_by_category",
        "reserved_peak_pending",
        "index",
        "phase",
    )

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.requested = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.peak_requested = 0
        self.peak_index: int | None = None
        self.reserved_peak_index: int | None = None
        self.peak_phase = ""
        self.by_category: dict[str, int] = {}
        self.peak_by_category: dict[str, int] = {}
        self.reserved_peak_by_category: dict[str, int] = {}
        self.reserved_peak_pending = False
        self.index = 0  # index of the event being processed
        self.phase = ""

    def add_reserved(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
            self.reserved_peak_index = self.index
            self.reserved_peak_pending = True  # category snapshot once the op is done

    def add_allocated(self, nbytes: int, requested: int, category: str) -> None:
        self.allocated += nbytes
        self.requested += requested
        by_cat = self.by_category
        by_cat[category] = by_cat.get(category, 0) + nbytes
        if requested > 0 and self.requested > self.peak_requested:
            self.peak_requested = self.requested
        if nbytes > 0 and self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
            self.peak_index = self.index
            self.peak_phase = self.phase
            self.peak_by_category = {k: v for k, v in by_cat.items() if v}

    def end_op(self) -> None:
        if self.reserved_peak_pending:
            self.reserved_peak_pending = False
            self.reserved_peak_by_category = {k: v for k, v in self.by_category.items() if v}

    def reset_peaks(self) -> None:
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved
        self.peak_requested = self.requested
        self.peak_index = self.reserved_peak_index = None
        self.peak_phase = ""
        snapshot = {k: v for k, v in self.by_category.items() if v}
        self.peak_by_category = dict(snapshot)
        self.reserved_peak_by_category = snapshot


class _ModelBase:
    """Handles, event replay and stats common to the CUDA and CPU models."""

    def __init__(self, capacity_bytes: int | None) -> None:
        if capacity_bytes is not None and capacity_bytes < 0:
            raise BadInputError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._stats = _Stats()
        self._live_ids: dict[int, int] = {}  # event id -> handle
        self._handles: dict[int, _Block] = {}
        self._next_handle = 0
        self._oom_index: int | None = None
        self._oom_request: int | None = None

    # -- public API ----------------------------------------------------------------

    @property
    def allocated_bytes(self) -> int:
        """Bytes in live blocks now (``torch.cuda.memory_allocated``)."""
        return self._stats.allocated

    @property
    def reserved_bytes(self) -> int:
        """Bytes held from the device now (``torch.cuda.memory_reserved``)."""
        return self._stats.reserved

    @property
    def peak_allocated_bytes(self) -> int:
        """Most bytes in live blocks since construction or `reset_peak_stats`."""
        return self._stats.peak_allocated

    @property
    def peak_reserved_bytes(self) -> int:
        """Most bytes held since construction or `reset_peak_stats`."""
        return self._stats.peak_reserved

    def reset_peak_stats(self) -> None:
        """Sets peaks to the current values (``torch.cuda.reset_peak_memory_stats``)."""
        self._stats.reset_peaks()

    def malloc(self, size: int, category: str = "", phase: str = "") -> int:
        """Allocates ``size`` bytes.

        Args:
            size: Requested bytes; 0 allocates nothing (PyTorch returns ``nullptr``).
            category: Counted in the per-category peaks.
            phase: Reported as ``peak_phase`` if this allocation sets the peak.

        Returns:
            A handle for `free`.

        Raises:
            SimulatedOutOfMemoryError: The request does not fit in ``capacity_bytes``.
        """
        if size < 0:
            raise BadInputError(f"allocation size must be >= 0, got {size}")
        stats = self._stats
        stats.phase = phase
        try:
            block = self._malloc(size, category)
        except SimulatedOutOfMemoryError:
            self._oom_index = stats.index
            self._oom_request = size
            raise
        finally:
            stats.end_op()
            stats.index += 1
        handle = self._next_handle
        self._next_handle += 1
        self._handles[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """Frees the block of a handle `malloc` returned.

        Raises:
            BadInputError: The handle is not live.
        """
        block = self._handles.pop(handle, None)
        if block is None:
            raise BadInputError(f"free of handle {handle}, which is not allocated")
        self._free(block)
        self._stats.end_op()
        self._stats.index += 1

    def replay(self, events: Iterable[AllocEvent]) -> ReplayResult:
        """Applies events in order, stopping at the first allocation that fails.

        The model keeps its state between calls, so a long stream can be replayed
        in pieces, and a second training step sees the cache the first one left.

        Args:
            events: Allocs and frees; a free names the id of a live alloc.

        Returns:
            The stats after the events (peaks since construction or
            `reset_peak_stats`).

        Raises:
            BadInputError: An event has an unknown kind, allocates a live id, or
                frees an id that is not live.
        """
        live = self._live_ids
        handles = self._handles
        stats = self._stats
        malloc = self._malloc
        free = self._free
        for ev in events:
            kind = ev.kind
            if kind == "alloc":
                if ev.id in live:
                    raise BadInputError(f"event {stats.index} allocates id {ev.id}, still live")
                if ev.size < 0:
                    raise BadInputError(f"event {stats.index} has size {ev.size} < 0")
                stats.phase = ev.phase
                try:
                    block = malloc(ev.size, ev.category)
                except SimulatedOutOfMemoryError:
                    stats.end_op()
                    self._oom_index = stats.index
                    self._oom_request = ev.size
                    stats.index += 1
                    break
                if stats.reserved_peak_pending:
                    stats.end_op()
                handle = self._next_handle
                self._next_handle = handle + 1
                handles[handle] = block
                live[ev.id] = handle
            elif kind == "free":
                handle = live.pop(ev.id, None)
                if handle is None:
                    raise BadInputError(f"event {stats.index} frees id {ev.id}, not allocated")
                free(handles.pop(handle))
                if stats.reserved_peak_pending:
                    stats.end_op()
            else:
                raise BadInputError(f"event {stats.index} has kind {kind!r}, not alloc/free")
            stats.index += 1
        return self.result()

    def result(self) -> ReplayResult:
        """The stats now, as a `ReplayResult`."""
        s = self._stats
        return ReplayResult(
            peak_allocated_bytes=s.peak_allocated,
            peak_reserved_bytes=s.peak_reserved,
            final_allocated_bytes=s.allocated,
            final_reserved_bytes=s.reserved,
            peak_index=s.peak_index,
            num_segments=self._num_segments(),
            num_cuda_mallocs=self._num_mallocs(),
            oom=self._oom_index is not None,
            oom_index=self._oom_index,
            peak_requested_bytes=s.peak_requested,
            reserved_peak_index=s.reserved_peak_index,
            peak_phase=s.peak_phase,
            peak_by_category=dict(s.peak_by_category),
            reserved_peak_by_category=dict(s.reserved_peak_by_category),
            num_cuda_frees=self._num_frees(),
            num_alloc_retries=self._num_retries(),
            oom_request_bytes=self._oom_request,
        )

    # -- implemented by the models -------------------------------------------------

    def _malloc(self, size: int, category: str) -> _Block:
        raise NotImplementedError

    def _free(self, block: _Block) -> None:
        raise NotImplementedError

    def _num_segments(self) -> int:
        raise NotImplementedError

    def _num_mallocs(self) -> int:
        return 0

    def _num_frees(self) -> int:
        return 0

    def _num_retries(self) -> int:
        return 0
