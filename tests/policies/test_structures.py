"""DList, IndexedHeap and SortedKeys against plain Python models (SortedKeys against
sortedcontainers' SortedList, whose order it must keep exactly)."""

from __future__ import annotations

import random
from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sortedcontainers import SortedList

from policies.base import Block
from policies.structures import DList, IndexedHeap, Node, SortedKeys


def ids(lst: DList[Node]) -> list[str]:
    return [node.block.block_id for node in lst]


def make(*names: str) -> tuple[DList[Node], dict[str, Node]]:
    lst: DList[Node] = DList()
    nodes = {name: Node(Block(name, 1)) for name in names}
    for node in nodes.values():
        lst.append(node)
    return lst, nodes


def test_dlist_append_remove_keeps_order_and_ends() -> None:
    # a b c d, oldest first.
    lst, nodes = make("a", "b", "c", "d")
    assert ids(lst) == ["a", "b", "c", "d"] and len(lst) == 4
    # Unlinking from the middle, then both ends, keeps the rest in order.
    lst.remove(nodes["b"])
    assert ids(lst) == ["a", "c", "d"]
    lst.remove(nodes["a"])
    lst.remove(nodes["d"])
    assert ids(lst) == ["c"]
    assert lst.first is nodes["c"] and lst.last is nodes["c"]
    # A removed node can be appended again, at the newest end.
    lst.append(nodes["a"])
    assert ids(lst) == ["c", "a"]
    assert lst.after(nodes["c"]) is nodes["a"] and lst.after(nodes["a"]) is None
    lst.remove(nodes["c"])
    lst.remove(nodes["a"])
    assert not lst and lst.first is None and lst.last is None


def test_dlist_extend_splices_and_empties_the_other() -> None:
    left, _ = make("a", "b")
    right, nodes = make("c", "d")
    left.extend(right)
    assert ids(left) == ["a", "b", "c", "d"] and len(left) == 4
    assert not right and ids(right) == []
    # The seam is linked both ways: removing across it works.
    left.remove(nodes["c"])
    assert ids(left) == ["a", "b", "d"]
    # Splicing into an empty list, and splicing an empty list, are both fine.
    empty: DList[Node] = DList()
    empty.extend(left)
    assert ids(empty) == ["a", "b", "d"]
    empty.extend(DList())
    assert ids(empty) == ["a", "b", "d"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "remove"]), st.integers(0, 9)), max_size=60))
def test_dlist_matches_a_list(ops: list[tuple[str, int]]) -> None:
    lst: DList[Node] = DList()
    nodes = {i: Node(Block(str(i), 1)) for i in range(10)}
    model: list[int] = []
    for op, i in ops:
        if op == "append" and i not in model:
            lst.append(nodes[i])
            model.append(i)
        elif op == "remove" and i in model:
            lst.remove(nodes[i])
            model.remove(i)
        assert ids(lst) == [str(i) for i in model]
        assert len(lst) == len(model)
        assert (lst.last.block.block_id if lst.last else None) == (str(model[-1]) if model else None)


def test_heap_orders_updates_and_removes() -> None:
    heap: IndexedHeap[str] = IndexedHeap()
    for name, key in [("a", 5), ("b", 1), ("c", 3), ("d", 4)]:
        heap.push(name, key, name.upper())
    assert list(heap.ordered()) == ["B", "C", "D", "A"]
    # ordered() pops nothing.
    assert len(heap) == 4 and list(heap.ordered()) == ["B", "C", "D", "A"]
    heap.update("a", 0)
    heap.update("b", 9)
    assert list(heap.ordered()) == ["A", "C", "D", "B"]
    assert heap.remove("c") == "C"
    assert "c" not in heap and heap.key("d") == 4 and heap.get("c") is None
    assert list(heap.ordered()) == ["A", "D", "B"]
    with pytest.raises(KeyError):
        heap.push("a", 1, "again")
    with pytest.raises(KeyError):
        heap.remove("zz")


def test_heap_breaks_key_ties_by_id() -> None:
    heap: IndexedHeap[str] = IndexedHeap()
    for name in ["c", "a", "b"]:
        heap.push(name, 7, name)
    assert list(heap.ordered()) == ["a", "b", "c"]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "update", "remove"]), st.integers(0, 15), st.integers(0, 20)), max_size=80))
