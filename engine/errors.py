"""Errors the engine raises for bad requests: the service maps them to HTTP 400."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI error body's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
