"""engine layer: the model, the KV pool and the step loop, with torch (layers and
modules: docs/architecture.md; interfaces: docs/internals.md)."""
