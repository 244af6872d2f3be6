"""An approximate prefix index: a character radix tree learned from routing history.

Without a tokenizer or the workers' KV events, the router can still guess where a prompt's
prefix is cached: on the workers it sent that prefix to before. Each node of this tree is
a run of characters tagged with those workers ("tenants").

Memory is bounded by one character budget for the whole tree (not per tenant, which lets
the index grow with the fleet). Eviction removes least-recently-used leaves, so a prefix
always outlives its extensions; each trim costs O(n + k log n) for k evicted nodes.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

# Distinct tenant sets kept for sharing; past it the table starts over (see ``_shared``).
_SHARED_TENANT_SETS = 4096


class _Node:
    __slots__ = ("children", "depth", "label", "last_access", "parent", "tenants")

    def __init__(
        self,
        label: str,
        parent: _Node | None,
        depth: int,
        now: float,
        tenants: frozenset[str],
    ) -> None:
        self.label = label
        self.parent = parent
        # Characters from the root to the end of this node's label: fixed while the node
        # lives (a split only shortens a label at its start), so a walk steps to it
        # without adding label lengths.
        self.depth = depth
        self.children: dict[str, _Node] = {}
        self.tenants = tenants
        self.last_access = now


def _common_prefix_length(label: str, text: str, start: int) -> int:
    """Length of the common prefix of ``label`` and ``text[start:]``, compared in C."""
    if text.startswith(label, start):
        return len(label)
    low, high = 0, min(len(label), len(text) - start)
    while low < high:  # invariant: label[:low] matches, label[:high + 1] does not
        mid = (low + high + 1) // 2
        if text.startswith(label[:mid], start):
            low = mid
        else:
            high = mid - 1
    return low


class Walk:
    """Where a text leads in the tree: the nodes whose whole label its longest cached
    prefix covers, then perhaps one node it covers only in part, and the length of that
    prefix.

    A policy matches a prompt and then inserts it where it sent it: one walk serves both
    (``tree.walk``, then ``tree.insert_walked``), since walking the tree was most of the
    cost of each. Valid until the tree next changes.
    """

    __slots__ = ("matched_chars", "partial", "path", "text")

    def __init__(
        self, text: str, path: list[_Node], partial: _Node | None, matched_chars: int
    ) -> None:
        self.text = text
        self.path = path
        self.partial = partial
        self.matched_chars = matched_chars

    def matched(self) -> dict[str, int]:
        """Characters of the text's longest cached prefix, per tenant that holds one."""
        matched: dict[str, int] = {}
        if self.partial is not None:
            matched = dict.fromkeys(self.partial.tenants, self.matched_chars)
        for on_path in reversed(self.path):
            depth = on_path.depth
            for tenant in on_path.tenants:
                if tenant not in matched:
                    matched[tenant] = depth
        return matched


