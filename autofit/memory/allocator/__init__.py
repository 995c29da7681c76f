"""Models of PyTorch's CUDA caching allocator and of its CPU allocator.

autofit records, on fake tensors, the stream of storage allocations and frees of a
training step, then replays it here to learn what the target device would see:
peak *allocated* bytes (live tensors, ``torch.cuda.max_memory_allocated``) and peak
*reserved* bytes (what the allocator holds from the driver,
``torch.cuda.max_memory_reserved``), the difference being rounding, caching and
fragmentation.

`CudaCachingAllocatorModel` follows ``c10/cuda/CUDACachingAllocator.cpp``
(``DeviceCachingAllocator``) for one device and one stream, block by block:

- ``round_size``: requests are rounded up to a multiple of 512 B (``kMinBlockSize``),
  at least 512 B.
- ``get_pool``: rounded sizes <= 1 MiB (``kSmallSize``) use the small pool, the rest
  the large pool; blocks never move between pools.
- ``get_free_block``: best fit, the free block of the pool that is smallest by
  (size, address) (``BlockComparatorSize``) among those large enough.
- ``get_allocation_size``: with no fitting free block a segment is ``cudaMalloc``-ed:
  2 MiB (``kSmallBuffer``) for small requests, 20 MiB (``kLargeBuffer``) for requests
  below 10 MiB (``kMinLargeAlloc``), else the request rounded up to 2 MiB
  (``kRoundLarge``).
- ``should_split``: the block found is split when the remainder is >= 512 B in the
  small pool, > 1 MiB in the large pool (>= 512 B in both with expandable segments).
- ``free_block`` / ``try_merge_blocks``: a freed block merges with its free
  neighbours, which are always in the same segment: segments never merge.
- ``malloc``'s retry chain: when ``cudaMalloc`` would exceed ``capacity_bytes`` the
  model frees every cached segment that holds no live block (``release_cached_blocks``,
  what ``torch.cuda.empty_cache()`` does) and retries once; if that fails too it is
  an out-of-memory error.
- ``expandable_segments=True`` (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``):
  each pool has one segment with a huge virtual range that grows by mapping pages
  of 2 MiB (small pool) or 20 MiB (large pool), see ``ExpandableSegment``,
  ``find_expandable_block``, ``map_block`` and ``unmap_block``. Reserved memory is
  the mapped pages; on OOM the pages that hold no live block are unmapped. Free
  space no longer sits in separate segments, but memory grows by whole pages, so
  a request can reserve more than it would without (see the tests).

The rules and constants were read in ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch
main of 2025, commit 001074d2) and checked against ``c10/core/AllocatorConfig.h`` of
newer releases, where ``large_segment_size`` (default ``kLargeBuffer``, 20 MiB) is
the 1-10 MiB segment and the large-pool page.

`CpuAllocatorModel` models torch's CPU allocator on glibc (``alloc_cpu``:
``posix_memalign`` with ``gAlignment`` = 64 of ``c10/core/alignment.h``, no
caching): each allocation is its own block and reserved == allocated == the
resident bytes of the live blocks, see `cpu_block_bytes`: with
``MALLOC_MMAP_THRESHOLD_=65536`` a block of 64 KiB or more is ``mmap``-ed as whole
4 KiB pages including glibc's header (``_int_memalign``, ``sysmalloc``); a smaller
one is charged its size rounded to 64 B plus a 16 B header. Reserved bytes are the
resident ones: the mapped blocks and the heap up to its top, each heap block placed
where glibc 2.36's ``_int_memalign`` puts it (best fit for the block plus 112 B of
alignment padding, the lead and trailer given back), so that the holes a freed block
leaves below a live one, and whether a later request fits them, are glibc's (checked
against the real glibc on the same streams: ``tests/memory/test_allocator.py``).

Both models take events (`AllocEvent`) through ``replay`` or calls to ``malloc``
and ``free``, keep their state between calls (a second training step finds the
cache the first left), and report a `ReplayResult`; the CUDA model also lists its
segments (``segments()``, like ``torch.cuda.memory_snapshot()``) and has
``empty_cache()``. A request of 0 bytes allocates nothing, as in PyTorch.

Usage::

    >>> from autofit.memory.allocator import AllocEvent, replay
    >>> events = [
    ...     AllocEvent("alloc", 0, 5 * 2**20),   # 5 MiB: a 20 MiB segment
    ...     AllocEvent("alloc", 1, 5 * 2**20),   # fits in what is left of it
    ...     AllocEvent("free", 0, 5 * 2**20),
    ... ]
    >>> r = replay(events, "cuda")
    >>> r.peak_allocated_bytes // 2**20, r.peak_reserved_bytes // 2**20
    (10, 20)

Known limitations:

- One stream. Blocks freed after use on another stream (``record_stream``) wait on
  events in PyTorch; here every free is immediate.
- ``max_split_size_mb`` is taken as unlimited (the default), so oversize blocks,
  ``release_available_cached_blocks`` and ``max_non_split_rounding_mb`` play no part.
- ``roundup_power2_divisions`` is taken as unset (the default): sizes round to 512 B.
- ``garbage_collection_threshold`` (only active with a memory fraction) is ignored.
- CUDA graphs' private pools, ``FreeCudaMemoryCallbacks`` and IPC are not modelled.
- ``capacity_bytes`` is the memory the allocator may take; the caller subtracts the
  CUDA context, cuBLAS workspaces and anything else outside the allocator. Real
  ``cudaMalloc`` may also fail earlier through device-side fragmentation.
- Addresses are invented: segments get increasing addresses, which only breaks ties
  between free blocks of equal size; real ``cudaMalloc`` addresses may order them
  differently.
- The category breakdown at the reserved peak is taken once the allocation that
  raised reserved memory is done, so it includes that allocation.
- CPU: ``MALLOC_MMAP_THRESHOLD_`` is assumed set; without it glibc's threshold
  starts at 128 KiB and rises (up to 32 MiB) as mmapped blocks are freed. glibc may
  serve a large request from the top of the heap instead of ``mmap``; heap blocks
  are charged a little more than glibc keeps and freed heap memory is taken as
  returned; untouched pages of an ``mmap``-ed block are not resident in reality but
  are counted here; other allocators (jemalloc, tcmalloc) differ.
"""

from autofit.memory.allocator._common import (
    CPU_ALIGNMENT,
    CPU_MMAP_THRESHOLD,
    CPU_PAGE_SIZE,
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    AllocEvent,
    BlockInfo,
    ReplayResult,
    SegmentInfo,
    SimulatedOutOfMemoryError,
    cpu_block_bytes,
    get_allocation_size,
    pinned_bytes,
    round_size,
)
from autofit.memory.allocator._cpu_model import CpuAllocatorModel
from autofit.memory.allocator._cuda_model import CudaCachingAllocatorModel
from autofit.memory.allocator._replay import replay

__all__ = [
    "K_MIN_BLOCK_SIZE",
    "K_SMALL_SIZE",
    "K_SMALL_BUFFER",
    "K_LARGE_BUFFER",
    "K_MIN_LARGE_ALLOC",
    "K_ROUND_LARGE",
    "CPU_ALIGNMENT",
    "CPU_PAGE_SIZE",
    "CPU_MMAP_THRESHOLD",
    "AllocEvent",
    "ReplayResult",
    "BlockInfo",
    "SegmentInfo",
    "SimulatedOutOfMemoryError",
    "CudaCachingAllocatorModel",
    "CpuAllocatorModel",
    "round_size",
    "get_allocation_size",
    "cpu_block_bytes",
    "pinned_bytes",
    "replay",
]
