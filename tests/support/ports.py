"""Free loopback ports for test servers."""

from kvserve.router.local_fleet import free_port

__all__ = ["free_port"]
