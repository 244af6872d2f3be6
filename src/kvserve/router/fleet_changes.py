"""Workers added and removed at run time (``POST /workers``, ``DELETE /workers/{id}``),
the same in every process of a router.

With ``--processes N`` each process has its own registry, and a worker must have the same
id and shared-table slot in all of them (ids are given in registration order). So one
process, process 0, orders the changes: a process that gets such a request asks process
0, which applies it, tells every sibling to apply it (in the order it applied them, on
its links, which keep order), and then answers the asking process. That answer travels
on the same link after the change, so the asking process has applied it when it answers
its client. A router of one process applies the change at once.

A change is a small dict (``op`` "add" with ``url``, ``pool``, ``kv_events``; or
"remove" with ``worker_id``); applying it returns ``{"worker_id": ...}`` or
``{"status": 4xx, "code": ..., "error": ...}``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

from kvserve.router.sibling_links import SiblingLinks

log = logging.getLogger(__name__)

Change = dict[str, Any]
ApplyChange = Callable[[Change], Change]

_ASK = "fleet_ask"
_APPLY = "fleet_apply"
_ANSWER = "fleet_answer"
ORDERING_PROCESS = 0


class FleetChanges:
    """Applies run-time fleet changes here and, ordered by process 0, in every sibling."""

    def __init__(
        self,
        apply: ApplyChange,
        links: SiblingLinks | None = None,
        index: int = 0,
        timeout_s: float = 10.0,
    ) -> None:
        self._apply = apply
        self._links = links
        self._index = index
        self._timeout_s = timeout_s
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future[Change]] = {}

    async def change(self, change: Change) -> Change:
        """Apply ``change`` in every process; what applying it gave."""
        if self._links is None or self._index == ORDERING_PROCESS:
            return self._apply_everywhere(change)
        ask = next(self._ids)
        answer: asyncio.Future[Change] = asyncio.get_running_loop().create_future()
        self._waiting[ask] = answer
        try:
            to_orderer = self._links.link_to(ORDERING_PROCESS)
            self._links.send_to(to_orderer, {_ASK: ask, "change": change})
            return await asyncio.wait_for(answer, self._timeout_s)
        except TimeoutError:
            return {
                "status": 503,
                "code": "fleet_change_timeout",
                "error": f"router process {ORDERING_PROCESS}, which orders fleet changes, did"
                f" not answer within {self._timeout_s:.0f} s; the change may still apply",
            }
        finally:
            del self._waiting[ask]

    def on_message(self, message: object, link: int) -> bool:
        """Handle a sibling's fleet message from ``link``; False for any other message."""
        if not isinstance(message, dict):
            return False
        if _ASK in message and self._links is not None:  # this is the ordering process
            result = self._apply_everywhere(message["change"])
            self._links.send_to(link, {_ANSWER: message[_ASK], "result": result})
            return True
        if _APPLY in message:
            result = self._apply(message[_APPLY])
            if result.get("worker_id") != message["worker_id"]:  # a bug: processes disagree
                log.error("fleet change %s applied as %s here", message, result)
            return True
        if _ANSWER in message:
            answer = self._waiting.get(message[_ANSWER])
            if answer is not None and not answer.done():
                answer.set_result(message["result"])
            return True
        return False

    def _apply_everywhere(self, change: Change) -> Change:
        result = self._apply(change)
        if self._links is not None and "worker_id" in result and "status" not in result:
            self._links.send({_APPLY: change, "worker_id": result["worker_id"]})
        return result
