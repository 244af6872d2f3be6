"""The ``--workload SPEC`` syntax: ``NAME[:PATH][,KEY=VALUE...]``.

Each source is a plain function with typed keyword parameters; the spec's keys are
checked and converted against its signature, so a new parameter needs no parser change
and a typo is an error that lists the accepted keys.
"""

from __future__ import annotations

import inspect
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvserve.bench.workloads import azure, few_shot, mooncake, mt_bench, multi_turn, shared_prefix
from kvserve.bench.workloads.base import Workload

DATA_DIR_ENV = "KVSERVE_DATA_DIR"
# In a source checkout the traces sit beside the repository, in shared/data.
_CHECKOUT_DATA_DIR = Path(__file__).resolve().parents[4].parent / "shared" / "data"


@dataclass(frozen=True)
class Source:
    build: Callable[..., Workload]
    summary: str
    default_path: str | None = None  # relative to the data dir; None: no file, or PATH needed
    takes_path: bool = True


SOURCES: dict[str, Source] = {
    "mooncake": Source(mooncake.load, "Mooncake trace at PATH"),
    "mooncake-conv": Source(
        mooncake.load, "Mooncake conversation trace", "mooncake/conversation_trace.jsonl"
    ),
    "mooncake-synth": Source(
        mooncake.load, "Mooncake synthetic trace", "mooncake/synthetic_trace.jsonl"
    ),
    "azure": Source(azure.load, "Azure LLM inference trace CSV at PATH"),
    "azure-code": Source(
        azure.load, "Azure 2023 code trace", "azure_llm_2023/AzureLLMInferenceTrace_code.csv"
    ),
    "azure-conv": Source(
        azure.load, "Azure 2023 chat trace", "azure_llm_2023/AzureLLMInferenceTrace_conv.csv"
    ),
    "mt-bench": Source(mt_bench.load, "MT-bench two-turn chats", "mt_bench/question.jsonl"),
    "shared-prefix": Source(shared_prefix.generate, "shared system prompts", takes_path=False),
    "multi-turn": Source(multi_turn.generate, "multi-turn chats", takes_path=False),
    "few-shot": Source(few_shot.generate, "few-shot prompts", takes_path=False),
}


class WorkloadSpecError(ValueError):
    """A SPEC that names no source, misses a path or has a bad key or value."""


def data_dir() -> Path:
    """Where traces named without a path are read: ``$KVSERVE_DATA_DIR``, else the
    ``shared/data`` folder beside the source checkout kvserve runs from. Never the working
    directory, so a command means the same thing wherever it is typed."""
    if DATA_DIR_ENV in os.environ:
        return Path(os.environ[DATA_DIR_ENV])
    return _CHECKOUT_DATA_DIR


def build_workload(spec: str, limit: int | None = None) -> Workload:
    """Parse ``spec`` and build its workload, reading at most ``limit`` items."""
    name, _, rest = spec.partition(":")
    if name not in SOURCES:
        raise WorkloadSpecError(f"unknown workload {name!r}; known: {', '.join(SOURCES)}")
    source = SOURCES[name]
    path, params = _split_args(rest)
    kwargs = _convert(source.build, params)
    if source.takes_path:
        kwargs["path"] = _resolve_path(name, source, path)
    elif path is not None:
        raise WorkloadSpecError(f"{name} takes no path, got {path!r}")
    try:
        return source.build(**kwargs, limit=limit)
    except (ValueError, KeyError) as exc:
        raise WorkloadSpecError(f"{spec}: {exc}") from exc


def _split_args(rest: str) -> tuple[str | None, dict[str, str]]:
    path: str | None = None
    params: dict[str, str] = {}
    for index, item in enumerate(filter(None, rest.split(","))):
        key, eq, value = item.partition("=")
        if eq:
            params[key.strip()] = value.strip()
        elif index == 0:
            path = item
        else:
            raise WorkloadSpecError(f"expected KEY=VALUE, got {item!r}")
    return path, params


def _convert(build: Callable[..., Workload], params: dict[str, str]) -> dict[str, object]:
    hints = typing.get_type_hints(build)
    accepted = _keys(build)
    out: dict[str, object] = {}
    for key, value in params.items():
        if key not in accepted:
            raise WorkloadSpecError(f"unknown key {key!r}; accepted: {', '.join(accepted)}")
        kind = next((t for t in typing.get_args(hints[key]) if t is not type(None)), hints[key])
        try:
            out[key] = kind(value)
        except ValueError as exc:
            raise WorkloadSpecError(f"{key}={value!r} is not a valid {kind.__name__}") from exc
    return out


def _keys(build: Callable[..., Workload]) -> list[str]:
    return [
        p.name
        for p in inspect.signature(build).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name != "limit"
    ]


def _resolve_path(name: str, source: Source, path: str | None) -> Path:
    if path is not None:
        resolved = Path(path)
    elif source.default_path is not None:
        resolved = data_dir() / source.default_path
    else:
        raise WorkloadSpecError(f"{name} needs a path: {name}:PATH")
    if not resolved.is_file():
        hint = f" (set {DATA_DIR_ENV} to the data folder)" if path is None else ""
        raise WorkloadSpecError(f"{name}: no file at {resolved}{hint}")
    return resolved


def describe_sources() -> str:
    """One line per source with its keys and defaults, for ``--help``."""
    lines = []
    for name, source in SOURCES.items():
        params = inspect.signature(source.build).parameters
        keys = ", ".join(f"{k}={params[k].default}" for k in _keys(source.build))
        path = "[:PATH]" if source.default_path else (":PATH" if source.takes_path else "")
        lines.append(f"{name}{path}  {source.summary}; keys: {keys}")
    return "\n".join(lines)
