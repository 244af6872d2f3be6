"""Every way out of a request with several choices (n, a list of prompts) releases every
choice's engine request and blocks: a client hanging up on a stream or on a collected
answer, and a list whose later prompt the engine refuses."""

from __future__ import annotations

import contextlib
import json

import httpx

from kvserve.router.local_fleet import ServerProcess
from tests.worker.test_disconnect import assert_every_block_free_or_cached
from tests.worker.worker_process import AUTH, api, served_model

LONG = {"max_tokens": 2000, "ignore_eos": True}


def test_hanging_up_on_a_stream_of_n_choices_aborts_them_all(worker: ServerProcess) -> None:
    body = {"model": served_model(worker), "prompt": list(range(300, 340)), "n": 4, **LONG}
    body["stream"] = True
    seen: set[int] = set()
    with api(worker) as client, client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith('data: {"id"'):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if seen == {0, 1, 2, 3}:  # every fork is running
                break
    assert_every_block_free_or_cached(worker)


def test_hanging_up_on_a_collected_prompt_list_aborts_every_prompt(worker: ServerProcess) -> None:
    body = {"model": served_model(worker), "prompt": [[5, 6, 7], [8, 9, 10]], "n": 2, **LONG}
    with contextlib.suppress(httpx.ReadTimeout):
        httpx.post(f"{worker.url}/v1/completions", json=body, headers=AUTH, timeout=0.5)
    assert_every_block_free_or_cached(worker)


def test_a_refused_prompt_in_a_list_leaves_nothing_running(worker: ServerProcess) -> None:
    with api(worker) as client:
        max_model_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
        body = {"model": served_model(worker), "prompt": [[5, 6], [3] * (max_model_len + 1)]}
        response = client.post("/v1/completions", json={**body, **LONG})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"
    assert_every_block_free_or_cached(worker)
