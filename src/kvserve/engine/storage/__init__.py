"""The shared storage tier of KV blocks: one small interface (:mod:`.base`), and the
built-in backends registered here: a directory (``file:DIR``), Redis
(``redis://host:port[/db]``) and a Mooncake Store (``mooncake://MASTER_HOST:PORT``, the
``kvserve[mooncake]`` extra). Each is imported only when a worker opens it."""

from pathlib import Path

from kvserve.engine.storage.base import (
    KVStorage,
    StorageError,
    StorageOptions,
    open_storage,
    register_backend,
)

__all__ = ["KVStorage", "StorageError", "open_storage", "register_backend"]


def _open_file(url: str, namespace: str, options: StorageOptions) -> KVStorage:
    from kvserve.engine.storage.file_backend import FileStorage

    directory = url.removeprefix("file:")
    if not directory:
        raise ValueError("file storage needs a directory: file:DIR")
    return FileStorage(Path(directory), namespace, max_bytes=options.max_bytes)


def _open_redis(url: str, namespace: str, options: StorageOptions) -> KVStorage:
    from kvserve.engine.storage.redis_backend import RedisStorage

    return RedisStorage(url, namespace)


def _open_mooncake(url: str, namespace: str, options: StorageOptions) -> KVStorage:
    from kvserve.engine.storage.mooncake_url import parse_mooncake_url

    config = parse_mooncake_url(url)
    try:
        from kvserve.engine.storage.mooncake_backend import MooncakeStorage
    except ImportError as error:
        raise ValueError(f"{url}: {error}; pip install 'kvserve[mooncake]'") from error

    return MooncakeStorage(config, namespace)


register_backend("file", "file:DIR", _open_file)
register_backend("redis", "redis://host:port", _open_redis)
register_backend("mooncake", "mooncake://MASTER_HOST:PORT[?options]", _open_mooncake)
