"""``/dashboard``: the page, its script and style (shipped in the package, no build step),
and ``/dashboard/data``, which the page fetches every second. All of it sits behind the
control plane's access rule (``router/access.py``): the figures name every worker's URL."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib.resources import files

import orjson
from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CONTENT_TYPES = {
    "index.html": "text/html",
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}


class DashboardRoutes:
    def __init__(self, data: Callable[[], dict[str, object]]) -> None:
        self._data = data
        static = files("kvserve.router.dashboard") / "static"
        self._files = {name: (static / name).read_bytes() for name in _CONTENT_TYPES}

    def routes(self, guard: Callable[[Handler], Handler]) -> list[web.RouteDef]:
        return [
            web.get("/dashboard", guard(self.page)),
            web.get("/dashboard/data", guard(self.data)),
            web.get("/dashboard/static/{name}", guard(self.asset)),
        ]

    async def page(self, _request: web.Request) -> web.Response:
        return self._file("index.html")

    async def asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name == "index.html" or name not in _CONTENT_TYPES:
            raise web.HTTPNotFound()
        return self._file(name)

    async def data(self, _request: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps(self._data()),
            content_type="application/json",
            headers={"Cache-Control": "no-store"},
        )

    def _file(self, name: str) -> web.Response:
        return web.Response(
            body=self._files[name],
            content_type=_CONTENT_TYPES[name],
            charset="utf-8",
            headers={"Cache-Control": "no-cache"},
        )
