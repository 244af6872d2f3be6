"""Run memory is reused once given back, never lent twice, and kept only up to a bound."""

from __future__ import annotations

import torch

from kvserve.worker.run_buffers import RunBuffers

MB = 1 << 20


def test_memory_given_back_lands_the_next_run_that_fits() -> None:
    buffers = RunBuffers(keep_bytes=64 * MB)
    run = buffers.take(3 * MB)
    assert run.dtype == torch.uint8 and run.nbytes == 3 * MB
    blocks = run.view(torch.float32).reshape(3, -1)  # the view an install sees
    buffers.give_back(blocks)
    assert buffers.free_bytes == 4 * MB  # capacity: the next power of two
    again = buffers.take(4 * MB)
    assert again.data_ptr() == run.data_ptr() and buffers.free_bytes == 0
    assert buffers.take(1 * MB).data_ptr() != run.data_ptr()  # lent out: not lent again


def test_the_smallest_buffer_that_holds_the_run_is_taken() -> None:
    buffers = RunBuffers(keep_bytes=64 * MB)
    big, small = buffers.take(16 * MB), buffers.take(2 * MB)
    buffers.give_back(big)
    buffers.give_back(small)
    assert buffers.take(1 * MB).data_ptr() == small.data_ptr()
    assert buffers.take(3 * MB).data_ptr() == big.data_ptr()


def test_a_second_give_back_and_memory_past_the_bound_are_not_kept() -> None:
    buffers = RunBuffers(keep_bytes=8 * MB)
    first, second, third = (buffers.take(4 * MB) for _ in range(3))
    buffers.give_back(first)
    buffers.give_back(first)
    assert buffers.free_bytes == 4 * MB
    buffers.give_back(second)
    buffers.give_back(third)  # would keep 12 MiB
    assert buffers.free_bytes == 8 * MB
    taken = {buffers.take(4 * MB).data_ptr() for _ in range(2)}
    assert taken == {first.data_ptr(), second.data_ptr()}
