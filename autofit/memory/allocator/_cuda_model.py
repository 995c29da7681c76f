"""The model of PyTorch's CUDA caching allocator (see `autofit.memory.allocator`)."""

from __future__ import annotations

from autofit.memory.allocator._common import (
    _ADDR_BITS,
    _FIRST_ADDRESS,
    _UNLIMITED_ADDRESS_SPACE,
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    BlockInfo,
    SegmentInfo,
    SimulatedOutOfMemoryError,
    get_allocation_size,
    round_size,
)
from autofit.memory.allocator._model_base import _Block, _ExpandableSegment, _ModelBase
from autofit.memory.allocator._sorted_ints import _SortedInts


class _Pool:
    """A ``BlockPool``: free mapped blocks by (size, address), unmapped by address."""

    __slots__ = ("small", "free", "by_key", "unmapped", "unmapped_by_addr")

    def __init__(self, small: bool) -> None:
        self.small = small
        self.free = _SortedInts()  # keys (size << _ADDR_BITS) | addr
        self.by_key: dict[int, _Block] = {}
        self.unmapped = _SortedInts()  # addresses
        self.unmapped_by_addr: dict[int, _Block] = {}

    def insert(self, block: _Block) -> None:
        key = (block.size << _ADDR_BITS) | block.addr
        self.free.add(key)
        self.by_key[key] = block

    def erase(self, block: _Block) -> None:
        key = (block.size << _ADDR_BITS) | block.addr
        self.free.remove(key)
        del self.by_key[key]

    def insert_unmapped(self, block: _Block) -> None:
        self.unmapped.add(block.addr)
        self.unmapped_by_addr[block.addr] = block

    def erase_unmapped(self, block: _Block) -> None:
        self.unmapped.remove(block.addr)
        del self.unmapped_by_addr[block.addr]


