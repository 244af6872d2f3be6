"""The control plane's loopback rule, address by address."""

from __future__ import annotations

import pytest

from kvserve.router.access import is_loopback


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.8.7", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("192.0.2.2", False),
        ("::ffff:192.0.2.2", False),
        ("fd00::2", False),
        ("0.0.0.0", False),
        ("", False),
        (None, False),
        ("localhost", False),  # a peer address is never a name: refuse what is not an IP
    ],
)
def test_is_loopback(address: str | None, loopback: bool) -> None:
    assert is_loopback(address) is loopback
