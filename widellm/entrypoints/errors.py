"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
status, and the exception the serving code raises to produce one.

``type`` is the name of the exception the official ``openai`` client raises for the status
(``BadRequestError`` for 400, ``NotFoundError`` for 404, ...), so a client reading the body
and one catching the exception see the same word.
"""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse

from widellm.engine.async_llm import EngineDrainingError, RequestFailedError
from widellm.engine.core_client import EngineDeadError
from widellm.entrypoints.protocol import ErrorInfo, ErrorResponse

ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.FORBIDDEN: "PermissionDeniedError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    # The openai client has no class of its own for 413; it raises its base status error.
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "APIStatusError",
    HTTPStatus.UNPROCESSABLE_ENTITY: "UnprocessableEntityError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}

# Validation messages in widellm start with the parameter they are about: "temperature must
# be >= 0, ...", "prompt: 600 tokens is longer than ...", or a path into one:
# "messages[0].content[1].type: ...".
_PARAM_RE = re.compile(r"^([a-z_][a-z0-9_]*(?:\[\d+\](?:\.[a-z_][a-z0-9_]*)?)*)(?=:| must )")


def error_type(status: int) -> str:
    try:
        return ERROR_TYPES.get(HTTPStatus(status), "APIError")
    except ValueError:  # not a standard status
        return "APIError"


def param_of(message: str) -> str | None:
    """The parameter a widellm ValueError message names, if it names one."""
    m = _PARAM_RE.match(message)
    return m.group(1) if m else None


class APIError(Exception):
    """Raised by serving code; the app turns it into the JSON error and status."""

    def __init__(self, message: str, status: int = HTTPStatus.BAD_REQUEST,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param

    @classmethod
    def from_value_error(cls, err: ValueError, param: str | None = None) -> "APIError":
        """A 400 for bad input; ``param`` overrides the one the message names."""
        message = str(err)
        return cls(message, HTTPStatus.BAD_REQUEST, param or param_of(message))

    def to_model(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=error_type(self.status), param=self.param,
            code=self.status,
        ))

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_model().model_dump(), status_code=self.status)


def to_api_error(err: BaseException) -> APIError:
    """Any failure of a request as the error its client gets."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, ValueError):
        return APIError.from_value_error(err)
    if isinstance(err, EngineDeadError):
        return APIError(f"the engine is dead: {err}", HTTPStatus.INTERNAL_SERVER_ERROR)
    if isinstance(err, EngineDrainingError):
        return APIError(str(err), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(err, RequestFailedError):
        return APIError(f"the request failed: {err}", HTTPStatus.INTERNAL_SERVER_ERROR)
    return APIError(f"internal error: {type(err).__name__}: {err}",
                    HTTPStatus.INTERNAL_SERVER_ERROR)
