"""Helpers shared by the tests and benchmarks that run real processes on loopback."""
