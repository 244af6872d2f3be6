"""``kvserve worker``: one engine behind the OpenAI HTTP API."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from kvserve.cli.client_limit_options import (
    LIMITS,
    BodyTimeout,
    HeaderTimeout,
    MaxConnections,
    MaxHeaderBytes,
    limits_from_flags,
)


def register(app: typer.Typer) -> None:
    @app.command()
    def worker(
        model: Annotated[Path, typer.Option(help="Hugging Face model folder.", exists=True)],
        host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Port to listen on.")] = 8001,
        role: Annotated[str, typer.Option(help="mixed | prefill | decode.")] = "mixed",
        block_size: Annotated[int, typer.Option(help="Tokens per KV block.")] = 16,
        num_blocks: Annotated[
            int | None, typer.Option(help="KV blocks in the device pool.")
        ] = None,
        kv_cache_memory: Annotated[
            int | None, typer.Option(help="Bytes for the KV pool (instead of --num-blocks).")
        ] = None,
        max_num_batched_tokens: Annotated[
            int, typer.Option(help="Token budget of one engine step.")
        ] = 512,
        api_key: Annotated[
            str | None,
            typer.Option(
                help="Require 'Authorization: Bearer KEY' on every route but /health "
                "(workers of one fleet share one key: PD peers send it to each other)."
            ),
        ] = None,
        metrics_without_key: Annotated[
            bool, typer.Option(help="With --api-key, leave /metrics open (for a scraper).")
        ] = False,
        worker_id: Annotated[
            str | None, typer.Option(help="Id in x-kvserve-worker (default host:port).")
        ] = None,
        served_model_name: Annotated[
            str | None, typer.Option(help="Model name clients use (default: folder name).")
        ] = None,
        shutdown_timeout: Annotated[
            float, typer.Option(help="Seconds in-flight requests get on SIGTERM.")
        ] = 30.0,
        device: Annotated[str | None, typer.Option(help="cpu | cuda (default: best).")] = None,
        dtype: Annotated[
            str,
            typer.Option(
                help="auto | float32 | bfloat16 | float16. auto: the checkpoint's on CUDA; "
                "on CPU bf16 where the CPU has native bf16 (AVX512-BF16, AMX), else float32."
            ),
        ] = "auto",
        threads: Annotated[
            int | None,
            typer.Option(help="Intra-op threads (default: every CPU this process may use)."),
        ] = None,
        runner: Annotated[
            str, typer.Option(help="model | sim (cost-model step times, no weights).")
        ] = "model",
        sim_profile: Annotated[
            str, typer.Option(help="Cost profile of --runner sim: llama3-8b-h100 | tiny.")
        ] = "llama3-8b-h100",
        pd_min_remote_tokens: Annotated[
            int, typer.Option(help="decode role: prefill here below this many uncached tokens.")
        ] = 64,
        pd_local_hit_fraction: Annotated[
            float, typer.Option(help="decode role: prefill here if this much is cached.")
        ] = 0.8,
        host_cache_blocks: Annotated[
            int, typer.Option(help="KV blocks of the host memory tier (0: none).")
        ] = 0,
        host_cache_memory: Annotated[
            int, typer.Option(help="Bytes of the host memory tier (instead of blocks).")
        ] = 0,
        kv_storage: Annotated[
            str | None,
            typer.Option(
                help="Shared KV storage tier: file:DIR | redis://host:port | "
                "mooncake://MASTER_HOST:PORT[?options]."
            ),
        ] = None,
        kv_storage_max_bytes: Annotated[
            int | None,
            typer.Option(help="Size bound of a file: storage directory (default: 8 GiB)."),
        ] = None,
        kv_storage_id: Annotated[
            str | None,
            typer.Option(
                help="The store's name for the router: workers giving the same one load "
                "each other's stored blocks (default: its location; give one for a "
                "directory shared between machines)."
            ),
        ] = None,
        kv_transfer: Annotated[
            str,
            typer.Option(help="PD roles: how KV blocks travel: tcp (built-in) | mooncake."),
        ] = "tcp",
        kv_transfer_same_host: Annotated[
            str,
            typer.Option(
                help="PD roles, built-in tcp transfer, peers on one host: the KV bytes go "
                "through shared memory (shm, falls back to the socket when the peer cannot "
                "map it) or the socket."
            ),
        ] = "shm",
        storage_write_policy: Annotated[
            str, typer.Option(help="Blocks written to storage: write_through | hit_count:K.")
        ] = "write_through",
        kv_events_publisher: Annotated[
            str | None,
            typer.Option(
                help="Also publish KV events on ZMQ in vLLM's format (tcp://*:PORT binds, "
                "tcp://host:PORT connects), for routers built for vLLM fleets."
            ),
        ] = None,
        kv_events_replay: Annotated[
            str | None,
            typer.Option(help="With --kv-events-publisher: its replay socket (tcp://*:PORT)."),
        ] = None,
        header_timeout: HeaderTimeout = LIMITS.header_timeout_s,
        body_timeout: BodyTimeout = LIMITS.body_timeout_s,
        max_header_bytes: MaxHeaderBytes = LIMITS.max_header_bytes,
        max_connections: MaxConnections = LIMITS.max_connections,
    ) -> None:
        """Serve one engine: OpenAI API, /health, /load, /metrics, KV events."""
        from kvserve.core.routing.pd_pair import PDConfig
        from kvserve.engine.kv_tier_config import KVTierConfig
        from kvserve.engine.storage.base import (
            DEFAULT_FILE_STORAGE_BYTES,
            is_storage_url,
            storage_usage,
        )
        from kvserve.worker.config import (
            WorkerConfig,
            is_kv_transfer,
            is_role,
            is_runner,
            is_same_host_transfer,
        )
        from kvserve.worker.server import serve

        dtypes = ("auto", "float32", "bfloat16", "float16")  # engine.device's (no torch here)
        if dtype not in dtypes:
            raise typer.BadParameter(f"choose one of {', '.join(dtypes)}", param_hint="--dtype")
        if threads is not None and threads < 1:
            raise typer.BadParameter("must be at least 1", param_hint="--threads")
        if not is_kv_transfer(kv_transfer):
            raise typer.BadParameter("use tcp or mooncake", param_hint="--kv-transfer")
        if not is_same_host_transfer(kv_transfer_same_host):
            raise typer.BadParameter("use shm or socket", param_hint="--kv-transfer-same-host")
        if not is_role(role):
            raise typer.BadParameter("role must be mixed, prefill or decode", param_hint="--role")
        from kvserve.core.cost_model import profile

        if not is_runner(runner):
            raise typer.BadParameter("runner must be model or sim", param_hint="--runner")
        try:
            profile(sim_profile)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="--sim-profile") from error
        if kv_events_replay is not None and kv_events_publisher is None:
            raise typer.BadParameter("needs --kv-events-publisher", param_hint="--kv-events-replay")
        if num_blocks is not None and kv_cache_memory is not None:
            raise typer.BadParameter("give --num-blocks or --kv-cache-memory, not both")
        try:
            kv_tiers = KVTierConfig(
                host_blocks=host_cache_blocks,
                host_memory=host_cache_memory,
                storage=kv_storage,
                storage_max_bytes=(
                    DEFAULT_FILE_STORAGE_BYTES
                    if kv_storage_max_bytes is None
                    else kv_storage_max_bytes
                ),
                write_policy=storage_write_policy,
                storage_id=kv_storage_id,
            )
        except ValueError as error:
            raise typer.BadParameter(str(error)) from error
        client_limits = limits_from_flags(
            header_timeout, body_timeout, max_header_bytes, max_connections
        )
        if kv_storage is not None and not is_storage_url(kv_storage):
            raise typer.BadParameter(f"use {storage_usage()}", param_hint="--kv-storage")
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
        serve(
            WorkerConfig(
                model_dir=model,
                host=host,
                port=port,
                role=role,
                block_size=block_size,
                num_blocks=num_blocks,
                kv_cache_memory=kv_cache_memory,
                max_num_batched_tokens=max_num_batched_tokens,
                api_key=api_key,
                metrics_without_key=metrics_without_key,
                worker_id=worker_id,
                model_name=served_model_name,
                shutdown_timeout_s=shutdown_timeout,
                device=device,
                dtype=dtype,
                threads=threads,
                runner=runner,
                sim_profile=sim_profile,
                pd=PDConfig(pd_min_remote_tokens, pd_local_hit_fraction),
                kv_tiers=kv_tiers,
                kv_transfer=kv_transfer,
                kv_transfer_same_host=kv_transfer_same_host,
                kv_events_publisher=kv_events_publisher,
                kv_events_replay=kv_events_replay,
                client_limits=client_limits,
            )
        )
