"""``/dashboard`` and its data sit behind the control plane's rule: with an admin key, the
key as a bearer token or as an HTTP Basic password (what a browser can send), and a Basic
challenge otherwise so that a browser asks for it. (Loopback-only without a key: see
tests/router/test_control_plane_e2e.py.)"""

from __future__ import annotations

import httpx
import pytest

from tests.dashboard.conftest import ADMIN_KEY, Fleet

PATHS = ("/dashboard", "/dashboard/data", "/dashboard/static/dashboard.js")


@pytest.mark.parametrize("path", PATHS)
def test_the_dashboard_needs_the_admin_key(fleet: Fleet, path: str) -> None:
    url = fleet.router.url + path
    refused = httpx.get(url)
    assert refused.status_code == 401
    assert refused.headers["WWW-Authenticate"].startswith("Basic ")
    assert httpx.get(url, auth=("anyone", "wrong")).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Basic !!!"}).status_code == 401
    assert httpx.get(url, auth=("anyone", ADMIN_KEY)).status_code == 200
    assert httpx.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200


def test_only_the_dashboards_own_files_are_served(fleet: Fleet) -> None:
    auth = ("operator", ADMIN_KEY)
    page = httpx.get(fleet.router.url + "/dashboard", auth=auth)
    assert page.headers["Content-Type"].startswith("text/html")
    assert 'src="dashboard/static/dashboard.js"' in page.text
    style = httpx.get(fleet.router.url + "/dashboard/static/dashboard.css", auth=auth)
    assert style.headers["Content-Type"].startswith("text/css")
    for name in ("index.html", "missing.js", "..%2F__init__.py"):
        asset = httpx.get(f"{fleet.router.url}/dashboard/static/{name}", auth=auth)
        assert asset.status_code == 404


def test_the_data_names_every_worker_and_its_kv(fleet: Fleet) -> None:
    data = httpx.get(fleet.router.url + "/dashboard/data", auth=("operator", ADMIN_KEY)).json()
    assert data["policy"] == "cache_aware"
    assert [w["id"] for w in data["workers"]] == ["w0", "w1"]
    assert [w["url"] for w in data["workers"]] == [w.url for w in fleet.workers]
    for worker in data["workers"]:
        assert worker["kv"]["blocks"]["total"] == 256
        assert worker["kv"]["host_tier"]["capacity"] == 64
        assert set(data["history"]["workers"][worker["id"]]) >= {"ttft_mean_s", "window"}
    assert data["fleet"]["workers_reporting_kv"] == 2
    assert data["fleet"]["kv"]["blocks"]["total"] == 512
