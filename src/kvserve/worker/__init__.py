"""worker layer: the HTTP server around one engine (layers and modules:
docs/architecture.md; interfaces: docs/internals.md)."""
