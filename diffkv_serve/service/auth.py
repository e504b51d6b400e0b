"""API keys: which `Authorization: Bearer` tokens the ingress accepts.

Keys are compared as SHA-256 digests with hmac.compare_digest, against every configured key without
stopping at a match, so the time taken says neither which key matched nor how long a key is."""
from __future__ import annotations

import hashlib
import hmac
from typing import Iterable, Optional


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class APIKeys:
    def __init__(self, keys: Iterable[str]):
        self._digests = [_digest(k) for k in dict.fromkeys(keys)]

    @property
    def required(self) -> bool:
        return bool(self._digests)

    def accepts(self, token: Optional[str]) -> bool:
        if token is None:
            return False
        given = _digest(token)
        ok = False
        for key in self._digests:
            ok |= hmac.compare_digest(given, key)
        return ok

    def __repr__(self) -> str:  # never the keys
        return f"APIKeys({len(self._digests)} keys)"


def bearer_token(authorization: Optional[str]) -> Optional[str]:
    """The token of an `Authorization: Bearer <token>` header value; None when absent or another scheme."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
