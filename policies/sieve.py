"""SIEVE: one FIFO queue, a visited bit per block and a moving hand (Zhang et al., NSDI'24)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from typing import Any

from policies.base import Block, Policy, PolicyContext
from policies.structures import DList, Node


class _Node(Node):
    __slots__ = ("visited",)

    def __init__(self, block: Block) -> None:
        super().__init__(block)
        self.visited = False


class SievePolicy(Policy):
    """Evicts the first unvisited block the hand reaches; the hand clears what it passes.

    Structures: an intrusive list (``DList``), oldest (SIEVE's tail) first, of nodes with a
    visited bit; the hand, a node of that list or None for "start at the oldest end". A
    ``DList`` rather than an OrderedDict because the hand is a cursor that must survive
    insertions and removals elsewhere in the queue.

    1. ``insert``: newest end (SIEVE's head), not visited.
    2. ``access``: set the visited bit. Nothing moves.
    3. Eviction: from the hand toward the newest end, wrapping to the oldest end, a visited
       block has its bit cleared and stays where it is; the first unvisited block is the
       victim, and the hand moves on to the block after it.
    4. ``remove`` of the block under the hand moves the hand on first.

    Atomic eviction. ``choose_victims`` walks from the hand on a read-only overlay (the ids
    it would have cleared and taken). A protected block that would be the victim is stepped
    over and left as it is; a visited one is cleared in passing like any other. Two full
    rounds are enough: after one, every bit the walk can clear is clear. ``evicted(v)`` walks again from the hand, stepping over every
    would-be victim that is not ``v`` (the protected ones, nothing else comes before ``v``),
    then clears the bits it passed, moves the hand past ``v`` and unlinks ``v``. The cost is
    SIEVE's own: the blocks the hand passes, amortised O(1) per victim since each cleared
    bit was set by a read.
    """

    name = "sieve"
    description = "SIEVE: FIFO queue with visited bits; a hand from the oldest end evicts the first unvisited block"

    def __init__(self, ctx: PolicyContext, params: Any = None) -> None:
        super().__init__(ctx, params)
        self._queue: DList[_Node] = DList()
        self._nodes: dict[str, _Node] = {}
        self._hand: _Node | None = None
        self._bytes = 0

    def hand(self) -> str | None:
        """Id of the block the hand is on (None: it starts at the oldest end)."""
        return None if self._hand is None else self._hand.block.block_id

    def visited(self, block_id: str) -> bool:
        return self._nodes[block_id].visited

    def insert(self, block: Block) -> None:
        node = _Node(block)
        self._nodes[block.block_id] = node
        self._queue.append(node)
        self._bytes += block.size

    def access(self, block: Block) -> None:
        self._nodes[block.block_id].visited = True

    def remove(self, block: Block) -> None:
        node = self._nodes.pop(block.block_id, None)
        if node is None:
            raise self._unknown(block)
        self._unlink(node)

    def _unlink(self, node: _Node) -> None:
        if node is self._hand:
            self._hand = self._queue.after(node)
        self._queue.remove(node)
        self._bytes -= node.block.size

    def _plan(self, skip: Callable[[Block], bool]) -> Iterator[tuple[bool, _Node]]:
        """The hand's walk on a read-only overlay: (True, victim) or (False, node cleared).

        ``skip(block)`` says an unvisited block must stay (it is stepped over, uncleared).
        The caller must stop using the stream before changing the policy.
        """
        queue = self._queue
        node = self._hand or queue.first
        cleared: set[str] = set()
        taken: set[str] = set()
        for _ in range(2 * len(queue)):
            assert node is not None
            bid = node.block.block_id
            if bid not in taken:
                if node.visited and bid not in cleared:
                    cleared.add(bid)
                    yield False, node
                elif not skip(node.block):
                    taken.add(bid)
                    yield True, node
            node = queue.after(node) or queue.first

    def choose_victims(self, bytes_needed: int, protected: AbstractSet[str]) -> list[Block] | None:
        victims: list[Block] = []
        if bytes_needed <= 0:
            return victims
        available = self._bytes
        for bid in protected:
            node = self._nodes.get(bid)
            if node is not None:
                available -= node.block.size
        if available < bytes_needed:
            return None  # without two rounds of the hand to find out
        got = 0
        for is_victim, node in self._plan(lambda b: b.block_id in protected):
            if is_victim:
                victims.append(node.block)
                got += node.block.size
                if got >= bytes_needed:
                    return victims
        return None

    def evicted(self, block: Block) -> None:
        """Move the hand to ``block`` as the walk would, clearing what it passes; evict it."""
        target = self._nodes.get(block.block_id)
        if target is None:
            raise self._unknown(block)
        passed: list[_Node] = []
        found = False
        for is_victim, node in self._plan(lambda b: b.block_id != block.block_id):
            if is_victim:  # skipping every other would-be victim, this can only be block
                found = node is target
                break
            passed.append(node)
        if found:
            for node in passed:
                node.visited = False
            self._hand = target  # unlinking it moves the hand on to the next block
        # else: not a victim SIEVE would name; evict just it and leave the hand alone.
        del self._nodes[block.block_id]
        self._unlink(target)

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._nodes
