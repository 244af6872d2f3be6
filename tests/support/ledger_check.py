"""A worker's ``/debug/check``, asked as its budget allows: a check that ran moments
before (another test's, or this one's other worker) makes it answer 429 with
``Retry-After``; a test that wants the answer comes back when told, rather than failing
on how fast the previous test ended."""

from __future__ import annotations

import time

import httpx


def ledger_check(url: str, headers: dict[str, str] | None = None, attempts: int = 5) -> dict:
    """The JSON body of ``url``'s ``/debug/check`` once it is not rate limited."""
    for _ in range(attempts):
        check = httpx.get(url + "/debug/check", headers=headers, timeout=30)
        if check.status_code != 429:
            assert check.status_code == 200, check.text
            body: dict = check.json()
            return body
        time.sleep(float(check.headers["Retry-After"]))
    raise AssertionError(f"{url}/debug/check still rate limited after {attempts} attempts")
