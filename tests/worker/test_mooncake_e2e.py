"""Real worker processes on a real Mooncake Store (master + segment holder).

Worker A serves a prompt and stops; worker B, started afresh, loads A's prefix from the
store (the blocks live in the holder's segment, not in A). Then the master is SIGKILLed
while clients keep sending: every request is answered with the cold engine's text,
the faults are counted, and once the master is back the tier serves again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support import mooncake_master as mooncake_support
from tests.support.ledger_check import ledger_check
from tests.support.metrics_text import samples
from tests.worker.test_tiers_e2e import FIRST, PREFIX, SECOND, _cold_text, _complete, _wait_until
from tests.worker.worker_process import AUTH, start_worker

mooncake_store = mooncake_support.mooncake_store


def _stored_keys(store: mooncake_support.MooncakeStore) -> float:
    return samples(store.metrics_url)[("master_key_count", frozenset())]


def _faults(url: str) -> float:
    found = samples(f"{url}/metrics", AUTH)
    return sum(v for (name, _), v in found.items() if name == "kvserve_kv_tier_faults_total")


def test_worker_b_loads_what_a_stopped_worker_stored(
    tiny_model_dir: Path, mooncake_store: mooncake_support.MooncakeStore
) -> None:
    options = ("--kv-storage", mooncake_store.url)
    model = tiny_model_dir.name
    worker_a = start_worker(tiny_model_dir, *options)
    try:
        _complete(worker_a.url, model, FIRST)
        _wait_until(lambda: _stored_keys(mooncake_store) >= 12)
    finally:
        assert worker_a.stop(timeout_s=30) == 0, worker_a.log_tail()
    worker_b = start_worker(tiny_model_dir, *options)
    try:
        text, cached = _complete(worker_b.url, model, SECOND)
        assert text and (text, cached) == (_cold_text(tiny_model_dir, SECOND), 192)
        assert ledger_check(worker_b.url, AUTH) == {"ok": True}
        metrics = samples(f"{worker_b.url}/metrics", AUTH)
        assert metrics[("kvserve_kv_tier_storage_hit_tokens_total", frozenset())] == 192
    finally:
        assert worker_b.stop(timeout_s=30) == 0, worker_b.log_tail()


def test_master_killed_under_load_then_restarted(
    tiny_model_dir: Path, mooncake_store: mooncake_support.MooncakeStore
) -> None:
    prompts = [[*PREFIX[: 16 * (2 + i % 8)], 90 + i] for i in range(24)]
    expected = {tuple(p): _cold_text(tiny_model_dir, p) for p in {tuple(p) for p in prompts}}
    options = ("--kv-storage", f"{mooncake_store.url}?timeout=1&retry=0.2")
    options += ("--num-blocks", "24")  # evicts: the store is asked again and again
    model = tiny_model_dir.name
    worker = start_worker(tiny_model_dir, *options)
    try:
        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(_complete, worker.url, model, p) for p in prompts]
            _wait_until(lambda: sum(a.done() for a in answers) >= 4, timeout_s=120)
            mooncake_store.kill_master()
            for prompt, answer in zip(prompts, answers, strict=True):
                assert answer.result(timeout=120)[0] == expected[tuple(prompt)]
        assert _faults(worker.url) >= 1
        assert ledger_check(worker.url, AUTH) == {"ok": True}
        mooncake_store.start_master()  # back, empty
        fresh = [[(17 * i + j) % 900 + 5 for i in range(192)] + [7] for j in range(1, 60)]
        attempt = 0
        while _stored_keys(mooncake_store) < 12:  # writes land once the segment is back
            assert attempt < len(fresh) - 1, "the tier did not come back"
            _complete(worker.url, model, fresh[attempt])
            attempt += 1
        _complete(worker.url, model, fresh[attempt])  # evicts the stored one from the device
        text, cached = _complete(worker.url, model, fresh[attempt - 1])
        assert cached == 192 and text == _cold_text(tiny_model_dir, fresh[attempt - 1])
    finally:
        assert worker.stop(timeout_s=30) == 0, worker.log_tail()
