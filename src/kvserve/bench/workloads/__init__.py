"""Workload sources (one module each) and the SPEC syntax that names them."""

from kvserve.bench.workloads.base import RequestSpec, Workload
from kvserve.bench.workloads.spec import WorkloadSpecError, build_workload, describe_sources

__all__ = ["RequestSpec", "Workload", "WorkloadSpecError", "build_workload", "describe_sources"]
