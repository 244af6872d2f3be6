"""The simulator: the router's policies over the engine's scheduler and KV cache, in virtual
time (see docs/architecture.md)."""
