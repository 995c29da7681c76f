"""Shared pieces of the allocator models: constants, events, results, size rules.

Import them from `autofit.memory.allocator`; this module only exists so that the
model classes, each in its own file, can share them without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from autofit.errors import DoesNotFitError

# Constants of c10/cuda/CUDACachingAllocator.cpp, with its comments. kLargeBuffer is
# also in c10/core/AllocatorConfig.h, where newer releases make it the default of
# large_segment_size (large_segment_size_mb), the 1-10 MiB segment and the large
# expandable-segment page.
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
K_SMALL_SIZE = 1048576  # kSmallSize: largest "small" allocation is 1 MiB
K_SMALL_BUFFER = 2097152  # kSmallBuffer: "small" allocations are packed in 2 MiB blocks
K_LARGE_BUFFER = 20971520  # kLargeBuffer: "large" allocations may be packed in 20 MiB
K_MIN_LARGE_ALLOC = 10485760  # kMinLargeAlloc: allocations of 1-10 MiB use kLargeBuffer
K_ROUND_LARGE = 2097152  # kRoundLarge: round up large allocations to 2 MiB

# c10/core/alignment.h: gAlignment (posix_memalign alignment), gPagesize.
CPU_ALIGNMENT = 64
CPU_PAGE_SIZE = 4096
# MALLOC_MMAP_THRESHOLD_=65536: glibc mmaps chunks of at least this many bytes (and,
# because the variable is set, no longer raises the threshold dynamically).
CPU_MMAP_THRESHOLD = 65536
CPU_SMALL_HEADER = 16  # per-chunk header + slack charged to heap (brk) blocks

_ADDR_BITS = 64  # a free block's sort key is (size << _ADDR_BITS) | address
_FIRST_ADDRESS = 1 << 32  # invented address of the first segment
_UNLIMITED_ADDRESS_SPACE = 1 << 44  # virtual range of an expandable segment, no capacity

EventKind = Literal["alloc", "free"]


@dataclass(frozen=True)
class AllocEvent:
    """One storage allocation or free, as recorded on fake tensors.

    Attributes:
        kind: ``"alloc"`` or ``"free"``.
        id: Identifies the storage; a free names the id of an earlier alloc.
        size: Bytes requested (``nbytes`` of the storage); ignored on a free.
        phase: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``""``.
        category: ``"weights"``, ``"gradients"``, ``"optimizer_states"``,
            ``"activations"``, ``"temporaries"`` or ``""``.
    """

    kind: EventKind
    id: int
    size: int
    phase: str = ""
    category: str = ""


@dataclass(frozen=True)
class ReplayResult:
    """What a device's allocator would report after a stream of events.

    Indices count every event the model has seen (replayed events and direct
    ``malloc``/``free`` calls, from 0), so they index the event list of a single
    ``replay`` on a fresh model.

    Attributes:
        peak_allocated_bytes: Most bytes in live blocks at once (rounded sizes;
            ``torch.cuda.max_memory_allocated``).
        peak_reserved_bytes: Most bytes held from the device at once
            (``torch.cuda.max_memory_reserved``).
        final_allocated_bytes: Bytes in live blocks after the last event.
        final_reserved_bytes: Bytes held after the last event.
        peak_index: Event at which allocated bytes first reached their peak, or
            ``None`` if nothing was ever allocated.
        num_segments: Segments held after the last event (for expandable segments,
            contiguous mapped ranges, as ``torch.cuda.memory_snapshot`` lists them;
            on CPU, live blocks).
        num_cuda_mallocs: ``cudaMalloc`` calls (page mappings with expandable
            segments), ``num_device_alloc`` in ``torch.cuda.memory_stats``; 0 on CPU.
        oom: Whether an allocation of this model failed (a replay stops there).
        oom_index: Index of the last failing allocation, or ``None``.
        peak_requested_bytes: Most bytes requested (unrounded) by live tensors.
        reserved_peak_index: Event at which reserved bytes first reached their
            peak, or ``None``.
        peak_phase: ``phase`` of the event at ``peak_index`` (``""`` if none).
        peak_by_category: Allocated bytes per category at the allocated peak.
        reserved_peak_by_category: Allocated bytes per category at the reserved
            peak (the rest of the reserved bytes is cached, free memory).
        num_cuda_frees: ``cudaFree`` calls (page unmappings), ``num_device_free``.
        num_alloc_retries: Times ``malloc`` freed the cache and retried.
        oom_request_bytes: Bytes of the failing request, or ``None``.
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    final_allocated_bytes: int
    final_reserved_bytes: int
    peak_index: int | None
    num_segments: int
    num_cuda_mallocs: int
    oom: bool
    oom_index: int | None
    peak_requested_bytes: int = 0
    reserved_peak_index: int | None = None
    peak_phase: str = ""
    peak_by_category: dict[str, int] = field(default_factory=dict)
    reserved_peak_by_category: dict[str, int] = field(default_factory=dict)
    num_cuda_frees: int = 0
    num_alloc_retries: int = 0
    oom_request_bytes: int | None = None


