"""Keys, limits and the worker API of a real router process."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvserve.router.ports import free_port
from tests.support.processes import ServerProcess, start_router

API = {"Authorization": "Bearer client-key"}
ADMIN = {"Authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def router(foreign_fleet: list[ServerProcess]) -> Iterator[ServerProcess]:
    options = ["--api-key", "client-key", "--admin-api-key", "admin-key"]
    options += ["--max-request-bytes", "4096", "--policy", "round_robin"]
    with start_router([foreign_fleet[0].url], free_port(), *options) as process:
        yield process


@pytest.fixture
def client(router: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=router.url, timeout=10.0) as http:
        yield http


def test_api_key_guards_the_openai_endpoints(client: httpx.Client) -> None:
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 401
    assert client.post("/v1/completions", json={"prompt": "x"}, headers=ADMIN).status_code == 401
    assert client.post("/v1/completions", json={"prompt": "x"}, headers=API).status_code == 200
    assert client.get("/v1/models", headers=API).json()["data"][0]["id"] == "foreign"
    assert client.get("/health").status_code == 200  # probes need no key


def test_admin_key_guards_the_worker_api(client: httpx.Client) -> None:
    assert client.get("/workers", headers=API).status_code == 401
    listed = client.get("/workers", headers=ADMIN).json()["workers"]
    assert [(w["id"], w["healthy"], w["circuit"]) for w in listed] == [("w0", True, "closed")]


def test_bad_requests_get_openai_errors(client: httpx.Client) -> None:
    too_big = client.post("/v1/completions", json={"prompt": "x" * 5000}, headers=API)
    assert too_big.status_code == 413
    assert too_big.json()["error"]["code"] == "request_too_large"
    not_json = client.post("/v1/completions", content=b"{nope", headers=API)
    assert (not_json.status_code, not_json.json()["error"]["code"]) == (400, "invalid_json")
    assert client.post("/v1/completions", json=[1], headers=API).status_code == 400


def test_unknown_urls_and_methods_get_openai_errors(
    router: ServerProcess, client: httpx.Client
) -> None:
    """aiohttp's own 404 and 405 are plain text, which SDKs report as an opaque failure.
    The connection opens with a hot route, so the requests after it reach the aiohttp app
    forwarded by the lean server; a handler's own 404 keeps its code."""
    assert client.post("/v1/completions", json={"prompt": "x"}, headers=API).status_code == 200
    for method, path in (("POST", "/v1/embeddings"), ("GET", "/nope")):
        sent = client.request(method, path, headers=API)
        assert sent.status_code == 404
        error = sent.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "unknown_url")
        assert f"{method} {path}" in error["message"]
    wrong = client.get("/v1/chat/completions", headers=API)
    assert (wrong.status_code, wrong.headers["Allow"]) == (405, "POST")
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    gone = client.delete("/workers/nobody", headers=ADMIN)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_worker"
    sdk = openai.OpenAI(base_url=f"{router.url}/v1", api_key="client-key", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="Invalid URL"):
        sdk.embeddings.create(model="foreign", input="x")


def test_a_body_over_the_bound_is_refused_by_the_middleware_before_any_handler(
    client: httpx.Client,
) -> None:
    """Without a key: the handler would answer 401, so a 413 can only be the body-size
    middleware's; streamed in chunks with no length given, the bound holds too."""
    expected = {
        "message": "request body too large",
        "type": "invalid_request_error",
        "param": None,
        "code": "request_too_large",
    }
    for sent in (
        client.post("/v1/completions", json={"prompt": "x" * 5000}),
        client.post("/v1/chat/completions", content=iter([b"{" + b" " * 1024] * 5)),
    ):
        assert sent.status_code == 413, sent.text
        assert sent.json() == {"error": expected}


def test_workers_added_and_removed_at_run_time(
    client: httpx.Client, foreign_fleet: list[ServerProcess]
) -> None:
    duplicate = client.post("/workers", json={"url": foreign_fleet[0].url}, headers=ADMIN)
    assert duplicate.status_code == 409
    assert client.post("/workers", json={"nope": 1}, headers=ADMIN).status_code == 400
    added = client.post("/workers", json={"url": foreign_fleet[1].url}, headers=ADMIN)
    assert added.status_code == 201 and added.json()["id"] == "w1"
    served = {
        client.post("/v1/completions", json={"prompt": "x"}, headers=API).json()[
            "system_fingerprint"
        ]
        for _ in range(4)
    }
    assert served == {"A", "B"}
    down = client.post("/workers", json={"url": f"http://127.0.0.1:{free_port()}"}, headers=ADMIN)
    assert down.status_code == 201 and down.json()["healthy"] is False
    for worker in ("w0", "w1", "w2"):
        assert client.delete(f"/workers/{worker}", headers=ADMIN).status_code == 200
    assert client.delete("/workers/w0", headers=ADMIN).status_code == 404
    no_worker = client.post("/v1/completions", json={"prompt": "x"}, headers=API)
    assert (no_worker.status_code, no_worker.json()["error"]["code"]) == (503, "no_worker")
    assert client.get("/health").status_code == 503


def non_loopback_address() -> str:
    """This machine's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            pytest.skip("this machine has no route off loopback")
        address = probe.getsockname()[0]
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback address")
    return address


@contextlib.contextmanager
def router_on_all_interfaces(
    worker_url: str, *options: str
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """A router listening on every interface, and a client from off loopback and one on it."""
    address = non_loopback_address()
    port = free_port()
    with (
        start_router([worker_url], port, "--host", "0.0.0.0", "--policy", "round_robin", *options),
        httpx.Client(base_url=f"http://{address}:{port}", timeout=10) as remote,
        httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as local,
    ):
        yield remote, local


def test_worker_api_without_a_key_answers_loopback_only(
    foreign_fleet: list[ServerProcess],
) -> None:
    with router_on_all_interfaces(foreign_fleet[0].url) as (remote, local):
        refused = [
            remote.get("/workers"),
            remote.post("/workers", json={"url": foreign_fleet[1].url}),
            remote.delete("/workers/w0"),
            remote.get("/dashboard"),
            remote.get("/dashboard/data"),
        ]
        assert [r.status_code for r in refused] == [403] * 5
        assert refused[0].json()["error"]["code"] == "admin_key_required"
        assert remote.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        foreign = local.get("/dashboard/data").json()["workers"][0]
        assert (foreign["id"], foreign["kv"]) == ("w0", None)  # no kvserve /metrics to read
        assert local.post("/workers", json={"url": foreign_fleet[1].url}).status_code == 201
        assert local.delete("/workers/w0").status_code == 200
        assert [w["id"] for w in local.get("/workers").json()["workers"]] == ["w1"]


def test_worker_api_with_a_key_answers_anywhere_with_the_key(
    foreign_fleet: list[ServerProcess],
) -> None:
    with router_on_all_interfaces(foreign_fleet[0].url, "--admin-api-key", "admin-key") as (
        remote,
        local,
    ):
        assert remote.get("/workers").status_code == 401
        assert local.get("/workers").status_code == 401  # a key, once set, binds loopback too
        added = remote.post("/workers", json={"url": foreign_fleet[1].url}, headers=ADMIN)
        assert added.status_code == 201
        assert remote.delete("/workers/w0", headers=ADMIN).status_code == 200
