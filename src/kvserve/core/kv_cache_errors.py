"""Errors of the KV block ledger and cache manager.

A misuse of the cache (freeing a block twice, unpinning a block nobody pinned, asking
for more blocks than exist) means two parts of the engine disagree about who holds KV
memory. Continuing would hand one block to two requests and serve wrong KV later, far
from the cause, so each misuse raises at once, names the block or request involved,
and leaves the ledger as it was before the call.
"""

from __future__ import annotations


class KVCacheError(Exception):
    """Base class: a caller broke the ledger's ownership rules."""


class DoubleFreeError(KVCacheError):
    """A block handed back to the free pool that was already free."""


class NotOwnedError(KVCacheError):
    """A block used as the caller's own (freed or committed) that the caller does not own."""


class NotPinnedError(KVCacheError):
    """An unpin of a block whose ref count is already zero."""


class NotCachedError(KVCacheError):
    """A pin, or a parent hash, naming a block that is not in the prefix tree."""


class OutOfBlocksError(KVCacheError):
    """More blocks requested than free plus reclaimable blocks can cover."""


class InconsistentChainError(KVCacheError):
    """A hash chain that contradicts the tree (a hash already cached under another prefix)."""


class RequestStateError(KVCacheError):
    """A per-request call made in the wrong state (e.g. a second match for one request)."""