@dataclass(frozen=True)
class BlockInfo:
    """One block of a segment, as ``torch.cuda.memory_snapshot`` lists it.

    Attributes:
        address: Invented device address.
        size: Bytes (rounded).
        allocated: Whether a live tensor holds it.
        requested: Bytes the tensor asked for (0 when free).
        category: The category of the live tensor (``""`` when free).
    """

    address: int
    size: int
    allocated: bool
    requested: int = 0
    category: str = ""


@dataclass(frozen=True)
class SegmentInfo:
    """One segment: a ``cudaMalloc`` or, for expandable segments, a mapped range.

    Attributes:
        address: Invented device address of its first byte.
        size: Bytes; the sum of its blocks' sizes.
        is_small: Whether it belongs to the small pool.
        is_expandable: Whether it is part of an expandable segment.
        blocks: Its blocks in address order.
    """

    address: int
    size: int
    is_small: bool
    is_expandable: bool
    blocks: tuple[BlockInfo, ...]


class SimulatedOutOfMemoryError(DoesNotFitError):
    """A modelled allocation did not fit in ``capacity_bytes``."""


def round_size(size: int) -> int:
    """Rounds a request as ``round_size`` does (no ``roundup_power2_divisions``).

    Args:
        size: Requested bytes, > 0.

    Returns:
        The block size: a multiple of 512, at least 512.

    Example:
        >>> round_size(1), round_size(513)
        (512, 1024)
    """
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def get_allocation_size(size: int) -> int:
    """The segment ``cudaMalloc``-ed for a rounded request no cached block fits.

    Args:
        size: A rounded request (see `round_size`).

    Returns:
        2 MiB for <= 1 MiB, 20 MiB below 10 MiB, else ``size`` rounded up to 2 MiB.

    Example:
        >>> get_allocation_size(25 * 2**20) // 2**20
        26
    """
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


def cpu_block_bytes(size: int, mmap_threshold: int = CPU_MMAP_THRESHOLD) -> int:
    """Resident bytes of one block of torch's CPU allocator on glibc.

    ``alloc_cpu`` calls ``posix_memalign(64, size)``. glibc's ``_int_memalign``
    asks ``_int_malloc`` for ``nb + 64 + MINSIZE`` bytes, ``nb = align16(size + 8)``,
    i.e. a chunk of ``nb + 112`` bytes; a chunk that large or larger than the mmap
    threshold is ``mmap``-ed as ``page_round(nb + 112 + 8)`` bytes and kept whole.
    Smaller blocks live on the heap; they are charged ``align64(size) + 16`` (the
    chunk header plus the alignment slack), slightly more than glibc keeps.

    Args:
        size: Requested bytes; 0 allocates nothing.
        mmap_threshold: ``MALLOC_MMAP_THRESHOLD_``.

    Returns:
        The bytes the block occupies.

    Example:
        >>> cpu_block_bytes(100), cpu_block_bytes(65536)  # 128 + 16; 17 pages
        (144, 69632)
    """
    if size <= 0:
        return 0
    nb = max(32, (size + 8 + 15) & ~15)  # checked_request2size
    if nb + 112 >= mmap_threshold:
        return (nb + 120 + CPU_PAGE_SIZE - 1) // CPU_PAGE_SIZE * CPU_PAGE_SIZE
    return (size + CPU_ALIGNMENT - 1) // CPU_ALIGNMENT * CPU_ALIGNMENT + CPU_SMALL_HEADER


def pinned_bytes(nbytes: int) -> int:
    """Bytes torch's pinned host caching allocator takes for a request: the next power of two
    (``CachingHostAllocator``: ``PowerOf2Ceil``), kept cached for the next step.

        >>> pinned_bytes(3 << 20) == 4 << 20, pinned_bytes(4 << 20) == 4 << 20
        (True, True)
    """
    return 0 if nbytes <= 0 else 1 << (int(nbytes) - 1).bit_length()
