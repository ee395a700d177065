"""OpenAI-style error responses: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Every error the server returns goes through `error_response`, so clients (the official
``openai`` package included) see the same shape whether FastAPI, vLLM or our own checks
rejected the request.  Validation problems are 400 (as OpenAI does), not FastAPI's 422.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("samrollout.server")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
          404: "NotFoundError", 405: "MethodNotAllowed", 409: "ConflictError", 413: "RequestTooLarge",
          415: "UnsupportedMediaType", 422: "UnprocessableEntityError", 429: "RateLimitError",
          501: "NotImplementedError", 503: "ServiceUnavailableError", 507: "InsufficientStorageError"}


class ApiError(Exception):
    """An error to return to the client as it is (status, message, offending parameter)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers or {}  # e.g. Retry-After on a 429


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The JSON body of an error, in OpenAI's format."""
    kind = _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error response."""
    return JSONResponse(error_body(status, message, param), status_code=status)


def _describe(errors: Any) -> tuple[str, str | None]:
    """One readable line out of pydantic's error list, and the first offending field."""
    parts, param = [], None
    for error in errors if isinstance(errors, list) else [errors]:
        if not isinstance(error, dict):
            parts.append(str(error))
            continue
        if error.get("type") == "json_invalid":
            return f"malformed JSON body: {error.get('ctx', {}).get('error', 'cannot parse')}", None
        location = [str(p) for p in error.get("loc", ()) if p != "body"]
        where = ".".join(location)
        param = param or (where or None)
        parts.append(f"{where}: {error.get('msg', 'invalid')}" if where else str(error.get("msg", "invalid")))
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception a route can raise to an OpenAI-style error with a fitting status."""

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe(exc.errors())
        return error_response(HTTPStatus.BAD_REQUEST, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = error_response(exc.status_code, str(exc.detail))
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        return response

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> JSONResponse:
        response = error_response(exc.status, exc.message, exc.param)
        response.headers.update(exc.headers)
        return response

    from samrollout.server.vllm_compat.vllm_serving import ERROR_TYPES, create_error_response

    async def _vllm(_: Request, exc: Exception) -> JSONResponse:
        # vLLM's own mapping: its client errors are 4xx, generation errors 5xx, bare ValueError 400.
        error = create_error_response(exc)
        return JSONResponse(error.model_dump(), status_code=error.error.code)

    for kind in ERROR_TYPES:
        app.add_exception_handler(kind, _vllm)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(exc).__name__}")
