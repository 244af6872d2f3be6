"""Router replicas announcing their routing: the wire form, the peers' load view, a
peer's choice recorded and taken back, and replicas fed the same events and
announcements deciding as one router does."""

from __future__ import annotations

import random

import pytest

from kvserve.core.kv_events import KVEvent
from kvserve.core.routing.announcements import (
    Announcement,
    Announcer,
    ChoiceNote,
    LoadNote,
    PeerView,
)
from kvserve.core.routing.announcing_policy import AnnouncingPolicy
from kvserve.core.routing.cache_aware import CacheAwareConfig
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.pd_pair import PDConfig
from kvserve.core.routing.policies.cache_aware import CacheAwarePolicy
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.types import PromptBlocks, RouteQuery, RoutingDecision, WorkerLoad

BLOCK = 16
CONFIG = KvAwareConfig(prefill_token_s=1e-4, attention_pair_s=1e-8, decode_request_s=1e-3)


def query(hashes: list[int], tokens: int | None = None) -> RouteQuery:
    num_tokens = tokens if tokens is not None else len(hashes) * BLOCK + 1
    return RouteQuery("", blocks=PromptBlocks(num_tokens, hashes, BLOCK))


def test_an_announcement_survives_its_wire_form() -> None:
    announcer = Announcer("a")
    seq = announcer.choice("w1", [5, 6], 40, 16)
    announcer.undo(seq)
    announcer.load("w1", 2, 24)
    announcer.load("w2", 1, 0)
    announcer.load("w2", 0, 0)  # released: announced as zero
    sent = announcer.take()
    assert Announcement.from_json(sent.to_json()) == sent
    assert sent.loads == (LoadNote("w1", 2, 24), LoadNote("w2", 0, 0))
    assert announcer.take().is_empty()
    full = announcer.take(full=True)  # every held load, changed or not
    assert full.full and full.loads == (LoadNote("w1", 2, 24),)


def test_choices_carry_their_time_only_to_receivers_on_the_same_clock() -> None:
    """A router's processes share a clock: a sibling records a choice as of the origin's
    time (its speculative deadline, its prefill's end in the queue); a peer on another
    host records it when it arrives."""
    stamped, plain = Announcer("a", stamp_times=True), Announcer("b")
    for announcer in (stamped, plain):
        announcer.choice("w1", [5], 40, 0, pool="decode", computes=False, at=2.5)
    sibling, peer = stamped.take(), plain.take()
    assert Announcement.from_json(sibling.to_json()) == sibling
    assert sibling.choices[0].at == 2.5 and not sibling.choices[0].computes
    assert peer.choices[0].at is None
    recorded: list[float] = []

    def record(_note: ChoiceNote, at: float) -> None:
        recorded.append(at)

    view = PeerView(record)
    view.apply(sibling, 3.0)
    view.apply(peer, 3.0)
    assert recorded == [2.5, 3.0]


def test_a_kv_aware_pair_is_announced_as_prefill_and_blocks_only_decode() -> None:
    origin, peer = KvAwarePolicy(CONFIG), KvAwarePolicy(CONFIG)
    announcer = Announcer("a")
    routing = AnnouncingPolicy(origin, announcer)
    hashes = list(range(1, 41))
    pair = routing.select_pair(
        query(hashes), [WorkerLoad("d0")], [WorkerLoad("p0")], 1.0, PDConfig()
    )
    assert pair.prefill_worker_id == "p0"
    sent = announcer.take()
    assert [(c.worker_id, c.computes) for c in sent.choices] == [("p0", True), ("d0", False)]
    PeerView(peer.observe_peer_choice).apply(Announcement.from_json(sent.to_json()), 1.0)
    assert peer.routing.queue.queued_s("d0", 1.0) == 0.0
    assert peer.routing.queue.queued_s("p0", 1.0) == pytest.approx(
        origin.routing.queue.queued_s("p0", 1.0)
    )
    assert peer.routing.index.num_speculative("d0") == len(hashes)


def test_workers_are_renamed_and_unknown_ones_left_out() -> None:
    announcement = Announcement(
        "a",
        choices=(ChoiceNote(0, "w0", (1,), 20, 0), ChoiceNote(1, "w9", (2,), 20, 0)),
        loads=(LoadNote("w0", 1, 20), LoadNote("w9", 1, 20)),
    )
    renamed = announcement.renamed({"w0": "http://a:1"}.get)
    assert [c.worker_id for c in renamed.choices] == ["http://a:1"]
    assert renamed.loads == (LoadNote("http://a:1", 1, 20),)


