"""``kvserve up`` end to end: a fresh cache, real kvserve workers behind the router, the
cache-aware policy finding the worker that holds a prefix, PD mode answering as mixed mode
does (and pairing with kv_aware from both pools' KV events), and a clean stop on Ctrl-C or
SIGTERM that leaves no process behind; the client limits given to ``up`` reach the router
and every worker."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvserve.router.config import POLICY_NAMES
from kvserve.router.local_fleet import KVSERVE_COMMAND, ServerProcess
from tests.support import client_limit_checks as checks
from tests.support.client_limit_checks import MAX_HEADER_BYTES
from tests.support.metrics_text import samples
from tests.support.shm_maps import segments_mapped_by_a_peer
from tests.support.up_fleet import start_up

SYSTEM = "You are a careful assistant. Always answer in exactly one short sentence. " * 3


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvserve-cache")


def stop_and_check(up: ServerProcess, signum: int, worker_urls: list[str]) -> None:
    up.process.send_signal(signum)
    assert up.process.wait(timeout=40) == 0, up.log_tail()
    assert up.log_tail().endswith("stopped.")
    for url in [up.url, *worker_urls]:
        with pytest.raises(httpx.TransportError):  # refused, or reset by a dying server
            httpx.get(url + "/health", timeout=2.0)


@pytest.fixture(scope="module")
def fleet(cache_dir: Path) -> Iterator[tuple[ServerProcess, httpx.Client]]:
    up = start_up(cache_dir, "--workers", "2", "--policy", "cache_aware")
    with httpx.Client(base_url=up.url, timeout=60.0) as client:
        yield up, client
    up.stop()


def _chat(
    client: httpx.Client, system: str, question: str, salt: str | None = None
) -> httpx.Response:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 4}
    if salt is not None:
        body["cache_salt"] = salt
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response


def test_first_run_makes_the_tiny_model_in_the_cache(fleet, cache_dir: Path) -> None:
    up, _ = fleet
    assert (cache_dir / "models" / "tiny-llama" / "config.json").exists()
    assert "making the tiny model" in up.log_tail()
    assert "curl http://127.0.0.1:" in up.log_tail()
    log = up.log_tail(60)
    assert f"dashboard: {up.url}/dashboard" in log
    assert f"model folder: {cache_dir / 'models' / 'tiny-llama'}" in log  # clients' tokenizer
    assert "served as 'tiny-llama'" in log and "random weights" in log


def test_a_taken_port_is_named_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run(
            [*KVSERVE_COMMAND, "up", "--port", str(port)],
            env={**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1, lines
    assert f"127.0.0.1:{port}" in lines[0] and "--port" in lines[0]
    assert not (tmp_path / "models").exists()  # nothing was made or started


def test_help_lists_the_policies() -> None:
    result = subprocess.run(
        [*KVSERVE_COMMAND, "up", "--help"], capture_output=True, text=True, timeout=60
    )
    for policy in POLICY_NAMES:
        assert policy in result.stdout


def test_cache_aware_sends_a_shared_prefix_to_the_worker_holding_it(fleet) -> None:
    _, client = fleet
    first = _chat(client, SYSTEM, "What is the capital of France?")
    second = _chat(client, SYSTEM, "Name a primary colour.")
    assert second.headers["x-kvserve-worker"] == first.headers["x-kvserve-worker"]
    assert "reason=cache_hit" in second.headers["x-kvserve-decision"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    unrelated = {
        _chat(client, f"{i} is my favourite number.", "Why?").headers["x-kvserve-worker"]
        for i in range(4)
    }
    assert unrelated == {"w0", "w1"}


def test_cache_aware_keeps_salted_prompts_with_their_salt(fleet) -> None:
    """Salts A, A, B over one system prompt: the second A follows the first and is
    served from its blocks; B matches nothing (not even the A worker's text)."""
    _, client = fleet
    system = "Salted system prompt: answer as a lighthouse keeper would. " * 3
    first = _chat(client, system, "Which light is brightest?", "A")
    again = _chat(client, system, "Which ship is slowest?", "A")
    assert again.headers["x-kvserve-worker"] == first.headers["x-kvserve-worker"]
    assert "reason=cache_hit" in again.headers["x-kvserve-decision"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    other = _chat(client, system, "Which storm was longest?", "B")
    assert "reason=cache_hit" not in other.headers["x-kvserve-decision"]
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_body_sent_without_a_json_content_type_still_works(fleet) -> None:
    _, client = fleet
    response = client.post(
        "/v1/completions",
        content=b'{"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},  # what `curl -d` sends
    )
    assert response.status_code == 200, response.text


def greedy_completion(client: httpx.Client, prompt: str) -> httpx.Response:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    response = client.post("/v1/completions", json={**body, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response


def shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith("kvserve-pd-")}


@pytest.mark.parametrize(
    ("kv_transfer", "same_host"), [("tcp", "shm"), ("tcp", "socket"), ("mooncake", "shm")]
)
def test_pd_mode_answers_as_mixed_names_both_workers_and_sigterm_stops_it(
    fleet, cache_dir: Path, kv_transfer: str, same_host: str
) -> None:
    _, mixed = fleet
    before = shm_segments()
    pd = start_up(cache_dir, "--prefill", "1", "--decode", "1", "--kv-transfer", kv_transfer,
                  "--kv-transfer-same-host", same_host)  # fmt: skip
    try:
        assert "making the tiny model" not in pd.log_tail()  # the cached model is reused
        listed = httpx.get(pd.url + "/workers", timeout=10).json()["workers"]
        pools = {worker["id"]: worker["pool"] for worker in listed}
        assert sorted(pools.values()) == ["decode", "prefill"]
        prefill_url = next(w["url"] for w in listed if w["pool"] == "prefill")
        info = httpx.get(prefill_url + "/pd/info", timeout=10).json()
        assert info.get("transfer", "tcp") == kv_transfer
        prompt = " ".join(f"word{i}" for i in range(120))  # long enough to prefill remotely
        with httpx.Client(base_url=pd.url, timeout=60.0) as client:
            answer = greedy_completion(client, prompt)
        headers = answer.headers
        assert headers["x-kvserve-pd"] == "remote", headers
        data = httpx.get(pd.url + "/dashboard/data", timeout=10).json()
        assert data["policy"] == "cache_aware"
        latest = data["decisions"]["recent"][0]
        assert latest["worker"] == headers["x-kvserve-worker"]
        assert latest["prefill_worker"] == headers["x-kvserve-prefill-worker"]
        assert pools[headers["x-kvserve-worker"]] == "decode"
        assert pools[headers["x-kvserve-prefill-worker"]] == "prefill"
        assert "policy=cache_aware" in headers["x-kvserve-decision"]
        expected = greedy_completion(mixed, prompt).json()["choices"][0]["text"]
        assert answer.json()["choices"][0]["text"] == expected
        # The prefill worker mapped the decode worker's segment, if the transfer used one.
        used_shm = bool(segments_mapped_by_a_peer() & (shm_segments() - before))
        assert used_shm == (kv_transfer == "tcp" and same_host == "shm")
        stop_and_check(pd, signal.SIGTERM, [worker["url"] for worker in listed])
        assert shm_segments() - before == set()  # unlinked when the worker stopped
    finally:
        pd.stop()


def device_blocks_in_router_index(router_url: str) -> dict[str, float]:
    return {
        dict(labels)["worker"]: value
        for (name, labels), value in samples(router_url + "/metrics").items()
        if name == "kvserve_router_kv_index_blocks" and ("tier", "device") in labels
    }


def decision_field(response: httpx.Response, field: str) -> str:
    return response.headers["x-kvserve-decision"].split(f"{field}=")[1].split(";")[0]


def test_pd_mode_with_kv_aware_pairs_from_both_pools_kv_events(cache_dir: Path) -> None:
    pd = start_up(cache_dir, "--prefill", "1", "--decode", "2", "--policy", "kv_aware")
    try:
        listed = httpx.get(pd.url + "/workers", timeout=10).json()["workers"]
        pools = {worker["id"]: worker["pool"] for worker in listed}
        prompt = " ".join(f"river{i}" for i in range(120))
        with httpx.Client(base_url=pd.url, timeout=60.0) as client:
            first = greedy_completion(client, prompt)
            assert decision_field(first, "policy") == "kv_aware"
            assert decision_field(first, "reason") == "remote", first.headers
            prefill, decode = decision_field(first, "prefill"), first.headers["x-kvserve-worker"]
            assert (pools[prefill], pools[decode]) == ("prefill", "decode")
            assert first.headers["x-kvserve-pd"] == "remote"
            # Both workers report the prompt's blocks: the prefill worker computed them,
            # the decode worker installed them. The router's index learns both.
            deadline = time.monotonic() + 20
            while True:
                held = device_blocks_in_router_index(pd.url)
                if held.get(prefill, 0) > 0 and held.get(decode, 0) > 0:
                    break
                assert time.monotonic() < deadline, held
                time.sleep(0.05)
            # The decode worker holding the prompt prefills its repeat locally.
            again = greedy_completion(client, prompt)
            assert again.headers["x-kvserve-worker"] == decode
            assert decision_field(again, "reason") in {"local_cached", "local_short"}
            assert float(decision_field(again, "matched")) > 0.5
            assert decision_field(again, "prefill") == "local"
            # A long continuation goes to the prefill worker, which holds its prefix.
            longer = greedy_completion(client, prompt + " " + prompt.replace("river", "lake"))
            assert decision_field(longer, "reason") == "remote"
            assert decision_field(longer, "prefill") == prefill
            assert float(decision_field(longer, "matched")) > 0.2
    finally:
        pd.stop()


def test_ctrl_c_stops_everything(fleet) -> None:
    up, client = fleet
    worker_urls = [w["url"] for w in client.get("/workers").json()["workers"]]
    stop_and_check(up, signal.SIGINT, worker_urls)


def test_kv_aware_fleet_hashes_prompts_then_sigkill_of_up_stops_its_children(
    cache_dir: Path,
) -> None:
    worker_settings = ("--num-blocks", "384", "--host-cache-blocks", "64")
    up = start_up(cache_dir, "--workers", "1", "--policy", "kv_aware", *worker_settings)
    try:
        (worker,) = httpx.get(up.url + "/workers").json()["workers"]
        exposed = samples(worker["url"] + "/metrics")  # up passed its worker settings on
        assert exposed[("kvserve_kv_blocks_total", frozenset())] == 384
        assert exposed[("kvserve_kv_tier_host_capacity_blocks", frozenset())] == 64
        with httpx.Client(base_url=up.url, timeout=60.0) as client:
            decisions = [
                _chat(client, SYSTEM, question).headers["x-kvserve-decision"]
                for question in ("What is the capital of France?", "Name a primary colour.")
            ]
        assert "reason=cache_hit" in decisions[1], decisions  # it has the model's tokenizer
        worker_urls = [w["url"] for w in httpx.get(up.url + "/workers").json()["workers"]]
        up.process.kill()  # SIGKILL to `kvserve up` alone: no chance to stop its children
        up.process.wait(timeout=10)
        deadline = time.monotonic() + 10
        for url in [up.url, *worker_urls]:
            while True:
                try:
                    httpx.get(url + "/health", timeout=1.0)
                except httpx.TransportError:  # refused, or reset while the server dies
                    break
                assert time.monotonic() < deadline, f"{url} outlived kvserve up"
                time.sleep(0.1)
    finally:
        up.stop()


def test_api_key_guards_the_router_and_the_workers_and_the_router_sends_it(
    cache_dir: Path,
) -> None:
    key = "up-key"
    up = start_up(cache_dir, "--api-key", key, "--workers", "1", "--runner", "sim")
    try:
        assert f"-H 'Authorization: Bearer {key}'" in up.log_tail()  # the curl works as printed
        auth = {"Authorization": f"Bearer {key}"}
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 2}
        assert httpx.post(up.url + "/v1/completions", json=body, timeout=60).status_code == 401
        served = httpx.post(up.url + "/v1/completions", json=body, headers=auth, timeout=60)
        assert served.status_code == 200, served.text
        listed = httpx.get(up.url + "/workers", headers=auth, timeout=10).json()["workers"]
        worker_url = listed[0]["url"]
        assert httpx.get(worker_url + "/load", timeout=10).status_code == 401
        assert httpx.get(worker_url + "/load", headers=auth, timeout=10).status_code == 200
    finally:
        up.stop()


def test_client_limits_given_to_up_reach_the_router_and_the_workers(cache_dir: Path) -> None:
    up = start_up(
        cache_dir, "--workers", "1", "--runner", "sim", "--max-header-bytes", str(MAX_HEADER_BYTES)
    )
    try:
        worker_url = httpx.get(up.url + "/workers", timeout=10).json()["workers"][0]["url"]
        checks.oversized_headers_get_431(up.url, "/health", {})
        checks.oversized_headers_get_431(worker_url, "/health", {})
    finally:
        up.stop()


def test_up_refuses_client_limits_that_make_no_sense(tmp_path: Path) -> None:
    done = subprocess.run(
        [*KVSERVE_COMMAND, "up", "--max-header-bytes", "10", "--port", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path)},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "max header bytes must be at least 1024" in done.stderr
    assert not (tmp_path / "models").exists()  # refused before anything was made
