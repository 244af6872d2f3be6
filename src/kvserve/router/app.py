"""The router's HTTP app: OpenAI endpoints proxied to the fleet, control plane, health and
metrics. One shared client session pools connections to all workers."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import orjson
from aiohttp import web

from kvserve.core.routing.announcements import PeerView
from kvserve.core.routing.announcing_policy import AnnouncingPolicy
from kvserve.core.routing.kv_index import TIERS
from kvserve.core.routing.policies.kv_aware import KvAwarePolicy
from kvserve.core.routing.policy import Policy
from kvserve.core.routing.types import WorkerLoad
from kvserve.router.access import bearer_matches, control_plane_refusal, unauthorized
from kvserve.router.client_guard import client_limits_middleware, serve
from kvserve.router.config import RouterConfig
from kvserve.router.dashboard.data import dashboard_data
from kvserve.router.dashboard.routes import DashboardRoutes
from kvserve.router.dashboard.sampler import FleetSampler
from kvserve.router.errors import openai_error, unknown_routes_as_openai_errors
from kvserve.router.fleet_changes import Change, FleetChanges
from kvserve.router.health import HealthChecker
from kvserve.router.kept_loads import KeptPoolLoads
from kvserve.router.kv_event_source import KVSERVE_STREAM, parse_kv_event_source
from kvserve.router.kv_event_subscriber import KVEventSubscriber
from kvserve.router.lean_request import LeanRequest, RelayedAnswer
from kvserve.router.lean_server import serve_lean
from kvserve.router.load_guard import LoadTracker
from kvserve.router.metrics import RouterMetrics
from kvserve.router.pd_proxy import PDProxy
from kvserve.router.peers import ANNOUNCEMENTS_PATH, STREAM_PATH, PeerLink
from kvserve.router.process_group import ProcessMember, run_process_group
from kvserve.router.prompt_preparer import PromptPreparer
from kvserve.router.proxy import ROUTER_PROCESS_HEADER, Proxy
from kvserve.router.shared_loads import ConnectionTally, SharedLoadTracker
from kvserve.router.sibling_links import SiblingAnnouncements
from kvserve.router.sibling_metrics import SiblingMetrics
from kvserve.router.worker_registry import Worker, WorkerRegistry

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(
    payload: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        status=status, body=orjson.dumps(payload), content_type="application/json", headers=headers
    )


class Router:
    """Everything one router process holds; handlers are its methods."""

    def __init__(self, config: RouterConfig, member: ProcessMember | None = None) -> None:
        self.config = config
        self.member = member  # None: the only process
        self.metrics = RouterMetrics()
        self._admin_key = config.admin_api_key or config.api_key
        self.registry = WorkerRegistry(config.circuit_breaker)
        for url, source in zip(config.worker_urls, config.kv_event_sources(), strict=True):
            self.registry.add(url, kv_events=source)
        for pool, urls in (("prefill", config.prefill_urls), ("decode", config.decode_urls)):
            for url in urls:
                self.registry.add(url, pool)
        self.tracker: LoadTracker
        if member is None:
            self.tracker = LoadTracker(on_change=self._load_changed)
        else:  # worker i of the starting fleet keeps slot i of the shared table
            slots = {w.worker_id: i for i, w in enumerate(self.registry.all())}
            self.tracker = SharedLoadTracker(
                member.table, member.index, slots, on_change=self._load_changed
            )
        self.metrics.show_loads(self._loads_to_show)
        self.policy = config.make_policy(time.monotonic())
        # With peers or sibling processes (replicas on this port), the proxy's policy
        # announces each choice; the rest reads self.policy. (Not both: config refuses.)
        self.peers: PeerLink | None = None
        self.siblings: SiblingAnnouncements | None = None
        self._sibling_metrics: SiblingMetrics | None = None  # /metrics summed over siblings
        self._routing_policy: Policy = self.policy
        if config.peer_urls:
            self.peers = PeerLink(
                config.peer_urls,
                PeerView(self.policy.observe_peer_choice, self._peer_load_changed),
                self._peer_headers(),
                worker_url=lambda worker_id: getattr(self.registry.get(worker_id), "url", None),
                worker_id=self.registry.id_of,
            )
            self.tracker.peer_load = self.peers.view.load
            self._routing_policy = AnnouncingPolicy(self.policy, self.peers.announcer)
        if member is not None and member.count > 1:
            # No announced load is added: the shared table sums the siblings' guards.
            self.siblings = SiblingAnnouncements(
                member.links,
                member.index,
                PeerView(self.policy.observe_peer_choice, self._sibling_load_changed),
            )
            self._routing_policy = AnnouncingPolicy(self.policy, self.siblings.announcer)
            self._sibling_metrics = SiblingMetrics(member.links, self.metrics.registry)
        # Each pool's loads kept for the policy, where every change of a load is told
        # (not with sibling processes: theirs change the shared table silently; PD pairs
        # list theirs, each decode load with its polled headroom).
        keep = self.siblings is None and not config.pd_mode
        self.kept_loads = KeptPoolLoads(self.tracker.load) if keep else None
        several = member is not None and member.count > 1
        self._fleet = FleetChanges(
            self._apply_fleet_change,
            member.links if several and member is not None else None,
            0 if member is None else member.index,
        )
        # An added worker's first health check, until it ends: every process makes one,
        # and the process answering the POST waits for its own.
        self._first_probes: dict[str, asyncio.Task[bool]] = {}
        if self.peers is not None:  # one replica of several, each seeing only its own guards
            # Not for sibling processes: they read one exact table of loads and hear each
            # other within a loop iteration, so a salt would only move short prompts off
            # their holders, by which process took the connection (docs/internals.md).
            self.policy.as_replica(_replica_name(config, member), config.replica_rank())
        # Only kv_aware keeps workers ordered by load: the others read the table itself.
        self._siblings_follow_loads = self.siblings is not None and isinstance(
            self.policy, KvAwarePolicy
        )
        self._process_headers = {} if member is None else {ROUTER_PROCESS_HEADER: str(member.index)}
        self.preparer = (
            PromptPreparer(config.tokenizer) if self.policy.reads_prompt_blocks else None
        )
        self.subscriber: KVEventSubscriber | None = None
        self._session: aiohttp.ClientSession | None = None
        self._proxy: Proxy | None = None
        self._health: HealthChecker | None = None
        self._sampler: FleetSampler | None = None

    async def lifecycle(self, _app: web.Application) -> AsyncIterator[None]:
        """Open the pooled session, check every worker once, then keep checking."""
        connector = aiohttp.TCPConnector(limit=0)  # the fleet, not the pool, bounds load
        # The fleet's key goes on every request to a worker: proxied, health, load, KV
        # events, the dashboard's /metrics scrape.
        headers = self.config.worker_headers()
        if self.siblings is not None:
            metrics, fleet = self._sibling_metrics, self._fleet
            assert metrics is not None
            await self.siblings.start(
                lambda message, link: (
                    metrics.on_message(message, link) or fleet.on_message(message, link)
                )
            )
        async with aiohttp.ClientSession(connector=connector, headers=headers) as session:
            self._session = session
            proxy_args = (
                self.config,
                self.registry,
                self.tracker,
                self._routing_policy,
                self.metrics,
            )
            process = None if self.member is None else self.member.index
            if self.config.pd_mode:
                self._proxy = PDProxy(*proxy_args, session, preparer=self.preparer, process=process)
            else:
                self._proxy = Proxy(
                    *proxy_args,
                    session,
                    preparer=self.preparer,
                    process=process,
                    kept_loads=self.kept_loads,
                )
            self._health = HealthChecker(self.registry, self.config.health, self.metrics, session)
            await self._health.probe_all()
            summed = None if self._sibling_metrics is None else self._sibling_metrics.families
            self._sampler = FleetSampler(
                self.registry, self.metrics, session, summed_families=summed
            )
            tasks = [asyncio.create_task(self._health.run_forever())]
            tasks.append(asyncio.create_task(self._sampler.run_forever()))
            if self.policy.observes_kv_events:  # every worker's stream, of every pool
                self.subscriber = KVEventSubscriber(
                    self.policy,
                    self.registry,
                    session,
                    on_worker_info=self.preparer.learn_worker if self.preparer else None,
                    block_size=self.config.kv_block_size,
                )
                tasks.append(asyncio.create_task(self.subscriber.run_forever()))
            if self.peers is not None:
                tasks.append(asyncio.create_task(self.peers.run_forever(session)))
            if isinstance(self._proxy, PDProxy):  # decode headroom for the pair choice
                tasks.append(asyncio.create_task(self._proxy.poll_decode_loads_forever()))
            yield
            self._proxy.upstream.close()
            if self.member is not None:
                self.member.links.close()
            for task in tasks:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _loads_to_show(self) -> list[WorkerLoad]:
        """Every registered worker's held load, and that of removed ones still held."""
        ids = dict.fromkeys([w.worker_id for w in self.registry.all()])
        ids.update(dict.fromkeys(self.tracker.held_worker_ids()))
        return [self.tracker.own_load(worker_id) for worker_id in ids]

    def _load_changed(self, load: WorkerLoad) -> None:
        """Guards changed: the policy reorders its workers (the gauges read the tracker),
        and the peers are told; so are the siblings where their policy orders workers by
        load (kv_aware), as the notice to re-read the table (``_sibling_load_changed``)."""
        tracker, siblings = self.tracker, self.siblings
        follow = self._siblings_follow_loads
        if follow and siblings is not None and isinstance(tracker, SharedLoadTracker):
            requests, tokens = tracker.process_load(load.worker_id)
            siblings.announcer.load(load.worker_id, requests, tokens)
        if self.peers is not None:
            self.peers.announcer.load(
                load.worker_id, load.in_flight_requests, load.in_flight_prefill_tokens
            )
            load = self.tracker.load(load.worker_id)  # with the peers' announced load
        self._loads_read_changed(load)

    def _loads_read_changed(self, load: WorkerLoad) -> None:
        """What selections read of a worker's load changed to ``load``."""
        self.policy.observe_load(load)
        if self.kept_loads is not None:
            self.kept_loads.changed(load)

    def _sibling_load_changed(self, worker_id: str) -> None:
        """A sibling process's guards on ``worker_id`` changed: the policy re-reads the
        total from the shared table (exact; the sibling's announced values are not used)."""
        self.policy.observe_load(self.tracker.load(worker_id))

    def _peer_load_changed(self, worker_id: str) -> None:
        """A peer's guards changed: the policy sees the sum."""
        self._loads_read_changed(self.tracker.load(worker_id))

    def _peer_headers(self) -> dict[str, str]:
        """Peers run with this router's settings: its control-plane key is theirs."""
        key = self._admin_key
        return {} if key is None else {"Authorization": f"Bearer {key}"}

    def build_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_request_bytes,
            middlewares=[
                client_limits_middleware(self.config.client_limits),
                unknown_routes_as_openai_errors,
            ],
        )
        app.cleanup_ctx.append(self.lifecycle)
        app.add_routes(
            [
                web.post("/v1/completions", self.generate),
                web.post("/v1/chat/completions", self.generate),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
                web.get("/workers", self._control_plane(self.list_workers)),
                web.post("/workers", self._control_plane(self.add_worker)),
                web.delete("/workers/{worker_id}", self._control_plane(self.remove_worker)),
                web.get("/peers", self._control_plane(self.list_peers)),
                web.post(ANNOUNCEMENTS_PATH, self._control_plane(self.peer_announcements)),
                web.get(STREAM_PATH, self._control_plane(self.peer_stream)),
                *DashboardRoutes(self.dashboard_data).routes(self._control_plane),
            ]
        )
        return app

    def _control_plane(self, handler: Handler) -> Handler:
        """``handler`` behind the control plane's access rule (see ``router/access.py``)."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            refusal = control_plane_refusal(request, self._admin_key)
            return refusal if refusal is not None else await handler(request)

        return guarded

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """The OpenAI routes under aiohttp's server, which needs its own response type."""
        answer = await self.answer(request)
        return answer.web_response() if isinstance(answer, RelayedAnswer) else answer

    async def answer(
        self, request: web.Request | LeanRequest
    ) -> web.StreamResponse | RelayedAnswer:
        """The OpenAI routes (the lean server writes a relayed answer itself)."""
        if not bearer_matches(request, self.config.api_key):
            return unauthorized()
        assert self._proxy is not None
        return await self._proxy.handle(request)

    async def models(self, request: web.Request) -> web.Response:
        """The first healthy worker's model list (every worker serves the same models)."""
        if not bearer_matches(request, self.config.api_key):
            return unauthorized()
        assert self._session is not None
        pool = "decode" if self.config.pd_mode else "regular"
        for worker in self.registry.accepting(time.monotonic(), pool):
            try:
                async with self._session.get(worker.url + "/v1/models") as upstream:
                    return web.Response(
                        status=upstream.status,
                        body=await upstream.read(),
                        content_type="application/json",
                    )
            except aiohttp.ClientError:
                continue
        return openai_error(
            503, "no healthy worker is available", error_type="upstream_error", code="no_worker"
        )

    async def health(self, _request: web.Request) -> web.Response:
        healthy = sum(1 for w in self.registry.all() if w.healthy)
        return _json(
            {"status": "ok" if healthy else "no_healthy_worker", "healthy_workers": healthy},
            status=200 if healthy else 503,
        )

    async def prometheus(self, _request: web.Request) -> web.Response:
        if isinstance(self.policy, KvAwarePolicy):
            index = self.policy.routing.index
            for worker in self.registry.all():
                for tier in TIERS:
                    blocks = index.num_blocks(worker.worker_id, tier)
                    self.metrics.kv_index_blocks.labels(worker.worker_id, tier).set(blocks)
        if self._sibling_metrics is not None:
            body = await self._sibling_metrics.render()
        else:
            body = self.metrics.render()
        return web.Response(body=body, content_type="text/plain", headers=self._process_headers)

    def dashboard_data(self) -> dict[str, object]:
        assert self._sampler is not None
        return dashboard_data(
            self.registry, self.tracker, self.metrics, self._sampler, self.config.policy
        )

    async def list_peers(self, _request: web.Request) -> web.Response:
        """This replica's peers and what it heard from them (404 without --peers)."""
        if self.peers is None:
            return _no_peers()
        return _json(self.peers.describe())

    async def peer_announcements(self, request: web.Request) -> web.Response:
        """A peer replica's announcements (router/peers.py), applied before answering."""
        if self.peers is None:
            return _no_peers()
        try:
            applied = self.peers.receive(await request.read())
        except ValueError as error:
            return openai_error(
                400, str(error), error_type="invalid_request_error", code="bad_announcement"
            )
        return _json({"applied": applied})

    async def peer_stream(self, request: web.Request) -> web.StreamResponse:
        """A peer replica's stream of announcements (router/peers.py): each message is
        applied as it comes; a malformed one closes the stream (the peer reconnects and
        starts over with a full announcement)."""
        if self.peers is None:
            return _no_peers()
        stream = web.WebSocketResponse(max_msg_size=self.config.max_request_bytes)
        await stream.prepare(request)
        async for message in stream:
            if message.type not in (aiohttp.WSMsgType.BINARY, aiohttp.WSMsgType.TEXT):
                break
            data = message.data if isinstance(message.data, bytes) else message.data.encode()
            try:
                self.peers.receive(data)
            except ValueError as error:
                log.warning("a peer sent a malformed announcement (%s): stream closed", error)
                await stream.close(code=aiohttp.WSCloseCode.UNSUPPORTED_DATA)
        return stream

    def _describe(self, worker: Worker) -> dict[str, object]:
        load = self.tracker.own_load(worker.worker_id)
        described: dict[str, object] = {
            **worker.describe(),
            "in_flight_requests": load.in_flight_requests,
            "in_flight_prefill_tokens": load.in_flight_prefill_tokens,
        }
        if self.peers is not None:  # what the other replicas announced they hold there
            peer_requests, peer_tokens = self.peers.view.load(worker.worker_id)
            described["peers_in_flight_requests"] = peer_requests
            described["peers_in_flight_prefill_tokens"] = peer_tokens
        if isinstance(self.tracker, SharedLoadTracker):  # whose requests the total sums
            described["in_flight_requests_by_process"] = self.tracker.by_process(worker.worker_id)
        follower = self.subscriber.zmq_followers.get(worker.worker_id) if self.subscriber else None
        if follower is not None:  # how its ZMQ stream has gone: gaps, replays, index drops
            described["kv_events_stream"] = {
                "next_seq": follower.next_seq,
                "gaps": follower.gaps,
                "replays": follower.replays,
                "drops": follower.drops,
                "unnamed_blocks": follower.blocks.unnamed_blocks,
            }
        return described

    async def list_workers(self, _request: web.Request) -> web.Response:
        workers = [self._describe(w) for w in self.registry.all()]
        return _json({"workers": workers}, headers=self._process_headers)

    async def add_worker(self, request: web.Request) -> web.Response:
        """Register a worker (in every process) and check it once, so the answer says
        whether it takes traffic."""
        try:
            body = orjson.loads(await request.read())
            url, pool = str(body["url"]), str(body.get("pool", "regular"))
            kv_events = str(body.get("kv_events", KVSERVE_STREAM))
            parse_kv_event_source(kv_events)
        except (orjson.JSONDecodeError, TypeError, KeyError, ValueError) as error:
            detail = f": {error}" if isinstance(error, ValueError) else ""
            return openai_error(
                400,
                'expected {"url": "http://host:port", "kv_events": "kvserve" | '
                f'"tcp://host:port[?replay=tcp://host:port]"}}{detail}',
                error_type="invalid_request_error",
                code="bad_worker",
            )
        change = {"op": "add", "url": url, "pool": pool, "kv_events": kv_events}
        result = await self._fleet.change(change)
        worker = None if "status" in result else self.registry.get(result["worker_id"])
        if worker is None:  # refused (or removed again before this answer)
            return _fleet_refusal(result)
        probe = self._first_probes.get(worker.worker_id)
        if probe is not None:  # else it has ended already
            await asyncio.shield(probe)
        return _json(self._describe(worker), status=201)

    async def remove_worker(self, request: web.Request) -> web.Response:
        """Stop routing to a worker (in every process); its in-flight requests finish and
        release their load."""
        worker_id = request.match_info["worker_id"]
        worker = self.registry.get(worker_id)
        result = await self._fleet.change({"op": "remove", "worker_id": worker_id})
        if "status" in result:
            return _fleet_refusal(result)
        return _json(worker.describe() if worker is not None else result)

    def _apply_fleet_change(self, change: Change) -> Change:
        """Apply one worker addition or removal to this process's state (every process
        applies the same changes in the same order: see ``fleet_changes.py``)."""
        if change["op"] == "add":
            return self._add(change["url"], change["pool"], change["kv_events"])
        return self._remove(change["worker_id"])

    def _add(self, url: str, pool: str, kv_events: str) -> Change:
        if isinstance(self.tracker, SharedLoadTracker) and not self.tracker.has_room():
            return _refused(
                409, "fleet_full", "the router's processes have no load slot left for another"
                " worker (each worker ever added takes one): restart it with the fleet"
            )  # fmt: skip
        try:
            worker = self.registry.add(url, pool, parse_kv_event_source(kv_events))
        except ValueError as error:
            return _refused(409, "bad_worker", str(error))
        if isinstance(self.tracker, SharedLoadTracker):
            self.tracker.add_worker(worker.worker_id)
        if self._health is not None:  # checked now, not at the next interval
            probe = asyncio.get_running_loop().create_task(self._health.probe(worker))
            self._first_probes[worker.worker_id] = probe
            probe.add_done_callback(lambda _: self._first_probes.pop(worker.worker_id, None))
        log.info("added worker %s at %s", worker.worker_id, worker.url)
        return {"worker_id": worker.worker_id}

    def _remove(self, worker_id: str) -> Change:
        try:
            worker = self.registry.remove(worker_id)
        except KeyError:
            return _refused(404, "unknown_worker", "no such worker")
        self.policy.forget_worker(worker.worker_id)
        if self.subscriber is not None:
            self.subscriber.reconcile()  # stop following it now, not at the next tick
        if isinstance(self._proxy, PDProxy):
            self._proxy.forget_worker(worker.worker_id)
        with contextlib.suppress(KeyError):
            self.metrics.worker_healthy.remove(worker.worker_id)
        for tier in TIERS:
            with contextlib.suppress(KeyError):
                self.metrics.kv_index_blocks.remove(worker.worker_id, tier)
        log.info("removed worker %s at %s", worker.worker_id, worker.url)
        return {"worker_id": worker.worker_id}