@pytest.mark.parametrize(
    "bad",
    [
        [],
        {"choices": []},
        {"origin": "a", "choices": [[0, "w", [1], 3]]},
        {"origin": "a", "loads": [["w", -1, 0]]},
        {"origin": "a", "loads": [["w", "1", 0]]},
        {"origin": "a", "undone": [True]},
    ],
)
def test_a_malformed_announcement_is_refused(bad: object) -> None:
    with pytest.raises(ValueError):
        Announcement.from_json(bad)


def test_peers_loads_add_up_per_worker_and_a_full_announcement_replaces() -> None:
    changed: list[str] = []
    view = PeerView(lambda _note, _now: None, changed.append)
    view.apply(Announcement("a", loads=(LoadNote("w1", 2, 100), LoadNote("w2", 1, 0))), 0.0)
    view.apply(Announcement("b", loads=(LoadNote("w1", 1, 50),)), 0.0)
    assert view.load("w1") == (3, 150) and view.load("w2") == (1, 0)
    view.apply(Announcement("a", loads=(LoadNote("w1", 2, 100),)), 0.0)  # repeated: no change
    assert changed == ["w1", "w2", "w1"]
    view.apply(Announcement("a", loads=(LoadNote("w3", 1, 7),), full=True), 1.0)
    assert (view.load("w1"), view.load("w2"), view.load("w3")) == ((1, 50), (0, 0), (1, 7))
    view.forget_origin("b")
    assert view.load("w1") == (0, 0) and view.origins() == ["a"]


def test_a_peers_choice_is_recorded_as_the_origin_recorded_it() -> None:
    origin = AnnouncingPolicy(KvAwarePolicy(CONFIG), Announcer("a"))
    peer = KvAwarePolicy(CONFIG)
    view = PeerView(peer.observe_peer_choice)
    workers = [WorkerLoad("w0"), WorkerLoad("w1")]
    prompt = query([11, 12, 13, 14])
    decision = origin.select(prompt, workers, 0.0)
    view.apply(origin.announcer.take(), 0.0)
    chosen = decision.worker_id
    assert peer.routing.index.num_speculative(chosen) == 4
    assert peer.routing.queue.queued_s(chosen, 0.0) == pytest.approx(
        CONFIG.prefill_s(4 * BLOCK + 1)
    )
    # The next turn of that conversation follows it there, whichever replica routes it.
    assert peer.select(query([11, 12, 13, 14, 15]), workers, 0.0).worker_id == chosen


def test_an_undone_choice_leaves_a_peer_as_it_was() -> None:
    origin = AnnouncingPolicy(KvAwarePolicy(CONFIG), Announcer("a"))
    peer = KvAwarePolicy(CONFIG)
    view = PeerView(peer.observe_peer_choice)
    decision = origin.select(query([21, 22, 23]), [WorkerLoad("w0"), WorkerLoad("w1")], 0.0)
    view.apply(origin.announcer.take(), 0.0)
    assert peer.routing.index.num_speculative(decision.worker_id) == 3
    origin.undo(decision, 0.0)
    view.apply(origin.announcer.take(), 0.0)
    assert peer.routing.index.num_speculative(decision.worker_id) == 0
    assert peer.routing.queue.queued_s(decision.worker_id, 0.0) == 0.0


def test_a_cache_aware_peer_learns_the_text_and_forgets_it_on_undo() -> None:
    origin = AnnouncingPolicy(CacheAwarePolicy(CacheAwareConfig(), 0.0), Announcer("a"))
    peer = CacheAwarePolicy(CacheAwareConfig(), 0.0)
    view = PeerView(peer.observe_peer_choice)
    workers = [WorkerLoad("w0"), WorkerLoad("w1"), WorkerLoad("w2")]
    text = "a long shared system prompt, then a question"
    first = origin.select(RouteQuery(text, model="m"), workers, 0.0)
    sent = origin.announcer.take()
    assert Announcement.from_json(sent.to_json()) == sent
    view.apply(sent, 0.0)
    follow_up = RouteQuery(text + " and its follow-up", model="m")
    assert peer.select(follow_up, workers, 0.0).worker_id == first.worker_id
    assert peer.index.tree("regular", "other").match(text) == {}  # per model, as its own
    fresh = CacheAwarePolicy(CacheAwareConfig(), 0.0)
    view = PeerView(fresh.observe_peer_choice)
    second = origin.select(RouteQuery("another prompt entirely", model="m"), workers, 0.0)
    view.apply(origin.announcer.take(), 0.0)
    origin.undo(second, 0.0)
    view.apply(origin.announcer.take(), 0.0)
    assert fresh.index.tree("regular", "m").match("another prompt entirely") == {}


