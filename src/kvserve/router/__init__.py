"""The router: an HTTP gateway over a fleet of OpenAI-compatible workers.

It talks HTTP only and never imports torch, so it installs and starts without it.
"""

from kvserve.router.app import Router, run_router
from kvserve.router.config import RouterConfig

__all__ = ["Router", "RouterConfig", "run_router"]