class ApproximatePrefixTree:
    """Prompts routed so far, as a radix tree of characters tagged with tenants.

    A node's tenants are a frozenset shared by every node with the same tenants (a fleet
    has few distinct sets): a set per node was half of a node's memory, and an object
    more per node for the allocator and the cyclic collector on every routed prompt.
    """

    def __init__(self) -> None:
        self._tenant_sets: dict[frozenset[str], frozenset[str]] = {}
        self._root = _Node("", None, 0, 0.0, self._shared(frozenset()))
        self.size_chars = 0

    def _shared(self, tenants: frozenset[str]) -> frozenset[str]:
        """The one shared set equal to ``tenants`` (sharing saves memory only: equal sets
        are alike whichever object they are, so the table may start over at any time)."""
        found = self._tenant_sets.get(tenants)
        if found is None:
            if len(self._tenant_sets) >= _SHARED_TENANT_SETS:
                self._tenant_sets.clear()
            found = self._tenant_sets[tenants] = tenants
        return found

    def insert(self, text: str, tenant: str, now: float) -> None:
        """Record that ``text`` was sent to ``tenant`` at time ``now``."""
        self.insert_walked(self.walk(text), tenant, now)

    def insert_walked(self, walk: Walk, tenant: str, now: float) -> None:
        """``insert(walk.text, ...)`` along a walk taken since the tree last changed."""
        text = walk.text
        node = self._root
        node.last_access = now
        for node in walk.path:
            if tenant not in node.tenants:
                node.tenants = self._shared(node.tenants | {tenant})
            node.last_access = now
        pos = node.depth
        partial = walk.partial
        if partial is not None:
            node = self._split(partial, walk.matched_chars - pos)
            if tenant not in node.tenants:
                node.tenants = self._shared(node.tenants | {tenant})
            node.last_access = now
            pos = node.depth
        if pos < len(text):
            alone = self._shared(frozenset((tenant,)))
            node.children[text[pos]] = _Node(text[pos:], node, len(text), now, alone)
            self.size_chars += len(text) - pos

    def match(self, text: str) -> dict[str, int]:
        """Characters of ``text``'s longest cached prefix, per tenant that holds one.

        Read-only: access times change when the routed prompt is inserted.
        """
        return self.walk(text).matched()

    def walk(self, text: str) -> Walk:
        """The path of ``text``'s longest cached prefix (read-only, as ``match``)."""
        path: list[_Node] = []
        node, pos, end = self._root, 0, len(text)
        while pos < end:
            child = node.children.get(text[pos])
            if child is None:
                break
            label = child.label
            if not text.startswith(label, pos):  # the last node, matched in part
                return Walk(text, path, child, pos + _common_prefix_length(label, text, pos))
            path.append(child)
            node, pos = child, child.depth
        return Walk(text, path, None, pos)

    def evict_to(self, max_chars: int) -> int:
        """Drop least-recently-used leaves until the tree holds at most ``max_chars``.

        Returns the number of characters evicted.
        """
        if self.size_chars <= max_chars:
            return 0
        order = itertools.count()
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._leaves()]
        heapq.heapify(heap)
        evicted = 0
        while heap and self.size_chars > max_chars:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            evicted += self._detach(leaf)
            if parent is not self._root and not parent.children:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return evicted

    def untag(self, text: str, tenant: str, keep_chars: int) -> None:
        """Take back ``insert(text, tenant, ...)``: ``tenant`` keeps only the first
        ``keep_chars`` characters of ``text`` (what it held before), and nodes left with
        no tenant go. Nodes that another of its prompts passes through keep it, since a
        prefix of what a tenant holds is held too."""
        path: list[tuple[int, _Node]] = []  # (start of the node's label in text, node)
        node, pos = self._root, 0
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            common = _common_prefix_length(child.label, text, pos)
            if common < len(child.label):
                break  # the insert went through this node whole: it is not ours
            if pos < keep_chars < pos + common:
                child = self._split(child, keep_chars - pos)
                common = keep_chars - pos
            path.append((pos, child))
            node, pos = child, pos + common
        for start, on_path in reversed(path):
            if start < keep_chars:
                break
            if any(tenant in c.tenants for c in on_path.children.values()):
                break
            on_path.tenants = self._shared(on_path.tenants - {tenant})
            if not on_path.tenants:
                self._detach(on_path)

    def remove_tenant(self, tenant: str) -> None:
        """Forget a worker everywhere (it left the fleet); nodes left untagged go."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                child.tenants = self._shared(child.tenants - {tenant})
                if child.tenants:
                    stack.append(child)
                else:
                    self._detach(child)

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s label at ``at``; the new upper node inherits its tags."""
        parent = child.parent
        assert parent is not None
        label = child.label
        upper = _Node(label[:at], parent, parent.depth + at, child.last_access, child.tenants)
        parent.children[label[0]] = upper
        child.label = label[at:]
        child.parent = upper
        upper.children[label[at]] = child
        return upper

    def _detach(self, node: _Node) -> int:
        """Remove ``node`` and its subtree; returns the characters freed."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.label[0]]
        freed = sum(len(n.label) for n in self._subtree(node))
        self.size_chars -= freed
        return freed

    def _leaves(self) -> Iterator[_Node]:
        return (n for n in self._subtree(self._root) if not n.children and n is not self._root)

    @staticmethod
    def _subtree(node: _Node) -> Iterator[_Node]:
        stack = [node]
        while stack:
            current = stack.pop()
            yield current
            stack.extend(current.children.values())