def test_choices_past_the_undo_window_are_forgotten() -> None:
    taken_back: list[float] = []
    view = PeerView(lambda _note, _now: taken_back.append, undo_window_s=1.0)
    view.apply(Announcement("a", choices=(ChoiceNote(0, "w", (1,), 20, 0),)), 0.0)
    view.apply(Announcement("a"), 2.0)  # the choice is past its window now
    view.apply(Announcement("a", undone=(0,)), 2.0)
    assert taken_back == []


class Replica:
    """One replica as the router wires it: own guards, peers' announced loads, both told
    to its policy as their sum."""

    def __init__(self, name: str) -> None:
        self.policy = KvAwarePolicy(CONFIG)
        self.announcer = Announcer(name)
        self.routing = AnnouncingPolicy(self.policy, self.announcer)
        self.peers = PeerView(self.policy.observe_peer_choice, self._tell)
        self.own: dict[str, tuple[int, int]] = {}

    def load(self, worker_id: str) -> WorkerLoad:
        r, t = self.own.get(worker_id, (0, 0))
        peer_r, peer_t = self.peers.load(worker_id)
        return WorkerLoad(worker_id, r + peer_r, t + peer_t)

    def acquire(self, worker_id: str, requests: int, tokens: int) -> None:
        r, t = self.own.get(worker_id, (0, 0))
        self.own[worker_id] = (r + requests, t + tokens)
        self.announcer.load(worker_id, *self.own[worker_id])
        self._tell(worker_id)

    def _tell(self, worker_id: str) -> None:
        self.policy.observe_load(self.load(worker_id))


def generated_fleet(seed: int) -> tuple[list[str], list[tuple[str, KVEvent]], list[list[int]]]:
    """Workers, the KV events they emitted, and the prompts of a burst: conversations
    over a shared system prompt, some held, some new."""
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(rng.randrange(3, 12))]
    system = [1, 2, 3]
    conversations = [[*system, 100 + 10 * c, 101 + 10 * c] for c in range(rng.randrange(4, 15))]
    events = []
    for seq, conversation in enumerate(conversations, start=1):
        if rng.random() < 0.7:
            holder = rng.choice(workers)
            depth = rng.randrange(1, len(conversation) + 1)
            events.append((holder, KVEvent(seq, "stored", "device", tuple(conversation[:depth]))))
    prompts = [[*rng.choice(conversations), 1000 + i] for i in range(rng.randrange(10, 40))]
    return workers, events, prompts


@pytest.mark.parametrize("seed", range(25))
def test_replicas_fed_the_same_events_and_announcements_decide_as_one_router(seed: int) -> None:
    workers, events, prompts = generated_fleet(seed)
    one = Replica("one")
    replicas = [Replica(f"r{i}") for i in range(3)]
    for replica in (one, *replicas):
        for worker_id, event in events:
            replica.policy.observe_events(worker_id, [event])
    rng = random.Random(seed)
    prefilling: list[tuple[Replica, str, int]] = []  # guards still holding prefill tokens
    for i, hashes in enumerate(prompts):
        now = i * 0.001
        prompt = query(hashes, len(hashes) * BLOCK - rng.randrange(0, BLOCK))
        expected = one.routing.select(prompt, [one.load(w) for w in workers], now)
        sender = replicas[i % len(replicas)]
        decision = sender.routing.select(prompt, [sender.load(w) for w in workers], now)
        assert _same(decision, expected), f"request {i}"
        uncached = expected.uncached_tokens(prompt.prefill_tokens)
        one.acquire(expected.worker_id, 1, uncached)
        sender.acquire(decision.worker_id, 1, uncached)
        prefilling.append((sender, decision.worker_id, uncached))
        if rng.random() < 0.3:  # a first token: the prefill part of a guard is released
            owner, worker_id, tokens = prefilling.pop(rng.randrange(len(prefilling)))
            one.acquire(worker_id, 0, -tokens)
            owner.acquire(worker_id, 0, -tokens)
        announcement = sender.announcer.take()
        for peer in replicas:
            if peer is not sender:
                peer.peers.apply(announcement, now)
        # Every replica, fed the same announcements, now chooses the same.
        probe = [*hashes[:-1], 5000 + i]  # another turn of the conversation
        choices = {
            r.policy.routing.best(
                [r.load(w) for w in workers], probe, len(probe) * BLOCK, BLOCK, now
            ).worker_id
            for r in replicas
        }
        assert len(choices) == 1
    for replica in replicas:
        assert [replica.load(w) for w in workers] == [one.load(w) for w in workers]


def _same(a: RoutingDecision, b: RoutingDecision) -> bool:
    return (a.worker_id, a.reason, a.matched_fraction) == (
        b.worker_id,
        b.reason,
        b.matched_fraction,
    )