def _no_peers() -> web.Response:
    return openai_error(
        404, "this router has no --peers", error_type="invalid_request_error", code="no_peers"
    )


def _fast_event_loop() -> asyncio.AbstractEventLoop | None:
    """uvloop where installed (it comes with ``uvicorn[standard]`` on Linux and macOS): it
    roughly halves the router's per-request overhead. Otherwise asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop()


def _collect_garbage_less_often() -> None:
    """Each proxied request allocates a few hundred short-lived objects (aiohttp's request
    and response on both sides), so at the default threshold of 700 the cyclic collector
    runs every few requests and, as the cache-aware tree grows, spends its time walking
    the long-lived nodes. Freezing the startup objects and collecting the young generation
    every 50,000 allocations cuts the router's CPU per request by 10-15% (see
    ``## Router`` in docs/benchmarks.md); the garbage between collections stays small."""
    gc.freeze()
    gc.set_threshold(50_000, 10, 10)


def run_router(config: RouterConfig) -> None:
    """Serve until interrupted: in this process, or in ``config.processes`` children (see
    :mod:`kvserve.router.process_group`). A client disconnect cancels its handler, which
    releases everything the request holds (see :mod:`kvserve.router.proxy`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if config.processes == 1:
        _serve(config, None)
        return
    status = run_process_group(config, lambda member: _serve(config, member))
    if status:
        raise SystemExit(status)


def _serve(config: RouterConfig, member: ProcessMember | None) -> None:
    if member is not None:  # whose line it is, in the group's one log
        prefix = f"%(asctime)s %(levelname)s [router {member.index}] %(message)s"
        for handler in logging.getLogger().handlers:
            handler.setFormatter(logging.Formatter(prefix))
    _collect_garbage_less_often()
    loop = _fast_event_loop() or asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    router = Router(config, member)
    app = router.build_app()
    reuse_port = member is not None
    tally = ConnectionTally() if member is None else ConnectionTally(member.table, member.index)
    if config.http_server == "lean":
        loop.run_until_complete(
            serve_lean(app, router.answer, config, reuse_port=reuse_port, tally=tally)
        )
        return
    loop.run_until_complete(
        serve(
            app, config.host, config.port, config.client_limits, reuse_port=reuse_port, tally=tally
        )
    )


def _replica_name(config: RouterConfig, member: ProcessMember | None) -> str:
    """What tells this replica from its peers and siblings, and stays the same across
    its restarts (its salt, see ``Policy.as_replica``): where it listens, and which of
    the processes sharing that port it is."""
    process = 0 if member is None else member.index
    return f"{config.host}:{config.port}/{process}"


def _refused(status: int, code: str, message: str) -> Change:
    return {"status": status, "code": code, "error": message}


def _fleet_refusal(result: Change) -> web.Response:
    return openai_error(
        int(result.get("status", 409)),
        str(result.get("error", "the worker was removed again")),
        error_type="invalid_request_error",
        code=str(result.get("code", "bad_worker")),
    )
