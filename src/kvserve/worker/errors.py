"""OpenAI-shaped error responses.

Clients (the ``openai`` SDK, the router) parse ``{"error": {message, type, param, code}}``
and decide on retries from the status code, so every failure the worker reports, from a
malformed body to an unknown route, goes through the one shape built here. Bad input is
always a 4xx; a 5xx means a fault in the worker itself.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.worker.json_response import JSONResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error to report to the client as an OpenAI error body with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or _ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def internal_error(exc: Exception) -> JSONResponse:
    """A fault in the worker itself: logged with its traceback, reported without it."""
    logger.exception("unhandled error in worker", exc_info=exc)
    return APIError(500, f"Internal error: {type(exc).__name__}").response()


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def validation_error_to_api_error(errors: Sequence[Any]) -> APIError:
    """Maps pydantic's error list to one 400 naming the first offending parameter.

    OpenAI names the top-level field in ``param``; the full location (list index, union
    branch) goes into the message so nested mistakes stay findable.
    """
    if not errors:
        return invalid_request("Invalid request body.")
    first = _most_telling(errors)
    location = [str(part) for part in _location(first) if not _is_branch(part)]
    if first.get("type") == "json_invalid":
        return invalid_request(f"Malformed JSON body: {first.get('msg', '')}")
    if not location:
        return invalid_request(f"Invalid request body: {first.get('msg', '')}")
    path = ".".join(location)
    if first.get("type") == "extra_forbidden":
        # A field the worker does not know is one it would not honour: never ignored.
        return invalid_request(f"Unrecognized request argument supplied: {path}", param=location[0])
    return invalid_request(f"{path}: {first.get('msg', 'invalid value')}", param=location[0])


def _most_telling(errors: Sequence[Any]) -> Any:
    """The error to report. A field that takes several forms (``prompt``, ``stop``, a
    message's ``content``) gets errors per form, the string form's first: for token ids
    with a negative one that was "Input should be a valid string". Of the forms the
    first error's field was tried as, the one meant is a form whose shape the value has
    (not refused whole as the wrong type) with the fewest errors: "prompt.0: Input
    should be greater than or equal to 0". Equals keep pydantic's order."""
    first = errors[0]
    location = _location(first)
    cut = next((i for i, part in enumerate(location) if _is_branch(part)), None)
    if cut is None:
        return first
    forms: dict[object, list[Any]] = {}
    for error in errors:
        where = _location(error)
        if where[:cut] == location[:cut] and len(where) > cut and _is_branch(where[cut]):
            forms.setdefault(where[cut], []).append(error)

    def unlikeliness(form: list[Any]) -> tuple[bool, int]:
        wrong_shape = any(
            len(_location(e)) == cut + 1 and str(e.get("type", "")).endswith("_type") for e in form
        )
        return wrong_shape, len(form)

    return min(forms.values(), key=unlikeliness)[0]


def _location(error: Any) -> tuple[object, ...]:
    return tuple(part for part in error.get("loc", ()) if part != "body")


def _is_branch(part: object) -> bool:
    """A location part that names a form of a field (pydantic's ``str``,
    ``constrained-str``, ``list[constrained-int]``...), not a field: left out of the
    path a client reads. A discriminated union's tag (a message's ``user``) stays."""
    return isinstance(part, str) and (part in _PLAIN_FORMS or "-" in part or "[" in part)


_PLAIN_FORMS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def install_error_handlers(app: FastAPI) -> None:
    """Routes every exception path of the app to the OpenAI error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_to_api_error(exc.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.detail else HTTPStatus(exc.status_code).phrase
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc)
