"""The cache-aware rule (SGLang semantics, ties by load, rotation on a miss) and its index."""

from __future__ import annotations

import pytest

from kvserve.core.routing.cache_aware import CacheAwareConfig, CacheAwareIndex, select_worker
from kvserve.core.routing.tie_breaking import Rotation
from kvserve.core.routing.types import WorkerLoad

CONFIG = CacheAwareConfig()


def _fleet(*requests: int) -> list[WorkerLoad]:
    return [WorkerLoad(f"w{i}", n) for i, n in enumerate(requests)]


def test_deepest_match_wins_above_threshold() -> None:
    choice = select_worker(_fleet(0, 3, 0), {"w1": 80, "w2": 10}, 100, CONFIG, Rotation())
    assert (choice.worker.worker_id, choice.reason, choice.matched_fraction) == (
        "w1",
        "cache_hit",
        0.8,
    )


def test_ties_among_deepest_holders_go_to_the_least_loaded() -> None:
    fleet = [
        WorkerLoad("w0", 5),
        WorkerLoad("w1", 2),
        WorkerLoad("w2", 2, 900),
        WorkerLoad("w3", 0),
    ]
    matched = {"w0": 90, "w1": 90, "w2": 90, "w3": 10}
    choice = select_worker(fleet, matched, 100, CONFIG, Rotation())
    assert choice.worker.worker_id == "w1"  # fewest requests, then fewest prefill tokens


def test_match_at_or_below_threshold_is_a_miss_to_the_least_loaded() -> None:
    choice = select_worker(_fleet(4, 1, 2), {"w0": 30}, 100, CONFIG, Rotation())
    assert (choice.worker.worker_id, choice.reason) == ("w1", "cache_miss")
    assert choice.matched_fraction == 0.0


def test_misses_on_an_idle_fleet_rotate_instead_of_piling_on_one_worker() -> None:
    rotation = Rotation()
    picks = [
        select_worker(_fleet(0, 0, 0), {}, 50, CONFIG, rotation).worker.worker_id for _ in range(6)
    ]
    assert picks == ["w0", "w1", "w2", "w0", "w1", "w2"]


@pytest.mark.parametrize(
    ("loads", "imbalanced"),
    [((100, 10), True), ((74, 10), False), ((200, 150), False), ((65, 0), True)],
)
def test_imbalance_overrides_the_cache(loads: tuple[int, int], imbalanced: bool) -> None:
    choice = select_worker(_fleet(*loads), {"w0": 100}, 100, CONFIG, Rotation())
    assert choice.reason == ("load_imbalance" if imbalanced else "cache_hit")
    assert choice.worker.worker_id == ("w1" if imbalanced else "w0")


def test_empty_prompt_is_a_miss() -> None:
    assert select_worker(_fleet(0, 0), {}, 0, CONFIG, Rotation()).reason == "cache_miss"


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        CacheAwareConfig(cache_threshold=1.5)
    with pytest.raises(ValueError):
        CacheAwareConfig(balance_rel_threshold=0.5)


def test_index_keeps_one_tree_per_pool_and_model() -> None:
    index = CacheAwareIndex(CONFIG, now=0.0)
    index.tree("regular", "m1").insert("hello world", "w0", now=0.0)
    assert index.tree("regular", "m2").match("hello world") == {}
    assert index.tree("prefill", "m1").match("hello world") == {}
    assert index.tree("regular", "m1").match("hello world") == {"w0": 11}


def test_index_trims_to_one_global_budget_on_the_interval() -> None:
    config = CacheAwareConfig(max_tree_size=100, eviction_interval_s=10.0)
    index = CacheAwareIndex(config, now=0.0)
    for i in range(15):  # 150 chars in two trees: over budget, under the 2x ceiling
        index.tree("regular", f"m{i % 2}").insert(chr(65 + i) + "x" * 9, "w0", now=float(i))
    assert index.maybe_trim(now=5.0) == 0
    assert index.size_chars == 150
    assert index.maybe_trim(now=10.0) > 0
    assert index.size_chars <= 100
    assert index.tree("regular", "m0").match("Oxxxxxxxxx") == {"w0": 10}  # recent survive
    assert index.tree("regular", "m0").match("Axxxxxxxxx") == {}  # oldest go first


def test_index_trims_at_once_at_twice_the_budget() -> None:
    index = CacheAwareIndex(CacheAwareConfig(max_tree_size=50), now=0.0)
    for i in range(10):
        index.tree("regular", "m").insert(f"{i}" + "y" * 9, "w0", now=float(i))
    assert index.maybe_trim(now=1.0) > 0
    assert index.size_chars <= 50


def test_forget_worker_clears_it_from_every_tree() -> None:
    index = CacheAwareIndex(CONFIG, now=0.0)
    for model in ("a", "b"):
        index.tree("regular", model).insert("prompt", "w0", now=0.0)
    index.forget_worker("w0")
    assert index.size_chars == 0
