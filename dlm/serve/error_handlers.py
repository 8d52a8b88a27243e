"""Every error answer in the OpenAI shape (``{"error": {"message", "type", "param", "code"}}``), counted in the
metrics: :class:`~dlm.serve.schemas.APIError` from the handlers, FastAPI's validation errors (its 422 replaced by a
400 naming the field), Starlette's 404/405 and, as a last resort, an unexpected exception (500)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dlm.serve.schemas import APIError, error_body

if TYPE_CHECKING:
    from dlm.serve.metrics import Metrics

log = logging.getLogger("dlm.serve")


def error_response(
    metrics: Metrics,
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The JSON answer of an error (and its count in ``dlm_request_errors_total``)."""
    metrics.on_error(status)
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """(message, param, code) of pydantic's first complaint about a body, in the words a client can act on."""
    errs = exc.errors()
    first = errs[0] if errs else {}
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON ({ctx}); send a JSON object", None, "invalid_json"
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # drop pydantic's union-member tags (e.g. 'str', 'list[int]') from the field path
    path = ".".join(p for p in loc if not any(c in p for c in "[]") and p not in ("str", "int", "float", "bool"))
    msg = first.get("msg", "invalid value")
    if not loc:
        message = f"the request body must be a JSON object with the API's fields ({msg})"
    else:
        message = f"invalid value for '{path}': {msg}"
    if len(errs) > 1:
        message += f" (and {len(errs) - 1} more problem{'s' if len(errs) > 2 else ''})"
    return message, path or None, "invalid_value"


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """Register the exception handlers that answer every error of ``app`` in the OpenAI shape."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return error_response(metrics, exc.status, exc.message, exc.param, exc.code, exc.headers)

    async def invalid_body(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param, code = validation_message(exc)
        return error_response(metrics, 400, message, param=param, code=code)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        msg = str(exc.detail) if exc.detail else "error"
        if status == 404:
            msg = (
                f"no route {request.method} {request.url.path}; see /v1/models, /v1/completions, "
                f"/v1/chat/completions, /health, /metrics"
            )
        return error_response(metrics, status, msg)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - a bug
        log.exception("unexpected error")
        return error_response(metrics, 500, f"internal error: {type(exc).__name__}: {exc}")

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
