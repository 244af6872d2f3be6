"""Runs one worker process: build the engine, serve the app, stop cleanly on SIGTERM.

uvicorn's own signal handling re-raises the signal after its graceful shutdown, which
makes the process die by SIGTERM (exit 143). A worker asked to stop that finished its
work should exit 0, so the signal handlers here only request the graceful shutdown:
stop accepting, let in-flight requests finish for ``shutdown_timeout_s``, cancel the
rest (which aborts them in the engine), stop the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator

import uvicorn

from kvserve.worker.app import build_app
from kvserve.worker.config import WorkerConfig
from kvserve.worker.http_guard import guarded_http_protocol

logger = logging.getLogger(__name__)


class _GracefulServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        signals = (signal.SIGINT, signal.SIGTERM)
        for sig in signals:
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)


def serve(config: WorkerConfig) -> None:
    """Blocks until the worker is told to stop."""
    from kvserve.core.cost_model import profile
    from kvserve.engine.cost_model_runner import CostModelRunner
    from kvserve.engine.device import release_openmp_threads, use_threads
    from kvserve.engine.kv_tiers.connector import kv_tiers
    from kvserve.engine.llm_engine import LLMEngine  # torch: import only when serving
    from kvserve.worker.pd_api import pd_connectors

    use_threads(config.threads)
    runner = None
    if config.runner == "sim":
        runner = CostModelRunner(config.model_dir, profile(config.sim_profile))
    connectors = [kv_tiers(config.kv_tiers)] if config.kv_tiers.enabled else []
    engine = LLMEngine(
        config.model_dir,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        kv_cache_memory=config.kv_cache_memory,
        max_num_batched_tokens=config.max_num_batched_tokens,
        device=config.device,
        dtype=config.dtype,
        model_name=config.model_name,
        runner=runner,
        connectors=[*connectors, *pd_connectors(config)],
    )
    release_openmp_threads()  # the engine steps on a thread of its own (EngineBridge)
    app = build_app(config, engine)
    server = _GracefulServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="uvloop",
            http=guarded_http_protocol(config.client_limits),
            lifespan="on",
            access_log=False,
            log_level="warning",
            # uvicorn types this as int but waits with asyncio, which takes a float.
            timeout_graceful_shutdown=config.shutdown_timeout_s,  # type: ignore[arg-type]
        )
    )
    logger.warning(
        "kvserve worker %s serving %s on http://%s:%d (role %s)",
        config.resolved_worker_id,
        engine.model_name,
        config.host,
        config.port,
        config.role,
    )
    server.run()  # on the loop that ``loop="uvloop"`` asks for
