"""Shared structures of the policies: an intrusive doubly linked list, an indexed heap and a
sorted list of keys.

Most policies need only an OrderedDict (a C doubly linked list plus a hash). The first two
are for what an OrderedDict cannot do in O(1) or O(log n): keep a cursor into the order
(SIEVE's hand), splice whole lists together (LFU's aging), or order by a key that is not
recency (LRU-K's K-th most recent access). ``SortedKeys`` orders by any key, as
sortedcontainers' SortedList does, compiled.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar, cast

from mypy_extensions import mypyc_attr

from policies.base import Block


# Interpreted policies subclass it (lfu, sieve); this also makes it copyable when compiled.
@mypyc_attr(allow_interpreted_subclasses=True)
class Node:
    """One entry of a ``DList``: a block and its two links. Policies subclass it to add slots."""

    __slots__ = ("block", "prev", "next")

    def __init__(self, block: Block) -> None:
        self.block = block
        self.prev: Node | None = None  # toward the oldest end
        self.next: Node | None = None  # toward the newest end


N = TypeVar("N", bound=Node)


class DList(Generic[N]):
    """Intrusive doubly linked list, oldest end first.

    Not a deque: removing a known node from the middle is O(1), a node can serve as a cursor
    that survives other insertions and removals, and ``extend`` splices a whole list in O(1).
    Linking allocates nothing: the policy allocates one node per block when it first sees it.
    The list does not record membership in its nodes, so a splice touches no node but the
    two at the seam; the policy must know which list a node is in.
    """

    __slots__ = ("first", "last", "_len")

    def __init__(self) -> None:
        self.first: N | None = None
        self.last: N | None = None
        self._len = 0

    def append(self, node: N) -> None:
        """Link ``node`` (not in any list) at the newest end."""
        node.prev = self.last
        node.next = None
        if self.last is None:
            self.first = node
        else:
            self.last.next = node
        self.last = node
        self._len += 1

    def remove(self, node: N) -> None:
        """Unlink ``node``, which must be in this list."""
        if node.prev is None:
            self.first = cast("N | None", node.next)
        else:
            node.prev.next = node.next
        if node.next is None:
            self.last = cast("N | None", node.prev)
        else:
            node.next.prev = node.prev
        node.prev = node.next = None
        self._len -= 1

    def extend(self, other: DList[N]) -> None:
        """Move every node of ``other`` to the newest end of this list, in order; O(1)."""
        if other.first is None:
            return
        if self.last is None:
            self.first = other.first
        else:
            self.last.next = other.first
            other.first.prev = self.last
        self.last = other.last
        self._len += other._len
        other.first = other.last = None
        other._len = 0

    def after(self, node: N) -> N | None:
        """The next node toward the newest end, or None at the end."""
        return cast("N | None", node.next)

    def __iter__(self) -> Iterator[N]:
        """Nodes from the oldest; the list must not change while the iterator is in use."""
        node = self.first
        while node is not None:
            yield node
            node = self.after(node)

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0


V = TypeVar("V")


class IndexedHeap(Generic[V]):
    """Binary min-heap of values keyed by ``(key, id)``, with the position of every id.

    The position index makes ``update`` and ``remove`` of any entry O(log n) instead of the
    lazy-deletion pattern, which would let stale entries pile up. ``ordered`` walks the
    entries in ascending order without popping (a second, small heap over the frontier), so
    a policy can name victims and change nothing: k entries cost O(k log k).
    Ids are unique, so keys that tie are ordered by id and the order is total.
    """

    __slots__ = ("_entries", "_pos")

    def __init__(self) -> None:
        # Each entry is [key, id, value]; lists compare element-wise, so (key, id) orders them.
        self._entries: list[list[Any]] = []
        self._pos: dict[str, int] = {}

    def push(self, item_id: str, key: Any, value: V) -> None:
        if item_id in self._pos:
            raise KeyError(f"{item_id!r} is already in the heap")
        self._entries.append([key, item_id, value])
        self._pos[item_id] = len(self._entries) - 1
        self._sift_up(len(self._entries) - 1)

    def update(self, item_id: str, key: Any) -> None:
        """Give ``item_id`` a new key and restore the heap order around it."""
        i = self._pos[item_id]
        old = self._entries[i][0]
        self._entries[i][0] = key
        if key < old:
            self._sift_up(i)
        else:
            self._sift_down(i)

    def remove(self, item_id: str) -> V:
        """Take ``item_id`` out (KeyError if absent) and return its value."""
        i = self._pos.pop(item_id)
        entries = self._entries
        entry = entries[i]
        last = entries.pop()
        if i < len(entries):
            entries[i] = last
            self._pos[last[1]] = i
            self._sift_up(i)
            self._sift_down(self._pos[last[1]])
        value: V = entry[2]
        return value

    def key(self, item_id: str) -> Any:
        return self._entries[self._pos[item_id]][0]

    def get(self, item_id: str) -> V | None:
        i = self._pos.get(item_id)
        return None if i is None else self._entries[i][2]

    def ordered(self) -> Iterator[V]:
        """Values in ascending (key, id) order; the heap must not change while in use."""
        entries = self._entries
        if not entries:
            return
        n = len(entries)
        frontier: list[tuple[Any, str, int]] = [(entries[0][0], entries[0][1], 0)]
        while frontier:
            _, _, i = heapq.heappop(frontier)
            yield entries[i][2]
            for child in (2 * i + 1, 2 * i + 2):
                if child < n:
                    heapq.heappush(frontier, (entries[child][0], entries[child][1], child))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._pos

    def _sift_up(self, i: int) -> None:
        entries, pos = self._entries, self._pos
        entry = entries[i]
        while i > 0:
            parent = (i - 1) >> 1
            if entries[parent] <= entry:
                break
            entries[i] = entries[parent]
            pos[entries[i][1]] = i
            i = parent
        entries[i] = entry
        pos[entry[1]] = i

    def _sift_down(self, i: int) -> None:
        entries, pos = self._entries, self._pos
        n = len(entries)
        entry = entries[i]
        while True:
            child = 2 * i + 1
            if child >= n:
                break
            if child + 1 < n and entries[child + 1] < entries[child]:
                child += 1
            if entry <= entries[child]:
                break
            entries[i] = entries[child]
            pos[entries[i][1]] = i
            i = child
        entries[i] = entry
        pos[entry[1]] = i


# Sublist length of SortedKeys: a sublist past twice this splits in two, and one under half
# of it is merged into a neighbour (sortedcontainers' default load factor).
_LOAD = 1000


class SortedKeys:
    """Sorted list of mutually comparable keys (tuples of numbers and ids), smallest first:
    ``sortedcontainers.SortedList``'s structure and its subset the policies use, compiled.

    The keys are kept in sorted sublists of about ``_LOAD`` keys with each sublist's
    largest key in ``_maxes``: ``add`` and ``remove`` are one bisection of ``_maxes`` and
    one of a sublist, a list insertion or deletion of at most ``2 * _LOAD`` pointers, so
    O(log n) comparisons. SortedList does the same work in interpreted Python (its ``add``
    was most of deadline_edf's filing under a prefix cache); the order is the same,
    duplicates included (an added key goes after its equals, ``remove`` and ``pop(0)`` take
    the first). Positional access other than at the ends (``[0]``, ``[-1]``, ``pop(0)``,
    ``pop()``) walks the sublists, O(n / _LOAD): the policies use only the ends.
    """

    __slots__ = ("_lists", "_maxes", "_len")

    def __init__(self, keys: Iterable[Any] = ()) -> None:
        self._lists: list[list[Any]] = []
        self._maxes: list[Any] = []
        self._len = 0
        self.update(keys)

    def _load(self, ordered: list[Any]) -> None:
        """Replace the contents with ``ordered`` (sorted)."""
        self._lists = [ordered[i : i + _LOAD] for i in range(0, len(ordered), _LOAD)]
        self._maxes = [sub[-1] for sub in self._lists]
        self._len = len(ordered)

    def add(self, key: Any) -> None:
        maxes = self._maxes
        if not maxes:
            self._lists.append([key])
            maxes.append(key)
        else:
            pos = bisect.bisect_right(maxes, key)
            if pos == len(maxes):
                pos -= 1
                self._lists[pos].append(key)
                maxes[pos] = key
            else:
                bisect.insort_right(self._lists[pos], key)
            if len(self._lists[pos]) > 2 * _LOAD:
                self._split(pos)
        self._len += 1

    def update(self, keys: Iterable[Any]) -> None:
        """Add every key: one by one when few, else one merge of two sorted runs."""
        ordered = sorted(keys)
        if not ordered:
            return
        if not self._lists:  # no merge, and no second copy of a list that may hold millions
            self._load(ordered)
            return
        if 4 * len(ordered) >= self._len:
            merged: list[Any] = []
            for sub in self._lists:
                merged.extend(sub)
            merged.extend(ordered)
            merged.sort()  # two sorted runs: a linear merge; the new keys after their equals
            self._load(merged)
            return
        for key in ordered:
            self.add(key)

    def remove(self, key: Any) -> None:
        """Remove the first key equal to ``key``; ValueError if there is none."""
        maxes = self._maxes
        pos = bisect.bisect_left(maxes, key)
        if pos < len(maxes):
            sub = self._lists[pos]
            i = bisect.bisect_left(sub, key)
            if sub[i] == key:
                self._delete(pos, i)
                return
        raise ValueError(f"{key!r} not in list")

    def pop(self, index: int = -1) -> Any:
        pos, i = self._locate(index)
        key = self._lists[pos][i]
        self._delete(pos, i)
        return key

    def __getitem__(self, index: int) -> Any:
        pos, i = self._locate(index)
        return self._lists[pos][i]

    def _locate(self, index: int) -> tuple[int, int]:
        """(sublist, position in it) of the key at ``index`` (negative from the end)."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("SortedKeys index out of range")
        lists = self._lists
        if index < len(lists[0]):
            return 0, index
        last = len(lists) - 1
        from_end = self._len - index
        if from_end <= len(lists[last]):
            return last, len(lists[last]) - from_end
        pos = 0
        while index >= len(lists[pos]):
            index -= len(lists[pos])
            pos += 1
        return pos, index

    def _split(self, pos: int) -> None:
        sub = self._lists[pos]
        half = sub[_LOAD:]
        del sub[_LOAD:]
        self._maxes[pos] = sub[-1]
        self._lists.insert(pos + 1, half)
        self._maxes.insert(pos + 1, half[-1])

    def _delete(self, pos: int, i: int) -> None:
        lists, maxes = self._lists, self._maxes
        sub = lists[pos]
        del sub[i]
        self._len -= 1
        if len(sub) > _LOAD // 2:
            maxes[pos] = sub[-1]
        elif len(lists) > 1:
            # Merge a small sublist into a neighbour (split again if that grows too long),
            # so that the number of sublists stays about n / _LOAD.
            if pos == 0:
                pos = 1
            prev = lists[pos - 1]
            prev.extend(lists[pos])
            maxes[pos - 1] = prev[-1]
            del lists[pos]
            del maxes[pos]
            if len(prev) > 2 * _LOAD:
                self._split(pos - 1)
        elif sub:
            maxes[pos] = sub[-1]
        else:
            del lists[pos]
            del maxes[pos]

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain.from_iterable(self._lists)

    def __reversed__(self) -> Iterator[Any]:
        return itertools.chain.from_iterable(map(reversed, reversed(self._lists)))

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0
