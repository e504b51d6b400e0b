"""Refuse a request before it costs work: an ASGI middleware in front of the ingress's routes.

In order: a missing or wrong API key (401), a draining server (503 + Retry-After), a body that is not
declared as JSON (400), a body over the size limit (413: from Content-Length before anything is read, else
counted while reading a chunked body). Only then does FastAPI parse the JSON. /health is never refused here:
it answers for readiness itself (503 while draining). Every refusal carries OpenAI's error body."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from diffkv_serve.service.auth import APIKeys, bearer_token
from diffkv_serve.service.protocol import error_body

OPEN_PATHS = frozenset({"/health"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
DRAIN_RETRY_AFTER_S = 5  # another server (or this one, restarted) takes requests within seconds


@dataclass
class GuardPolicy:
    """What the middleware enforces; the ingress replica owns it and flips `draining` on shutdown."""

    api_keys: APIKeys
    max_body_bytes: int
    draining: bool = False
    on_reject: Callable[[str, str, str], None] = field(default=lambda method, path, reason: None)


class Refusal(Exception):
    def __init__(self, status: int, message: str, reason: str, code: Optional[str] = None,
                 headers: Optional[dict] = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.reason, self.code, self.headers = status, message, reason, code, headers
        self.type = type_

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, None, self.code), status_code=self.status,
                            headers=self.headers)


def route_path(scope: dict) -> str:
    """The path inside the app: Serve may keep the route prefix (root_path) at the front of scope['path']."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


def check_api_key(policy: GuardPolicy, headers: Headers) -> None:
    if not policy.api_keys.required:
        return
    token = bearer_token(headers.get("authorization"))
    if policy.api_keys.accepts(token):
        return
    # The message never repeats the token (OpenAI echoes a masked one; nothing at all is safer).
    message = ("Incorrect API key provided" if token is not None else
               "No API key provided: send it in an Authorization header, 'Authorization: Bearer YOUR_KEY'")
    raise Refusal(401, message, "unauthorized", "invalid_api_key", {"WWW-Authenticate": "Bearer"})


def check_not_draining(policy: GuardPolicy) -> None:
    if policy.draining:
        raise Refusal(503, "the server is shutting down and takes no new requests; retry on another server or "
                           f"after {DRAIN_RETRY_AFTER_S}s", "draining", None,
                      {"Retry-After": str(DRAIN_RETRY_AFTER_S)}, "service_unavailable")


def check_json_content_type(headers: Headers) -> None:
    raw = headers.get("content-type")
    media = (raw or "").split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    got = f"got '{raw}'" if raw else "no Content-Type header was sent"
    raise Refusal(400, f"the request body must be JSON sent with 'Content-Type: application/json' ({got})",
                  "invalid")


def _too_large(limit: int, size: Optional[int] = None) -> Refusal:
    what = f"is {size} bytes" if size is not None else f"exceeds {limit} bytes"
    return Refusal(413, f"the request body {what}; this server accepts at most {limit} bytes "
                        f"(limits.max_body_bytes)", "too_large", "request_too_large")


def check_declared_length(policy: GuardPolicy, headers: Headers) -> None:
    declared = headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > policy.max_body_bytes:
        raise _too_large(policy.max_body_bytes, int(declared))


async def read_bounded_body(receive, limit: int) -> Optional[bytes]:
    """The whole body, or a 413 Refusal as soon as more than `limit` bytes arrived; None if the client left."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def replay(body: bytes, receive):
    """A receive() that hands the app the body already read, then passes on what the client sends next
    (a disconnect, which a streaming response listens for)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again


class RequestGuard:
    """ASGI middleware applying the GuardPolicy the app holds on `app.state.guard` (none: let all through)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        policy: Optional[GuardPolicy] = None
        if scope["type"] == "http" and "app" in scope:
            policy = getattr(scope["app"].state, "guard", None)
        path = route_path(scope) if policy is not None else ""
        if policy is None or path in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        method = scope.get("method", "GET")
        try:
            check_api_key(policy, headers)
            check_not_draining(policy)
            if method in _BODY_METHODS:
                check_json_content_type(headers)
                check_declared_length(policy, headers)
                body = await read_bounded_body(receive, policy.max_body_bytes)
                if body is None:
                    return  # the client left before sending its body
                receive = replay(body, receive)
        except Refusal as refusal:
            policy.on_reject(method, path, refusal.reason)
            await refusal.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
