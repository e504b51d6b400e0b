"""The ingress's HTTP error: an OpenAI error body with its status (and Retry-After where the client should retry)."""
from typing import Optional

from fastapi.responses import JSONResponse

from diffkv_serve.service.protocol import error_body

RETRY_AFTER_DEAD_S = 5  # a replica whose engine died is replaced within a few health-check periods


class APIError(Exception):
    """An HTTP error with OpenAI's error body. `code` is a string or None, as OpenAI's (the status is the
    response's, not the body's)."""

    def __init__(self, status: int, message: str, type_: str, param: Optional[str] = None,
                 code: Optional[str] = None, retry_after: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)
