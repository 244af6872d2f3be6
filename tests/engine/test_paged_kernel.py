"""The C++ paged-attention kernel against attention computed naively (float64, explicit
softmax over each query's visible keys), on pools with shuffled block tables."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve.engine import paged_kernel


def test_kernel_builds():
    """CI has a C++ compiler (.ci/run installs g++ when missing): the kernel must build."""
    assert shutil.which("c++") is not None, "no C++ compiler (.ci/run installs g++)"
    assert paged_kernel.load()
    assert paged_kernel.usable(torch.device("cpu"))
    assert not paged_kernel.usable(torch.device("cuda"))


def test_cache_key_covers_every_included_file():
    """Every file a kernel source includes by quotes (its own headers) is hashed into the
    build folder's key, so a changed header can never load a stale build."""
    hashed = {path.resolve() for path in (*paged_kernel._SOURCES, *paged_kernel._HEADERS)}
    pending = list(paged_kernel._SOURCES)
    while pending:
        source = pending.pop()
        for name in re.findall(r'^#include "([^"]+)"', source.read_text(), re.MULTILINE):
            included = (source.parent / name).resolve()
            assert included in hashed, f"{source.name} includes {name}, not in the cache key"
            pending.append(included)
    assert {path.suffix for path in paged_kernel._CSRC.iterdir()} <= {".cpp", ".h"}
    assert {path.resolve() for path in paged_kernel._CSRC.iterdir()} == hashed


def test_cache_key_changes_with_a_header(tmp_path: Path, monkeypatch):
    copy = tmp_path / "convert.h"
    copy.write_text(paged_kernel._HEADERS[0].read_text())
    monkeypatch.setattr(paged_kernel, "_HEADERS", (copy,))
    before = paged_kernel.build_directory()
    copy.write_text(copy.read_text() + "\n// changed\n")
    assert paged_kernel.build_directory() != before


def cpu_has_amx() -> bool:
    return "amx_bf16" in Path("/proc/cpuinfo").read_text()


def test_bf16_vector_path_where_amx_would_run():
    """On a CPU with AMX the bf16 tests above run the tile products; the AVX512-BF16 path
    they replace still serves small tiles, other head sizes and CPUs without AMX, so the
    bf16 tests run again with it alone (``KVSERVE_PAGED_AMX=0``, read once per process).
    Elsewhere the tests above already ran that path."""
    if not cpu_has_amx():
        return
    selection = "bfloat16 and not vector_path"
    env = {**os.environ, "KVSERVE_PAGED_AMX": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selection],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout


