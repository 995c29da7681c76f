"""The model of torch's CPU allocator on glibc (see `autofit.memory.allocator`)."""

from __future__ import annotations

from autofit.memory.allocator._common import (
    CPU_MMAP_THRESHOLD,
    SimulatedOutOfMemoryError,
    cpu_block_bytes,
)
from autofit.memory.allocator._model_base import _Block, _ModelBase


class CpuAllocatorModel(_ModelBase):
    """torch's CPU allocator on glibc: no caching, one block per allocation.

    Allocated and reserved bytes are both the resident bytes of the live blocks,
    `cpu_block_bytes` of each: ``mmap``-ed whole pages at or above the mmap
    threshold, 64 B-aligned heap chunks plus a 16 B header below it.

    Args:
        capacity_bytes: Host memory the process may use; ``None`` for unlimited.
        mmap_threshold: ``MALLOC_MMAP_THRESHOLD_`` (autofit sets 65536 when it
            measures, which also stops glibc from raising it dynamically).

    Example:
        >>> m = CpuAllocatorModel()
        >>> h = m.malloc(100)
        >>> m.allocated_bytes, m.reserved_bytes
        (144, 144)
    """

    def __init__(self, capacity_bytes: int | None = None, mmap_threshold: int = CPU_MMAP_THRESHOLD):
        super().__init__(capacity_bytes)
        self.mmap_threshold = mmap_threshold
        self._live_blocks = 0
        self._num_mmaps = 0
        self._num_munmaps = 0

    def _malloc(self, size: int, category: str) -> _Block:
        nbytes = cpu_block_bytes(size, self.mmap_threshold)
        cap = self.capacity_bytes
        if cap is not None and self._stats.reserved + nbytes > cap:
            raise SimulatedOutOfMemoryError(
                f"CPU out of memory (modelled): tried to allocate {size} B with "
                f"{self._stats.allocated} B in use of {cap} B; try a smaller micro batch"
            )
        block = _Block(nbytes, 0, small=nbytes < self.mmap_threshold)
        block.allocated = True
        block.requested = size
        block.category = category
        if nbytes:
            self._live_blocks += 1
        self._stats.add_reserved(nbytes)
        self._stats.add_allocated(nbytes, size, category)
        return block

    def _free(self, block: _Block) -> None:
        block.allocated = False
        if block.size:
            self._live_blocks -= 1
        self._stats.add_allocated(-block.size, -block.requested, block.category)
        self._stats.add_reserved(-block.size)

    def _num_segments(self) -> int:
        return self._live_blocks
