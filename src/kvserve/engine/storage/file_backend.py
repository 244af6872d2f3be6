"""The default storage tier: one file per block in a directory that workers share.

- **Atomic writes.** A value is written to a temporary file beside its final name and
  renamed over it, so a reader (another worker, or this one after a crash) sees a whole
  value or none; a cut or flipped file is still caught by the value's checksum.
- **Bounded size.** The directory is kept under ``max_bytes``: when this process's count
  passes it, it rescans the directory (other workers write too) and deletes the least
  recently used files down to 90% of the bound.
- **LRU order that keeps prefixes.** A read or write touches a chain's files suffix
  first, so a prefix is never older than the suffixes used with it and eviction, oldest
  first, takes suffixes before their prefixes. A lookup is a longest-prefix scan anyway:
  a suffix whose prefix went is never served.

Layout: ``DIR/<namespace>/<first two hex digits>/<key as 16 hex digits>.kvb``.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from kvserve.engine.storage.base import KVStorage, StorageError

_SUFFIX = ".kvb"
_LOW_WATER = 0.9  # evict down to this fraction of the bound
_RESCAN_EVERY = 1024  # writes between rescans that catch other workers' files


class FileStorage(KVStorage):
    def __init__(self, root: Path, namespace: str, *, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.namespace = namespace
        self.directory = root / namespace
        with contextlib.suppress(OSError):  # a full or unwritable disk: writes will say so
            self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._size: int | None = None  # bytes in the directory as last counted, plus writes
        self._writes_since_scan = 0

    def _path(self, key: int) -> Path:
        name = f"{key:016x}"
        return self.directory / name[:2] / (name + _SUFFIX)

    def exists(self, keys: Sequence[int]) -> int:
        for i, key in enumerate(keys):
            if not self._path(key).is_file():
                return i
        return len(keys)

    def get_many(self, keys: Sequence[int]) -> list[bytes | None]:
        values: list[bytes | None] = []
        for key in keys:
            try:
                values.append(self._path(key).read_bytes())
            except FileNotFoundError:
                values.append(None)
            except OSError as error:
                raise StorageError(f"cannot read block {key:#x}: {error}") from error
        self._touch([key for key, value in zip(keys, values, strict=True) if value is not None])
        return values

    def put_many(self, items: Sequence[tuple[int, bytes]]) -> list[int]:
        written = 0
        for key, value in reversed(items):  # suffix first: the prefix ends up newest
            path = self._path(key)
            if path.is_file():
                self._touch([key])
                continue
            self._write_atomically(path, value)
            written += len(value)
        if not written:
            return []
        size = self._counted_size() + written
        self._size = size
        self._writes_since_scan += 1
        if size > self.max_bytes or self._writes_since_scan >= _RESCAN_EVERY:
            return self._evict()
        return []

    def delete_many(self, keys: Sequence[int]) -> None:
        for key in keys:
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()

    def _write_atomically(self, path: Path, value: bytes) -> None:
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with temporary.open("wb") as file:
                file.write(value)
            os.replace(temporary, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise StorageError(f"cannot write {path.name}: {error}") from error

    def _touch(self, keys: Sequence[int]) -> None:
        for key in reversed(keys):
            with contextlib.suppress(OSError):  # deleted meanwhile: nothing to keep
                os.utime(self._path(key))

    def _counted_size(self) -> int:
        if self._size is None:
            self._size = sum(size for _, _, size, _ in self._scan())
        return self._size

    def _scan(self) -> list[tuple[float, str, int, Path]]:
        """``(mtime, name, size, path)`` of every block file (temporary files skipped)."""
        files = []
        try:
            shards = list(os.scandir(self.directory))
        except OSError as error:
            raise StorageError(f"cannot list {self.directory}: {error}") from error
        for shard in shards:
            if not shard.is_dir():
                continue
            with contextlib.suppress(OSError):
                for entry in os.scandir(shard.path):
                    if entry.name.endswith(_SUFFIX) and not entry.name.startswith("."):
                        with contextlib.suppress(FileNotFoundError):
                            stat = entry.stat()
                            files.append(
                                (stat.st_mtime, entry.name, stat.st_size, Path(entry.path))
                            )
        return files

    def _evict(self) -> list[int]:
        """Recount the directory; delete the least recently used files past the bound."""
        files = self._scan()
        size = sum(file[2] for file in files)
        self._writes_since_scan = 0
        evicted: list[int] = []
        if size > self.max_bytes:
            target = self.max_bytes * _LOW_WATER
            files.sort()  # oldest first; equal times: any order
            for _, name, file_size, path in files:
                if size <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                    evicted.append(int(name.removesuffix(_SUFFIX), 16))
                size -= file_size
        self._size = size
        return evicted
