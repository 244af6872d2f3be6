"""The tree on its own: LRU order by release, held blocks, the lazily cleaned heap."""

import pytest

from kvserve.core.kv_cache_errors import InconsistentChainError, NotCachedError, NotPinnedError
from kvserve.core.prefix_tree import PrefixTree


def grow(tree, hashes, blocks, parent_hash=None):
    """Insert a chain under ``parent_hash`` and release it."""
    tree.insert(hashes, blocks, 0, parent_hash)
    tree.unpin(blocks)


def test_match_pins_the_longest_cached_prefix():
    tree = PrefixTree(8)
    grow(tree, [10, 11, 12], [0, 1, 2])
    assert tree.match([10, 11, 99, 12]) == [0, 1]
    assert [tree.ref_count(b) for b in (0, 1, 2)] == [1, 1, 0]
    assert tree.match([99]) == []
    tree.check()


def test_a_parent_used_after_its_children_is_ordered_by_its_own_release():
    tree = PrefixTree(8)
    grow(tree, [10, 11], [0, 1])  # released at t1
    grow(tree, [20], [2])  # t2
    tree.unpin(tree.match([10]))  # parent 10 used again at t3
    # Leaf 11 (t1) goes first; parent 10 then becomes a leaf but is newer than 20 (t2).
    assert tree.evict(1) == ([11], [1])
    assert tree.evict(2) == ([20, 10], [2, 0])
    assert len(tree) == 0
    tree.check()


def test_blocks_released_together_age_in_the_order_given():
    tree = PrefixTree(8)
    tree.insert([30], [3], 0)
    tree.insert([31], [5], 0)
    tree.unpin([5, 3])
    assert tree.evict(2) == ([31, 30], [5, 3])


def test_a_pinned_descendant_holds_every_ancestor():
    tree = PrefixTree(8)
    grow(tree, [10, 11, 12], [0, 1, 2])
    grow(tree, [13], [3], parent_hash=10)
    assert tree.num_reclaimable == 4
    tree.pin([2])  # only the deepest block, not its prefix
    assert tree.num_reclaimable == 1  # only 13
    assert tree.evict(10) == ([13], [3])
    tree.check()
    tree.unpin([2])
    assert tree.num_reclaimable == 3
    assert tree.evict(10) == ([12, 11, 10], [2, 1, 0])
    tree.check()


def test_unpin_of_an_unpinned_block_restores_the_call():
    tree = PrefixTree(4)
    grow(tree, [10, 11], [0, 1])
    pinned = tree.match([10, 11])
    with pytest.raises(NotPinnedError, match="block 1 is not pinned"):
        tree.unpin([*pinned, 1])
    assert [tree.ref_count(b) for b in (0, 1)] == [1, 1]
    assert tree.num_reclaimable == 0
    tree.check()


def test_insert_under_an_unknown_parent_changes_nothing():
    tree = PrefixTree(4)
    with pytest.raises(NotCachedError, match="parent hash"):
        tree.insert([11], [1], 0, parent_hash=10)
    assert len(tree) == 0
    tree.check()


def test_items_list_parents_before_children_after_churn():
    tree = PrefixTree(8)
    grow(tree, [10, 11], [0, 1])
    grow(tree, [20], [2])
    tree.evict(2)  # 11, then 10... re-added below under a changed history
    grow(tree, [10], [4])
    grow(tree, [11], [5], parent_hash=10)
    items = list(tree.items())
    assert items.index((10, None)) < items.index((11, 10))
    tree.check()


def test_candidate_queue_of_a_hot_block_stays_bounded():
    tree = PrefixTree(4)
    grow(tree, [10], [0])
    for _ in range(10_000):
        tree.unpin(tree.match([10]))
    assert len(tree._released) <= 2 * len(tree) + 64 + 1
    tree.check()
    assert tree.evict(1) == ([10], [0])


def test_match_follows_tree_paths_only():
    tree = PrefixTree(4)
    grow(tree, [10], [0])
    grow(tree, [20], [1])  # cached, but at the root, not under 10
    assert tree.match([10, 20]) == [0]
    tree.check()


def test_insert_whose_cached_lead_is_not_a_path_changes_nothing():
    tree = PrefixTree(4)
    grow(tree, [10], [0])
    grow(tree, [20], [1])
    with pytest.raises(InconsistentChainError, match="block 1 of the chain"):
        tree.insert([10, 20, 30], [2, 3, 3], 2)
    assert [tree.ref_count(b) for b in (0, 1)] == [0, 0]
    assert tree.num_reclaimable == 2
    tree.check()