def reference(q, pool, tables, sequences, window, scale):
    """Per sequence and query: softmax over the keys at positions it may see."""
    block_size, kv_heads = pool.shape[1], pool.shape[2] // 2
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for table, (start, num_new, first) in zip(tables.tolist(), sequences.tolist(), strict=True):
        length = start + num_new
        slots = [table[p // block_size] * block_size + p % block_size for p in range(length)]
        kv = pool.flatten(0, 1)[slots].double()  # [length, 2 * kv_heads, head_dim]
        for i in range(num_new):
            position = start + i
            low = max(0, position - window + 1) if window else 0
            for head in range(q.shape[1]):
                kv_head = head // group
                keys, values = (
                    kv[low : position + 1, kv_head],
                    kv[low : position + 1, kv_heads + kv_head],
                )
                weights = torch.softmax(keys @ q[first + i, head].double() * scale, dim=0)
                out[first + i, head] = weights @ values
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(8, 2, 4), (4, 4, 16), (6, 3, 32)])
# 40 and 48: head sizes off the GEMM's 32-column register blocks (a 16-column and a scalar tail);
# 36 also off the key tile's 8 x 8 transposition blocks (4 dimensions element-wise). 64 and
# 128: the decode written out for AVX-512 (128 with two of a KV head's query heads at a time).
@pytest.mark.parametrize("head_dim", [32, 36, 40, 48, 64, 128])
def test_kernel_matches_naive_attention(dtype, window, heads, kv_heads, block_size, head_dim):
    assert paged_kernel.load(), "the paged kernel did not build (see test_kernel_builds)"
    rng = random.Random(heads * block_size + window)
    num_blocks = 128
    pool = torch.randn(num_blocks, block_size, 2 * kv_heads, head_dim).to(dtype)
    # (start_pos, num_new): decodes, a prompt from 0, chunks after cached tokens, and a
    # chunk over three of the kernel's 64-token query tiles (the last one partial).
    shapes = [(0, 1), (9, 1), (40, 1), (0, 13), (21, 5), (3, 37), (50, 2), (5, 150)]
    blocks = rng.sample(range(num_blocks), num_blocks)
    tables, rows, first = [], [], 0
    width = max(-(-(s + n) // block_size) for s, n in shapes)
    for start, num_new in shapes:
        used = -(-(start + num_new) // block_size)
        table = [blocks.pop() for _ in range(used)] + [0] * (width - used)
        tables.append(table)
        rows.append((start, num_new, first))
        first += num_new
    tables_t, sequences = torch.tensor(tables), torch.tensor(rows)
    # Queries as a strided slice of a fused projection, as the model passes them.
    qkv = torch.randn(first, heads + 2 * kv_heads, head_dim).to(dtype)
    q, scale = qkv[:, :heads], head_dim**-0.5
    ours = torch.ops.kvserve_kernels.paged_attention(q, pool, tables_t, sequences, window, scale)
    assert ours.dtype == dtype and ours.shape == q.shape
    expected = reference(q, pool, tables_t, sequences, window, scale)
    # bf16: inputs and output are rounded to 8 bits of mantissa (relative step 2^-8).
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(ours.double(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(8, 2, 4), (6, 3, 16)])
@pytest.mark.parametrize("head_dim", [32, 64])  # 64: the written-out decode after a prefix
def test_kernel_shared_prefixes(dtype, window, heads, kv_heads, block_size, head_dim):
    """Decodes whose tables begin with the same blocks (read once for all of them, then each
    goes on over its own blocks): prefixes shared by some, partly by others, a decode on the
    last shared block, a prefill over the same blocks, and lone decodes."""
    assert paged_kernel.load(), "the paged kernel did not build (see test_kernel_builds)"
    rng = random.Random(heads * block_size + window + 1)
    num_blocks = 96
    pool = torch.randn(num_blocks, block_size, 2 * kv_heads, head_dim).to(dtype)
    free = rng.sample(range(num_blocks), num_blocks)
    prefix = [free.pop() for _ in range(4)]
    other = [free.pop() for _ in range(2)]
    # (start_pos, num_new, leading shared blocks, whose)
    shapes = [
        (4 * block_size + 3, 1, 4, prefix),
        (5 * block_size, 1, 4, prefix),
        (4 * block_size - 1, 1, 4, prefix),  # its token is the last slot of a shared block
        (2 * block_size + 1, 1, 2, prefix),  # shares only the first two blocks
        (3 * block_size, 1, 3, prefix),
        (4 * block_size, 6, 4, prefix),  # a prefill chunk after the cached prefix
        (2 * block_size + 2, 1, 2, other),
        (3 * block_size + 1, 1, 2, other),
        (block_size + 5, 1, 0, []),
    ]
    width = max(-(-(s + n) // block_size) for s, n, _, _ in shapes)
    tables, rows, first = [], [], 0
    for start, num_new, shared, whose in shapes:
        used = -(-(start + num_new) // block_size)
        table = whose[:shared] + [free.pop() for _ in range(used - shared)]
        tables.append(table + [0] * (width - used))
        rows.append((start, num_new, first))
        first += num_new
    tables_t, sequences = torch.tensor(tables), torch.tensor(rows)
    qkv = torch.randn(first, heads + 2 * kv_heads, head_dim).to(dtype)
    q, scale = qkv[:, :heads], head_dim**-0.5
    ours = torch.ops.kvserve_kernels.paged_attention(q, pool, tables_t, sequences, window, scale)
    expected = reference(q, pool, tables_t, sequences, window, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(ours.double(), expected, atol=tolerance, rtol=tolerance)


def unshare(pool, tables):
    """The same contexts with every table's blocks copied to blocks of its own: the kernel's
    plain per-sequence path over identical keys and values."""
    copies = [pool[b] for row in tables.tolist() for b in row]
    fresh = torch.cat([pool, torch.stack(copies)])
    width = tables.shape[1]
    new_tables = torch.arange(len(copies)).view(-1, width) + pool.shape[0]
    return fresh, new_tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("heads", "kv_heads", "block_size"), [(8, 2, 4), (16, 8, 16), (6, 6, 8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_prefill_cascade(dtype, heads, kv_heads, block_size, seed):
    """Prefill chunks (and decodes) resuming after a cached prefix whose leading blocks they
    share: the prefix is read once for all their new tokens, tiles of rows taken across the
    sequences, then each goes on over its own blocks. Random prefix lengths (whole and
    partial blocks), chunk lengths shorter and longer than a tile, several groups; checked
    against naive attention and against the plain path on the same data unshared."""
    assert paged_kernel.load(), "the paged kernel did not build (see test_kernel_builds)"
    rng = random.Random(seed * 1000 + heads * block_size)
    head_dim, num_blocks = 32, 400
    pool = torch.randn(num_blocks, block_size, 2 * kv_heads, head_dim).to(dtype)
    free = rng.sample(range(num_blocks), num_blocks)
    shapes = []  # (start_pos, num_new, leading shared blocks, whose)
    for _ in range(rng.randint(1, 3)):
        prefix_blocks = rng.randint(1, 12)
        prefix = [free.pop() for _ in range(prefix_blocks)]
        for _ in range(rng.randint(2, 6)):
            shared = rng.randint(1, prefix_blocks)
            # A start inside its last shared block, at its end or past it (a partial block).
            start = shared * block_size - 1 + rng.randint(0, block_size + 3)
            num_new = rng.choice([1, 1, rng.randint(2, 9), rng.randint(20, 300)])
            shapes.append((start, num_new, shared, prefix))
    shapes.append((rng.randint(0, 40), rng.randint(1, 50), 0, []))  # shares nothing
    rng.shuffle(shapes)
    width = max(-(-(s + n) // block_size) for s, n, _, _ in shapes)
    tables, rows, first = [], [], 0
    for start, num_new, shared, whose in shapes:
        used = -(-(start + num_new) // block_size)
        table = whose[:shared] + [free.pop() for _ in range(used - shared)]
        tables.append(table + [free[-1]] * (width - used))
        rows.append((start, num_new, first))
        first += num_new
    tables_t, sequences = torch.tensor(tables), torch.tensor(rows)
    qkv = torch.randn(first, heads + 2 * kv_heads, head_dim).to(dtype)
    q, scale = qkv[:, :heads], head_dim**-0.5
    ours = torch.ops.kvserve_kernels.paged_attention(q, pool, tables_t, sequences, 0, scale)
    plain_pool, plain_tables = unshare(pool, tables_t)
    plain = torch.ops.kvserve_kernels.paged_attention(
        q, plain_pool, plain_tables, sequences, 0, scale
    )
    expected = reference(q, pool, tables_t, sequences, 0, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(ours.double(), expected, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(ours.double(), plain.double(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
# (36, 4): key tiles whose transposition (8 x 8 blocks in registers) has a dimension tail
# and, in a chunk of fewer than 256 keys, a group of fewer than 8 keys, done element-wise.
@pytest.mark.parametrize(("head_dim", "block_size"), [(32, 16), (36, 4)])
def test_kernel_gives_the_same_output_on_two_threads(dtype, head_dim, block_size):
    """Work items are taken from a shared counter by whichever thread is free: every item
    is still computed whole by one thread, so two threads give one thread's output exactly
    (a long causal prompt, shared-prefix chunks and decodes, a lone decode)."""
    assert paged_kernel.load(), "the paged kernel did not build (see test_kernel_builds)"
    rng = random.Random(5)
    heads, kv_heads, num_blocks = 8, 4, 200 * 16 // block_size
    pool = torch.randn(num_blocks, block_size, 2 * kv_heads, head_dim).to(dtype)
    free = rng.sample(range(num_blocks), num_blocks)
    prefix = [free.pop() for _ in range(6)]
    shapes = [(0, 300, 0), (6 * block_size, 40, 6), (6 * block_size, 1, 6), (6 * block_size, 9, 6)]
    shapes += [(37, 1, 0)]
    width = max(-(-(s + n) // block_size) for s, n, _ in shapes)
    tables, rows, first = [], [], 0
    for start, num_new, shared in shapes:
        used = -(-(start + num_new) // block_size)
        table = prefix[:shared] + [free.pop() for _ in range(used - shared)]
        tables.append(table + [0] * (width - used))
        rows.append((start, num_new, first))
        first += num_new
    tables_t, sequences = torch.tensor(tables), torch.tensor(rows)
    q, scale = torch.randn(first, heads, head_dim).to(dtype), head_dim**-0.5
    outputs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            outputs.append(
                torch.ops.kvserve_kernels.paged_attention(q, pool, tables_t, sequences, 0, scale)
            )
        finally:
            torch.set_num_threads(1)  # the engine tests' setting (tests/engine/conftest.py)
    assert torch.equal(outputs[0], outputs[1])
