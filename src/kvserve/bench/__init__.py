"""The load generator: workloads and traces replayed against any OpenAI endpoint, with
metrics, reports and plots (docs/architecture.md)."""