def test_heap_matches_a_sorted_dict(ops: list[tuple[str, int, int]]) -> None:
    heap: IndexedHeap[int] = IndexedHeap()
    model: dict[str, int] = {}
    for op, i, key in ops:
        name = f"{i:02d}"
        if op == "push" and name not in model:
            heap.push(name, key, i)
            model[name] = key
        elif op == "update" and name in model:
            heap.update(name, key)
            model[name] = key
        elif op == "remove" and name in model:
            assert heap.remove(name) == i
            del model[name]
        expected = [int(n) for n, _ in sorted(model.items(), key=lambda kv: (kv[1], kv[0]))]
        assert list(heap.ordered()) == expected
        assert len(heap) == len(model)


# ---- SortedKeys ---------------------------------------------------------------------------


class Tagged(tuple[int, int]):
    """A key whose equals are told apart by identity: where equal keys go shows."""


def same(a: Iterable[object], b: Iterable[object]) -> bool:
    """Same keys in the same order, each the very same object."""
    xs, ys = list(a), list(b)
    return len(xs) == len(ys) and all(x is y for x, y in zip(xs, ys, strict=True))


@pytest.mark.parametrize("seed", range(4))
def test_sorted_keys_keeps_sortedlists_order_through_splits_and_merges(seed: int) -> None:
    """Random adds, updates, removes and pops at both ends: the list grows to about 10,000
    keys (its sublists split past 2000) and shrinks again (they merge under 500); duplicate
    keys (equal, not the same object) must land where SortedList puts them."""
    rng = random.Random(seed)
    keys, model = SortedKeys(), SortedList()
    pool: list[tuple[int, int]] = []  # the keys held, by value, to pick removals from
    sublists: list[int] = []
    for step in range(12_000):
        roll = rng.random()
        grow = step < 3000
        if roll < (0.6 if grow else 0.15):
            key = Tagged((rng.randrange(300), rng.randrange(4)))
            keys.add(key)
            model.add(key)
            pool.append(key)
        elif grow and roll < 0.65:
            batch = [Tagged((rng.randrange(300), rng.randrange(4))) for _ in range(rng.choice((1, 5, 50, 200)))]
            keys.update(batch)
            model.update(batch)
            pool.extend(batch)
        elif pool and roll < (0.85 if grow else 0.6):
            i = rng.randrange(len(pool))
            pool[i], pool[-1] = pool[-1], pool[i]
            equal = Tagged(pool.pop())  # remove takes the first equal key, whichever object
            keys.remove(equal)
            model.remove(equal)
        elif pool:
            index = rng.choice((0, -1))
            assert keys[index] is model[index]
            popped = keys.pop(index)
            assert popped is model.pop(index)
            pool.remove(popped)
        assert len(keys) == len(model) == len(pool) and bool(keys) == bool(model)
        sublists.append(len(keys._lists))
        if step % 500 == 0:
            # Small sublists are merged: the sublists stay about n / 1000, however n got there
            # (the last one may be short after a bulk load, as in SortedList).
            assert all(len(sub) > 500 for sub in keys._lists[:-1])
            assert same(keys, model) and same(reversed(keys), reversed(model))
    assert same(keys, model) and same(reversed(keys), reversed(model))
    peak = max(sublists)
    assert peak >= 5 and sublists[-1] < peak  # it split, and merged again


def test_sorted_keys_positions_errors_and_construction() -> None:
    keys = SortedKeys([(5, "e"), (1, "a"), (3, "c")])
    assert list(keys) == [(1, "a"), (3, "c"), (5, "e")] and len(keys) == 3
    assert keys[1] == (3, "c") and keys[-2] == (3, "c") and keys[-3] == (1, "a")
    big = SortedKeys(range(5000))
    assert big[2500] == 2500 and big[-2501] == 2499 and big.pop(1234) == 1234 and len(big) == 4999
    with pytest.raises(IndexError):
        keys[3]
    with pytest.raises(IndexError):
        SortedKeys().pop()
    with pytest.raises(ValueError, match="not in list"):
        keys.remove((2, "b"))
    with pytest.raises(ValueError, match="not in list"):
        keys.remove((9, "z"))  # past the largest key
    keys.update([])
    assert list(keys) == [(1, "a"), (3, "c"), (5, "e")]
    # An update of an empty list loads the keys as they are, equal keys in their order.
    first, second = Tagged((1, 1)), Tagged((1, 1))
    fresh, model = SortedKeys(), SortedList()
    fresh.update([(2, 0), first, second, (0, 9)])
    model.update([(2, 0), first, second, (0, 9)])
    assert same(fresh, model) and fresh[1] is first and len(fresh) == 4
    while keys:
        keys.pop(0)
    assert list(keys) == [] and list(reversed(keys)) == [] and len(keys) == 0
