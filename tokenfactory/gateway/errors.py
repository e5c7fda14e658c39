"""Errors in OpenAI's shape, and the HTTP edge's own refusals.

Every error leaves as {"error": {"message", "type", "param", "code"}}: `APIError` for the request service's
own (service/errors.py; auth and admission's `Refusal` is one),
`ParameterError` (a 400 naming the parameter), pydantic's validation errors (400, the field's path as
`param`), Starlette's (404, 405, ...), and anything unexpected as a 500 that says only its id: the log
has the rest, never the client (no SQL, no parameters, no paths). `BodySizeLimit` refuses bodies over
the limit with 413 before they are read whole.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenfactory.service.errors import APIError, Cancelled
from tokenfactory.types import ParameterError

__all__ = ["APIError", "BodySizeLimit", "error_response", "install_error_handlers"]

logger = logging.getLogger("tokenfactory.gateway.app")


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


class BodyTooLarge(APIError):
    """Raised from `receive` once a body passes the limit (whoever reads it: a route, the form parser)."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {max_bytes} bytes",
                         code="request_too_large")


class BodySizeLimit:
    """Refuse bodies over the limit with 413, by Content-Length or by counting a chunked body. Once a counted
    body passes the limit, whatever the app answers (a form parser turns any exception into its own 400) is
    replaced by the 413, so the client always learns why."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length")
        too_big = error_response(413, f"the request body is larger than the server's limit of {self.max_bytes} "
                                 "bytes", "invalid_request_error", code="request_too_large")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_big(scope, receive, send)
        seen, over, answered = 0, False, False

        async def counting_receive() -> dict:
            nonlocal seen, over
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                over = True
                raise BodyTooLarge(self.max_bytes)
            return message

        async def guarded_send(message: dict) -> None:
            nonlocal answered
            if not over:
                await send(message)
            elif not answered and message["type"] == "http.response.start":
                answered = True
                await too_big(scope, receive, send)  # the app's own answer is dropped

        try:
            await self.app(scope, counting_receive, guarded_send)
        except BodyTooLarge:
            pass
        if over and not answered:
            await too_big(scope, receive, send)


def install_error_handlers(app: FastAPI, count: Callable[[int], None]) -> None:
    """`count(status)`: the error counter in /metrics."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        count(e.status)
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)

    @app.exception_handler(Cancelled)
    async def cancelled(_: Request, e: Cancelled) -> JSONResponse:  # the client left: nobody reads this
        return error_response(499, str(e), "invalid_request_error", code="client_closed_request")

    @app.exception_handler(ParameterError)
    async def parameter_error(_: Request, e: ParameterError) -> JSONResponse:
        count(400)
        return error_response(400, str(e), "invalid_request_error", e.param)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        count(400)
        err = e.errors()[0] if e.errors() else {}
        if err.get("type") == "json_invalid":
            return error_response(400, f"the request body is not valid JSON: {err.get('msg', '')}",
                                  "invalid_request_error", code="invalid_json")
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        if err.get("type") == "extra_forbidden":
            message = f"unrecognized request argument: {param}"
        elif err.get("type") == "missing":
            message = f"missing required parameter: {param}"
        else:
            message = f"invalid value for {param}: {err.get('msg', 'invalid')}"
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        count(e.status_code)
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, e: Exception) -> JSONResponse:
        count(500)
        error_id = uuid.uuid4().hex[:12]
        logger.error("internal error %s", error_id, exc_info=e)
        return error_response(500, f"internal server error (id {error_id}); the server's log has the details",
                              "server_error", code="internal_error")
