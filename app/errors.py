"""Errors as values: a code, an HTTP status, a message a person understands.

Each boundary translates them once: the server into the LMSP error body, the GUI into a dialog.
"""

from __future__ import annotations

from typing import Any


class LmspError(Exception):
    status = 400
    type = "invalid_request_error"

    def __init__(self, code: str, message: str, *, param: str | None = None,
                 status: int | None = None, title: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.title = title or "Request not accepted"
        self.headers: dict[str, str] = {}  # HTTP headers the answer carries (Retry-After)
        if status is not None:
            self.status = status

    def body(self) -> dict[str, Any]:
        return {"error": {"type": self.type, "code": self.code,
                          "message": self.message, "param": self.param}}


class InvalidRequest(LmspError):
    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(code, message, param=param, status=400)


class Failed(LmspError):
    """A foreground generation that failed, answered as the HTTP error its code stands for: the
    input's fault, the model file's, an upstream's, or else ours."""

    # model_load_failed: 422, as `POST /v1/models/{id}/load` answers it.
    # not_found: the model was deleted while the task waited; model_missing: its file was.
    STATUS = {"context_length_exceeded": 400, "invalid_request": 400, "not_found": 404, "model_changed": 409,
              "model_missing": 409, "model_load_failed": 422, "disk_full": 507, "upstream_error": 502,
              "upstream_unavailable": 503,
              "unsupported_schema": 400, "template_error": 400, "unsupported_suffix": 400}
    TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error",
             422: "invalid_request_error"}

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message or "The generation failed.", status=self.STATUS.get(code, 500),
                         param="input" if code in ("context_length_exceeded", "template_error") else None,
                         title="Generation failed")
        self.type = self.TYPES.get(self.status, "server_error")


class NotFound(LmspError):
    type = "not_found_error"

    def __init__(self, what: str, ident: str) -> None:
        super().__init__("not_found", f"No {what} with id {ident!r}.", status=404,
                         title=f"{what.capitalize()} not found")


class Conflict(LmspError):
    type = "conflict_error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message, status=409)


class Unauthorized(LmspError):
    type = "authentication_error"

    def __init__(self, message: str = "A valid bearer token is required.") -> None:
        super().__init__("unauthorized", message, status=401)


class Forbidden(LmspError):
    type = "permission_error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message, status=403)


class TooManyRequests(LmspError):
    """A limit on queued work or stored bytes: 429 with a Retry-After, nothing stored."""

    type = "rate_limit_error"

    def __init__(self, code: str, message: str, retry_after: int) -> None:
        super().__init__(code, message, status=429, title="Limit reached")
        self.headers = {"Retry-After": str(retry_after)}


class StoreError(LmspError):
    """The database refused: newer schema, full disk, locked. Nothing stored was changed."""

    type = "server_error"

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message, status=503, title="Storage problem")
