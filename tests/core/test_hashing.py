"""Golden values pin the hash: any change to it breaks router/worker agreement."""

import struct

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvserve.core.hashing import HashChain, block_hashes, make_namespace, root_hash, salted

NS = make_namespace("tiny-llama")


def reference_chain(tokens, block_size, namespace):
    """Independent restatement of the byte layout documented in hashing.py."""
    prev = xxhash.xxh3_64_intdigest(namespace)
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        payload = struct.pack("<Q", prev) + namespace + struct.pack(f"<{block_size}I", *block)
        prev = xxhash.xxh3_64_intdigest(payload)
        out.append(prev)
    return out


def test_namespace_layout():
    assert NS == b"kvserve/1\x00tiny-llama\x00\x00"
    assert make_namespace("m", "l", "s") == b"kvserve/1\x00m\x00l\x00s"


def test_a_salt_is_the_namespace_made_with_it_and_no_salt_changes_nothing():
    assert salted(NS, None) is NS and salted(NS, "") is NS
    assert salted(NS, "tenant-a") == make_namespace("tiny-llama", None, "tenant-a")
    tokens = list(range(32))
    a, b = (block_hashes(tokens, 16, salted(NS, s)) for s in ("tenant-a", "tenant-b"))
    assert not {*a} & {*b} and not {*a} & {*block_hashes(tokens, 16, NS)}


def test_golden_values():
    assert root_hash(NS) == 3646094641782165614
    assert block_hashes(list(range(40)), 16, NS) == [9989489581703554121, 12600012861147840857]
    assert block_hashes(list(range(8)), 4, b"") == [7356754698806402580, 4998129498157500886]
    salted = make_namespace("tiny-llama", "lora-a", "salt")
    assert block_hashes(list(range(40)), 16, salted) == [25802053065893030, 9498106958534084315]


def test_only_full_blocks_are_hashed():
    assert block_hashes(list(range(15)), 16, NS) == []
    assert len(block_hashes(list(range(47)), 16, NS)) == 2


def test_namespace_changes_every_hash():
    a = block_hashes(list(range(64)), 16, make_namespace("m", cache_salt="a"))
    b = block_hashes(list(range(64)), 16, make_namespace("m", cache_salt="b"))
    assert not set(a) & set(b)


def test_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2, 3], 0, NS)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.integers(1, 20),
)
def test_matches_reference_layout(tokens, block_size):
    assert block_hashes(tokens, block_size, NS) == reference_chain(tokens, block_size, NS)


@given(tokens=st.lists(st.integers(0, 50_000), max_size=120), cut=st.integers(0, 120))
def test_incremental_chain_equals_full_chain(tokens, cut):
    chain = HashChain(NS, 8)
    chain.extend_to(tokens[:cut])
    assert chain.extend_to(tokens) == block_hashes(tokens, 8, NS)
    if chain.hashes:
        assert chain.parent_of(0) == root_hash(NS)


@given(prefix=st.lists(st.integers(0, 1000), min_size=32, max_size=64))
def test_shared_prefix_shares_hashes(prefix):
    a = block_hashes(prefix + [1] * 16, 16, NS)
    b = block_hashes(prefix + [2] * 16, 16, NS)
    shared = len(prefix) // 16
    assert a[:shared] == b[:shared]
    assert a[len(a) - 1] != b[len(b) - 1]
