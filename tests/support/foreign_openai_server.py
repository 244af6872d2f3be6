"""A small OpenAI-compatible server that is not kvserve, for testing the router against a
foreign backend and benchmarking it over a fast upstream.

Run: ``python tests/support/foreign_openai_server.py --port P [--name N] [--ttft S]``.

It "generates" ``x`` tokens and reports ``usage.prompt_tokens_details.cached_tokens`` from
its own prefix memory: the 64-character blocks of the prompt's longest prefix seen before,
at 4 characters per token. A request can steer it with a body field the router passes through::

    "x_test": {"status": 503, "delay": 1.5, "tokens": 40, "token_delay": 0.05}

``POST /admin/behavior {"status": 503}`` makes every later request fail the same way
(``{"status": 0}`` restores it); ``{"fail_after_first_token": true}`` makes non-streamed
answers fail as a kvserve worker's engine fault after its first-token headers does (200,
``x-kvserve-first-token: 1``, an error body); ``GET /stats`` counts the requests it served.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import orjson
from aiohttp import web

CHARS_PER_TOKEN = 4
BLOCK_CHARS = 64  # prefix memory granularity: 16 "tokens", like a KV block
MEMORY_BLOCKS = 100_000


def _prompt_text(body: dict[str, Any]) -> str:
    if isinstance(body.get("messages"), list):
        return "".join(f"{m.get('role')}:{m.get('content')}\n" for m in body["messages"])
    return str(body.get("prompt", ""))


class ForeignServer:
    def __init__(self, name: str, ttft_s: float, token_delay_s: float) -> None:
        self.name = name
        self.ttft_s = ttft_s
        self.token_delay_s = token_delay_s
        self.forced_status = 0
        self.fail_after_first_token = False
        self.known_prefixes: set[str] = set()
        self.served = 0
        self.in_flight = 0

    def cached_tokens(self, prompt: str) -> int:
        """Whole blocks of ``prompt`` seen before as a prefix; then remember this prompt's."""
        blocks = [prompt[:end] for end in range(BLOCK_CHARS, len(prompt) + 1, BLOCK_CHARS)]
        hits = 0
        while hits < len(blocks) and blocks[hits] in self.known_prefixes:
            hits += 1
        if len(self.known_prefixes) > MEMORY_BLOCKS:
            self.known_prefixes.clear()
        self.known_prefixes.update(blocks)
        return hits * BLOCK_CHARS // CHARS_PER_TOKEN

    async def generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        steer = body.get("x_test") or {}
        self.in_flight += 1
        try:
            await asyncio.sleep(float(steer.get("delay", self.ttft_s)))
            status = int(steer.get("status", self.forced_status))
            if status:
                error = {"message": f"{self.name} injected {status}", "type": "server_error"}
                return web.json_response({"error": error}, status=status)
            if self.fail_after_first_token and not body.get("stream"):
                error = {"message": f"{self.name} failed after its first token"}
                headers = {"x-kvserve-first-token": "1"}
                return web.json_response({"error": error}, headers=headers)
            prompt = _prompt_text(body)
            tokens = int(steer.get("tokens", body.get("max_tokens") or 4))
            usage = {
                "prompt_tokens": max(1, len(prompt) // CHARS_PER_TOKEN),
                "completion_tokens": tokens,
                "total_tokens": max(1, len(prompt) // CHARS_PER_TOKEN) + tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens(prompt)},
            }
            chat = request.path.endswith("/chat/completions")
            if body.get("stream"):
                delay = float(steer.get("token_delay", self.token_delay_s))
                return await self._stream(request, body, tokens, delay, usage, chat)
            self.served += 1
            text = " x" * tokens
            choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return web.json_response(
                self._envelope(body, chat, [choice], usage),
                dumps=lambda o: orjson.dumps(o).decode(),
            )
        finally:
            self.in_flight -= 1

    def _envelope(
        self, body: dict[str, Any], chat: bool, choices: list[Any], usage: Any
    ) -> dict[str, Any]:
        return {
            "id": f"{self.name}-{self.served}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", "foreign"),
            "system_fingerprint": self.name,
            "choices": choices,
            "usage": usage,
        }

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        tokens: int,
        delay: float,
        usage: dict[str, Any],
        chat: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(tokens):
            if index:
                await asyncio.sleep(delay)
            delta = {"delta": {"content": " x"}} if chat else {"text": " x"}
            chunk = self._envelope(body, chat, [{"index": 0, "finish_reason": None, **delta}], None)
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        final = self._envelope(body, chat, [], usage)
        await response.write(b"data: " + orjson.dumps(final) + b"\n\ndata: [DONE]\n\n")
        self.served += 1
        await response.write_eof()
        return response

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "foreign", "object": "model"}]})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"name": self.name, "served": self.served, "in_flight": self.in_flight}
        )

    async def behavior(self, request: web.Request) -> web.Response:
        behavior = await request.json()
        self.forced_status = int(behavior.get("status", 0))
        self.fail_after_first_token = bool(behavior.get("fail_after_first_token", False))
        return web.json_response({"status": self.forced_status})

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self.generate),
                web.post("/v1/chat/completions", self.generate),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/stats", self.stats),
                web.post("/admin/behavior", self.behavior),
            ]
        )
        return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default="foreign")
    parser.add_argument("--ttft", type=float, default=0.0, help="seconds before answering")
    parser.add_argument("--token-delay", type=float, default=0.0, help="seconds between tokens")
    args = parser.parse_args()
    server = ForeignServer(args.name, args.ttft, args.token_delay)
    web.run_app(
        server.app(),
        host="127.0.0.1",
        port=args.port,
        print=None,
        access_log=None,
        handler_cancellation=True,
    )


if __name__ == "__main__":
    main()
