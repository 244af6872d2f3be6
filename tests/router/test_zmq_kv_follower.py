"""The router's ZMQ follower against a real publisher in vLLM's wire format (driven by the
test): blocks are renamed into kvserve's chain hash of their tokens, removals and clears
follow the engine's names, a sequence gap is filled from the replay socket (or drops the
index when there is none), and a publisher that restarts is dropped and relearned."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq.asyncio

from kvserve.core.hashing import block_hashes, make_namespace
from kvserve.core.routing.kv_aware import KvAwareConfig
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.router.kv_event_source import ZmqEventSource
from kvserve.router.ports import free_port
from kvserve.router.zmq_kv_follower import ZmqKVFollower
from tests.support.vllm_publisher import VllmFormatPublisher, block_removed, block_stored

BS = 32
MODEL = "tiny-qwen"
WORKER = "w0"


def ours(tokens: list[int], namespace: bytes | None = None) -> list[int]:
    return block_hashes(tokens, BS, namespace or make_namespace(MODEL))


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class Setup:
    def __init__(self, replay: bool) -> None:
        self.port = free_port()
        self.replay_port = free_port() if replay else None
        self.publisher = VllmFormatPublisher(self.port, self.replay_port)
        self.policy = KvAwarePolicy(KvAwareConfig())
        self.context = zmq.asyncio.Context()
        source = ZmqEventSource(
            f"tcp://127.0.0.1:{self.port}",
            f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None,
        )
        self.block_sizes: list[int] = []
        self.follower = ZmqKVFollower(
            WORKER, source, self.policy, self.context, MODEL, on_block_size=self.block_sizes.append
        )
        self.task: asyncio.Task[None] | None = None

    def holds(self, hashes: list[int]) -> list[bool]:
        return [self.policy.routing.index.holds(WORKER, h) for h in hashes]

    def held(self) -> int:
        return self.policy.routing.index.num_blocks(WORKER)

    async def start(self) -> None:
        self.task = asyncio.create_task(self.follower.run())
        await asyncio.to_thread(self.publisher.wait_for_subscriber)
        if self.replay_port is not None:  # on connecting, it asks what it missed
            await until(lambda: self.publisher.replays_served >= 1)

    async def stop(self) -> None:
        assert self.task is not None
        self.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self.task
        self.context.term()
        self.publisher.close()


@pytest.fixture
async def plain() -> AsyncIterator[Setup]:
    setup = Setup(replay=False)
    await setup.start()
    yield setup
    await setup.stop()


@pytest.fixture
async def replaying() -> AsyncIterator[Setup]:
    setup = Setup(replay=True)
    await setup.start()
    yield setup
    await setup.stop()


A = list(range(100, 100 + 2 * BS))  # two blocks
B = list(range(500, 500 + BS))


async def test_stored_blocks_are_keyed_by_our_chain_of_their_tokens(plain: Setup) -> None:
    pub = plain.publisher
    # The engine's names are arbitrary (any hash algorithm, any seed): 11, 12.
    pub.publish([block_stored([11], None, A[:BS], BS)])
    pub.publish([block_stored([12], 11, A[BS:], BS)])
    await until(lambda: plain.held() == 2)
    assert plain.holds(ours(A)) == [True, True]
    assert plain.block_sizes == [BS]
    assert not plain.policy.routing.index.holds(WORKER, 11)

    pub.publish([block_removed([12])])
    await until(lambda: plain.held() == 1)
    assert plain.holds(ours(A)) == [True, False]

    pub.publish([block_stored([13], None, B, BS)])
    pub.publish([{"type": "AllBlocksCleared"}])
    await until(lambda: plain.follower.next_seq == 5)
    assert plain.held() == 0 and len(plain.follower.blocks) == 0


async def test_cache_salt_and_lora_name_join_the_namespace(plain: Setup) -> None:
    pub = plain.publisher
    # vLLM lists, per block, the LoRA name then the cache salt (block 0 only).
    pub.publish(
        [block_stored([21], None, B, BS, lora_name="adapter", extra_keys=[["adapter", "tenant-A"]])]
    )
    pub.publish([block_stored([22], None, B, BS, extra_keys=[["tenant-B"]])])
    pub.publish([block_stored([23], 22, A[:BS], BS)])  # inherits tenant-B's namespace
    await until(lambda: plain.held() == 3)
    salted_a = make_namespace("adapter", None, "tenant-A")
    salted_b = make_namespace(MODEL, None, "tenant-B")
    assert plain.holds(ours(B, salted_a)) == [True]
    assert plain.holds(ours(B + A[:BS], salted_b)) == [True, True]
    assert plain.holds(ours(B)) == [False]  # unsalted: nobody holds it


async def test_a_gap_is_filled_from_the_replay_socket(replaying: Setup) -> None:
    pub = replaying.publisher
    pub.publish([block_stored([11], None, A[:BS], BS)])
    pub.publish([block_stored([12], 11, A[BS:], BS)], send=False)  # lost on the way
    pub.publish([block_stored([13], None, B, BS)])
    await until(lambda: replaying.follower.next_seq == 3)
    assert replaying.follower.gaps == 1 and replaying.follower.replays >= 1
    assert replaying.follower.drops == 0
    assert replaying.holds(ours(A) + ours(B)) == [True, True, True]
    pub.publish([block_removed([12])])  # the replayed block's engine name is known
    await until(lambda: replaying.holds(ours(A)) == [True, False])


async def test_without_replay_a_gap_drops_the_index_and_rebuilds_from_new_events(
    plain: Setup,
) -> None:
    pub = plain.publisher
    pub.publish([block_stored([11], None, A[:BS], BS)])
    pub.publish([block_stored([12], 11, A[BS:], BS)], send=False)
    pub.publish([block_stored([13], None, B, BS)])
    pub.publish([block_stored([14], 12, B, BS)])  # its parent was lost: cannot be named
    await until(lambda: plain.follower.next_seq == 4)
    assert plain.follower.gaps == 1 and plain.follower.drops == 1
    assert plain.holds(ours(A) + ours(B)) == [False, False, True]
    assert plain.held() == 1 and plain.follower.blocks.unnamed_blocks == 1


async def test_a_restarted_publisher_is_dropped_and_relearned(replaying: Setup) -> None:
    pub = replaying.publisher
    pub.publish([block_stored([11], None, A[:BS], BS)])
    await until(lambda: replaying.held() == 1)
    pub.close()  # the engine dies: its cache with it
    await until(lambda: replaying.follower.drops == 1 and replaying.held() == 0)

    # A new engine on the same ports, numbering from 0 again.
    pub = replaying.publisher = VllmFormatPublisher(replaying.port, replaying.replay_port)
    await asyncio.to_thread(pub.wait_for_subscriber)
    pub.publish([block_stored([31], None, B, BS)])
    await until(lambda: replaying.holds(ours(B)) == [True])
    assert replaying.holds(ours(A[:BS])) == [False]
    assert replaying.follower.next_seq == 1


async def test_a_malformed_message_drops_the_index_and_following_goes_on(plain: Setup) -> None:
    pub = plain.publisher
    pub.publish([block_stored([11], None, A[:BS], BS)])
    await until(lambda: plain.held() == 1)
    pub.send_raw([b"kv", (1).to_bytes(8, "big"), b"\xc1not msgpack"])
    await until(lambda: plain.follower.bad_messages == 1)
    assert plain.held() == 0
    pub.next_seq = 2
    pub.publish([block_stored([13], None, B, BS)])
    await until(lambda: plain.holds(ours(B)) == [True])


async def test_a_sequence_that_starts_again_is_a_restart(plain: Setup) -> None:
    """Behind a relay the subscriber sees no disconnect: the numbering tells."""
    pub = plain.publisher
    pub.publish([block_stored([11], None, A[:BS], BS)])
    pub.publish([block_stored([12], 11, A[BS:], BS)])
    await until(lambda: plain.held() == 2)
    pub.next_seq = 0  # a new engine behind the same endpoint
    pub.publish([block_stored([11], None, B, BS)])  # engine names may repeat
    await until(lambda: plain.follower.drops == 1)
    await until(lambda: plain.holds(ours(B)) == [True])
    assert plain.holds(ours(A)) == [False, False] and plain.follower.next_seq == 1
