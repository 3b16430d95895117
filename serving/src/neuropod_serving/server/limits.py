"""What of a request the server checks before it costs anything, and what of it the server writes down:
the bearer token check both protocols share, and the escaping of client-chosen text (model names)
in log lines (uvicorn's access log writes REST paths percent-encoded already). The request-head limits are :mod:`neuropod_serving.server.http`'s."""

from __future__ import annotations

import hmac
import re

_BEARER = b"bearer"


def bearer_refusal(given: bytes, expected: bytes) -> str | None:
    """Why an ``Authorization`` value ``given`` does not carry the token of ``expected``
    (``b"Bearer <token>"``), or None when it does. The scheme is matched without regard
    to case (RFC 9110 section 11.1); the token is compared in constant time."""
    scheme, _, token = given.partition(b" ")
    # compare_digest: the time taken must not tell an attacker how much of a guess was right.
    if hmac.compare_digest(token.lstrip(b" "), expected[len(_BEARER) + 1 :]) and scheme.lower() == _BEARER:
        return None
    return "no Authorization header" if not given else "the bearer token does not match"


# C0 controls, DEL, C1 controls and Unicode's line separators (a newline in a model name would start a forged log line).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_log(text: str) -> str:
    """``text`` with its control characters written as escapes (``\\n``, ``\\x1b``), for a log line."""
    if text.isprintable():
        return text
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)


__all__ = [
    "bearer_refusal",
    "escape_log",
]
