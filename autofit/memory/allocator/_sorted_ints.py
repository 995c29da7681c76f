"""A sorted set of ints for the allocator model (stdlib only).

The allocator keeps its free blocks ordered by (size, address), like the
``std::set<Block*, BlockComparatorSize>`` of PyTorch's caching allocator. A plain
sorted list costs O(n) per insert, which is too slow when tens of thousands of
blocks are free; this keeps the ints in a list of sorted sub-lists (the layout of
the ``sortedcontainers`` package), so insert, remove and "first element >= x" cost
O(log n + load).

    >>> s = _SortedInts()
    >>> for x in (5, 1, 3):
    ...     s.add(x)
    >>> s.ceiling(2), s.ceiling(6), list(s)
    (3, None, [1, 3, 5])
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterator

__all__ = ["_SortedInts"]

_LOAD = 256  # sub-lists are split above 2 * _LOAD and merged below _LOAD // 8


class _SortedInts:
    """A set of distinct ints kept in ascending order."""

    __slots__ = ("_lists", "_maxes", "_len")

    def __init__(self) -> None:
        self._lists: list[list[int]] = []
        self._maxes: list[int] = []  # _maxes[i] == _lists[i][-1]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for sub in self._lists:
            yield from sub

    def add(self, x: int) -> None:
        """Inserts ``x``; it must not be present already."""
        maxes = self._maxes
        lists = self._lists
        self._len += 1
        if not maxes:
            lists.append([x])
            maxes.append(x)
            return
        i = bisect_left(maxes, x)
        if i == len(maxes):
            i -= 1
            sub = lists[i]
            sub.append(x)
            maxes[i] = x
        else:
            sub = lists[i]
            insort(sub, x)
        if len(sub) > 2 * _LOAD:
            self._split(i)

    def _split(self, i: int) -> None:
        sub = self._lists[i]
        half = sub[_LOAD:]
        del sub[_LOAD:]
        self._maxes[i] = sub[-1]
        self._lists.insert(i + 1, half)
        self._maxes.insert(i + 1, half[-1])

    def remove(self, x: int) -> None:
        """Removes ``x``; raises ``KeyError`` if it is absent."""
        maxes = self._maxes
        lists = self._lists
        i = bisect_left(maxes, x)
        if i == len(maxes):
            raise KeyError(x)
        sub = lists[i]
        j = bisect_left(sub, x)
        if sub[j] != x:
            raise KeyError(x)
        del sub[j]
        self._len -= 1
        if not sub:
            del lists[i]
            del maxes[i]
            return
        if j == len(sub):
            maxes[i] = sub[-1]
        if len(sub) < _LOAD // 8 and i + 1 < len(lists):
            # Merge a small sub-list into its right neighbour to keep _maxes short.
            sub.extend(lists[i + 1])
            maxes[i] = sub[-1]
            del lists[i + 1]
            del maxes[i + 1]
            if len(sub) > 2 * _LOAD:
                self._split(i)

    def ceiling(self, x: int) -> int | None:
        """The smallest element ``>= x``, or ``None``."""
        maxes = self._maxes
        i = bisect_left(maxes, x)
        if i == len(maxes):
            return None
        sub = self._lists[i]
        return sub[bisect_left(sub, x)]

    def iter_from(self, x: int) -> Iterator[int]:
        """The elements ``>= x`` in ascending order (do not mutate while iterating)."""
        maxes = self._maxes
        i = bisect_left(maxes, x)
        if i == len(maxes):
            return
        sub = self._lists[i]
        yield from sub[bisect_left(sub, x) :]
        for sub in self._lists[i + 1 :]:
            yield from sub
