"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with a matching status.

Every failure path of the app ends here, so a client always gets JSON it can parse and the server
keeps serving: validation errors become 400 naming the offending field in `param`, unknown routes
404, admission rejections 429 with Retry-After, shutdown 503, and anything unexpected 500.
"""

from __future__ import annotations

import json
import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import EngineDead, EngineShuttingDown
from engine.server.responses import ErrorInfo, ErrorResponse
from engine.server.text_check import LoneSurrogate

logger = logging.getLogger(__name__)


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI-style error response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def response_body(self) -> dict:
        return ErrorResponse(error=self.info).model_dump()

    def response(self) -> JSONResponse:
        return _ErrorJSONResponse(self.response_body(), status_code=self.status, headers=self.headers)


class _ErrorJSONResponse(JSONResponse):
    """JSONResponse, but an error must render whatever its message echoes: text that is not
    Unicode (a lone surrogate), which UTF-8 cannot encode, goes out escaped as JSON allows."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def invalid_field(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value")


def context_exceeded(param: str, message: str) -> APIError:
    # 400 rather than 413, as OpenAI and vLLM answer; the code tells clients what to shorten.
    return APIError(400, message, param=param, code="context_length_exceeded")


def request_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of {limit} bytes "
                    "(serve --max-body-bytes sets it).", code="request_too_large")


class BodyTooLarge(StarletteHTTPException):
    """Raised while a body is read, once it passes the limit. An HTTPException, because FastAPI
    lets only those out of its body reading (any other error there becomes a 400)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413)
        self.limit = limit


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key; send 'Authorization: Bearer <key>'.",
                    code="invalid_api_key")


def rate_limited(reason: str, retry_after_s: float) -> APIError:
    # Retry-After takes whole seconds; round up so a client that obeys it is not rejected again.
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, f"Server overloaded, request not admitted: {reason}", type="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down and accepts no new requests.",
                    type="service_unavailable", code="shutting_down")


def aborted_at_shutdown() -> APIError:
    # Not shutting_down(): this request was accepted and ran, but the server stopped before it
    # finished (a stream gets its text so far and finish_reason "abort" instead).
    return APIError(503, "The server shut down before this request finished; its output was discarded.",
                    type="service_unavailable", code="aborted_at_shutdown")


def engine_failed(message: str) -> APIError:
    return APIError(500, f"The engine failed: {message}", type="server_error", code="engine_error")


def engine_state_error(exc: EngineShuttingDown | EngineDead) -> APIError:
    """The answer to a request the engine does not take: 503 while draining, 500 once it failed."""
    if isinstance(exc, EngineDead):
        return engine_failed(str(exc))
    return shutting_down()


# A field name as the API spells them; pydantic's union tags ("list[int]", "function-after[...]",
# "ContentPart") are not, except the bare type names below.
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_BARE_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "bytes", "list", "dict", "none"})


def _validation_param(error: dict) -> str | None:
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, LoneSurrogate):  # the validator found the nested path itself
        return cause.param
    # loc is like ("body", "messages", 0, "content", "str"): after "body", the path to the field the
    # client must fix, with the name of each union member pydantic tried (here "str") mixed in.
    # Those tags name no field, so they are dropped, and "messages.0.content" is left.
    names = [str(part) for part in error.get("loc", ()) if part != "body" and _is_field_or_index(part)]
    if error.get("type") == "json_invalid" or not names:
        return None
    return ".".join(names)


def _is_field_or_index(part: str | int) -> bool:
    if isinstance(part, int):
        return True
    return _FIELD_NAME.fullmatch(part) is not None and part not in _BARE_TYPE_TAGS


async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    if tuple(first.get("loc", ())) == ("body",) and not _sent_as_json(request):
        # FastAPI reads no JSON from a body sent without its content type (a guard against
        # cross-site posts from browser pages), and pydantic's words for that named nothing.
        return APIError(400, "send the body as JSON, with the header Content-Type: application/json",
                        code="invalid_value").response()
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        # pydantic's "Field required" named no field: the whole body is what is missing.
        return APIError(400, "the request body is empty: send a JSON object", code="invalid_value").response()
    param = _validation_param(first)
    # A validator's own ValueError reads "Value error, <its message>": the message is enough.
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if param:
        message = f"{param}: {message}"
    return APIError(400, message, param=param, code="invalid_value").response()


def _sent_as_json(request: Request) -> bool:
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _on_body_too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
    return request_too_large(exc.limit).response()


async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    message, code = str(exc.detail), None
    if exc.status_code == 400:  # FastAPI's: a body it could not decode (not UTF-8), answered as bad JSON is
        # Valid JSON nested past the parser's recursion limit fails there too, and is named so.
        reason = "nests too deeply" if isinstance(exc.__cause__, RecursionError) else "must be JSON in UTF-8"
        message, code = f"{message}: the body {reason}", "invalid_value"
    # Starlette's headers carry what the status needs, such as a 405's Allow.
    return APIError(exc.status_code, message, type=kind, code=code, headers=exc.headers).response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s", request.url.path)
    return APIError(500, "Internal server error", type="server_error").response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(BodyTooLarge, _on_body_too_large)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
