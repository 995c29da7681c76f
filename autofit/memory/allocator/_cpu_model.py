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


_MINSIZE = 32  # glibc's smallest chunk
_ALIGN = 64  # torch's gAlignment: alloc_cpu calls posix_memalign(64, size)
_MEMALIGN_PAD = _ALIGN + _MINSIZE + 16  # _int_memalign's request: a chunk of nb + 112
_HEAP_BASE = 16  # the first chunk's address: 16-aligned, as glibc's are


class CpuAllocatorModel(_ModelBase):
    """torch's CPU allocator on glibc: no caching, one block per allocation.

    Allocated bytes are the live blocks', `cpu_block_bytes` of each. Reserved bytes are
    what is resident: the ``mmap``-ed blocks and the heap up to its top. A block is
    placed as glibc 2.36's ``_int_memalign`` places ``posix_memalign(64, size)``: it
    asks ``_int_malloc`` for a chunk of ``nb + 112`` bytes (``nb`` = ``size + 8``
    rounded to 16), the smallest free chunk that holds it (best fit) or the heap's
    top, then keeps ``nb`` bytes at the first 64 B-aligned spot and frees the lead
    and the trailer around it. Only a request that neither a free chunk nor the top
    can hold at or above the mmap threshold is ``mmap``-ed, as whole pages.

    glibc gives heap memory back only from the top (``MALLOC_TRIM_THRESHOLD_`` 0, as
    autofit measures), so a block freed below a live one stays resident as a hole,
    merged with the free chunks beside it. The memalign padding is what makes holes
    costly: a freed 8 KiB block leaves an 8.3 KiB hole, and the next 8 KiB request
    needs 8.3 KiB + 112 B, so it cannot reuse the hole and grows the heap. A step of
    many small tensors, some kept for backward between others freed (RWKV's
    per-token recurrence: tens of thousands), is charged those holes; without the
    padding the model reused them and was 3% under on RWKV (medium, LoRA: 405.6 MiB
    against 424.5 MiB for the same allocations through glibc; this model 427.7).
    glibc's tcache and fastbins, which delay merging small free chunks, are left
    out: merged at once here.

    Args:
        capacity_bytes: Host memory the process may use; ``None`` for unlimited.
        mmap_threshold: ``MALLOC_MMAP_THRESHOLD_`` (autofit sets 65536 when it
            measures, which also stops glibc from raising it dynamically).

    Example:
        >>> m = CpuAllocatorModel()
        >>> h = m.malloc(100)
        >>> m.allocated_bytes, m.reserved_bytes  # 112 B kept after a 32 B lead
        (144, 144)
    """

    def __init__(self, capacity_bytes: int | None = None, mmap_threshold: int = CPU_MMAP_THRESHOLD):
        super().__init__(capacity_bytes)
        self.mmap_threshold = mmap_threshold
        self._live_blocks = 0
        self._num_mmaps = 0
        self._num_munmaps = 0
        # the heap: its top, its holes by (size, address), by address and by end, and the
        # kept span of each live heap block by address
        self._top = _HEAP_BASE
        self._holes = _SortedInts()
        self._hole_at: dict[int, int] = {}  # address -> size
        self._hole_to: dict[int, int] = {}  # end -> address
        self._span: dict[int, int] = {}

    def _malloc(self, size: int, category: str) -> _Block:
        nbytes = cpu_block_bytes(size, self.mmap_threshold)
        addr, grown, small = 0, nbytes, False
        if nbytes:
            nb = max(_MINSIZE, (size + 8 + 15) & ~15)  # checked_request2size
            need = nb + _MEMALIGN_PAD
            place = self._heap_take(nb, need, top=need < self.mmap_threshold)
            if place is not None:
                (addr, grown), small = place, True
        cap = self.capacity_bytes
        if cap is not None and self._stats.reserved + grown > cap:
            if small:
                self._release(addr, self._span.pop(addr))
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
        self._stats.add_reserved(-(self._release(block.addr, self._span.pop(block.addr))
                                   if block.small else block.size))

    # -- the heap ----------------------------------------------------------------------
    def _heap_take(self, nb: int, need: int, top: bool) -> tuple[int, int] | None:
        """Where ``_int_memalign`` keeps ``nb`` bytes (recorded in ``_span``), and by
        how much the heap grew for it; ``None`` when no hole holds ``need`` bytes and
        ``top`` is false (the request goes to ``mmap``)."""
        key = self._holes.ceiling(need << _ADDR_BITS)
        if key is not None:  # best fit
            hole, p = key >> _ADDR_BITS, key & _ADDR_MASK
            self._drop_hole(p, hole)
            end, grown = p + hole, 0
        elif top:  # the top chunk, with the hole below it if any
            p = self._top
            below = self._hole_to.get(p)
            if below is not None:
                self._drop_hole(below, self._hole_at[below])
                p = below
            end = max(self._top, p + need)
            grown, self._top = end - self._top, end
        else:
            return None
        chunk = need if end - p - need >= _MINSIZE else end - p  # a rest under MINSIZE stays
        lead = 0
        if (p + 16) % _ALIGN:  # the first aligned spot at least MINSIZE in
            lead = (-(p + 16)) % _ALIGN
            if lead < _MINSIZE:
                lead += _ALIGN
        kept = nb if chunk - lead - nb > _MINSIZE else chunk - lead
        if lead:
            grown -= self._release(p, lead)
        if p + lead + kept < end:
            grown -= self._release(p + lead + kept, end - p - lead - kept)
        self._span[p + lead] = kept
        return p + lead, grown

    def _release(self, addr: int, nbytes: int) -> int:
        """Frees a piece of the heap: merged with the holes beside it, given back when it
        reaches the top. Returns the bytes the heap shrank by."""
        after = self._hole_at.get(addr + nbytes)
        if after is not None:
            self._drop_hole(addr + nbytes, after)
            nbytes += after
        before = self._hole_to.get(addr)
        if before is not None:
            size = self._hole_at[before]
            self._drop_hole(before, size)
            addr, nbytes = before, nbytes + size
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
