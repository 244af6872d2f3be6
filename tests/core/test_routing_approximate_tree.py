"""The approximate prefix tree: matching per tenant, splitting, bounded LRU eviction."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.core.routing import approximate_tree
from kvserve.core.routing.approximate_tree import ApproximatePrefixTree


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_match_reports_deepest_prefix_per_tenant() -> None:
    tree = ApproximatePrefixTree()
    tree.insert("system: be brief. user: hello", "w0", now=1.0)
    tree.insert("system: be brief. user: goodbye", "w1", now=2.0)
    matched = tree.match("system: be brief. user: help me")
    assert matched == {
        "w0": len("system: be brief. user: hel"),
        "w1": len("system: be brief. user: "),
    }
    assert tree.match("unrelated") == {}
    assert tree.size_chars == len("system: be brief. user: hello") + len("goodbye")


def test_partial_edge_match_counts_matched_characters() -> None:
    tree = ApproximatePrefixTree()
    tree.insert("abcdef", "w0", now=0.0)
    assert tree.match("abcxyz") == {"w0": 3}
    assert tree.match("abcdefgh") == {"w0": 6}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(alphabet="ab", max_size=12), st.sampled_from(["w0", "w1", "w2"])),
        max_size=25,
    ),
    st.text(alphabet="ab", max_size=12),
)
def test_match_equals_brute_force(inserts: list[tuple[str, str]], query: str) -> None:
    tree = ApproximatePrefixTree()
    for now, (text, tenant) in enumerate(inserts):
        tree.insert(text, tenant, now=float(now))
    expected: dict[str, int] = {}
    for text, tenant in inserts:
        depth = _common(text, query)
        if depth:
            expected[tenant] = max(expected.get(tenant, 0), depth)
    assert tree.match(query) == expected
    distinct_chars = {text[:i] for text, _ in inserts for i in range(1, len(text) + 1)}
    assert tree.size_chars == len(distinct_chars)


def test_eviction_drops_least_recent_leaves_and_keeps_prefixes() -> None:
    tree = ApproximatePrefixTree()
    tree.insert("shared-prefix/old-tail", "w0", now=1.0)
    tree.insert("shared-prefix/new-tail", "w1", now=5.0)
    tree.insert("other", "w1", now=3.0)
    budget = tree.size_chars - len("old-tail")
    evicted = tree.evict_to(budget)
    assert evicted == len("old-tail")
    assert tree.match("shared-prefix/old-tail") == {
        "w0": len("shared-prefix/"),
        "w1": len("shared-prefix/"),
    }
    tree.evict_to(0)
    assert tree.size_chars == 0
    assert tree.match("shared-prefix/new-tail") == {}


def test_evict_to_is_a_no_op_within_budget() -> None:
    tree = ApproximatePrefixTree()
    tree.insert("abc", "w0", now=0.0)
    assert tree.evict_to(3) == 0
    assert tree.match("abc") == {"w0": 3}


def test_remove_tenant_forgets_it_and_frees_its_own_branches() -> None:
    tree = ApproximatePrefixTree()
    tree.insert("common/a-only", "w0", now=0.0)
    tree.insert("common/b-only", "w1", now=1.0)
    tree.remove_tenant("w0")
    assert tree.match("common/a-only") == {"w1": len("common/")}
    assert tree.size_chars == len("common/b-only")


def _brute_match(tree: ApproximatePrefixTree, query: str) -> dict[str, int]:
    """The match read from the labels alone (each node's full text, from the root): a
    node is on the query's path when the query goes past its parent's text."""
    expected: dict[str, int] = {}
    stack = [("", tree._root)]
    while stack:
        above, node = stack.pop()
        for child in node.children.values():
            text = above + child.label
            depth = _common(text, query)
            if depth > len(above):
                for tenant in child.tenants:
                    expected[tenant] = max(expected.get(tenant, 0), depth)
            stack.append((text, child))
    return expected


@settings(max_examples=80, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "untag", "evict"]),
            st.text(alphabet="ab", max_size=10),
            st.sampled_from(["w0", "w1"]),
            st.integers(0, 10),
        ),
        max_size=30,
    ),
    st.text(alphabet="ab", max_size=10),
    st.sampled_from([1, 4096]),
)
def test_matches_agree_with_the_labels_after_untags_and_evictions(
    ops: list[tuple[str, str, str, int]], query: str, shared_sets: int
) -> None:
    """Splits by ``untag`` and the removals of ``untag`` and ``evict_to`` keep the walk
    (which steps by each node's stored depth) in line with the labels; so does a table
    of shared tenant sets that starts over at every new set."""
    tree = ApproximatePrefixTree()
    default = approximate_tree._SHARED_TENANT_SETS
    approximate_tree._SHARED_TENANT_SETS = shared_sets  # hypothesis: no monkeypatch
    try:
        for now, (op, text, tenant, amount) in enumerate(ops):
            if op == "insert":
                tree.insert(text, tenant, now=float(now))
            elif op == "untag":
                tree.untag(text, tenant, keep_chars=min(amount, len(text)))
            else:
                tree.evict_to(tree.size_chars * amount // 10)
    finally:
        approximate_tree._SHARED_TENANT_SETS = default
    assert tree.match(query) == _brute_match(tree, query)
    assert tree.size_chars == sum(len(n.label) for n in tree._subtree(tree._root))


def test_nodes_with_the_same_tenants_share_one_set() -> None:
    tree = ApproximatePrefixTree()
    tree.insert("shared/one", "w0", now=0.0)
    tree.insert("shared/two", "w0", now=1.0)
    tree.insert("other", "w0", now=2.0)
    sets = {id(n.tenants) for n in tree._subtree(tree._root) if n is not tree._root}
    assert len(sets) == 1
