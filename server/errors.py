"""HTTP error envelopes and the exception handlers that produce them.

Native routes answer ``{"error": {"message": ...}}``; ``/v1`` routes answer OpenAI's
``{"object": "error", "message", "type", "param", "code"}`` (sglang-facts.md section 1.1).
FastAPI's 422 validation errors are remapped to 400.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.types import InvalidRequestError
from server.engine_client import EngineUnavailableError
from server.generation import ClientDisconnected, RequestFailed

logger = logging.getLogger("server.errors")

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          500: "InternalServerError", 503: "ServiceUnavailableError"}


class APIError(Exception):
    """An error with an HTTP status; ``param`` names the offending field (OpenAI's ``param``),
    ``code`` is OpenAI's string code (e.g. "model_not_found") or None for the status."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status_code, self.message, self.param, self.code = status_code, message, param, code


def error_response(request: Request | None, status: int, message: str,
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    """The error body for ``request``'s route family (OpenAI shape under ``/v1``)."""
    path = request.url.path if request is not None else ""
    if path.startswith("/v1"):
        body = {"object": "error", "message": message, "type": _TYPES.get(status, str(status)),
                "param": param, "code": code or status}
    else:
        body = {"error": {"message": message}}
    return JSONResponse(body, status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that turn exceptions into the envelopes above."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        return error_response(request, e.status_code, e.message, e.param, e.code)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, e: InvalidRequestError) -> Response:
        return error_response(request, 400, str(e), e.field)

    @app.exception_handler(EngineUnavailableError)
    async def _unavailable(request: Request, e: EngineUnavailableError) -> Response:
        return error_response(request, 503, str(e))

    @app.exception_handler(RequestFailed)
    async def _failed(request: Request, e: RequestFailed) -> Response:
        return error_response(request, e.status_code, str(e))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, e: ClientDisconnected) -> Response:
        logger.info("client disconnected from %s; request aborted", request.url.path)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        errs = e.errors()
        loc = ".".join(str(x) for x in (errs[0].get("loc", ()) if errs else ()) if x != "body")
        msg = errs[0].get("msg", "invalid request") if errs else "invalid request"
        return error_response(request, 400, f"{loc or 'body'}: {msg}", loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        return error_response(request, e.status_code, str(e.detail))
