"""Requests coming and going in random order against a small cache.

Prompts draw from a two-token vocabulary so they share prefixes often, and twelve blocks of
two tokens keep the cache under constant pressure. After every step: the manager's own
``check()``, the KV events replayed from the start equal its snapshot, and every cached
block in a request's table holds the hash of that request's own tokens there.
"""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.core.kv_cache_errors import RequestStateError
from kvserve.core.kv_cache_manager import KVCacheManager
from kvserve.core.kv_events import apply_events

NS = make_namespace("manager-machine")
BS = 2
NUM_BLOCKS = 12
prompts = st.lists(st.integers(0, 1), min_size=1, max_size=9)


def hashes_of(tokens):
    return block_hashes(tokens, BS, NS)


class ManagerMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BS)
        self.tokens: dict[str, list[int]] = {}
        self.mirror: dict[int, int | None] = {}
        self.seen_seq = 0
        self.next_id = 0

    def cached_prefix_len(self, hashes):
        n = 0
        while n < len(hashes) and hashes[n] in self.mirror:
            n += 1
        return n

    def match(self, request_id):
        tokens = self.tokens[request_id]
        reusable = hashes_of(tokens[:-1])
        expected = self.cached_prefix_len(reusable)
        assert self.kv.match_prefix(request_id, reusable) == expected
        assert len(self.kv.block_table(request_id)) == expected

    @rule(target=requests, prompt=prompts, prefill_now=st.booleans())
    def admit(self, prompt, prefill_now):
        """Match the cached prefix and allocate the prompt, or give everything back.

        A request prefilled later lets others compute the same blocks meanwhile.
        """
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.tokens[request_id] = prompt
        self.match(request_id)
        if not self.allocate_for_all_tokens(request_id):
            self.preempt(request_id)
            return multiple()
        if prefill_now:
            self.compute(request_id)
        return request_id

    @rule(request_id=requests)
    def compute(self, request_id):
        """The model ran: publish every full block the table holds."""
        if request_id not in self.tokens:
            return
        computed = min(len(self.tokens[request_id]), len(self.kv.block_table(request_id)) * BS)
        hashes = hashes_of(self.tokens[request_id][:computed])
        self.kv.commit_blocks(request_id, hashes)
        self.take_events()
        assert all(h in self.mirror for h in hashes)

    @rule(request_id=requests, tokens=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def decode(self, request_id, tokens):
        """New tokens need room; without it the request is preempted."""
        if request_id not in self.tokens:
            return
        self.tokens[request_id].extend(tokens)
        if not self.allocate_for_all_tokens(request_id):
            self.preempt(request_id)

    def preempt(self, request_id):
        self.kv.free_request(request_id)
        del self.tokens[request_id]
        assert self.kv.block_table(request_id) == []

    def allocate_for_all_tokens(self, request_id):
        kv = self.kv
        table = kv.block_table(request_id)
        need = -(-len(self.tokens[request_id]) // BS) - len(table)
        before = (kv.num_free_blocks, kv.snapshot())
        fits = need <= kv.num_available_blocks
        assert kv.allocate_slots(request_id, len(self.tokens[request_id])) == fits
        if fits:
            assert len(kv.block_table(request_id)) == len(table) + max(0, need)
            assert kv.block_table(request_id)[: len(table)] == table
        else:
            assert (kv.block_table(request_id), kv.num_free_blocks, kv.snapshot()) == (
                table,
                *before,
            )
        return fits

    @rule(request_id=requests)
    def rematch(self, request_id):
        if request_id not in self.tokens:
            return
        table = self.kv.block_table(request_id)
        owns = any(self.kv._ledger.state_of(b) == "owned" for b in table)
        if owns:
            with pytest.raises(RequestStateError, match="owns blocks"):
                self.kv.match_prefix(request_id, [])
        else:
            self.match(request_id)

    @rule(request_id=consumes(requests))
    def finish(self, request_id):
        self.kv.free_request(request_id)  # a no-op if it was preempted
        self.tokens.pop(request_id, None)
        assert self.kv.block_table(request_id) == []

    @rule(n=st.integers(0, 5))
    def evict(self, n):
        evictable = self.kv.num_evictable_blocks
        assert self.kv.evict(n) == min(n, evictable)

    @rule()
    def clear(self):
        self.kv.clear()
        assert self.kv.num_evictable_blocks == 0

    def take_events(self):
        events = self.kv.events.since(self.seen_seq)
        apply_events(self.mirror, events)
        self.seen_seq = self.kv.events.last_seq

    @invariant()
    def consistent(self):
        kv = self.kv
        kv.check()
        self.take_events()
        last_seq, blocks = kv.snapshot()
        assert last_seq == self.seen_seq
        assert dict(blocks) == self.mirror
        assert kv.num_available_blocks == kv.num_free_blocks + kv.num_evictable_blocks
        ledger = kv._ledger
        for request_id, tokens in self.tokens.items():
            hashes = hashes_of(tokens)
            for i, block in enumerate(kv.block_table(request_id)):
                if ledger.state_of(block) == "cached":
                    assert ledger.hash_of(block) == hashes[i], f"{request_id} block {i}: alien KV"


ManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_manager_state_machine = ManagerMachine.TestCase
