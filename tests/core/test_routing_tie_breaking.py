"""``least_loaded``: fewest requests, then fewest prefill tokens, ties rotating in order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvserve.core.routing.tie_breaking import Rotation, least_loaded
from kvserve.core.routing.types import WorkerLoad, sort_key_of

_LOADS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=6)


@given(_LOADS, st.integers(0, 10))
def test_least_loaded_is_the_rotation_over_the_lightest_in_order(
    loads: list[tuple[int, int]], turn: int
) -> None:
    workers = [WorkerLoad(f"w{i}", r, t) for i, (r, t) in enumerate(loads)]
    rotation, expected_rotation = Rotation(), Rotation()
    for _ in range(turn):  # both at the same turn
        rotation.pick(workers)
        expected_rotation.pick(workers)
    lightest = min(w.sort_key for w in workers)
    expected = expected_rotation.pick([w for w in workers if w.sort_key == lightest])
    assert least_loaded(workers, rotation) is expected
    assert least_loaded(workers, rotation) is expected_rotation.pick(
        [w for w in workers if w.sort_key == lightest]
    )


def test_sort_key_of_is_the_sort_key() -> None:
    load = WorkerLoad("w0", 3, 700)
    assert sort_key_of(load) == load.sort_key == (3, 700)
