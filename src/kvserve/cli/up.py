"""``kvserve up``: a local fleet (workers + router on loopback), the README's main job.

With no ``--model`` it serves a tiny random-weight model, made once into the cache folder
(``$KVSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvserve``, else ``~/.cache/kvserve``), so it
runs on a fresh machine with no download.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Annotated, cast

import typer

from kvserve.cli.client_limit_options import (
    LIMITS,
    BodyTimeout,
    HeaderTimeout,
    MaxConnections,
    MaxHeaderBytes,
    client_limit_args,
    limits_from_flags,
)
from kvserve.core.routing.policies import POLICY_NAMES

TINY_MODEL_NAME = "tiny-llama"


def cache_dir() -> Path:
    if "KVSERVE_CACHE_DIR" in os.environ:
        return Path(os.environ["KVSERVE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvserve"


def tiny_model_dir() -> Path:
    """The cached tiny model, made on first use; written aside and renamed into place, so an
    interrupted first run never leaves a half-written model behind."""
    target = cache_dir() / "models" / TINY_MODEL_NAME
    if (target / "config.json").exists():
        return target
    from kvserve.engine.tiny_model import make_tiny_model

    typer.echo(f"making the tiny model (first run) in {target} ...")
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{TINY_MODEL_NAME}-", dir=target.parent))
    try:
        make_tiny_model(scratch, "llama", seed=0)
        scratch.rename(target)
    except OSError:
        if not (target / "config.json").exists():  # not merely beaten by a concurrent run
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _raise_keyboard_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


_WORKERS_PANEL = "Worker settings (every worker gets them; see kvserve worker --help)"


def _worker_option(help_text: str) -> typer.models.OptionInfo:
    return cast(
        typer.models.OptionInfo, typer.Option(help=help_text, rich_help_panel=_WORKERS_PANEL)
    )


def _worker_args(**settings: object) -> list[str]:
    """``kvserve worker`` flags for the settings given (None: the worker's default)."""
    args: list[str] = []
    for name, value in settings.items():
        if value is not None:
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def _auth_header(api_key: str | None) -> str:
    """The printed curl's key, so that it works as printed."""
    return "" if api_key is None else f" -H 'Authorization: Bearer {api_key}'"


def register(app: typer.Typer) -> None:
    @app.command()
    def up(
        workers: Annotated[int, typer.Option(min=1, help="Worker processes.")] = 2,
        model: Annotated[
            Path | None,
            typer.Option(help="Hugging Face model folder (default: the tiny model).", exists=True),
        ] = None,
        policy: Annotated[
            str,
            typer.Option(
                help=f"Router policy (in PD mode it selects the pair): {', '.join(POLICY_NAMES)}."
            ),
        ] = "cache_aware",
        host: Annotated[str, typer.Option(help="Router address.")] = "127.0.0.1",
        port: Annotated[int, typer.Option(help="Router port.")] = 8000,
        routers: Annotated[
            int,
            typer.Option(
                help="Router replicas, on ports PORT … PORT+R-1 (listed at start), each "
                "announcing its routing to the others (`kvserve router --peers`)."
            ),
        ] = 1,
        start_timeout: Annotated[float, typer.Option(help="Seconds to wait for health.")] = 180,
        prefill: Annotated[int, typer.Option(min=0, help="PD mode: prefill workers.")] = 0,
        decode: Annotated[
            int, typer.Option(min=0, help="PD mode: decode workers (replace --workers).")
        ] = 0,
        num_blocks: Annotated[
            int | None, _worker_option("KV blocks of each worker's device pool.")
        ] = None,
        host_cache_blocks: Annotated[
            int, _worker_option("KV blocks of each worker's host memory tier (0: none).")
        ] = 0,
        kv_storage: Annotated[
            str | None, _worker_option("KV storage tier the workers share (e.g. file:DIR).")
        ] = None,
        storage_write_policy: Annotated[
            str, _worker_option("Blocks written to storage: write_through | hit_count:K.")
        ] = "write_through",
        runner: Annotated[
            str, _worker_option("model | sim (cost-model step times, no weights).")
        ] = "model",
        sim_profile: Annotated[
            str, _worker_option("Cost profile of --runner sim: llama3-8b-h100 | tiny.")
        ] = "llama3-8b-h100",
        kv_transfer: Annotated[
            str, typer.Option(help="PD mode: how KV blocks travel: tcp (built-in) | mooncake.")
        ] = "tcp",
        kv_transfer_same_host: Annotated[
            str,
            typer.Option(
                help="PD mode, built-in tcp transfer, peers on one host: the KV bytes go "
                "through shared memory (shm, falls back to the socket when the peer cannot "
                "map it) or the socket."
            ),
        ] = "shm",
        api_key: Annotated[
            str | None,
            typer.Option(
                help="Require 'Authorization: Bearer KEY' from the router's clients; the "
                "workers require it too (--api-key) and the router sends it (--worker-api-key)."
            ),
        ] = None,
        header_timeout: HeaderTimeout = LIMITS.header_timeout_s,
        body_timeout: BodyTimeout = LIMITS.body_timeout_s,
        max_header_bytes: MaxHeaderBytes = LIMITS.max_header_bytes,
        max_connections: MaxConnections = LIMITS.max_connections,
    ) -> None:
        """Start workers and a router on this machine and keep them running: a worker that
        exits is restarted on its port (with backoff; crash loops are reported). Ctrl-C
        stops everything; so does the router's exit."""
        from kvserve.router.local_fleet import LocalFleet, StartError
        from kvserve.router.ports import port_taken

        if policy not in POLICY_NAMES:
            raise typer.BadParameter(
                f"choose one of {', '.join(POLICY_NAMES)}", param_hint="--policy"
            )
        # The router and every worker face clients alike: one set of limits for all.
        limit_args = client_limit_args(
            limits_from_flags(header_timeout, body_timeout, max_header_bytes, max_connections)
        )
        if routers < 1:
            raise typer.BadParameter("at least 1", param_hint="--routers")
        for router_port in range(port, port + routers):
            taken = port_taken(host, router_port)
            if taken is not None:
                typer.echo(
                    f"cannot serve on {host}:{router_port} ({taken}): another server holds it; "
                    "choose another with --port N",
                    err=True,
                )
                raise typer.Exit(1)
        model_dir = model.resolve() if model else tiny_model_dir()
        if prefill and not decode:
            raise typer.BadParameter(
                "prefill workers need --decode workers", param_hint="--prefill"
            )
        if kv_transfer not in ("tcp", "mooncake"):
            raise typer.BadParameter("use tcp or mooncake", param_hint="--kv-transfer")
        if kv_transfer_same_host not in ("shm", "socket"):
            raise typer.BadParameter("use shm or socket", param_hint="--kv-transfer-same-host")
        log_dir = Path(tempfile.mkdtemp(prefix="kvserve-up-"))
        fleet = LocalFleet(
            model_dir,
            workers=workers,
            policy=policy,
            host=host,
            port=port,
            log_dir=log_dir,
            prefill=prefill,
            decode=decode,
            worker_args=_worker_args(
                num_blocks=num_blocks,
                host_cache_blocks=host_cache_blocks,
                kv_storage=kv_storage,
                storage_write_policy=storage_write_policy,
                runner=runner,
                sim_profile=sim_profile,
                kv_transfer=kv_transfer,  # read by PD workers only
                kv_transfer_same_host=kv_transfer_same_host,
            )
            + limit_args,
            router_args=limit_args,
            api_key=api_key,
            routers=routers,
        )
        if decode:
            workers = prefill + decode
        for signum in (signal.SIGINT, signal.SIGTERM):  # SIGINT too: `&` in a script ignores it
            signal.signal(signum, _raise_keyboard_interrupt)
        typer.echo(f"model folder: {model_dir} (clients' tokenizer; served as {model_dir.name!r})")
        if model is None:
            typer.echo(
                "the tiny model has random weights: its replies are gibberish by design; "
                "pass --model FOLDER for a real model"
            )
        typer.echo(f"starting {workers} worker(s) (logs: {log_dir}) ...")
        try:
            fleet.start(start_timeout)
            for process in fleet.processes:  # before "is up": whoever waits for it may kill
                typer.echo(fleet.started_line(process))
            typer.echo(
                f"\nkvserve is up: {fleet.url}/v1  ({workers} workers, policy {policy})\n"
                + _replicas_line(fleet.router_urls)
                + f"dashboard: {fleet.url}/dashboard\n"
                f"try:\n  curl {fleet.url}/v1/chat/completions -H 'Content-Type: application/json'"
                f"{_auth_header(api_key)}"
                f' -d \'{{"model": "{model_dir.name}", "messages": [{{"role": "user",'
                f' "content": "Hello!"}}], "max_tokens": 16}}\'\n'
                "Ctrl-C to stop.",
            )
            router = fleet.supervise(lambda line: typer.echo(line, err=True))
            typer.echo(
                f"the router exited ({router.exit_reason()}); stopping the fleet:\n"
                f"{router.log_tail()}",
                err=True,
            )
            raise typer.Exit(1)
        except StartError as error:
            typer.echo(str(error), err=True)
            raise typer.Exit(1) from error
        except KeyboardInterrupt:
            typer.echo("stopping ...")
        finally:
            fleet.stop()
        typer.echo("stopped.")


def _replicas_line(urls: list[str]) -> str:
    """With replicas, where each one serves (clients spread requests over them)."""
    if len(urls) == 1:
        return ""
    listed = "  ".join(f"{url}/v1" for url in urls)
    return f"router replicas (peers of each other; spread requests over them): {listed}\n"
