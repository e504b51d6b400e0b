"""Errors the engine raises: bad requests (the service maps them to HTTP 400) and a dead engine (503)."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field (OpenAI error body's `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineDeadError(RuntimeError):
    """The engine cannot serve any more: a tensor-parallel worker died or failed a step (its ranks' state is
    lost), or the engine was shut down. Requests in flight are lost; the owner replaces the engine."""