class CudaCachingAllocatorModel(_ModelBase):
    """PyTorch's CUDA caching allocator for one device and one stream.

    See the module docstring for what is modelled and what is not.

    Args:
        capacity_bytes: Memory the allocator may reserve; ``None`` for unlimited.
        expandable_segments: Model ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``.

    Example:
        >>> m = CudaCachingAllocatorModel()
        >>> h = m.malloc(1)
        >>> m.allocated_bytes, m.reserved_bytes
        (512, 2097152)
        >>> m.free(h)
        >>> m.allocated_bytes, m.reserved_bytes  # the segment stays cached
        (0, 2097152)
    """

    def __init__(self, capacity_bytes: int | None = None, expandable_segments: bool = False):
        super().__init__(capacity_bytes)
        self.expandable_segments = expandable_segments
        self._small = _Pool(small=True)
        self._large = _Pool(small=False)
        self._next_addr = _FIRST_ADDRESS
        self._num_plain_segments = 0
        self._expandable: list[_ExpandableSegment] = []
        self._num_device_alloc = 0
        self._num_device_free = 0
        self._num_alloc_retries = 0

    def empty_cache(self) -> None:
        """Releases every cached segment with no live block (``release_cached_blocks``)."""
        self._release_cached_blocks()
        self._stats.end_op()

    def segments(self) -> list[SegmentInfo]:
        """The segments held now, by address, like ``torch.cuda.memory_snapshot()``.

        An expandable segment is listed as one segment per contiguous mapped range.
        """
        blocks: list[_Block] = [b for b in self._handles.values() if b.size]
        for pool in (self._small, self._large):
            blocks.extend(pool.by_key.values())
            blocks.extend(pool.unmapped_by_addr.values())
        result = []
        for head in blocks:
            if head.prev is not None:
                continue
            run: list[_Block] = []
            b: _Block | None = head
            while b is not None:
                if b.mapped:
                    run.append(b)
                if run and (not b.mapped or b.next is None):
                    result.append(_segment_info(run))
                    run = []
                b = b.next
        result.sort(key=lambda seg: seg.address)
        return result

    # -- malloc / free ---------------------------------------------------------------

    def _malloc(self, orig_size: int, category: str) -> _Block:
        if orig_size == 0:
            block = _Block(0, 0, small=True)  # nullptr: no memory, no stats
            block.allocated = True
            block.category = category
            return block
        size = round_size(orig_size)
        pool = self._small if size <= K_SMALL_SIZE else self._large  # get_pool
        block = self._get_free_block(pool, size)
        if block is None:
            block = self._alloc_block(pool, size)
            if block is None:
                # release_available_cached_blocks only acts with max_split_size set.
                self._num_alloc_retries += 1
                self._release_cached_blocks()
                block = self._alloc_block(pool, size)
            if block is None:
                raise SimulatedOutOfMemoryError(
                    f"CUDA out of memory (modelled): tried to allocate {orig_size} B with "
                    f"{self._stats.allocated} B allocated and {self._stats.reserved} B reserved "
                    f"of {self.capacity_bytes} B; try a smaller micro batch"
                )
        # alloc_found_block
        if self._should_split(block, size):
            remaining = block
            block = _Block(size, remaining.addr, pool.small, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.addr += size
            remaining.size -= size
            pool.insert(remaining)
        block.allocated = True
        block.requested = orig_size
        block.category = category
        self._stats.add_allocated(block.size, orig_size, category)
        return block

    def _free(self, block: _Block) -> None:
        block.allocated = False
        self._stats.add_allocated(-block.size, -block.requested, block.category)
        if block.size == 0:
            return
        # free_block
        pool = self._small if block.small else self._large
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert(block)

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.expandable_segments:
            return remaining >= K_MIN_BLOCK_SIZE
        return remaining > K_SMALL_SIZE  # and size < max_split_size (unlimited)

    def _get_free_block(self, pool: _Pool, size: int) -> _Block | None:
        key = pool.free.ceiling(size << _ADDR_BITS)
        if key is None:
            return None
        block = pool.by_key[key]
        if block.segment is not None:
            # For best fit a free block followed by unmapped space counts as the size
            # it can grow to, so blocks that cannot grow are preferred.
            by_key = pool.by_key
            best = _expandable_size(block)
            for nxt_key in pool.free.iter_from(key + 1):
                nxt = by_key[nxt_key]
                nxt_size = _expandable_size(nxt)
                if nxt_size >= best:
                    break
                block, best = nxt, nxt_size
        pool.erase(block)
        return block

    def _try_merge_blocks(self, dst: _Block, src: _Block | None, pool: _Pool) -> int:
        if src is None or src.allocated or dst.mapped != src.mapped:
            return 0
        if src.mapped:
            pool.erase(src)
        else:
            pool.erase_unmapped(src)
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    # -- segments --------------------------------------------------------------------

    def _fits(self, nbytes: int) -> bool:
        cap = self.capacity_bytes
        return cap is None or self._stats.reserved + nbytes <= cap

    def _alloc_block(self, pool: _Pool, size: int) -> _Block | None:
        if self.expandable_segments:
            return self._try_allocate_expandable_block(pool, size)
        alloc_size = get_allocation_size(size)
        if not self._fits(alloc_size):
            return None  # cudaMalloc fails
        block = _Block(alloc_size, self._next_addr, pool.small)
        self._next_addr += alloc_size
        self._num_plain_segments += 1
        self._num_device_alloc += 1
        self._stats.add_reserved(alloc_size)
        return block

    def _release_cached_blocks(self) -> None:
        self._release_blocks(self._large)
        self._release_blocks(self._small)

    def _release_blocks(self, pool: _Pool) -> None:
        to_unmap = []
        for key in list(pool.free):
            block = pool.by_key[key]
            if block.segment is not None:
                to_unmap.append(block)
            elif block.prev is None and block.next is None:
                # release_block: cudaFree a segment with no live block
                pool.erase(block)
                self._num_plain_segments -= 1
                self._num_device_free += 1
                self._stats.add_reserved(-block.size)
        for block in to_unmap:
            self._unmap_block(block, pool)
            if not block.mapped and block.prev is None and block.next is None:
                # release_expandable_segment
                pool.erase_unmapped(block)
                self._expandable.remove(block.segment)

    # -- expandable segments -----------------------------------------------------------

    def _find_expandable_block(self, pool: _Pool, size: int) -> _Block:
        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        for addr in pool.unmapped:
            c = pool.unmapped_by_addr[addr]
            # there might be a free block right before the unmapped space
            if allocatable(c.prev):
                c = c.prev
            b: _Block | None = c
            nbytes = 0
            while nbytes < size and b is not None and allocatable(b):
                nbytes += b.size
                b = b.next
            if nbytes >= size:
                return c
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        if self.capacity_bytes is None:
            space = _UNLIMITED_ADDRESS_SPACE
        else:
            # address space for 1 1/8 of the device memory, in whole pages
            total = self.capacity_bytes + self.capacity_bytes // 8
            space = max(1, (total + page - 1) // page) * page
        segment = _ExpandableSegment(self._next_addr, page, space)
        self._next_addr += space
        self._expandable.append(segment)
        candidate = _Block(space, segment.base, pool.small, segment, mapped=False)
        pool.insert_unmapped(candidate)
        return candidate

    def _map_block(self, to_map: _Block, size: int, pool: _Pool) -> bool:
        segment = to_map.segment
        assert segment is not None and not to_map.mapped and size <= to_map.size
        page = segment.page
        offset = to_map.addr - segment.base
        assert offset % page == 0, "unmapped blocks start on a page"
        mapped_size = (offset + size + page - 1) // page * page - offset
        if not self._fits(mapped_size):
            return False  # cuMemCreate fails; pages of this call are released
        pool.erase_unmapped(to_map)
        to_map.mapped = True
        if mapped_size < to_map.size:
            remaining = _Block(
                to_map.size - mapped_size, to_map.addr + mapped_size, pool.small, segment, False
            )
            remaining.splice(to_map, to_map.next)
            pool.insert_unmapped(remaining)
            to_map.size = mapped_size
        self._try_merge_blocks(to_map, to_map.prev, pool)
        self._try_merge_blocks(to_map, to_map.next, pool)
        pool.insert(to_map)
        self._num_device_alloc += 1
        self._stats.add_reserved(mapped_size)
        return True

    def _try_allocate_expandable_block(self, pool: _Pool, size: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), pool):
            return None
        while candidate.size < size:
            # invariant: free -> unmapped -> *
            remaining = size - candidate.size
            new_candidate = candidate.next
            assert new_candidate is not None
            if not self._map_block(new_candidate, min(remaining, new_candidate.size), pool):
                return None
            candidate = new_candidate
        pool.erase(candidate)
        return candidate

    def _unmap_block(self, block: _Block, pool: _Pool) -> None:
        segment = block.segment
        assert segment is not None
        page = segment.page
        start = block.addr - segment.base
        begin = (start + page - 1) // page  # first whole page
        end = (start + block.size) // page  # past the last whole page
        if begin >= end:
            return
        pool.erase(block)
        unmapped_addr = segment.base + begin * page
        unmapped_size = (end - begin) * page
        before = unmapped_addr - block.addr
        if before > 0:
            before_free = _Block(before, block.addr, pool.small, segment)
            before_free.splice(block.prev, block)
            pool.insert(before_free)
        after = block.size - before - unmapped_size
        if after > 0:
            after_free = _Block(after, unmapped_addr + unmapped_size, pool.small, segment)
            after_free.splice(block, block.next)
            pool.insert(after_free)
        block.addr = unmapped_addr
        block.size = unmapped_size
        block.mapped = False
        self._try_merge_blocks(block, block.prev, pool)
        self._try_merge_blocks(block, block.next, pool)
        pool.insert_unmapped(block)
        self._num_device_free += 1
        self._stats.add_reserved(-unmapped_size)

    # -- stats -------------------------------------------------------------------------

    def _num_segments(self) -> int:
        return len(self.segments())

    def _num_mallocs(self) -> int:
        return self._num_device_alloc

    def _num_frees(self) -> int:
        return self._num_device_free

    def _num_retries(self) -> int:
        return self._num_alloc_retries


def _segment_info(run: list[_Block]) -> SegmentInfo:
    infos = tuple(
        BlockInfo(
            b.addr,
            b.size,
            b.allocated,
            b.requested if b.allocated else 0,
            b.category if b.allocated else "",
        )
        for b in run
    )
    return SegmentInfo(
        address=run[0].addr,
        size=sum(b.size for b in run),
        is_small=run[0].small,
        is_expandable=run[0].segment is not None,
        blocks=infos,
    )


def _expandable_size(block: _Block) -> int:
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)
