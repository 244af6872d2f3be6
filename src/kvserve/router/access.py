"""Who may call the router: the API key on ``/v1/*``, and the control plane (``/workers``,
``/dashboard``).

With no admin key (``--admin-api-key``, else ``--api-key``), the control plane answers
loopback clients only. ``kvserve up`` and an operator on the same machine need no key,
while anyone else who can reach the port could otherwise register a worker of their own
(and receive the fleet's prompts) or remove every worker.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress

from aiohttp import web

from kvserve.router.errors import openai_error
from kvserve.router.lean_request import LeanRequest


def bearer_matches(request: web.Request | LeanRequest, key: str | None) -> bool:
    return key is None or request.headers.get("Authorization") == f"Bearer {key}"


def unauthorized() -> web.Response:
    return openai_error(
        401, "invalid or missing API key", error_type="authentication_error", code="invalid_api_key"
    )


def admin_credentials_match(request: web.Request, admin_key: str) -> bool:
    """The key as a bearer token, or as the password of HTTP Basic credentials (any user
    name): a browser opening ``/dashboard`` can send only the latter, and then sends them
    again with the page's own requests."""
    if bearer_matches(request, admin_key):
        return True
    scheme, _, encoded = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        decoded = base64.b64decode(encoded, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return False
    return decoded.partition(":")[2] == admin_key


def is_loopback(address: str | None) -> bool:
    """Whether a peer address is this machine's loopback (IPv4, IPv6 or IPv4-mapped)."""
    try:
        ip = ipaddress.ip_address(address or "")
    except ValueError:
        return False  # unknown peers are remote
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip).is_loopback


def control_plane_refusal(request: web.Request, admin_key: str | None) -> web.Response | None:
    """The answer refusing a control-plane request, or None when it may proceed."""
    if admin_key is not None:
        if admin_credentials_match(request, admin_key):
            return None
        refusal = unauthorized()
        refusal.headers["WWW-Authenticate"] = 'Basic realm="kvserve router"'  # browsers ask
        return refusal
    if is_loopback(request.remote):
        return None
    return openai_error(
        403,
        "the worker API answers loopback clients only when the router has no "
        "--admin-api-key (or --api-key)",
        error_type="permission_error",
        code="admin_key_required",
    )
