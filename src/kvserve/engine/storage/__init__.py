"""The shared storage tier of KV blocks: one small interface, file and Redis backends."""

from kvserve.engine.storage.base import KVStorage, StorageError, open_storage

__all__ = ["KVStorage", "StorageError", "open_storage"]
