"""The request service's errors, in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}.

`APIError` is a request that fails with a status the API documents (404 model_not_found, 503
engine_unavailable, ...); `Refusal` is one refused before any work by authentication or admission (401, 402,
403, 429, 503), with a `retry_after_s` where waiting helps. `ParameterError` (tokenfactory.types) is a 400
naming the parameter. None of them knows HTTP: the gateway renders them, and the Batch API writes them into
its error file.
"""

from __future__ import annotations

import json
import math
from typing import Any


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def error(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def body(self) -> bytes:
        return json.dumps(self.error()).encode()


class Refusal(APIError):
    """A request refused before any work, in OpenAI's error shape (raised by auth and admission)."""

    def __init__(self, status: int, message: str, type_: str, code: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(status, message, type_, param, code, headers)


class Cancelled(Exception):  # noqa: N818 - what happened, not an error of the service
    """The call's `cancelled` signal was set before it finished: its engine requests were aborted and it was
    settled as aborted, billed for what was made."""


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def retry_after(seconds: float) -> dict[str, str]:
    return {"Retry-After": str(max(1, math.ceil(seconds)))}
