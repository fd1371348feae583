"""OpenAI-style error bodies ``{"error": {"message", "type", "param", "code"}}`` and the FastAPI
exception handlers that turn every failure into one (never a 500 with a stack trace for bad input).
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvfit.errors import RequestRejected

logger = logging.getLogger("kvfit.server")

_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "internal_error", 503: "service_unavailable"}


class APIError(Exception):
    """Raised by handlers; rendered by ``error_response``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: Optional[str] = None,
               code: Optional[str] = None, type: Optional[str] = None) -> dict:
    kind = type or _TYPES.get(status, "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code, err.type),
                        status_code=err.status)


def sse_error(err: APIError) -> str:
    """An error event for a stream that has already started (status 200 was sent)."""
    body = error_body(err.status, err.message, err.param, err.code, err.type)
    return f"data: {json.dumps(body)}\n\n"


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model",
                    code="model_not_found")


def rejected(e: RequestRejected) -> APIError:
    return APIError(400, str(e), param=e.param, code=e.code)


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    errs = exc.errors()
    if not errs:
        return "invalid request body", None
    first = errs[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"invalid JSON in the request body: {ctx.get('error', first.get('msg'))}", None
    if not loc:  # the body itself has the wrong type (e.g. a JSON array, or no JSON at all)
        return "the request body must be a JSON object (Content-Type: application/json)", None
    # A field whose type is a union reports one error per member; name the field once.
    param = None
    for p in loc:
        if not p.isdigit() and p[:1].islower() and "[" not in p and "(" not in p:
            param = p
            break
    where = ".".join(loc) or "body"
    return f"{where}: {first.get('msg', 'invalid value')}", param or (loc[0] if loc else None)


def install_error_handlers(app: FastAPI) -> None:
    """400 for pydantic/JSON errors (FastAPI would say 422), OpenAI bodies for 404/405, and a
    generic 500 body for unexpected server errors (logged with the traceback server-side)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestRejected)
    async def _rejected(request: Request, exc: RequestRejected):
        return error_response(rejected(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return error_response(APIError(400, msg, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        detail = exc.detail if isinstance(exc.detail, str) else phrase
        return error_response(APIError(exc.status_code, detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("internal error while serving %s", request.url.path)
        return error_response(APIError(500, f"internal server error ({type(exc).__name__})"))
