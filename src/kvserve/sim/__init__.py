"""The discrete-event simulator: the servers' own scheduler, cache and routing policies
in virtual time, with a cost model in place of the GPU (docs/architecture.md)."""
