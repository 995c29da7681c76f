"""The model of torch's CPU allocator on glibc (see `autofit.memory.allocator`)."""

from __future__ import annotations

from autofit.memory.allocator._common import (
    CPU_MMAP_THRESHOLD,
    SimulatedOutOfMemoryError,
    cpu_block_bytes,
)
from autofit.memory.allocator._model_base import _Block, _ModelBase
from autofit.memory.allocator._sorted_ints import _SortedInts

_ADDR_BITS = 48  # a hole's sort key is (size << _ADDR_BITS) | address
_ADDR_MASK = (1 << _ADDR_BITS) - 1


class CpuAllocatorModel(_ModelBase):
    """torch's CPU allocator on glibc: no caching, one block per allocation.

    Allocated bytes are the live blocks', `cpu_block_bytes` of each: ``mmap``-ed whole
    pages at or above the mmap threshold, 64 B-aligned heap chunks plus a 16 B header
    below it. Reserved bytes are what is resident: the mapped blocks and the heap up to
    its top. glibc gives heap memory back only from the top (``MALLOC_TRIM_THRESHOLD_``
    0, as autofit measures), so a small block freed below a live one stays resident as
    a hole until a later small block reuses it (best fit, holes merged with their free
    neighbours, as glibc's bins do). A step of many small tensors, some kept for backward
    between others freed (RWKV's per-token recurrence: tens of thousands), leaves holes
    between them that no tensor count shows (its bf16 step with checkpointing: 4.3%
    under without them).

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
        # the heap: its top, and its holes by (size, address), by address and by end
        self._top = 0
        self._holes = _SortedInts()
        self._hole_at: dict[int, int] = {}  # address -> size
        self._hole_to: dict[int, int] = {}  # end -> address

    def _malloc(self, size: int, category: str) -> _Block:
        nbytes = cpu_block_bytes(size, self.mmap_threshold)
        small = 0 < nbytes < self.mmap_threshold
        addr, grown = self._heap_take(nbytes) if small else (0, nbytes)
        cap = self.capacity_bytes
        if cap is not None and self._stats.reserved + grown > cap:
            if small:
                self._heap_give(addr, nbytes)
            raise SimulatedOutOfMemoryError(
                f"CPU out of memory (modelled): tried to allocate {size} B with "
                f"{self._stats.allocated} B in use of {cap} B; try a smaller micro batch"
            )
        block = _Block(nbytes, addr, small=small)
        block.allocated = True
        block.requested = size
        block.category = category
        if nbytes:
            self._live_blocks += 1
        self._stats.add_reserved(grown)
        self._stats.add_allocated(nbytes, size, category)
        return block

    def _free(self, block: _Block) -> None:
        block.allocated = False
        if block.size:
            self._live_blocks -= 1
        self._stats.add_allocated(-block.size, -block.requested, block.category)
        self._stats.add_reserved(-(self._heap_give(block.addr, block.size) if block.small
                                   else block.size))

    # -- the heap (blocks below the mmap threshold) ------------------------------------
    def _heap_take(self, nbytes: int) -> tuple[int, int]:
        """A place for ``nbytes`` on the heap, and by how much the heap grew for it: the
        smallest hole that holds it (its rest stays a hole), else the top."""
        key = self._holes.ceiling(nbytes << _ADDR_BITS)
        if key is not None:
            hole, addr = key >> _ADDR_BITS, key & _ADDR_MASK
            self._drop_hole(addr, hole)
            if hole > nbytes:
                self._add_hole(addr + nbytes, hole - nbytes)
            return addr, 0
        addr = self._top
        self._top += nbytes
        return addr, nbytes

    def _heap_give(self, addr: int, nbytes: int) -> int:
        """Frees ``nbytes`` at ``addr``: merged with the holes beside it, given back when
        it reaches the top. Returns the bytes the heap shrank by."""
        before = self._hole_to.get(addr)
        if before is not None:
            size = self._hole_at[before]
            self._drop_hole(before, size)
            addr, nbytes = before, nbytes + size
        after = self._hole_at.get(addr + nbytes)
        if after is not None:
            self._drop_hole(addr + nbytes, after)
            nbytes += after
        if addr + nbytes == self._top:
            self._top = addr
            return nbytes
        self._add_hole(addr, nbytes)
        return 0

    def _add_hole(self, addr: int, size: int) -> None:
        self._holes.add((size << _ADDR_BITS) | addr)
        self._hole_at[addr] = size
        self._hole_to[addr + size] = addr

    def _drop_hole(self, addr: int, size: int) -> None:
        self._holes.remove((size << _ADDR_BITS) | addr)
        del self._hole_at[addr]
        del self._hole_to[addr + size]

    def _num_segments(self) -> int:
        return self._live_blocks
