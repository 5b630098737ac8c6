"""Every error answered in OpenAI's shape ({"error": {"message", "type", "param", "code"}}) and
noted in the request's log line: our own `APIError`s, invalid request bodies (400, naming the
field), unknown routes and methods, and faults (500)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .schemas import APIError
from .sse import note

log = logging.getLogger("powerinfer_rs.server")


async def on_api_error(request: Request, e: APIError):
    note(request, error=e.message, error_kind=e.code or e.type)
    return e.response()


async def on_invalid(request: Request, e: RequestValidationError):
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        param = None
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error') or first.get('msg')}"
    else:
        message = "; ".join(
            f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
            for err in errors
        )
    return await on_api_error(request, APIError(400, message, param=param))


async def on_fault(request: Request, e: Exception):
    log.exception("internal error on %s %s", request.method, request.url.path)
    return await on_api_error(
        request, APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error")
    )


async def on_http(request: Request, e: StarletteHTTPException):
    code = "not_found" if e.status_code == 404 else None
    response = await on_api_error(request, APIError(e.status_code, str(e.detail), code=code))
    # e.g. a 405's `Allow`, which RFC 9110 requires
    response.headers.update(e.headers or {})
    return response


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(Exception, on_fault)
    app.add_exception_handler(StarletteHTTPException, on_http)
